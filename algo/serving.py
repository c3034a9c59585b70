"""How much generation work one server holds, and how long a generation may take before it counts as lost.

In flight. A server's KV pool holds so many tokens (SGLang reports it as max_total_num_tokens; the planner
estimates it, launch/plan/memory.py); a group of `group_size` answers holds `group_size` contexts of prompt plus
answer. `groups_in_kv` is how many groups fit at once: more only wait in the server's queue, where their
time runs without progress, or are retracted and generated again. The buffer caps each rollout with it, and
the planner's simulator its servers, by this one rule.

Timeouts. The pace of recent answers, and the timeout a generation of a given length gets from it.

A fixed timeout is wrong at one end or the other: 30 minutes cuts a 32k-token answer of a 32B model (AReaL's
published step there is 6,707 s), and is hours too long for a 1.5B model at 8k. The pace is measured instead:
seconds per generated token of each finished answer, wall clock from when it was sent, so queueing and
weight-update pauses are in it. The slowest of the recent ones sets the timeout, times a slack. Until the
first is measured, an assumed pace stands in (the settings' `gen.assumed_tokens_per_s`).

Pure: it holds numbers and reads no clock. The buffer times its groups with it (actors/buffer/state.py), the
SGLang client its requests (actors/engines/sglang.py).
"""
from __future__ import annotations

from collections import deque

__all__ = ["DecodePace", "MIN_TOKENS", "groups_in_kv"]

# An answer shorter than this is mostly prefill and queueing: it says little about the decode pace.
MIN_TOKENS = 32


class DecodePace:
    """The slowest seconds per token of the last ``window`` answers of at least MIN_TOKENS tokens, and
    timeouts from it: ``max(floor_s, slack * tokens * seconds_per_token)``."""

    def __init__(self, assumed_tokens_per_s: float = 5.0, slack: float = 3.0, floor_s: float = 60.0,
                 window: int = 64) -> None:
        if assumed_tokens_per_s <= 0 or slack < 1 or floor_s < 0 or window < 1:
            raise ValueError(f"DecodePace: assumed_tokens_per_s > 0, slack >= 1, floor_s >= 0, window >= 1 "
                             f"(got {assumed_tokens_per_s}, {slack}, {floor_s}, {window})")
        self.assumed_s_per_token = 1.0 / assumed_tokens_per_s
        self.slack, self.floor_s = slack, floor_s
        self._recent: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float, tokens: int) -> None:
        """An answer of ``tokens`` generated tokens took ``seconds`` from when it was sent."""
        if tokens >= MIN_TOKENS and seconds > 0:
            self._recent.append(seconds / tokens)

    @property
    def measured(self) -> bool:
        return bool(self._recent)

    @property
    def seconds_per_token(self) -> float:
        """The slowest recent pace, or the assumed one before any was measured."""
        return max(self._recent) if self._recent else self.assumed_s_per_token

    def timeout(self, tokens: int) -> float:
        """Seconds a generation of up to ``tokens`` tokens may take before it counts as lost."""
        return max(self.floor_s, self.slack * tokens * self.seconds_per_token)


def groups_in_kv(kv_tokens: int, group_size: int, context_tokens: float, max_groups: int) -> int:
    """Groups of ``group_size`` answers whose contexts (``context_tokens`` each: prompt plus answer, the
    expected length) fit a KV pool of ``kv_tokens`` at once; at least one, at most ``max_groups``."""
    if group_size < 1 or context_tokens <= 0 or max_groups < 1:
        raise ValueError(f"groups_in_kv: group_size >= 1, context_tokens > 0, max_groups >= 1 (got {group_size}, "
                         f"{context_tokens}, {max_groups})")
    return max(1, min(max_groups, int(kv_tokens // (group_size * context_tokens))))
