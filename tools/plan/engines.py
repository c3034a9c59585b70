"""The rollout engines as cost models, for the simulation (`tools/plan/sim.py`): what a device admits, decodes,
retracts and recomputes at each step, and what each step costs.

A `Device` is what runs decode steps: one SGLang server (its tensor-parallel GPUs), or one CPU core that
several embedded engines time-share. Its requests are the answers of the groups its engines were given;
decode steps advance them all by one token, in closed form between events (`costs.DecodeCost.steps`).

Admission, the rule that decides which waiting answers join the running batch, is the engine's:

* `SGLangAdmission`: SGLang 0.5.6's scheduler, read in the 0.5.6 wheel (file:line below).
  - Admission (`managers/schedule_policy.py` PrefillAdder): first come first served (`server_args.py:272`,
    schedule_policy "fcfs"); a waiting request is admitted while `extend + min(max_new - out, 4096)` is below
    the pool's free tokens minus what the batch reserves (`add_one_req`, :591), where every running request
    reserves `min(max_new - out, 4096) * new_token_ratio` (`_get_running_request_total_token_offset`,
    :372-380; CLIP_MAX_NEW_TOKENS 4096 at :42) and every request admitted in the same round its full
    `extend + min(max_new, 4096)` (`_update_prefill_budget`, :445). A round stops at 16,384 prompt tokens
    (max_prefill_tokens, `server_args.py:271`) and the next round follows at once; it also stops at
    max_running_requests (`managers/tp_worker.py:289`: min(pool // 2, the request pool), whose size is
    min(max(pool / context_len * 512, 2048), 4096), `model_executor/model_runner.py:1677`).
  - A request that does not fit marks the batch full (`managers/scheduler.py:1820`): nothing more is
    admitted until the running batch shrinks (`:1939`, a request finished or was retracted), however long
    the queue is.
  - new_token_ratio starts at 0.7 x schedule_conservativeness (1.0) and decays by (0.7 - 0.7 x 0.14) / 600
    every decode step to 0.098 (`scheduler.py:490-502`, `environ.py:177-179`, `:1934-1937`).
  - Retraction: before a decode step the pool must hold one more token per running request
    (`schedule_batch.py:1567` check_decode_mem, page size 1); if it does not, requests are retracted, the
    ones with the fewest output tokens first (ties: the longest input), until it does, at least one
    (`retract_decode`, :1587-1661); they go back to the end of the queue keeping their tokens and are
    prefilled again (prompt + output) when admitted anew (`reset_for_retract`, :992). new_token_ratio then
    becomes (tokens decoded + 20 x remaining requests) / (their max_new_tokens + 1) (:1650,
    SGLANG_RETRACT_DECODE_STEPS 20 at `environ.py:180`).
  - A group's prompt is in the radix cache once one of its answers was prefilled, until the next weight
    update flushes it; its other answers extend only their own tokens.

* `EmbeddedAdmission`: the project's torch engine (`actors/engines/torch_gen.py` `_take_waiting`): whole
  groups, while the rows stay within max_running and the prompts within max_prefill_tokens; one prefill per
  group; no KV pool to overflow.

A weight update pauses the device. Interruptible (`gen.interruptible`): SGLang aborts every request
(`/pause_generation {"mode": "abort"}`) and the rollout resubmits each as prompt + tokens so far with the
rest of its budget, through admission again (the cache is flushed); the embedded engine rebuilds its rows'
KV cache in place (one prefill of every row's context). Otherwise the device only waits.

Simplifications, so that their effect can be judged: a group's prompt is counted in every answer's KV
tokens (the cache shares it: at most a prompt per answer, ~1 % of a long answer); chunked prefill is not
split into chunks (the same FLOPs); the radix cache never evicts a live group's prompt.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from typing import Callable

import numpy as np

from tools.plan import costs

# --- SGLang 0.5.6's scheduler constants (see the module docstring for file:line) ------------------------
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RETRACT_DECODE_STEPS = 20
MAX_PREFILL_TOKENS = 16384


def sglang_max_running(pool_tokens: int, context_len: int) -> int:
    """max_running_requests SGLang derives when it is not set (tp_worker.py:289, model_runner.py:1677)."""
    request_pool = min(max(int(pool_tokens / context_len * 512), 2048), 4096)
    return max(1, min(pool_tokens // 2, request_pool))


@dataclasses.dataclass(slots=True)
class Req:
    """One answer as its engine sees it. `origin`: input tokens as submitted (the prompt, plus the answer's
    earlier tokens when it was resubmitted after an interruption); `out0`: output tokens it held when it
    joined the running batch (kept across a retraction); `max_new`: its max_new_tokens as submitted; `left`:
    output tokens it must generate from its submission to finish; `join`: the device's step counter when it
    joined the running batch."""

    aid: int
    group: int
    engine: str
    prompt: int
    origin: int
    max_new: int
    left: int
    out0: int = 0
    join: int = 0

    def output(self, counter: int) -> int:
        return self.out0 + counter - self.join

    def finish_at(self) -> int:
        return self.join + self.left - self.out0


class Device:
    """One device's decode loop (see the module docstring). `decode_cost(n, busy_engines)` and
    `prefill_cost(tokens, sum_sq, prefills)` give seconds; `on_finished(req, t)` hears each answer that is
    done. State is exact at `t`, a step boundary."""

    def __init__(self, index: int, admission: "SGLangAdmission | EmbeddedAdmission",
                 decode_cost: Callable[[int, int], costs.DecodeCost],
                 prefill_cost: Callable[[float, float, int], float],
                 on_finished: Callable[["Device", Req, float], None], interruptible: bool = True) -> None:
        self.index = index
        self.admission = admission
        self.decode_cost, self.prefill_cost, self.on_finished = decode_cost, prefill_cost, on_finished
        self.interruptible = interruptible
        self.t = 0.0
        self.counter = 0
        self.running: dict[int, Req] = {}
        self.finish: list[tuple[int, int]] = []       # heap of (finish counter, answer id), lazily pruned
        self.used_base = 0                            # KV tokens = used_base + n * counter
        self.waiting: deque[Req] = deque()
        self.engines_busy: dict[str, int] = {}        # engine -> its requests running
        self.cached_prompts: set[int] = set()         # groups whose prompt the (radix) cache holds
        self.paused, self.paused_since = False, 0.0
        self.epoch = 0
        self.seconds = {"decode": 0.0, "prefill": 0.0, "paused": 0.0}
        self.counters = {"retractions": 0, "retracted": 0, "admitted": 0, "prefill_tokens": 0,
                         "recomputed_tokens": 0, "batch_full": 0, "max_running": 0, "max_waiting": 0}
        self.batch_area = 0.0                         # integral of the running batch's size over decode time
        self.ratio, self.ratio_at = INIT_NEW_TOKEN_RATIO, 0   # SGLang's new_token_ratio, set at step ratio_at
        self.batch_full = False

    # --- state ----------------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.running)

    def used(self) -> int:
        """KV tokens held by the running requests."""
        return self.used_base + self.n * self.counter

    def new_token_ratio(self) -> float:
        return max(self.ratio - NEW_TOKEN_RATIO_DECAY * (self.counter - self.ratio_at), MIN_NEW_TOKEN_RATIO)

    def cost(self) -> costs.DecodeCost:
        return self.decode_cost(self.n, max(1, sum(1 for v in self.engines_busy.values() if v)))

    def _valid(self, at: int, aid: int) -> bool:
        """A finish entry of an answer still running, from its current stay in the batch (a retracted and
        re-admitted answer has a newer one)."""
        r = self.running.get(aid)
        return r is not None and r.finish_at() == at

    def _join(self, r: Req) -> None:
        r.join = self.counter
        self.running[r.aid] = r
        self.used_base += r.origin + r.out0 - r.join
        heapq.heappush(self.finish, (r.finish_at(), r.aid))
        self.engines_busy[r.engine] = self.engines_busy.get(r.engine, 0) + 1
        self.counters["max_running"] = max(self.counters["max_running"], len(self.running))

    def _leave(self, r: Req) -> int:
        """Takes r out of the running batch; returns its output tokens."""
        out = r.output(self.counter)
        del self.running[r.aid]
        self.used_base -= r.origin + r.out0 - r.join
        self.engines_busy[r.engine] -= 1
        return out

    # --- time ------------------------------------------------------------------------------------------
    def _spend(self, kind: str, dt: float) -> None:
        if dt > 0:
            self.seconds[kind] += dt
            self.t += dt

    def steps_to_stop(self) -> int:
        """Decode steps until the next answer finishes or the pool overflows (whichever first)."""
        while self.finish and not self._valid(*self.finish[0]):
            heapq.heappop(self.finish)
        j = self.finish[0][0] - self.counter if self.finish else math.inf
        pool = self.admission.pool
        if pool is not None:
            n, free = self.n, pool - self.used()
            j = min(j, 0 if free < n else (free - n) // n + 1)
        return int(max(0, j))

    def advance(self, now: float) -> None:
        """Decode up to the first step boundary at or after `now`, never past the next stop; then settle
        what happened there (finishes, a retraction, admissions)."""
        if self.t >= now:
            return
        if self.paused or self.n == 0:
            self.t = now
            return
        cost, kv0, n = self.cost(), self.used(), self.n
        limit = self.steps_to_stop()
        dt = now - self.t
        lo = min(limit, int(dt / cost.step(kv0 + limit * n)))
        hi = min(limit, int(math.ceil(dt / cost.step(kv0))))
        while lo < hi:   # smallest j <= limit with t + steps(j) >= now
            mid = (lo + hi) // 2
            if self.t + cost.steps(kv0, n, mid) >= now:
                hi = mid
            else:
                lo = mid + 1
        spent = cost.steps(kv0, n, lo)
        self._spend("decode", spent)
        self.batch_area += n * spent
        self.counter += lo
        self.settle()

    def settle(self) -> None:
        """At a step boundary: hand on finished answers, retract if the pool cannot take the next step, admit."""
        shrank = False
        while self.finish and self.finish[0][0] <= self.counter:
            at, aid = heapq.heappop(self.finish)
            if not self._valid(at, aid):
                continue
            r = self.running[aid]
            self._leave(r)
            shrank = True
            self.on_finished(self, r, self.t)
        if self.admission.pool is not None and self.n and self.admission.pool - self.used() < self.n:
            self._retract()
            shrank = True
        if shrank:
            self.batch_full = False
        self.admit()

    def next_event_time(self) -> float | None:
        """When the device reaches its next stop, if it is decoding."""
        if self.paused or self.n == 0:
            return None
        return self.t + self.cost().steps(self.used(), self.n, self.steps_to_stop())

    # --- admission, retraction ---------------------------------------------------------------------------
    def _note_queue(self) -> None:
        self.counters["max_waiting"] = max(self.counters["max_waiting"], len(self.waiting))

    def submit(self, reqs: list[Req]) -> None:
        self.waiting.extend(reqs)
        self._note_queue()
        if not self.paused:
            self.admit()

    def admit(self) -> None:
        if self.paused:
            return
        while self.waiting and not self.batch_full:
            taken = self.admission.take(self)
            if not taken:
                return
            tokens = sq = 0.0
            groups = set()
            for r in taken:
                context = r.origin + r.out0
                cached = r.prompt if r.group in self.cached_prompts else 0
                tokens += context - cached
                sq += context ** 2 - cached ** 2
                self.cached_prompts.add(r.group)
                groups.add(r.group)
                self.counters["recomputed_tokens"] += context - max(cached, r.prompt)
                self._join(r)
            self.counters["admitted"] += len(taken)
            self.counters["prefill_tokens"] += int(tokens)
            self._spend("prefill", self.prefill_cost(tokens, sq, self.admission.prefills(taken, groups)))

    def _retract(self) -> None:
        """SGLang's retract_decode (module docstring)."""
        order = sorted(self.running.values(), key=lambda r: (r.output(self.counter), -r.origin), reverse=True)
        pool = self.admission.pool
        assert pool is not None
        retracted = []
        while not retracted or pool - self.used() < len(order):
            if len(order) == 1:
                if not retracted:   # SGLang asserts here: the pool cannot hold one request's next token
                    raise RuntimeError(f"server {self.index}: the KV pool ({pool:,} tokens) cannot hold one answer")
                break
            r = order.pop()
            r.out0 = self._leave(r)
            retracted.append(r)
        self.waiting.extend(retracted)
        self._note_queue()
        self.counters["retractions"] += 1
        self.counters["retracted"] += len(retracted)
        rest = self.running.values()
        decoded = sum(r.output(self.counter) for r in rest)
        self.ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(rest)) / (sum(r.max_new for r in rest) + 1))
        self.ratio_at = self.counter

    def abort(self, aids: set[int]) -> int:
        """SGLang's /abort_request for these answers (running or waiting): they leave at once and free their KV.
        Returns how many were found."""
        found = 0
        for aid in aids & self.running.keys():
            self._leave(self.running[aid])
            found += 1
        kept = deque(r for r in self.waiting if r.aid not in aids)
        found += len(self.waiting) - len(kept)
        self.waiting = kept
        if found:
            self.batch_full = False
            self.admit()
        return found

    # --- weight updates ---------------------------------------------------------------------------------
    def pause(self, now: float) -> None:
        """A weight update starts (call `advance(now)` first)."""
        self.paused, self.paused_since = True, max(self.t, now)
        self.epoch += 1

    def clock(self, kind: str, now: float) -> float:
        """Seconds spent on `kind` so far, a pause still running counted up to `now`."""
        extra = max(0.0, now - self.paused_since) if kind == "paused" and self.paused else 0.0
        return self.seconds[kind] + extra

    def resume(self, now: float) -> None:
        """The new weights are in: interrupted work is taken up again."""
        self.seconds["paused"] += max(0.0, now - self.paused_since)
        self.t = max(self.t, now)
        self.paused = False
        self.epoch += 1
        if not self.interruptible:
            self.admit()
            return
        if isinstance(self.admission, EmbeddedAdmission):
            if self.running:   # the KV cache is rebuilt under the new weights, in place
                ctx = np.array([r.origin + r.output(self.counter) for r in self.running.values()], dtype=np.float64)
                self.counters["recomputed_tokens"] += int(ctx.sum())
                self._spend("prefill", self.prefill_cost(float(ctx.sum()), float((ctx ** 2).sum()), 1))
            self.admit()
            return
        # SGLang: every request was aborted; each comes back as prompt + tokens so far, with the rest of its
        # budget, and is admitted again from an empty batch (the weight update flushed the cache).
        interrupted = list(self.running.values()) + list(self.waiting)
        for r in list(self.running.values()):
            r.out0 = self._leave(r)
        self.waiting.clear()
        self.cached_prompts.clear()
        for r in sorted(interrupted, key=lambda r: r.aid):
            out = r.out0
            r.origin, r.max_new, r.left, r.out0 = r.origin + out, r.max_new - out, r.left - out, 0
            self.waiting.append(r)
        self._note_queue()
        self.batch_full = False
        self.admit()

    def generated(self, r: Req, counter: int | None = None) -> int:
        """Tokens of r's answer generated so far (over every resubmission)."""
        out = r.output(self.counter if counter is None else counter) if r.aid in self.running else r.out0
        return r.origin - r.prompt + out


@dataclasses.dataclass
class SGLangAdmission:
    """SGLang 0.5.6's admission (module docstring). `pool`: the KV pool's tokens."""

    pool: int
    max_running: int

    def take(self, d: Device) -> list[Req]:
        """One prefill round: the requests admitted, in order (and `d.batch_full` set if one did not fit)."""
        ratio = d.new_token_ratio()
        reserved = 0.0
        if d.running:
            left = np.fromiter((r.max_new - r.output(d.counter) for r in d.running.values()), dtype=np.int64,
                               count=d.n)
            reserved = float(np.minimum(np.maximum(left, 0), CLIP_MAX_NEW_TOKENS).sum()) * ratio
        rem_total = self.pool - d.used() - reserved
        rem_input = MAX_PREFILL_TOKENS
        taken: list[Req] = []
        cached = set(d.cached_prompts)
        for r in d.waiting:
            if d.n + len(taken) >= self.max_running:
                d.batch_full = True
                break
            extend = r.origin + r.out0 - (r.prompt if r.group in cached else 0)
            total = extend + min(max(r.max_new - r.out0, 0), CLIP_MAX_NEW_TOKENS)
            if total >= rem_total:
                d.batch_full = True
                d.counters["batch_full"] += 1
                break
            if extend >= rem_input and taken:
                break
            taken.append(r)
            cached.add(r.group)
            rem_total -= total
            rem_input -= extend
            if rem_total <= 0:
                d.batch_full = True
                break
            if rem_input <= 0:
                break
        for _ in taken:
            d.waiting.popleft()
        return taken

    @staticmethod
    def prefills(taken: list[Req], groups: set[int]) -> int:
        return 1   # one prefill batch


@dataclasses.dataclass
class EmbeddedAdmission:
    """The embedded torch engine's admission (module docstring), per engine (rollout) on the device."""

    max_running: int
    max_prefill_tokens: int = 8192
    pool: None = None

    def take(self, d: Device) -> list[Req]:
        rows = dict(d.engines_busy)
        tokens: dict[str, int] = {}
        taken: list[Req] = []
        blocked: set[str] = set()
        i = 0
        waiting = list(d.waiting)
        while i < len(waiting):   # whole groups, first come first served, per engine
            r = waiting[i]
            group = [w for w in waiting[i:] if w.group == r.group]
            i += len(group)
            e = r.engine
            if e in blocked:
                continue
            n, plen = len(group), r.origin + r.out0
            have = rows.get(e, 0)
            first = not any(t.engine == e for t in taken)
            if (not first and (have + n > self.max_running or tokens.get(e, 0) + plen > self.max_prefill_tokens)) \
                    or (first and have and have + n > self.max_running):
                blocked.add(e)
                continue
            taken.extend(group)
            rows[e] = have + n
            tokens[e] = tokens.get(e, 0) + plen
        ids = {r.aid for r in taken}
        d.waiting = deque(r for r in d.waiting if r.aid not in ids)
        return taken   # what waits is looked at again when rows finish (or a group arrives)

    @staticmethod
    def prefills(taken: list[Req], groups: set[int]) -> int:
        return len(groups)   # one prefill per group
