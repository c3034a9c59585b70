"""What a user reads while the main command runs and when it ends: the progress line, the launcher's events once,
the end summary's commands, the evaluations' wording, the warm start's progress lines."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.evaluation import versions
from launch.progress import TrainingProgress, launcher_logger, see_the_run, summary
from launch.prepare.sft import time_left


def metrics_line(step: int, time: float) -> str:
    return json.dumps({"step": step, "time": time, "task_reward": -4.38, "accuracy": 0.0625,
                       "effective_throughput": 148.0, "staleness_mean": 0.0, "staleness_max": 0,
                       "weight_sync_seconds": 0.4, "buffer_depth": 0}) + "\n"


def test_the_progress_line_names_training_accuracy_the_reward_scale_and_the_time_left(tmp_path: Path) -> None:
    progress = TrainingProgress(tmp_path, 40, reward_range=(-5.0, 5.0))
    assert progress.poll() is None
    (tmp_path / "metrics.jsonl").write_text(metrics_line(1, 100.0))
    line = progress.poll()
    assert line.startswith("step 1/40  reward -4.38 (wrong -5, right +5)  training accuracy   6.2% (sampled answers)")
    assert "left" not in line   # one step gives no pace
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(metrics_line(3, 110.0))   # 5 s a step, 37 to go
    assert progress.poll().startswith("step 3/40  ~185 s left  reward")


def test_the_end_summary_names_the_trace_and_report_commands(tmp_path: Path) -> None:
    text = summary("local", {"trainer": {"node": "localhost", "state": "finished", "exit": 0}}, 10.0, tmp_path,
                   "finished")
    assert f"  python3 -m tools.trace {tmp_path}" in text and f"  python3 -m tools.report {tmp_path}" in text
    assert see_the_run("RUN_DIR")[0] == "see the run:"


def test_the_launcher_prints_each_actor_event_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = launcher_logger(tmp_path)
    log.info("actor_started", actor="buffer", pid=1)                      # the progress view shows these
    log.info("actor_ready", actor="buffer", pid=1, after_s=2.0)
    log.info("actor_ready", actor="rollout.1", pid=2, joined_late=True)   # news: on the console
    log.warning("actor_died", actor="reward", exit_code=-9, restart=1)
    log.info("actor_finished", actor="buffer")
    console = capsys.readouterr().out   # on stdout, with the progress lines
    assert "actor_started" not in console and "actor_finished" not in console and "after_s" not in console
    assert "joined_late" in console and "actor_died" in console
    events = [json.loads(x)["event"] for x in (tmp_path / "logs" / "launcher.jsonl").read_text().splitlines()]
    assert events == ["actor_started", "actor_ready", "actor_ready", "actor_died", "actor_finished"]


def test_missed_evaluations_are_named_as_versions() -> None:
    assert versions([40]) == "version 40" and versions([10, 20]) == "versions 10, 20" and versions([]) == ""


def test_the_warm_starts_progress_estimates_the_time_left() -> None:
    assert time_left(100.0, 10, 3000, until_plateau=True) == ", at most 8:18:20 left"
    assert time_left(60.0, 30, 90, until_plateau=False) == ", 2:00 left"
    assert time_left(60.0, 90, 90, until_plateau=False) == ""


def test_replay_on_a_run_without_message_logs_says_how_to_record_them(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    from tools.replay.cli import main

    run = tmp_path / "run"
    (run / "specs").mkdir(parents=True)   # a default run: no msglog/ folder
    assert main([str(run / "msglog" / "buffer.msglog")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the run in {run} kept no message logs" in err and "--record" in err
    assert main([str(run)]) == 2
    assert "holds no message logs" in capsys.readouterr().err
    (run / "msglog").mkdir()
    (run / "msglog" / "trainer.msglog").write_bytes(b"")
    assert main([str(run)]) == 2
    assert f"give one actor's log, one of {run / 'msglog' / 'trainer.msglog'}" in capsys.readouterr().err
    assert main([str(run / "msglog" / "buffer.msglog")]) == 2
    assert "no such file; the logs there: trainer.msglog" in capsys.readouterr().err


def test_the_replay_recipes_assets_are_made_by_a_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tools.bench.chaos import main
    from actors.engines.checkpoint import has_weights

    assert main(["--make-assets", str(tmp_path / "assets")]) == 0
    assert has_weights(tmp_path / "assets" / "model") and (tmp_path / "assets" / "data" / "train.jsonl").exists()
    assert (tmp_path / "assets" / "model" / "tokenizer.json").exists()
