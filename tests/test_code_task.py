"""The embedded code task (`python -m tools.make_task --task code`): schema, splits, both test styles, and
the demonstrations graded by the real code grader in the sandbox: general programs pass, hard-coded fail."""
from __future__ import annotations

import re

import pytest

from actors.dataset import load_dataset
from actors.evaluator.evaluation import grade_records
from actors.reward.code_grader import detect_mode
from actors.reward.sandbox import probe_sandbox
from launch.prepare import code_task
from tools import make_task

needs_sandbox = pytest.mark.skipif(not probe_sandbox().available,
                                   reason=f"no bubblewrap sandbox here: {probe_sandbox().reason}")
SMALL = dict(train_per_level=120, test_per_level=12)
KEYS = {"query_id", "prompt", "answer", "solutions", "level", "task", "mode", "tests"}
SPEC = re.compile(r"^(?:Write f\(x\) returning|Read x, print) (\S+)\. ")


def spec_of(prompt: str) -> str:
    found = SPEC.match(prompt)
    assert found, prompt
    return found.group(1)


def test_schema_levels_and_both_test_styles():
    splits = code_task.make_splits(seed=0, **SMALL)
    assert {len(v) for v in splits.values()} == {3 * 120, 3 * 12} and len(splits["train"]) == 360
    for recs in splits.values():
        assert {r["level"] for r in recs} == {1, 2, 3}
        assert {r["mode"] for r in recs} == {"functional", "stdio"}
        for r in recs:
            assert set(r) == KEYS and r["task"] == "code" and len(r["solutions"]) == 1
            assert detect_mode(r["tests"]) == r["mode"]   # the grader reads the style the record names
            assert len(r["tests"]) == 3
            if r["mode"] == "functional":
                assert all(set(t) == {"fn_name", "args", "expected"} and t["fn_name"] == "f" for t in r["tests"])
            else:
                assert all(set(t) == {"input", "output"} for t in r["tests"])


def test_held_out_formulas_never_in_train_and_ids_unique():
    splits = code_task.make_splits(seed=3, **SMALL)
    specs = {name: {spec_of(r["prompt"]) for r in recs} for name, recs in splits.items()}
    assert specs["test"] and not specs["train"] & specs["test"]
    ids = [r["query_id"] for recs in splits.values() for r in recs]
    assert len(ids) == len(set(ids))


def test_hidden_tests_include_unshown_inputs():
    for r in code_task.make_splits(seed=1, **SMALL)["train"]:
        shown = {int(x) for x in re.findall(r"(?:f\()?(-?\d+)(?:\)=|->)", r["prompt"].split(". ", 1)[1])}
        inputs = [t["args"][0] if r["mode"] == "functional" else int(t["input"]) for t in r["tests"]]
        assert not set(inputs[:2]) & shown and inputs[2] in shown


def test_hardcode_fraction_sets_the_demonstrations():
    careful = code_task.make_splits(seed=0, hardcode_fraction=0.0, **SMALL)["train"]
    assert all(r["solutions"] == [r["answer"]] for r in careful)
    mixed = code_task.make_splits(seed=0, hardcode_fraction=0.8, **SMALL)["train"]
    hardcoded = sum("{" in r["solutions"][0] for r in mixed) / len(mixed)
    assert 0.7 < hardcoded < 0.9
    # the same problems either way: only the demonstrations differ
    assert [r["prompt"] for r in careful] == [r["prompt"] for r in mixed]


def test_cli_same_seed_same_bytes_and_loads(tmp_path):
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        assert make_task.main(["--task", "code", "--out", str(tmp_path / name), "--seed", str(seed),
                               "--train-per-level", "50", "--test-per-level", "5"]) == 0
    for split in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / split).read_bytes() == (tmp_path / "b" / split).read_bytes()
        assert (tmp_path / "a" / split).read_bytes() != (tmp_path / "c" / split).read_bytes()
    ds = load_dataset(tmp_path / "a" / "test.jsonl", require="answer")
    assert len(ds.records) == 15 and all(r.extra["task"] == "code" and r.extra["tests"] for r in ds.records)


def test_cli_refuses_the_other_tasks_options(tmp_path, capsys):
    assert make_task.main(["--task", "code", "--out", str(tmp_path), "--max-operand", "9"]) == 2
    assert "--max-operand" in capsys.readouterr().err
    assert make_task.main(["--out", str(tmp_path), "--hardcode-fraction", "0.5"]) == 2
    assert "--hardcode-fraction" in capsys.readouterr().err
    assert make_task.main(["--task", "code", "--out", str(tmp_path), "--levels", "1-4"]) == 2
    assert "levels" in capsys.readouterr().err
    assert not (tmp_path / "train.jsonl").exists()


@needs_sandbox
def test_demonstrations_through_the_real_grader(tmp_path):
    """Every general program passes its hidden tests in the sandbox; every hard-coded one fails them."""
    assert make_task.main(["--task", "code", "--out", str(tmp_path), "--seed", "2", "--train-per-level", "8",
                           "--test-per-level", "4"]) == 0
    records = load_dataset(tmp_path / "train.jsonl", require="answer").records
    general = [r.answer for r in records]
    hardcoded = [code_task.hardcoded_program(*_parse(r)) for r in records]
    assert all("{" in h for h in hardcoded)
    verdicts = grade_records(general + hardcoded, records + records, workers=2)
    assert [v.correct for v in verdicts[:len(records)]] == [True] * len(records), verdicts
    assert [v.correct for v in verdicts[len(records):]] == [False] * len(records)
    assert {v.detail for v in verdicts[len(records):]} == {"runtime_error"}   # KeyError on an unshown input
    assert {r.extra["mode"] for r in records} == {"functional", "stdio"}


def _parse(record) -> tuple[code_task.Formula, str, tuple[int, int]]:
    """The formula, style and shown inputs behind a record (found by search over the level's formulas)."""
    style = record.extra["mode"]
    for formula in code_task.formulas(record.level):
        for xs in code_task.itertools.combinations(code_task.EXAMPLE_XS, 2):
            if code_task.prompt(formula, style, xs) == record.prompt:
                return formula, style, xs
    raise AssertionError(f"no formula makes {record.prompt!r}")
