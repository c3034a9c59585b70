"""Staleness control: how far behind the trainer the weights that generated a sample may be.

Admission (AReaL's rule). With batch size B (in whatever unit the buffer counts: prompts), trainer
version v (completed training steps) and maximum staleness eta (0 = synchronous), a new prompt may be
handed to rollout only while

    accepted + running < (v + eta + 1) * B      and      running < max_concurrent

where `accepted` counts every sample accepted into the buffer since the start of the run (it is never
decreased by training; it is decreased only when an accepted sample is later thrown away, so that it
gets replaced) and `running` counts samples handed out and not yet back. Because `accepted` is cumulative
it must be checkpointed: a recovered run that restarted it at 0 would admit (v + eta + 1) * B samples
at once, far more than the bound allows (a known failure of the original system).

Per-sample check. Rollout records the weight version of every generated token; a sample's start version
is the oldest of them (-1 when it has none) and `sample_staleness` is current version - start version (0
without a start version). `filter_stale` drops samples beyond eta when a batch is formed.
"""
from __future__ import annotations

from typing import Any

import torch

from algo._validate import as_tensor

_STATE_KEYS = ("batch_size", "max_staleness", "max_concurrent", "version", "accepted", "running",
               "admitted_total", "dropped_total")


class StalenessGate:
    """Admission counters for the buffer actor. Not thread-safe: the buffer's event loop owns it."""

    def __init__(self, batch_size: int, max_staleness: int, max_concurrent: int | None = None) -> None:
        _check_int("batch_size", batch_size, minimum=1)
        _check_int("max_staleness", max_staleness, minimum=0)
        if max_concurrent is not None:
            _check_int("max_concurrent", max_concurrent, minimum=1)
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent
        self.version = 0
        self.accepted = 0
        self.running = 0
        self.admitted_total = 0  # for metrics: every sample ever handed out
        self.dropped_total = 0  # for metrics: finished-but-rejected plus accepted-then-discarded

    @property
    def limit(self) -> int:
        """(v + eta + 1) * B: the most samples that may be accepted or running at this version."""
        return (self.version + self.max_staleness + 1) * self.batch_size

    def capacity(self) -> int:
        """How many more samples may be handed out right now."""
        room = self.limit - self.accepted - self.running
        if self.max_concurrent is not None:
            room = min(room, self.max_concurrent - self.running)
        return max(0, room)

    def can_admit(self) -> bool:
        return self.capacity() > 0

    def admit(self, n: int = 1) -> int:
        """Hand out up to n samples; returns how many were admitted (0 when the gate is closed)."""
        _check_int("n", n, minimum=0)
        k = min(n, self.capacity())
        self.running += k
        self.admitted_total += k
        return k

    def finish(self, accepted: bool = True, n: int = 1) -> None:
        """n running samples came back: accepted into the buffer, or rejected (aborted, failed,
        filtered by dynamic sampling) which frees their slot for a replacement."""
        _check_int("n", n, minimum=0)
        if n > self.running:
            raise ValueError(f"n: {n} samples finished but only {self.running} are running")
        self.running -= n
        if accepted:
            self.accepted += n
        else:
            self.dropped_total += n

    def discard(self, n: int = 1) -> None:
        """n already-accepted samples were thrown away before training (too stale, or a group filtered
        at batch formation): they no longer count, so replacements can be admitted."""
        _check_int("n", n, minimum=0)
        if n > self.accepted:
            raise ValueError(f"n: cannot discard {n} samples, only {self.accepted} were accepted")
        self.accepted -= n
        self.dropped_total += n

    def set_version(self, version: int) -> None:
        """The trainer finished a step and published `version`; versions never go back."""
        _check_int("version", version, minimum=0)
        if version < self.version:
            raise ValueError(f"version: {version} is older than the current version {self.version}")
        self.version = version

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _STATE_KEYS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore exactly what `state_dict` saved. `running` comes back as saved: the buffer must
        re-issue the samples that were in flight (they stay running) or call `finish(accepted=False)`
        for those it gives up on; either way nothing is admitted beyond the bound."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"state: missing key(s) {', '.join(missing)}")
        unknown = sorted(set(state) - set(_STATE_KEYS))
        if unknown:
            raise ValueError(f"state: unknown key(s) {', '.join(unknown)}")
        for key in ("batch_size", "max_staleness", "max_concurrent"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state: {key}={state[key]!r} was saved but this gate has {getattr(self, key)!r}")
        for key in ("version", "accepted", "running", "admitted_total", "dropped_total"):
            _check_int(f"state[{key!r}]", state[key], minimum=0)
        for key in ("version", "accepted", "running", "admitted_total", "dropped_total"):
            setattr(self, key, int(state[key]))

    def __repr__(self) -> str:
        return (f"StalenessGate(B={self.batch_size}, eta={self.max_staleness}, v={self.version}, "
                f"accepted={self.accepted}, running={self.running}, capacity={self.capacity()})")


def sample_staleness(start_versions: torch.Tensor, current_version: int) -> torch.Tensor:
    """current_version - start version per sample; 0 for samples without a version (-1)."""
    _check_int("current_version", current_version, minimum=0)
    sv = as_tensor("start_versions", start_versions).to(torch.int64)
    if bool((sv > current_version).any()):
        raise ValueError(f"start_versions: a sample is newer than current_version={current_version}")
    return torch.where(sv < 0, torch.zeros_like(sv), current_version - sv)


def filter_stale(staleness: torch.Tensor, max_staleness: int) -> torch.Tensor:
    """Which samples to train on (bool [B]): those with staleness <= max_staleness; the rest are dropped."""
    _check_int("max_staleness", max_staleness, minimum=0)
    s = as_tensor("staleness", staleness).to(torch.int64)
    if bool((s < 0).any()):
        raise ValueError("staleness: negative staleness")
    return s <= max_staleness


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
