"""A generation engine whose steps take what the planner says a GPU's steps take: the stand-in SGLang server
(testsupport/sglang_standin.py) serves it in the rehearsal in place of the embedded torch engine.

What runs when is decided by the planner's model of SGLang 0.5.6's scheduler (`tools.plan.engines.Device`
with `SGLangAdmission`: admission under new_token_ratio, the full-batch mark, retraction), the same object the
simulation drives; here it is driven in real time: the device's clock is the wall clock times the time scale
(divided by the server's slowness, for a straggler), and every answer ends when the device's decode steps,
costed by `tools.plan.costs`, reach its modelled length. The routes, the pause and weight semantics, the
aborts and the answers' fields stay the stand-in server's (SGLang's, cited there).

Token ids carry no text: an answer is `token_scale`-fold shorter than the modelled one, made of a filler token
and, when it stops before its budget, the request's first stop token.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from actors.engines.base import EngineError, GenerationRequest, GenerationResult
from tools.plan.engines import Device, Req, SGLangAdmission, sglang_max_running
from tools.rehearse.costs import RehearsalCosts

__all__ = ["CostModelEngine", "answer_identity"]

FILLER_TOKEN = 3          # any id below the tiny tokenizer's vocabulary that is not a stop token
STATS_EVERY_S = 0.5       # how often the server's clocks and counters are written for the rehearsal


def answer_identity(rid: str) -> tuple[str, str, bool]:
    """(answer id, group id, is an answer) of a request id. The SGLang client names every submission of a
    group's answer ``<group rid>/<index>/<segment>/`` (`actors.engines.sglang.sglang_rid`, the group's own
    '/' escaped); the segment changes when an interrupted answer is resubmitted, so the answer, and its
    modelled length, is ``<group rid>/<index>``."""
    parts = rid[:-1].split("/") if rid.endswith("/") else []
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return f"{parts[0]}/{parts[1]}", parts[0], True
    return rid, rid, False


@dataclass
class _Entry:
    rid: str
    req: Req
    future: asyncio.Future
    before: int            # tokens of this answer emitted by earlier submissions
    total: int             # the answer's modelled length (tokens)
    budget: int            # its modelled max_new_tokens over every submission
    stop_token: int | None
    version: int


class CostModelEngine:
    """The `GenerationEngine` surface the stand-in server drives (generate, abort, pause, resume, health,
    update_weights, version), over a modelled device. ``index``: the server's rollout instance index."""

    def __init__(self, costs: RehearsalCosts, index: int, stats_path: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.costs, self.index = costs, index
        sim = costs.sim
        self.k = costs.token_scale
        self.slow = costs.slow.get(index, 1.0)
        pool = int(sim.kv_tokens_per_server)
        self.admission = SGLangAdmission(pool=pool, max_running=sglang_max_running(pool, sim.context_len))
        self.device = Device(index, self.admission, self._decode_cost, self._prefill_cost, self._finished,
                             interruptible=False)   # the server aborts and the client resubmits, for real
        # What the control plane sees, in its tokens (each stands for k modelled ones).
        self.context_len = sim.context_len // self.k
        self.max_total_tokens = pool // self.k
        self.max_running = self.admission.max_running
        self.max_new_seen = sim.max_new_tokens // self.k   # gen.max_new_tokens as the actors have it
        self.on_step: Callable[[int], None] | None = None   # the stand-in's hook; steps here are modelled
        self._clock = clock
        self._t0 = clock()
        self._version = 0
        self._synced_versions: set[int] = set()
        self._entries: dict[str, _Entry] = {}
        self._by_aid: dict[int, _Entry] = {}
        self._groups: dict[str, int] = {}
        self._next_aid = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stats_task: asyncio.Task | None = None
        self.stats_path = stats_path
        self.counters = {"answers": 0, "aborted": 0, "finished": 0, "tokens_modelled": 0}
        self._area = 0.0           # modelled seconds x groups on the server (time-weighted mean)
        self._area_t = 0.0
        self._max_groups = 0

    # --- clock ----------------------------------------------------------------------------------------
    def vnow(self) -> float:
        """The device's modelled time: wall seconds times the time scale, slowed for a straggler."""
        return (self._clock() - self._t0) * self.costs.time_scale / self.slow

    def _real_seconds(self, modelled: float) -> float:
        return modelled * self.slow / self.costs.time_scale

    # --- costs ----------------------------------------------------------------------------------------
    def _decode_cost(self, n: int, _engines: int) -> Any:
        return self.costs.decode_cost(n)

    def _prefill_cost(self, tokens: float, sum_sq: float, _prefills: int) -> float:
        return self.costs.prefill_seconds(tokens, sum_sq)

    # --- the loop -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())
        if self.stats_path is not None:
            self._stats_task = asyncio.ensure_future(self._write_stats_loop())

    async def stop(self) -> None:
        for task in (self._task, self._stats_task):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._task, self._stats_task) if t is not None), return_exceptions=True)
        self._write_stats()
        for e in list(self._entries.values()):
            if not e.future.done():
                e.future.set_exception(EngineError("engine stopped"))

    def _advance(self) -> None:
        """The device up to now: every stop passed on the way is settled (finishes, retractions, admissions)."""
        now = self.vnow()
        self._count_groups(now)
        for _ in range(100_000):   # bounded: each pass settles one stop
            before = (self.device.t, self.device.counter, self.device.n)
            self.device.advance(now)
            if self.device.t >= now or (self.device.t, self.device.counter, self.device.n) == before:
                return

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            self._advance()
            t = self.device.next_event_time()
            timeout = None if t is None else max(0.0, self._real_seconds(t - self.vnow()))
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # --- requests -------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        if request.n != 1:
            raise EngineError("the cost-model engine takes one answer per request (the SGLang client sends n = 1)")
        sp = request.sampling
        answer, group, is_answer = answer_identity(request.rid)
        before = max(0, self.max_new_seen - sp.max_new_tokens) if is_answer else 0
        budget = (before + sp.max_new_tokens) * self.k
        total = min(self.costs.answer_tokens(answer), budget) if is_answer else sp.max_new_tokens * self.k
        total = max(total, before * self.k + 1)
        prompt = self.costs.sim.prompt_tokens
        gid = self._groups.setdefault(group, len(self._groups))
        req = Req(aid=self._next_aid, group=gid, engine="server", prompt=prompt, origin=prompt + before * self.k,
                  max_new=budget - before * self.k, left=total - before * self.k)
        self._next_aid += 1
        loop = asyncio.get_running_loop()
        entry = _Entry(request.rid, req, loop.create_future(), before, total, budget,
                       sp.stop_token_ids[0] if sp.stop_token_ids else None, self._version)
        self._advance()
        self._entries[request.rid] = entry
        self._by_aid[req.aid] = entry
        self.counters["answers"] += 1
        self.device.submit([req])
        self._poke()
        try:
            return [await entry.future]
        except asyncio.CancelledError:   # the route went away (a health probe): the request is aborted
            self._abort_entry(entry)
            raise

    def _finished(self, _device: Device, r: Req, _t: float) -> None:
        entry = self._by_aid.pop(r.aid, None)
        if entry is None:
            return
        self._entries.pop(entry.rid, None)
        emitted = math.ceil(entry.total / self.k) - entry.before
        length = entry.total >= entry.budget or entry.stop_token is None
        ids = [FILLER_TOKEN] * emitted
        if not length and ids:
            ids[-1] = entry.stop_token
        self.counters["finished"] += 1
        self.counters["tokens_modelled"] += entry.total - entry.before * self.k
        if not entry.future.done():
            entry.future.set_result(GenerationResult(entry.rid, 0, ids, [-1.0] * len(ids), [entry.version] * len(ids),
                                                     "length" if length else "stop", len(ids)))

    def _abort_entry(self, entry: _Entry) -> None:
        self._advance()
        generated = self.device.generated(entry.req)   # modelled tokens over every submission
        if self.device.abort({entry.req.aid}) == 0 and entry.req.aid not in self._by_aid:
            return
        self._by_aid.pop(entry.req.aid, None)
        self._entries.pop(entry.rid, None)
        emitted = max(0, generated // self.k - entry.before)
        self.counters["aborted"] += 1
        if not entry.future.done():
            entry.future.set_result(GenerationResult(entry.rid, 0, [FILLER_TOKEN] * emitted, [-1.0] * emitted,
                                                     [entry.version] * emitted, "abort", 0))
        self._poke()

    async def abort(self, rid: str | None = None) -> int:
        targets = list(self._entries.values()) if rid is None else \
            [self._entries[rid]] if rid in self._entries else []
        for entry in targets:
            self._abort_entry(entry)
        return len(targets)

    async def pause(self) -> None:
        self._advance()
        if not self.device.paused:
            self.device.pause(self.vnow())

    async def resume(self) -> None:
        self._advance()
        if self.device.paused:
            self.device.resume(self.vnow())
        self._poke()

    async def health(self) -> dict[str, Any]:
        return {"ok": True, "running": self.device.n, "waiting": len(self.device.waiting), "version": self._version}

    @property
    def version(self) -> int:
        return self._version

    async def update_weights(self, version: int, source: Any) -> None:
        """The weights arrived (the bucket itself went over the weights group for real); the modelled push of
        the whole version holds the server as long as the planner says a push does, once per version."""
        if source and version not in self._synced_versions:
            self._synced_versions.add(version)
            await asyncio.sleep(self._real_seconds(self.costs.weight_sync().push_s))
        self._version = version

    # --- what the rehearsal reads -----------------------------------------------------------------------
    def _count_groups(self, now: float) -> None:
        groups = len({e.req.group for e in self._entries.values()})
        if now > self._area_t:
            self._area += groups * (now - self._area_t)
            self._area_t = now
        self._max_groups = max(self._max_groups, groups)

    def stats(self) -> dict[str, Any]:
        d = self.device
        now = self.vnow()
        return {"index": self.index, "pid": os.getpid(), "modelled_s": now, "slow": self.slow,
                "seconds": {k: d.clock(k, now) for k in d.seconds}, "device": dict(d.counters),
                "groups_mean": self._area / max(self._area_t, 1e-9), "groups_max": self._max_groups,
                **self.counters}

    def _write_stats(self) -> None:
        """One line of the server's clocks and counters, with the wall time, appended (the rehearsal reads
        them over its measured window; a killed server's last line stays)."""
        if self.stats_path is None:
            return
        with open(self.stats_path, "a") as f:
            f.write(json.dumps({"time": time.time(), **self.stats()}) + "\n")

    async def _write_stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_EVERY_S)
            self._advance()
            self._write_stats()
