"""What a restart or relaunch leaves behind must not mislead: the run's summary counts what was trained,
temporary directories of a killed launcher are cleaned, and evaluations missed while the evaluator was
down are caught up or named."""
from __future__ import annotations

import json
from pathlib import Path

from actors.runtime.recovery import checkpoint_dir, mark_complete
from testsupport.tiny_models import tiny_model_dir
from topology.experiment import ExperimentConfig


def step_record(step: int, n_tokens: float, t: float) -> dict:
    return {"step": step, "n_tokens": n_tokens, "time": t, "step_seconds": 1.0, "staleness_max": 1.0}


def test_the_summary_counts_a_step_trained_again_after_a_restart_once(tmp_path: Path) -> None:
    # A trainer restarted after step 3 resumed from the checkpoint of step 1 and trained steps 2 and 3 again:
    # "31 steps" for a 30-step run was this counted twice.
    from launch.evaluation import final_evaluation

    run_dir = tmp_path / "run"
    ckpt = checkpoint_dir(run_dir, 30)
    tiny_model_dir(ckpt / "model")
    (ckpt / "buffer.json").write_text("{}")
    mark_complete(ckpt, {"step": 30})
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({"query_id": str(i), "prompt": f"{i}+1=", "answer": str(i + 1), "level": 1})
                            + "\n" for i in range(2)))
    records = [step_record(s, 100.0, s) for s in (1, 2, 3)] + [step_record(s, 10.0, 10 + s) for s in range(2, 31)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = ExperimentConfig.model_validate({"data": {"test": str(test)}, "gen": {"max_new_tokens": 4},
                                              "model": {"path": str(ckpt / "model")}})
    summary = final_evaluation(config, run_dir)
    assert summary is not None and summary["steps"] == 30, summary
    assert summary["tokens_trained"] == 100.0 + 29 * 10.0, summary


def test_after_the_run_missed_evaluations_are_caught_up_from_checkpoints_or_named(tmp_path: Path) -> None:
    # A killed evaluator restarted after the run ended left the run without periodic evaluations from version 8
    # on, without a word. Now the launcher evaluates the kept versions whose weights are left on disk and names
    # the others.
    from actors.evaluator.actor import EVAL_FILE, catch_up, evaluated_versions, skipped_versions

    run_dir = tmp_path / "run"
    for step in (4, 6):
        ckpt = checkpoint_dir(run_dir, step)
        tiny_model_dir(ckpt / "model", seed=step)
        (ckpt / "buffer.json").write_text("{}")
        mark_complete(ckpt, {"step": step})
    (checkpoint_dir(run_dir, 6) / "buffer.json").write_text("{ }")   # corrupt: its weights do not count
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({"query_id": str(i), "prompt": f"{i}+1=", "answer": str(i + 1), "level": 1})
                            + "\n" for i in range(2)))
    (run_dir / EVAL_FILE).write_text(json.dumps({"kind": "periodic", "version": 0}) + "\n")
    config = ExperimentConfig.model_validate({"data": {"test": str(test)}, "gen": {"max_new_tokens": 4},
                                              "eval": {"every_versions": 2, "max_problems": 2},
                                              "model": {"path": str(checkpoint_dir(run_dir, 4) / "model")}})
    assert catch_up(config, run_dir, 6) == ([4], [2, 6])
    assert evaluated_versions(run_dir / EVAL_FILE) == {0, 4} and skipped_versions(run_dir / EVAL_FILE) == {2, 6}
    line = json.loads((run_dir / EVAL_FILE).read_text().splitlines()[1])
    assert line["source"] == "checkpoint" and line["n_prompts"] == 2
    assert catch_up(config, run_dir, 6) == ([], [])   # nothing is named twice
