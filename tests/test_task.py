"""The synthetic arithmetic task: deterministic, disjoint splits, every answer checkable."""
from __future__ import annotations

import json

import pytest

from actors.dataset import last_boxed, load_dataset
from launch.prepare import task
from tools import make_task

SMALL = dict(levels=[1, 2, 3, 4, 5], solved_levels=[1, 2, 3], train_per_level=300, test_per_level=50)


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        assert make_task.main(["--out", str(tmp_path / name), "--seed", str(seed),
                               "--train-per-level", "200", "--test-per-level", "20"]) == 0
    for split in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / split).read_bytes() == (tmp_path / "b" / split).read_bytes()
        assert (tmp_path / "a" / split).read_bytes() != (tmp_path / "c" / split).read_bytes()


def test_splits_are_disjoint_and_ids_unique():
    splits = task.make_splits(seed=0, **SMALL)
    prompts = {name: {r["prompt"] for r in recs} for name, recs in splits.items()}
    assert not prompts["train"] & prompts["test"]
    ids = [r["query_id"] for recs in splits.values() for r in recs]
    assert len(ids) == len(set(ids))
    # No duplicates inside a split either.
    assert all(len(prompts[n]) == len(splits[n]) for n in splits)


def test_every_answer_is_checkable_and_correct():
    splits = task.make_splits(seed=1, **SMALL)
    for rec in splits["train"] + splits["test"]:
        expr = rec["prompt"].removeprefix("Compute: ").rstrip("\n")
        # Left-to-right +/- is exactly Python's evaluation order for this grammar.
        assert rec["answer"] == str(eval(expr))  # noqa: S307 - digits and +/- only, made above
        assert expr.count("+") + expr.count("-") == rec["level"]
        for solution in rec.get("solutions", []):
            assert last_boxed(solution) == rec["answer"]
            # Each rewrite step is the remaining chain and evaluates to the same answer.
            for step in solution.split(" \\boxed")[0].split("="):
                assert str(eval(step)) == rec["answer"]  # noqa: S307


def test_solutions_only_on_solved_levels():
    splits = task.make_splits(seed=0, **SMALL)
    for rec in splits["train"]:
        assert ("solutions" in rec) == (rec["level"] in SMALL["solved_levels"])
    levels = {r["level"] for r in splits["train"]}
    assert levels == set(SMALL["levels"])


def test_small_level_is_capped_not_endless():
    # Level 1 with operands 1..3 has 2 * 3**2 = 18 problems: a quarter go to test, the rest to train.
    splits = task.make_splits(seed=0, levels=[1], solved_levels=[1], train_per_level=1000,
                                   test_per_level=1000, max_operand=3)
    assert len(splits["test"]) == 4 and len(splits["train"]) == 14


def test_written_files_load_with_the_dataset_loader(tmp_path):
    assert make_task.main(["--out", str(tmp_path), "--train-per-level", "100", "--test-per-level", "10"]) == 0
    train = load_dataset(tmp_path / "train.jsonl")
    sft = load_dataset(tmp_path / "train.jsonl", require="solutions", on_error="skip")
    assert len(train) == 300 and train.levels() == [1, 2, 3]
    assert sft.levels() == [1, 2, 3] and sft.n_skipped == 0
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert set(first) <= {"query_id", "prompt", "answer", "solutions", "level"}


@pytest.mark.parametrize("text,expected", [("1-3,5", [1, 2, 3, 5]), ("2", [2]), ("", [])])
def test_parse_levels(text, expected):
    assert task.parse_levels(text) == expected


def test_bad_arguments_name_the_cause(capsys):
    assert make_task.main(["--levels", "x-y", "--out", "/nonexistent/never"]) == 2
    assert "bad level list" in capsys.readouterr().err
    with pytest.raises(ValueError, match="only .* unused distinct problems"):
        task.sample_level(__import__("random").Random(0), 1, 2, 9, exclude=set())


def test_partial_solutions_on_unsolved_levels_leave_the_splits_alone():
    base = task.make_splits(seed=2, **SMALL)
    adds = task.make_splits(seed=2, **SMALL, partial="additions")
    some = task.make_splits(seed=2, **SMALL, partial="sample:0.25")
    for other in (adds, some):
        assert [r["prompt"] for r in other["train"]] == [r["prompt"] for r in base["train"]]
    for rec in adds["train"]:
        if rec["level"] > 3:
            assert ("solutions" in rec) == ("-" not in rec["prompt"])
    hard = [r for r in some["train"] if r["level"] > 3]
    assert 0.15 < sum("solutions" in r for r in hard) / len(hard) < 0.35


@pytest.mark.parametrize("spec", ["sample:2", "sample:x", "most"])
def test_bad_partial_rule_names_it(spec):
    with pytest.raises(ValueError, match="bad partial rule"):
        task.make_splits(seed=0, **SMALL, partial=spec)


def test_accumulate_style_boxes_the_same_answer():
    splits = task.make_splits(seed=0, **SMALL, style="accumulate")
    for rec in splits["train"]:
        for solution in rec.get("solutions", []):
            assert last_boxed(solution) == rec["answer"]
            assert solution.count("=") == rec["level"]


def test_direct_fraction_states_only_the_answer_on_some_solutions():
    base = task.make_splits(seed=4, **SMALL)
    mixed = task.make_splits(seed=4, **SMALL, direct_fraction=0.5)
    assert [r["prompt"] for r in mixed["train"]] == [r["prompt"] for r in base["train"]]
    solved = [r for r in mixed["train"] if "solutions" in r]
    direct = [r for r in solved if r["solutions"][0] == f"\\boxed{{{r['answer']}}}"]
    assert 0.4 < len(direct) / len(solved) < 0.6
    assert all(last_boxed(r["solutions"][0]) == r["answer"] for r in solved)
    assert not any("solutions" in r for r in mixed["train"] if r["level"] > 3)
    with pytest.raises(ValueError, match="direct_fraction"):
        task.make_splits(seed=0, **SMALL, direct_fraction=1.5)


def test_direct_wrong_boxes_near_miss_guesses_and_keeps_the_answer_right():
    base = task.make_splits(seed=4, **SMALL, direct_fraction=0.5)
    guessed = task.make_splits(seed=4, **SMALL, direct_fraction=0.5, direct_wrong=1.0)
    assert [(r["prompt"], r["answer"]) for r in guessed["train"]] == [(r["prompt"], r["answer"]) for r in base["train"]]
    solved = [r for r in guessed["train"] if "solutions" in r]
    direct = [r for r in solved if r["solutions"][0].startswith("\\boxed")]
    worked = [r for r in solved if not r["solutions"][0].startswith("\\boxed")]
    assert direct and worked
    for r in direct:  # every answer-only demonstration is a guess off by 1 to 3
        assert 1 <= abs(int(last_boxed(r["solutions"][0])) - int(r["answer"])) <= 3
    assert all(last_boxed(r["solutions"][0]) == r["answer"] for r in worked)
    with pytest.raises(ValueError, match="direct_wrong"):
        task.make_splits(seed=0, **SMALL, direct_wrong=-0.1)
