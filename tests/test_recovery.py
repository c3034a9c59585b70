"""Checkpoints are committed by a manifest written last; a resume skips an incomplete or corrupt one,
naming it, and falls back to the previous complete one."""
from __future__ import annotations

import json
from pathlib import Path

from structlog.testing import capture_logs

from actors.runtime.recovery import (COMPLETE, checkpoint_dir, checkpoint_problem, latest_checkpoint, mark_complete,
                             resume_checkpoint)


def make_checkpoint(run_dir: Path, step: int, complete: bool = True) -> Path:
    ckpt = checkpoint_dir(run_dir, step)
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "model.safetensors").write_bytes(bytes(range(256)) * (step + 10))
    (ckpt / "buffer.json").write_text(json.dumps({"step": step}))
    if complete:
        mark_complete(ckpt, {"step": step})
    return ckpt


def test_the_manifest_lists_every_file(tmp_path):
    ckpt = make_checkpoint(tmp_path, 2)
    meta = json.loads((ckpt / COMPLETE).read_text())
    assert meta["step"] == 2 and sorted(meta["files"]) == ["buffer.json", "model/model.safetensors"]
    assert meta["files"]["buffer.json"]["bytes"] == len('{"step": 2}')
    assert checkpoint_problem(ckpt, checksums=True) is None
    assert not list(ckpt.glob(COMPLETE + ".tmp*"))


def test_an_incomplete_newest_checkpoint_is_ignored(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4, complete=False)   # the run died while saving it
    assert latest_checkpoint(tmp_path)[0] == 2


def test_a_truncated_newest_checkpoint_falls_back_with_a_warning_naming_it(tmp_path):
    make_checkpoint(tmp_path, 2)
    bad = make_checkpoint(tmp_path, 4)
    weights = bad / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with capture_logs() as logs:
        assert latest_checkpoint(tmp_path)[0] == 2
    [warning] = [e for e in logs if e["event"] == "checkpoint_skipped"]
    assert warning["path"] == str(bad) and "model/model.safetensors has 100 bytes" in warning["reason"]


def test_changed_content_is_caught_by_the_checksums_and_set_aside_at_resume(tmp_path, capsys):
    make_checkpoint(tmp_path, 2)
    bad = make_checkpoint(tmp_path, 4)
    (bad / "buffer.json").write_text(json.dumps({"step": 5}))   # same size, other content
    assert latest_checkpoint(tmp_path)[0] == 4                   # the actors' size check cannot see it
    assert "does not match its checksum" in checkpoint_problem(bad, checksums=True)
    assert resume_checkpoint(tmp_path)[0] == 2                   # the launcher's can, and moves it aside
    assert not bad.exists() and bad.with_name(bad.name + ".corrupt").is_dir()
    assert latest_checkpoint(tmp_path)[0] == 2                   # so every actor agrees
    assert "step_000004 is corrupt (buffer.json does not match its checksum)" in capsys.readouterr().out


def test_nothing_sound_means_no_checkpoint(tmp_path):
    bad = make_checkpoint(tmp_path, 2)
    (bad / "buffer.json").unlink()
    assert latest_checkpoint(tmp_path) is None and resume_checkpoint(tmp_path) is None


def test_a_complete_marker_without_a_manifest_is_corrupt_and_set_aside(tmp_path, capsys):
    # A COMPLETE with no file list once let a truncated safetensors through: every actor that loaded it
    # failed on its header, again at every restart.
    make_checkpoint(tmp_path, 2)
    bad = make_checkpoint(tmp_path, 4)
    (bad / COMPLETE).write_text(json.dumps({"step": 4}))
    weights = bad / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:7])
    assert "has no manifest" in checkpoint_problem(bad)
    assert latest_checkpoint(tmp_path)[0] == 2
    assert resume_checkpoint(tmp_path)[0] == 2 and bad.with_name(bad.name + ".corrupt").is_dir()
    assert "step_000004 is corrupt (COMPLETE has no manifest" in capsys.readouterr().out


def test_a_manifest_without_one_of_the_parts_is_corrupt(tmp_path):
    ckpt = make_checkpoint(tmp_path, 2)
    meta = json.loads((ckpt / COMPLETE).read_text())
    del meta["files"]["buffer.json"]
    (ckpt / COMPLETE).write_text(json.dumps(meta))
    assert checkpoint_problem(ckpt) == "the manifest lists no buffer.json"
    assert latest_checkpoint(tmp_path) is None


def test_every_checkpoint_corrupt_is_said_loudly_before_starting_from_step_0(tmp_path, capsys):
    for step in (2, 4):
        ckpt = make_checkpoint(tmp_path, step)
        (ckpt / "buffer.json").write_text("{}")
    assert resume_checkpoint(tmp_path) is None
    out = capsys.readouterr().out
    assert "WARNING: every checkpoint of" in out and "STARTS AGAIN FROM STEP 0" in out
    assert "step 4: buffer.json has 2 bytes" in out and "step 2: buffer.json has 2 bytes" in out


def test_checkpoints_come_by_steps_and_by_time_as_areal_ckpt_freq_secs():
    from actors.runtime.recovery import checkpoint_due

    # by steps only: every 10 steps and the last one
    assert [s for s in range(1, 26) if checkpoint_due(s, 25, 10, None, since_s=1e9)] == [10, 20, 25]
    # by time too: a step ending 600 s or more after the last checkpoint is saved whatever its number
    assert checkpoint_due(3, 400, 10, 600.0, since_s=600.0)
    assert not checkpoint_due(3, 400, 10, 600.0, since_s=599.9)
    assert checkpoint_due(10, 400, 10, 600.0, since_s=0.0)


def test_retention_keeps_the_checkpoint_a_starting_actor_is_loading(tmp_path):
    # A restarted rollout chose the newest checkpoint and loads it seconds later; meanwhile the trainer saved two
    # more and pruned to keep_checkpoints=2. The rollout's load found no model.safetensors and the rollout died,
    # three restarts in a row, until it was given up.
    from actors.runtime.recovery import held_start_weights, prune_checkpoints
    from topology.experiment import ExperimentConfig

    cfg = ExperimentConfig.model_validate({"model": {"path": str(tmp_path / "start")}})
    make_checkpoint(tmp_path, 5)
    make_checkpoint(tmp_path, 10)
    with held_start_weights(cfg, tmp_path, "rollout.0") as (version, model_dir):
        assert version == 10
        for step in (15, 20):   # the trainer goes on while the rollout loads
            make_checkpoint(tmp_path, step)
            prune_checkpoints(tmp_path, keep=2, lease_s=600)
        assert (Path(model_dir) / "model.safetensors").read_bytes() == bytes(range(256)) * 20
        assert not checkpoint_dir(tmp_path, 5).exists()   # unleased: pruned as before
    assert checkpoint_problem(checkpoint_dir(tmp_path, 10)) is None   # the lease is no part of the checkpoint
    assert not list(checkpoint_dir(tmp_path, 10).glob("LEASE.*"))     # released once loaded
    prune_checkpoints(tmp_path, keep=2, lease_s=600)
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("step_*"))] == ["step_000015", "step_000020"]


def test_a_lease_older_than_its_bound_pins_nothing(tmp_path):
    # A reader killed mid-load leaves its lease behind: retention honours it for checkpoint_lease_s only.
    import os

    from actors.runtime.recovery import prune_checkpoints

    for step in (5, 10, 15):
        make_checkpoint(tmp_path, step)
    lease = checkpoint_dir(tmp_path, 5) / "LEASE.rollout.0"
    lease.write_text("{}")
    assert prune_checkpoints(tmp_path, keep=2, lease_s=600) == []
    os.utime(lease, (lease.stat().st_atime - 601, lease.stat().st_mtime - 601))
    assert prune_checkpoints(tmp_path, keep=2, lease_s=600) == [checkpoint_dir(tmp_path, 5)]


def test_a_checkpoint_saved_over_a_lease_does_not_list_it(tmp_path):
    # A trainer restarted in place saves a step again; a reader's lease in that directory is no file of it.
    ckpt = make_checkpoint(tmp_path, 4, complete=False)
    (ckpt / "LEASE.rollout.1").write_text("{}")
    mark_complete(ckpt, {"step": 4})
    assert sorted(json.loads((ckpt / COMPLETE).read_text())["files"]) == ["buffer.json", "model/model.safetensors"]
