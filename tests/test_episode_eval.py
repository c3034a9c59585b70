"""Held-out evaluation of episodes (actors/evaluator/episode_eval.py, tools/eval_agent.py): the tool's use is measured
(accuracy with it and restricted to one turn, turns and calls per level), and records without a tool give
exactly the report of the single-answer evaluation."""
from __future__ import annotations

import functools
import json

from actors.dataset import parse_record
from actors.engines.tokenizer import load_tokenizer
from actors.engines.torch_gen import TorchGenerationEngine
from actors.rollout.episode import EpisodeLimits
from actors.evaluator.episode_eval import aevaluate_episodes
from actors.evaluator.evaluation import EvalSettings, aevaluate_with, engine_generator
from testsupport.bounded import run_bounded
from testsupport.scripted_engine import ScriptedEngine
from testsupport.tiny_models import ARITH_TOKENIZER_DIR, ARITH_VOCAB, tiny_model, tiny_model_dir
from launch.prepare import agent_task, task
from tools import eval_agent, make_task

run = functools.partial(run_bounded, timeout=120.0)
ARITH = load_tokenizer(str(ARITH_TOKENIZER_DIR))
SETTINGS = EvalSettings(k=2, samples=2, max_new_tokens=16, seed=3)


def agent_records(per_level: int = 4):
    splits = agent_task.make_splits(seed=0, train_per_level=0, test_per_level=per_level, guess_fraction=0.0)
    return [parse_record(r) for r in splits["test"]]


def test_the_tool_is_what_makes_the_answer_and_its_use_is_counted(careful_agent):
    records = agent_records()

    async def main():
        engine = ScriptedEngine(careful_agent, vocab_size=ARITH_VOCAB)
        await engine.start()
        return [await aevaluate_episodes(engine, ARITH, records, SETTINGS, EpisodeLimits(max_turns=t, max_tokens=256),
                                         details=True) for t in (5, 1)]

    with_tool, one_turn = run(main())
    assert with_tool["max_turns"] == 5 and one_turn["max_turns"] == 1
    assert with_tool["overall"]["greedy_accuracy"] == 1.0 and with_tool["overall"]["pass@2"] == 1.0
    assert one_turn["overall"]["greedy_accuracy"] == 0.0 and one_turn["overall"]["greedy_truncated"] == 1.0
    for level, summary in with_tool["by_level"].items():
        assert summary["greedy_tool_calls"] == int(level) and summary["greedy_turns"] == int(level) + 1
        assert summary["greedy_ends"] == {"done": 4} and summary["sample_ends"] == {"done": 8}
    assert one_turn["overall"]["greedy_ends"] == {"turns": 12} and one_turn["overall"]["greedy_tool_calls"] == 0
    row = with_tool["prompts"][0]
    record = next(r for r in records if r.query_id == row["query_id"])
    assert row["greedy_transcripts"] == [record.solutions[0]]   # the careful teacher's transcript, observations too
    assert row["greedy_ends"] == ["done"] and len(row["sample_transcripts"]) == 2


def test_records_without_a_tool_get_the_single_answer_report():
    splits = task.make_splits(seed=0, levels=(1, 2), train_per_level=0, test_per_level=6, max_operand=9)
    records = [parse_record(r) for r in splits["test"]]
    model = tiny_model(seed=0, vocab_size=ARITH_VOCAB)

    async def main():
        engine = TorchGenerationEngine(model=model)
        await engine.start()
        try:
            plain = await aevaluate_with(engine_generator(engine), ARITH, records, SETTINGS)
            episodes = await aevaluate_episodes(engine, ARITH, records, SETTINGS, EpisodeLimits(max_turns=3))
            return plain, episodes
        finally:
            await engine.stop()

    plain, episodes = run(main())
    for key in ("n_prompts", "k", "samples", "temperature", "max_new_tokens", "seed"):
        assert plain[key] == episodes[key]
    for ours, theirs in [(episodes["overall"], plain["overall"])] + [
            (episodes["by_level"][k], v) for k, v in plain["by_level"].items()]:
        assert {k: v for k, v in ours.items() if k in theirs} == theirs
        assert ours["greedy_turns"] == 1 and ours["greedy_tool_calls"] == 0 and ours["sample_turns"] == 1
    assert plain["overall"]["greedy_len"] > 0   # the answers compared are real generations


def test_cli_compares_turn_budgets_and_names_bad_input(tmp_path, capsys):
    model_dir = tiny_model_dir(tmp_path / "model")
    data = tmp_path / "data"
    assert make_task.main(["--task", "agent", "--out", str(data), "--train-per-level", "0",
                           "--test-per-level", "3"]) == 0
    capsys.readouterr()
    assert eval_agent.main([str(model_dir), "--data", str(data / "test.jsonl"), "--max-turns", "3,1",
                            "--max-new-tokens", "8", "--json", "--details", str(tmp_path / "rows.jsonl")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["max_turns"] for r in result["reports"]] == [3, 1]
    assert all(r["n_prompts"] == 9 and "greedy_ends" in r["overall"] for r in result["reports"])
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 18 and {r["max_turns"] for r in rows} == {3, 1} and "greedy_transcripts" in rows[0]
    assert eval_agent.main([str(model_dir), "--data", str(data / "test.jsonl")]) == 0   # the tables
    # the tables fit the terminal's width: a long model path wraps their title, so words, not lines, are compared
    assert "at most 5 turns" in " ".join(capsys.readouterr().out.split())
    assert eval_agent.main([str(ARITH_TOKENIZER_DIR), "--data", str(data / "test.jsonl")]) == 2
    assert "no model weights" in capsys.readouterr().err
