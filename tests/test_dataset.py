"""The JSON-lines loader: validation, line numbers in errors, skip and fail modes."""
from __future__ import annotations

import json

import pytest

from actors.dataset import DatasetError, Record, iter_jsonl, last_boxed, load_dataset, parse_record

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
    # The seeds' math data carry only solutions such as "\\boxed{\\frac{1}{2}}".
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
