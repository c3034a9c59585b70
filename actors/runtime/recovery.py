"""Where a run's weights and state come from: the starting model, or the last complete checkpoint.

A checkpoint of training step k is the directory ``RUN_DIR/checkpoints/step_<k>/`` with

    model/         the trainer's checkpoint: Hugging Face layout (config.json, model.safetensors,
                   tokenizer files) plus optimizer, scheduler, RNG and step (TorchTrainEngine.save)
    buffer.json    the buffer's state for step k (dataset cursor, staleness counters, work to re-issue)
    COMPLETE       written last, by the trainer, once both parts are on disk: the step and a manifest of
                   every file (bytes, XXH3-64), written under a temporary name, fsynced, then renamed,
                   after every file of the checkpoint was fsynced

A checkpoint whose COMPLETE is missing (a crash mid-save), has no manifest (nothing says what a sound copy
holds), lacks one of the parts (the model, buffer.json) or whose files disagree with its manifest (a file
truncated or changed afterwards) is skipped with a warning naming it, and the previous complete one is
used. The launcher checks the checksums of the one it resumes from and renames a corrupt one to
``step_<k>.corrupt``, so that every actor, which checks sizes only, agrees on the same checkpoint; when
none is sound it says so before the run starts again from step 0.

Every actor that needs weights (trainer, rollouts, parameter server) calls :func:`start_weights`, so
they all agree on version k after a recovery without talking to each other first.

Retention (``run.keep_checkpoints``, :func:`prune_checkpoints`) and readers never race: a reader chooses its
checkpoint and writes a lease file ``LEASE.<holder>`` into it under the run's retention lock (an fcntl lock
on ``checkpoints/.retention.lock``, which the pruner holds while it decides and deletes), and removes the
lease once loaded. Retention keeps a leased checkpoint until the lease is removed or older than
``run.checkpoint_lease_s``, so a reader killed mid-load pins nothing for ever. A restarted rollout reads its
checkpoint seconds after choosing it while the trainer goes on saving and deleting.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import structlog
import xxhash

from topology.experiment import ExperimentConfig
from transport.files import atomic_write

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
CORRUPT_SUFFIX = ".corrupt"
LEASE_PREFIX = "LEASE."
RETENTION_LOCK = ".retention.lock"

log = structlog.get_logger("recovery")


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:06d}"


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Checkpoint directories with a COMPLETE marker, newest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.name.startswith("step_") and (d / COMPLETE).exists():
            try:
                found.append((int(d.name[len("step_"):]), d))
            except ValueError:   # step_<k>.corrupt and other leftovers
                continue
    return sorted(found, reverse=True)


def checkpoint_problem(ckpt: Path, checksums: bool = False) -> str | None:
    """Why `ckpt` cannot be resumed from, or None: its manifest is missing or does not list both parts (the
    model, buffer.json), or a file it lists is missing, of the wrong size or, with `checksums`, of other
    content. A COMPLETE without a manifest is not trusted: nothing says what a sound copy holds (a
    truncated safetensors behind it would fail every actor that loads it, again at every restart)."""
    try:
        meta = json.loads((ckpt / COMPLETE).read_text())
    except (OSError, ValueError) as exc:
        return f"{COMPLETE} is unreadable ({exc})"
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not files:
        return f"{COMPLETE} has no manifest (no list of files with their sizes and checksums)"
    parts = {"buffer.json": "buffer.json" in files, "model/": any(str(rel).startswith("model/") for rel in files)}
    if missing := [name for name, listed in parts.items() if not listed]:
        return f"the manifest lists no {' and no '.join(missing)}"
    for rel, want in files.items():
        path = ckpt / rel
        if not isinstance(want, dict) or not isinstance(want.get("bytes"), int) or not want.get("xxh3"):
            return f"the manifest's entry for {rel} is malformed ({want!r:.80})"
        try:
            size = path.stat().st_size
        except OSError:
            return f"{rel} is missing"
        if size != want["bytes"]:
            return f"{rel} has {size} bytes, the manifest says {want['bytes']}"
        if checksums and _file_digest(path) != want["xxh3"]:
            return f"{rel} does not match its checksum"
    return None


def latest_checkpoint(run_dir: str | os.PathLike, checksums: bool = False) -> tuple[int, Path] | None:
    """The newest checkpoint that is complete and agrees with its manifest (sizes; also the checksums with
    `checksums`). One that does not is skipped with a warning naming it."""
    for step, d in complete_checkpoints(run_dir):
        problem = checkpoint_problem(d, checksums)
        if problem is None:
            return step, d
        log.warning("checkpoint_skipped", path=str(d), reason=problem)
    return None


def resume_checkpoint(run_dir: str | os.PathLike) -> tuple[int, Path] | None:
    """The launcher's choice before any actor starts: the newest checkpoint whose checksums all match.
    Corrupt ones newer than it are renamed to ``step_<k>.corrupt`` (kept for inspection), so that the
    actors' cheaper size check finds the same one. When there were checkpoints and none is sound, it says
    so loudly: the run starts again from step 0."""
    corrupt = []
    for step, d in complete_checkpoints(run_dir):
        problem = checkpoint_problem(d, checksums=True)
        if problem is None:
            return step, d
        aside = d.with_name(d.name + CORRUPT_SUFFIX)
        os.replace(d, aside)
        corrupt.append(f"step {step}: {problem}")
        log.warning("checkpoint_corrupt", path=str(d), reason=problem, moved_to=str(aside))
        print(f"checkpoint {d} is corrupt ({problem}); moved to {aside}, trying the previous one", flush=True)
    if corrupt:
        log.error("every_checkpoint_corrupt", run_dir=str(run_dir), checkpoints=corrupt)
        print(f"WARNING: every checkpoint of {run_dir} is corrupt ({'; '.join(corrupt)}); they were moved "
              f"aside as step_<k>{CORRUPT_SUFFIX}, and this run STARTS AGAIN FROM STEP 0 (the starting model)",
              flush=True)
    return None


def mark_complete(ckpt: Path, meta: dict[str, Any]) -> None:
    """The checkpoint's commit point: every file is fsynced and listed (bytes, XXH3-64) in COMPLETE,
    which is written under a temporary name, fsynced and renamed into place."""
    files = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file() and not p.name.startswith((COMPLETE, LEASE_PREFIX))):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[str(path.relative_to(ckpt))] = {"bytes": path.stat().st_size, "xxh3": _file_digest(path)}
    atomic_write(ckpt / COMPLETE, json.dumps({**meta, "files": files}, sort_keys=True).encode())


def _file_digest(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def restarted_in_place(actor: Any) -> bool:
    """Whether this process replaces one of the same actor under the same launcher (the supervisor restarted
    it after it died), as opposed to the first start of a launch or a relaunch. Stateful actors (trainer,
    buffer) then take up the run where the others are, not where the last checkpoint was."""
    marker = Path(actor.run_dir) / "launch" / f"{actor.name}.json"
    marker.parent.mkdir(parents=True, exist_ok=True)
    again = marker.exists() and json.loads(marker.read_text()).get("ppid") == os.getppid()
    marker.write_text(json.dumps({"ppid": os.getppid(), "pid": os.getpid()}))
    return again


FINISHED = "FINISHED"


def mark_run_finished(run_dir: str | os.PathLike, step: int) -> None:
    """Written by the trainer after its last step: a finished run is never resumed."""
    (Path(run_dir) / FINISHED).write_text(json.dumps({"step": step}))


def run_finished(run_dir: str | os.PathLike) -> bool:
    return (Path(run_dir) / FINISHED).exists()


def recovering(cfg: ExperimentConfig) -> bool:
    """`run.recover`: "auto" (default) resumes from the last complete checkpoint, "off" never does."""
    return cfg.run.recover == "auto"


def start_weights(cfg: ExperimentConfig, run_dir: str | os.PathLike) -> tuple[int, str]:
    """(version, model directory) this run starts from: the last checkpoint when recovering, else the
    starting model at version 0. A reader that loads the checkpoint later holds it with
    :func:`held_start_weights` instead."""
    if recovering(cfg):
        found = latest_checkpoint(run_dir)
        if found is not None:
            return found[0], str(found[1] / "model")
    return 0, _starting_model(cfg)


def _starting_model(cfg: ExperimentConfig) -> str:
    if not cfg.model.path:
        raise ValueError("model.path: not set (the starting model directory, Hugging Face layout)")
    return str(cfg.model.path)


@contextlib.contextmanager
def retention_lock(run_dir: str | os.PathLike) -> Iterator[None]:
    """The run's checkpoint retention, held exclusively for the block: a reader's choice and lease, or a
    pruner's decision and deletion, happen one at a time. Released by the kernel if the holder dies."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    with open(root / RETENTION_LOCK, "a+b") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def held_start_weights(cfg: ExperimentConfig, run_dir: str | os.PathLike, holder: str) -> Iterator[tuple[int, str]]:
    """:func:`start_weights`, with the chosen checkpoint leased to `holder` for the block: retention
    (:func:`prune_checkpoints`) keeps it until the block ends (the load is done), or the lease is older than
    ``run.checkpoint_lease_s``."""
    lease = None
    if recovering(cfg):
        with retention_lock(run_dir):
            found = latest_checkpoint(run_dir)
            if found is not None:
                lease = found[1] / f"{LEASE_PREFIX}{holder}"
                lease.write_text(json.dumps({"holder": holder, "pid": os.getpid(), "time": time.time()}))
    try:
        yield (found[0], str(found[1] / "model")) if lease is not None else (0, _starting_model(cfg))
    finally:
        if lease is not None:
            lease.unlink(missing_ok=True)


def live_leases(ckpt: Path, lease_s: float, now: float | None = None) -> list[str]:
    """The holders of `ckpt` whose lease is younger than `lease_s` seconds (by the file's time)."""
    now = time.time() if now is None else now
    held = []
    for lease in ckpt.glob(f"{LEASE_PREFIX}*"):
        try:
            if now - lease.stat().st_mtime < lease_s:
                held.append(lease.name[len(LEASE_PREFIX):])
        except OSError:   # released meanwhile
            continue
    return held


def prune_checkpoints(run_dir: str | os.PathLike, keep: int, lease_s: float) -> list[Path]:
    """Delete the complete checkpoints beyond the newest `keep` (0 keeps all), but for those a reader holds
    (:func:`held_start_weights`); returns the deleted ones. ``.corrupt`` ones stay for inspection."""
    if keep <= 0:
        return []
    deleted = []
    with retention_lock(run_dir):
        for step, old in complete_checkpoints(run_dir)[keep:]:
            if holders := live_leases(old, lease_s):
                log.info("checkpoint_kept_while_read", step=step, path=str(old), holders=holders)
                continue
            shutil.rmtree(old, ignore_errors=True)
            deleted.append(old)
    return deleted


def checkpoint_due(step: int, total_steps: int, every_steps: int, every_s: float | None, since_s: float) -> bool:
    """Whether the step that just ended is checkpointed: every `every_steps` steps, the last step, and, with
    `every_s`, any step that ends `every_s` seconds or more after the last checkpoint (`since_s` seconds ago;
    AReaL's ``exp_ctrl.ckpt_freq_secs``, 600 in its configs: a 32B step takes hours, ten of them a working day)."""
    if step % every_steps == 0 or step == total_steps:
        return True
    return every_s is not None and since_s >= every_s

