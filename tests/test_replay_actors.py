"""tools.replay --into on the real actors, from the message logs of one real recorded run (`tools.up --record`):
each replays identically, and a changed setting is reported as the first divergence naming message and field."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tools import replay
from tools.bench.chaos import kill_everything, launch, make_assets


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step run of topology/local.yaml with every actor's messages logged; returns its msglog dir."""
    base = tmp_path_factory.mktemp("replay-run")
    assets = make_assets(base, train_per_level=40)
    run_dir = base / "run"
    proc = launch(assets, run_dir, steps=3, ckpt_every=3, extra=("experiment.run.final_eval=false", "--record"))
    try:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-4000:]
    except subprocess.TimeoutExpired:
        kill_everything(proc, run_dir)
        raise
    logs = run_dir / "msglog"
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        f"{n}.msglog" for n in ("buffer", "reward", "trainer", "param_server", "rollout.0", "rollout.1"))
    return logs


def test_buffer_replays_identically(recorded: Path, capsys: pytest.CaptureFixture) -> None:
    # It used to hang: the trainer's first BatchRequest arrives before any scored group, and a replay that
    # waited for each handler to finish before the next message waited for ever.
    assert replay.main([str(recorded / "buffer.msglog"), "--into", "actors.buffer:BufferActor"]) == 0
    out = capsys.readouterr().out
    assert "identical: every outbound message matches the original" in out, out


def test_buffer_with_a_changed_setting_reports_the_first_divergence(recorded: Path) -> None:
    log = str(recorded / "buffer.msglog")
    # Another seed shuffles the dataset differently: the first group handed out is another prompt.
    d = replay.replay_into(log, "actors.buffer:BufferActor", overrides={"seed": 2}).divergence
    assert d is not None and d.inbound_position == -1 and d.outbound_position == 0
    assert d.message == "rl.generate_group" and d.field == "group_id" and d.expected != d.actual
    # A smaller batch admits fewer groups at once: the original's later groups never go out.
    r = replay.replay_into(log, "actors.buffer:BufferActor", idle_timeout=5, overrides={"algo.batch_size": 3})
    d = r.divergence
    assert d is not None and d.message == "rl.generate_group" and d.actual == "nothing", d
    assert any("then nothing for 5 s" in n for n in r.notes), r.notes


def test_reward_replays_identically_and_a_changed_grader_setting_is_caught(recorded: Path) -> None:
    log = str(recorded / "reward.msglog")
    same = replay.replay_into(log, "actors.reward.math:MathReward")
    # score_seconds differs in any rerun: ScoredGroup declares it VOLATILE, so it is not compared
    assert same.compared and same.divergence is None and same.fed > 0, same
    # a random model answers every prompt wrong (algo.reward_wrong, -5 here); another value for a wrong answer
    # changes the first scored group's first sample
    d = replay.replay_into(log, "actors.reward.math:MathReward", overrides={"algo.reward_wrong": -0.5}).divergence
    assert d is not None and d.inbound_position == 0 and d.message == "rl.scored_group", d
    assert d.field == "answers.samples[0].reward" and (d.expected, d.actual) == ("-5.0", "-0.5"), d
