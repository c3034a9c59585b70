"""The JSON-lines loader: validation, line numbers in errors, skip and fail modes."""
from __future__ import annotations

import json

import pytest

from actors.dataset import LAYOUTS, DatasetError, Layout, Record, iter_jsonl, last_boxed, load_dataset, parse_record

GOOD = {"query_id": "q1", "prompt": "Compute: 1+2\n", "answer": "3", "solutions": ["3 \\boxed{3}"], "level": 1}


def write(tmp_path, lines, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def test_reads_valid_records_and_keeps_extra_fields(tmp_path):
    path = write(tmp_path, [GOOD, "", {"query_id": 7, "prompt": "p", "answer": 12, "task": "math"}])
    ds = load_dataset(path)
    assert [r.query_id for r in ds] == ["q1", "7"]
    assert ds[0] == Record("q1", "Compute: 1+2\n", "3", ("3 \\boxed{3}",), 1)
    assert ds[1].answer == "12" and ds[1].extra == {"task": "math"} and ds[1].level is None
    assert parse_record(ds[1].to_dict()) == ds[1]


def test_answer_taken_from_the_seeds_solution_layout(tmp_path):
    # AReaL's math data carry only solutions such as "\\boxed{\\frac{1}{2}}".
    rec = parse_record({"query_id": "a", "prompt": "p", "solutions": ["so \\boxed{\\frac{1}{2}}"]})
    assert rec.answer == "\\frac{1}{2}"


@pytest.mark.parametrize("bad,field", [
    ({"prompt": "p", "answer": "1"}, "query_id"),
    ({"query_id": "a", "answer": "1"}, "prompt"),
    ({"query_id": "a", "prompt": "", "answer": "1"}, "prompt"),
    ({"query_id": True, "prompt": "p", "answer": "1"}, "query_id"),
    ({"query_id": "a", "prompt": "p", "answer": ["1"]}, "answer"),
    ({"query_id": "a", "prompt": "p"}, "answer"),
    ({"query_id": "a", "prompt": "p", "solutions": "x \\boxed{1}"}, "solutions"),
    ({"query_id": "a", "prompt": "p", "answer": "1", "solutions": [""]}, "solutions"),
    ({"query_id": "a", "prompt": "p", "answer": "1", "level": -1}, "level"),
    ({"query_id": "a", "prompt": "p", "answer": "1", "level": "2"}, "level"),
])
def test_bad_fields_name_file_line_and_field(tmp_path, bad, field):
    path = write(tmp_path, [GOOD, bad])
    with pytest.raises(DatasetError) as info:
        load_dataset(path)
    err = info.value
    assert (err.line_no, err.field) == (2, field)
    assert str(err).startswith(f"{path}:2: field {field!r}")


@pytest.mark.parametrize("line,reason", [
    ('{"query_id": "a", "prompt": ', "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
])
def test_unparsable_lines_report_their_line_number(tmp_path, line, reason):
    path = write(tmp_path, [GOOD, "", line])
    with pytest.raises(DatasetError, match=rf":3: {reason}"):
        load_dataset(path)


def test_duplicate_query_id_points_at_both_lines(tmp_path):
    path = write(tmp_path, [GOOD, {**GOOD, "prompt": "other"}])
    with pytest.raises(DatasetError, match=r":2: field 'query_id': duplicate 'q1' \(first on line 1\)"):
        load_dataset(path)


def test_skip_mode_counts_and_keeps_going(tmp_path):
    path = write(tmp_path, ["not json", GOOD, {"query_id": "b"}, {**GOOD, "query_id": "c"}, "[]"])
    ds = load_dataset(path, on_error="skip")
    assert [r.query_id for r in ds] == ["q1", "c"]
    assert [e.line_no for e in ds.skipped] == [1, 3, 5]
    assert ds.n_skipped == 3 and ds.skipped[1].field == "prompt"


def test_skip_mode_with_nothing_usable_is_an_error(tmp_path):
    path = write(tmp_path, ["nope", "{}"])
    with pytest.raises(DatasetError, match=r"no usable records \(2 malformed lines skipped, first: .*:1: "):
        load_dataset(path, on_error="skip")


def test_require_solutions_for_sft(tmp_path):
    path = write(tmp_path, [GOOD, {"query_id": "b", "prompt": "p", "answer": "2", "level": 4}])
    with pytest.raises(DatasetError, match=r":2: field 'solutions': missing or empty"):
        load_dataset(path, require="solutions")
    assert [r.query_id for r in load_dataset(path, require="solutions", on_error="skip")] == ["q1"]
    assert len(load_dataset(path, require="none")) == 2


def test_filter_by_level_and_solutions(tmp_path):
    path = write(tmp_path, [GOOD, {"query_id": "b", "prompt": "p", "answer": "2", "level": 4}])
    ds = load_dataset(path)
    assert ds.levels() == [1, 4]
    assert [r.query_id for r in ds.filter(levels=[4])] == ["b"]
    assert [r.query_id for r in ds.filter(with_solutions=True)] == ["q1"]


def test_missing_file_invalid_utf8_and_bad_flags(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_dataset(tmp_path / "absent.jsonl")
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(DatasetError, match="not valid UTF-8"):
        load_dataset(path)
    with pytest.raises(ValueError, match="on_error"):
        list(iter_jsonl(write(tmp_path, [GOOD]), on_error="ignore"))


@pytest.mark.parametrize("text,expected", [
    ("a \\boxed{1} then \\boxed{-2}", "-2"), ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("no box", None), ("\\boxed{unclosed", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_invalid_utf8_is_skipped_on_its_own_line(tmp_path):
    # Once a bad byte failed the whole file in skip mode too, and was reported on line 1 (here it is on 33).
    lines = [json.dumps({**GOOD, "query_id": f"q{i}"}).encode() for i in range(40)]
    lines[32] = b'{"query_id": "bad", "prompt": "caf\xe9"}'
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    dataset = load_dataset(path, on_error="skip")
    assert len(dataset) == 39 and [e.line_no for e in dataset.skipped] == [33]
    assert "not valid UTF-8" in str(dataset.skipped[0])
    with pytest.raises(DatasetError, match=r"mixed.jsonl:33: not valid UTF-8"):
        load_dataset(path, on_error="fail")


def test_a_line_over_the_length_limit_is_refused_without_reading_it_whole(tmp_path):
    huge = json.dumps({**GOOD, "query_id": "huge", "prompt": "x" * 10_000_000})
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join([json.dumps(GOOD), huge, json.dumps({**GOOD, "query_id": "q2"})]) + "\n")
    dataset = load_dataset(path, on_error="skip")
    assert [r.query_id for r in dataset] == ["q1", "q2"]
    assert dataset.skipped[0].line_no == 2 and "max_line_bytes" in str(dataset.skipped[0])
    with pytest.raises(DatasetError, match=r"long.jsonl:2: longer than max_line_bytes \(1048576 bytes"):
        load_dataset(path)
    assert len(load_dataset(path, max_line_bytes=20_000_000)) == 3


# --- layouts: AReaL's files and the common public ones, through the config's field mapping ----------

def test_boba_and_orz_layout_reads_answers_from_boxed_solutions(tmp_path):
    # The tutorial's boba_106k_0319.jsonl / orz-zero_56k_0319.jsonl: query_id, prompt, task, boxed solutions.
    path = write(tmp_path, [{"query_id": "b1", "prompt": "What is 1/2+1/2?", "task": "math",
                             "solutions": ["\\boxed{1}"]},
                            {"query_id": "b2", "prompt": "2*3?", "task": "math", "solutions": ["\\boxed{6}", "6"]}])
    ds = load_dataset(path, layout=Layout.from_settings({"layout": "areal"}))
    assert [(r.query_id, r.answer, r.extra) for r in ds] == [("b1", "1", {"task": "math"}), ("b2", "6", {"task": "math"})]


def test_areal_prompt_file_takes_answers_from_id2info(tmp_path):
    path = write(tmp_path, [{"query_id": "p1", "prompt": "1+1?"}, {"query_id": "p2", "prompt": "2+2?"}])
    info = tmp_path / "id2info.json"
    info.write_text(json.dumps({"p1": {"solutions": ["\\boxed{2}"]}, "p2": {"solutions": ["so \\boxed{4}"]}}))
    ds = load_dataset(path, layout=Layout.from_settings({"id2info": str(info)}))
    assert [(r.query_id, r.answer, r.solutions) for r in ds] == [("p1", "2", ("\\boxed{2}",)),
                                                                  ("p2", "4", ("so \\boxed{4}",))]


def test_id2info_missing_entry_or_broken_file_is_named(tmp_path):
    path = write(tmp_path, [{"query_id": "p1", "prompt": "1+1?"}, {"query_id": "p9", "prompt": "?"}])
    info = tmp_path / "id2info.json"
    info.write_text(json.dumps({"p1": {"solutions": ["\\boxed{2}"]}}))
    with pytest.raises(DatasetError) as err:
        load_dataset(path, layout=Layout(id2info=str(info)))
    assert (err.value.line_no, err.value.field) == (2, "query_id") and "'p9' has no entry" in str(err.value)
    info.write_text(json.dumps({"p1": {"answer": "2"}}))
    with pytest.raises(DatasetError, match="entry 'p1': expected"):
        load_dataset(path, layout=Layout(id2info=str(info)), on_error="skip")


def test_gsm8k_layout_takes_the_answer_after_the_marker(tmp_path):
    path = write(tmp_path, [{"question": "Natalia sold 48 clips...", "answer": "48/2 = <<48/2=24>>24\n#### 72"},
                            {"question": "Big?", "answer": "lots\n#### 1,000"}])
    ds = load_dataset(path, layout=Layout.from_settings({"layout": "gsm8k"}))
    assert [(r.query_id, r.prompt, r.answer) for r in ds] == [("1", "Natalia sold 48 clips...", "72"),
                                                              ("2", "Big?", "1000")]
    bad = write(tmp_path, [{"question": "q", "answer": "72"}], name="bad.jsonl")
    with pytest.raises(DatasetError) as err:
        load_dataset(bad, layout=LAYOUTS["gsm8k"])
    assert str(err.value).startswith(f"{bad}:1: field 'answer': no '####'")
    with pytest.raises(DatasetError, match="field 'question': missing"):
        load_dataset(write(tmp_path, [{"prompt": "q", "answer": "#### 1"}], name="b2.jsonl"), layout=LAYOUTS["gsm8k"])


def test_math_layout_reads_the_boxed_answer_and_level(tmp_path):
    path = write(tmp_path, [{"problem": "Find x.", "solution": "So $x=\\boxed{\\frac{1}{2}}$.", "level": "Level 3",
                             "type": "Algebra"},
                            {"problem": "y?", "solution": "\\boxed{2}", "answer": "2", "level": "Level ?"},
                            {"problem": "z?", "solution": "no box", "level": "Level 1"}])
    ds = load_dataset(path, layout=Layout.from_settings({"layout": "math"}), on_error="skip")
    assert [(r.query_id, r.answer, r.level, r.solutions[0][:2]) for r in ds] == [("1", "\\frac{1}{2}", 3, "So"),
                                                                                  ("2", "2", None, "\\b")]
    assert ds[0].extra == {"type": "Algebra"}
    assert [(e.line_no, e.field) for e in ds.skipped] == [(3, "answer")]


def test_field_mapping_and_prompt_template(tmp_path):
    path = write(tmp_path, [{"uid": "m-1", "input": "1+1?", "target": 2}])
    layout = Layout.from_settings({"layout": "areal", "fields": {"query_id": "uid", "prompt": "input", "answer": "target"},
                                   "prompt_template": "User: {prompt}\nAssistant: <think>"})
    (rec,) = load_dataset(path, layout=layout)
    assert (rec.query_id, rec.prompt, rec.answer) == ("m-1", "User: 1+1?\nAssistant: <think>", "2")
    with pytest.raises(DatasetError, match="field 'uid': missing"):
        load_dataset(write(tmp_path, [{"input": "x", "target": 1}], name="b.jsonl"), layout=layout)


@pytest.mark.parametrize("data,message", [
    ({"layout": "csv"}, "data.layout: input should be 'areal', 'areal_eval', 'gsm8k' or 'math'"),
    ({"fields": {"question": "q"}}, "data.fields.question: unknown key"),
    ({"fields": {"prompt": None}}, "data.fields.prompt"),
    ({"prompt_template": "no placeholder"}, r"data.prompt_template: .*must contain \{prompt\} or name a template"),
    ({"prompt_template": "r1-distiled-qwen"}, "did you mean 'r1-distilled-qwen'"),
])
def test_bad_layout_settings_are_refused(data, message):
    with pytest.raises(ValueError, match=message):
        Layout.from_settings(data)
