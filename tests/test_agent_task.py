"""The embedded agent task (`python -m tools.make_task --task agent`): schema, determinism, splits that share no
product, transcripts that the calculator environment reproduces token for token, and the teacher's guesses."""
from __future__ import annotations

import asyncio
import json

import pytest

from actors.dataset import load_dataset, parse_record
from actors.rollout.envs.calculator import Calculator
from actors.evaluator.evaluation import grade_records
from launch.prepare import agent_task
from tools import make_task

SMALL = dict(train_per_level=150, test_per_level=20)
KEYS = {"query_id", "prompt", "answer", "solutions", "level", "task", "tool", "transcripts"}


def factors(prompt: str) -> frozenset[int]:
    expr = prompt.removeprefix("Compute: ").rstrip("\n")
    a, b = expr.split("*")[0], expr.split("*")[1]
    b = b.split("+")[0].split("-")[0]
    return frozenset((int(a), int(b)))


def test_schema_levels_and_transcripts_that_spell_the_solution():
    splits = agent_task.make_splits(seed=0, **SMALL)
    assert len(splits["train"]) == 450 and len(splits["test"]) == 60
    for records in splits.values():
        assert {r["level"] for r in records} == {1, 2, 3}
        for r in records:
            assert set(r) == KEYS and r["task"] == "math" and r["tool"] == "calculator"
            [transcript] = r["transcripts"]
            assert r["solutions"] == ["".join(s["text"] for s in transcript)]
            assert [s["role"] for s in transcript] == ["model", "env"] * ((len(transcript) - 1) // 2) + ["model"]
            assert transcript[-1]["text"].startswith("\\boxed{")
            assert r["prompt"].startswith("Compute: ") and r["prompt"].count("*") == 1
            assert r["prompt"].count("+") + r["prompt"].count("-") == r["level"] - 1


def test_the_calculator_answers_every_call_exactly_as_the_demonstration_shows():
    splits = agent_task.make_splits(seed=0, guess_fraction=0.0, **SMALL)

    async def replay(transcript: list[dict]) -> list[str | None]:
        env = Calculator()
        return [await env.step(seg["text"], "]" if seg["text"].endswith("]") else "stop")
                for seg in transcript if seg["role"] == "model"]

    for r in splits["test"] + splits["train"][:60]:
        [transcript] = r["transcripts"]
        observations = [seg["text"] for seg in transcript if seg["role"] == "env"]
        assert asyncio.run(replay(transcript)) == observations + [None]
        assert len(observations) == r["level"]                 # one call per operation
        assert transcript[-1]["text"] == f"\\boxed{{{r['answer']}}}"
        assert eval(r["prompt"].removeprefix("Compute: ")) == int(r["answer"])   # noqa: S307 - digits and +-*


def test_splits_share_no_problem_and_no_product():
    splits = agent_task.make_splits(seed=3, **SMALL)
    test, train = splits["test"], splits["train"]
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    assert not {factors(r["prompt"]) for r in test} & {factors(r["prompt"]) for r in train}
    ids = [r["query_id"] for r in test + train]
    assert len(ids) == len(set(ids))


def test_the_teacher_mostly_guesses_and_every_guess_is_wrong():
    splits = agent_task.make_splits(seed=0, **SMALL)
    records = splits["train"] + splits["test"]
    guesses = [r for r in records if len(r["transcripts"][0]) == 1]
    assert 0.7 < len(guesses) / len(records) < 0.9                   # the recipe's 80%
    for r in guesses:
        guessed = int(r["solutions"][0].removeprefix("\\boxed{").removesuffix("}"))
        assert 1 <= abs(guessed - int(r["answer"])) <= agent_task.GUESS_SPREAD
    # The math grader reads the final answer: every guess wrong, every tool demonstration right.
    verdicts = grade_records([r["solutions"][0] for r in records], [parse_record(r) for r in records])
    assert [v.correct for v in verdicts] == [len(r["transcripts"][0]) > 1 for r in records]


def test_a_spread_of_zero_is_a_teacher_who_answers_in_its_head_correctly():
    splits = agent_task.make_splits(seed=0, guess_fraction=1.0, guess_spread=0, **SMALL)
    assert all(r["transcripts"] == [[{"role": "model", "text": f"\\boxed{{{r['answer']}}}"}]] for r in splits["train"])


def test_guess_fraction_changes_the_demonstrations_not_the_splits():
    mix = agent_task.make_splits(seed=0, guess_fraction=0.8, **SMALL)
    careful = agent_task.make_splits(seed=0, guess_fraction=0.0, **SMALL)
    for split in ("train", "test"):
        assert [(r["query_id"], r["prompt"], r["answer"]) for r in mix[split]] == \
               [(r["query_id"], r["prompt"], r["answer"]) for r in careful[split]]
    assert all(len(r["transcripts"][0]) == 2 * r["level"] + 1 for r in careful["train"])


def test_cli_same_seed_same_bytes_loads_and_refuses_other_tasks_options(tmp_path, capsys):
    args = ["--task", "agent", "--train-per-level", "40", "--test-per-level", "8"]
    for name in ("a", "b"):
        assert make_task.main(args + ["--out", str(tmp_path / name)]) == 0
    for split in ("train", "test"):
        assert (tmp_path / "a" / f"{split}.jsonl").read_bytes() == (tmp_path / "b" / f"{split}.jsonl").read_bytes()
    assert make_task.main(args + ["--out", str(tmp_path / "c"), "--seed", "1"]) == 0
    assert (tmp_path / "c" / "train.jsonl").read_bytes() != (tmp_path / "a" / "train.jsonl").read_bytes()
    dataset = load_dataset(tmp_path / "a" / "train.jsonl")
    assert len(dataset) == 120 and dataset.records[0].extra["tool"] == "calculator"
    line = json.loads((tmp_path / "a" / "test.jsonl").read_text().splitlines()[0])
    assert set(line) == KEYS
    assert make_task.main(args + ["--out", str(tmp_path / "d"), "--direct-fraction", "0.5"]) == 2
    assert "--direct-fraction do(es) not apply to --task agent" in capsys.readouterr().err
    assert make_task.main(["--task", "math", "--out", str(tmp_path / "e"), "--guess-fraction", "0.5"]) == 2
    assert "--guess-fraction do(es) not apply to --task math" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, cause", [(dict(levels=[4]), "agent levels must be among"),
                                           (dict(guess_fraction=1.5), "guess_fraction must be within"),
                                           (dict(guess_spread=-1), "guess_spread must be >= 0"),
                                           (dict(train_per_level=-1), "must be >= 0"),
                                           (dict(levels=[1], train_per_level=10_000), "level 1 has only")])
def test_bad_arguments_name_the_cause(kwargs, cause):
    with pytest.raises(ValueError, match=cause):
        agent_task.make_splits(seed=0, **kwargs)


def test_a_prompt_expression_parses_back_to_its_chain():
    for r in agent_task.make_splits(seed=0, **SMALL)["test"]:
        chain = agent_task.Chain.parse(r["prompt"].removeprefix("Compute: ").rstrip("\n"))
        assert agent_task.PROMPT_TEMPLATE.format(expr=chain.expr) == r["prompt"] and str(chain.value) == r["answer"]
    for bad in ("37+48", "37*48*2", "37*48+", "x*2"):
        with pytest.raises(ValueError, match="not a product"):
            agent_task.Chain.parse(bad)
