"""Where a run's weights and state come from: the starting model, or the last complete checkpoint.

A checkpoint of training step k is the directory ``RUN_DIR/checkpoints/step_<k>/`` with

    model/         the trainer's checkpoint: Hugging Face layout (config.json, model.safetensors,
                   tokenizer files) plus optimizer, scheduler, RNG and step (TorchTrainEngine.save)
    buffer.json    the buffer's state for step k (dataset cursor, staleness counters, work to re-issue)
    COMPLETE       written last, by the trainer, once both parts are on disk

Every actor that needs weights (trainer, rollouts, parameter server) calls :func:`start_weights`, so
they all agree on version k after a recovery without talking to each other first.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:06d}"


def latest_checkpoint(run_dir: str | os.PathLike) -> tuple[int, Path] | None:
    """The newest checkpoint with its COMPLETE marker; partial ones (a crash mid-save) are ignored."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for d in root.iterdir():
        if d.name.startswith("step_") and (d / COMPLETE).exists():
            try:
                step = int(d.name[len("step_"):])
            except ValueError:
                continue
            if best is None or step > best[0]:
                best = (step, d)
    return best


def mark_complete(ckpt: Path, meta: dict[str, Any]) -> None:
    tmp = ckpt / (COMPLETE + ".tmp")
    tmp.write_text(json.dumps(meta, sort_keys=True))
    os.replace(tmp, ckpt / COMPLETE)


def refuse_restart_within_launch(actor: Any) -> None:
    """Stateful actors (trainer, buffer) must not be restarted alone: the others hold work and weights
    newer than the last checkpoint, so a lone restart would train a history that never happened. A
    restart under the same launcher (same parent process) raises; relaunching with `run.recover: auto`
    resumes every actor consistently from the last checkpoint."""
    marker = Path(actor.run_dir) / "launch" / f"{actor.name}.json"
    marker.parent.mkdir(parents=True, exist_ok=True)
    if marker.exists() and json.loads(marker.read_text()).get("ppid") == os.getppid():
        raise RuntimeError(f"{actor.name} was restarted inside a running launch; the other actors hold work newer "
                           "than the last checkpoint, so the run must be relaunched to recover consistently "
                           "(run.recover: auto resumes from the last checkpoint)")
    marker.write_text(json.dumps({"ppid": os.getppid(), "pid": os.getpid()}))


FINISHED = "FINISHED"


def mark_run_finished(run_dir: str | os.PathLike, step: int) -> None:
    """Written by the trainer after its last step: a finished run is never resumed."""
    (Path(run_dir) / FINISHED).write_text(json.dumps({"step": step}))


def run_finished(run_dir: str | os.PathLike) -> bool:
    return (Path(run_dir) / FINISHED).exists()


def recovering(settings: dict[str, Any]) -> bool:
    """`run.recover`: "auto" (default) resumes from the last complete checkpoint, "off" never does."""
    mode = str((settings.get("run") or {}).get("recover", "auto")).lower()
    if mode not in ("auto", "off", "true", "false"):
        raise ValueError(f"run.recover must be 'auto' or 'off', got {mode!r}")
    return mode in ("auto", "true")


def start_weights(settings: dict[str, Any], run_dir: str | os.PathLike) -> tuple[int, str]:
    """(version, model directory) this run starts from: the last checkpoint when recovering, else the
    starting model at version 0."""
    if recovering(settings):
        found = latest_checkpoint(run_dir)
        if found is not None:
            return found[0], str(found[1] / "model")
    path = (settings.get("model") or {}).get("path")
    if not path:
        raise ValueError("model.path: not set (the starting model directory, Hugging Face layout)")
    return 0, str(path)
