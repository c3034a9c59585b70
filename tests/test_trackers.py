"""run.trackers: TensorBoard, Weights & Biases and SwanLab in offline mode, writing into the run directory with no
network; a missing package refused at load; a tracker that fails never stops the run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import topology
from actors.trainer.metrics import MetricsWriter
from actors.trainer.trackers import Trackers


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields: object) -> None:
        self.events.append((event, fields))


def stats(step: int) -> dict:
    return {"step": step, "task_reward": -1.0 + step, "importance_weight": 1.0, "time": 1e9 + step,
            "accuracy_by_level": {"1": 0.5}, "n_tokens": 100 * step}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # no network, no account, nothing written outside the test's folder
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab-home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_each_tracker_writes_the_steps_into_the_run_directory_offline(tmp_path: Path, offline: None) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = Log()
    writer = MetricsWriter(run_dir, log, Trackers(["tensorboard", "wandb", "swanlab"], run_dir, "areal-lite-test",
                                                  "offline", {"algo": {"eta": 4}}, log))
    assert [t.name for t in writer.trackers.active] == ["tensorboard", "wandb", "swanlab"], log.events
    for step in (1, 2, 3):
        writer.write(stats(step), step)
    writer.close()
    assert log.events == []
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("task_reward")] == [(1, 0.0), (2, 1.0), (3, 2.0)]
    assert "time" not in tb.Tags()["scalars"] and "n_tokens" in tb.Tags()["scalars"]

    [wandb_run] = list((run_dir / "wandb").glob("offline-run-*"))
    [record_file] = list(wandb_run.glob("*.wandb"))   # what `wandb sync` uploads
    history = wandb_history(record_file)
    assert [(h["step"], h["task_reward"], h["n_tokens"]) for h in history] == [(1, 0, 100), (2, 1, 200), (3, 2, 300)]
    assert all(h["_step"] == h["step"] and "time" not in h for h in history)

    [swan_run] = list((run_dir / "swanlog").glob("run-*"))
    [swan_file] = list(swan_run.glob("*.swanlab"))   # what `swanlab sync` uploads
    written = swan_file.read_bytes()
    assert all(key.encode() in written for key in ("task_reward", "importance_weight", "n_tokens"))


def wandb_history(path: Path) -> list[dict]:
    """The history rows of a wandb run's record file: LevelDB's log format (a 7-byte file header, then 32 KiB
    blocks of chunks, each with a 7-byte header: crc32, length, type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4) around
    wandb's Record protobufs."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block   # a block's tail too short for a header is padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


class Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, scalars: dict, step: int) -> None:
        self.calls += 1
        raise ConnectionError("the service is unreachable")

    def close(self) -> None:
        raise ConnectionError("still unreachable")


def test_a_tracker_that_fails_is_logged_once_and_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from actors.trainer import trackers

    def cannot_start(*args: object) -> None:
        raise RuntimeError("no credentials")

    monkeypatch.setitem(trackers.MAKERS, "wandb", cannot_start)
    log = Log()
    writer = MetricsWriter(tmp_path, log, Trackers(["wandb", "tensorboard"], tmp_path, "p", "online", {}, log))
    assert [t.name for t in writer.trackers.active] == ["tensorboard"]
    assert log.events == [("tracker_failed", {"tracker": "wandb", "when": "start", "error": "RuntimeError('no "
                                               "credentials')", "disabled": True})]
    broken = Broken()
    writer.trackers.active.append(broken)
    for step in (1, 2, 3):
        writer.write(stats(step), step)   # never raises
    writer.close()
    assert broken.calls == 1 and [e for e, f in log.events].count("tracker_failed") == 2
    assert log.events[1][1]["tracker"] == "broken" and log.events[1][1]["when"] == "step 1"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3   # the run's own record goes on


def test_a_tracker_whose_package_is_missing_is_refused_at_load_with_the_install_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "swanlab" else real(name, *a))
    with pytest.raises(topology.TopologyError) as refused:
        topology.load("topology/local.yaml", ["experiment.run.trackers=[tensorboard, swanlab]"], check_imports=False)
    assert "experiment.run.trackers" in str(refused.value) and "swanlab is not installed (pip install swanlab)" \
        in str(refused.value)
    with pytest.raises(topology.TopologyError, match="experiment.run.trackers"):
        topology.load("topology/local.yaml", ["experiment.run.trackers=[mlflow]"], check_imports=False)
    plan = topology.load("topology/local.yaml", [], check_imports=False)
    assert plan.topology.config.run.trackers == ["tensorboard"] and plan.topology.config.run.tracker_mode == "offline"
