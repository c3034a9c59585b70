"""A discrete-event simulation of the asynchronous run in virtual time.

Rollout servers decode continuous batches (`costs.DecodeCost`: a step's time from the bytes it reads and the
FLOPs it does at the batch's size and KV length, summed in closed form between events; a group's prompt is
prefilled once, its answers share it); answer lengths come from a long-tailed distribution; every weight
update pauses the servers for the broadcast and, in interruptible mode, re-prefills the answers in flight;
each finished group waits the reward latency; the buffer admits groups through the project's own
`algo.staleness.StalenessGate`, drops uniform groups with `algo.dynamic_sampling.is_uniform`
when dynamic sampling is on, and forms a batch of the B oldest accepted groups; the trainer's step packs
them with `algo.packing` (`costs.train_step_seconds`) and then broadcasts the weights.

On CPU topologies the same simulation runs on costs measured on the machine (`costs.MeasuredCosts`, from
`python -m tools.plan.calibrate`), and one simulated server can stand for a core that several rollout
engines time-share (`SimConfig.engines_per_server`).

Simplifications (named so that their effect can be judged): a server takes at most
`buffer.max_groups_per_rollout` groups and no more than its KV pool holds at the mean answer length
(SGLang's retraction when the pool overflows is not modelled); changes to a server's batch take effect at
its next step boundary; reward workers never queue.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections import Counter, deque
from typing import Any

import numpy as np
import torch

from algo.dynamic_sampling import is_uniform
from algo.serving import groups_in_kv
from algo.staleness import StalenessGate, sample_staleness
from tools.plan import costs, hardware
from tools.plan.shapes import ModelShape

#: Answer lengths of AReaL's distilled reasoning models: the tutorial's 7B training log (512 x 16) reports
#: avg_seq_len 7,773-8,204 (prompt included, avg_prompt_len 106-112) and no_eos_ratio 0.118-0.138, the share
#: of answers cut at max_new_tokens, whose default the tutorial gives as 16k. A lognormal with those two
#: figures at a 16,384-token cut (mean 7,800 - 108, 12.5 % cut) has these parameters (`lognormal_for`).
DEFAULT_LENGTHS = {"kind": "lognormal", "mean_tokens_at_cut": 7692, "cut_share": 0.125, "cut": 16384}
#: Average prompt in the same log.
PROMPT_TOKENS = 108
#: Seconds from a group's last answer to its rewards: stated 1 s (the math checker grades thousands of
#: answers a second on a 32-worker pool; docs/reward-math.md), so it is small against decoding.
REWARD_LATENCY_S = 1.0


@functools.lru_cache(maxsize=64)
def lognormal_for(mean_at_cut: float, cut_share: float, cut: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal whose share above `cut` is `cut_share` and whose mean after cutting
    at `cut` is `mean_at_cut` (bisection on sigma; mu follows from the share)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(1 - cut_share)

    def clipped_mean(sigma: float) -> float:
        mu = math.log(cut) - z * sigma
        below = NormalDist().cdf((math.log(cut) - mu - sigma ** 2) / sigma)
        return math.exp(mu + sigma ** 2 / 2) * below + cut * cut_share

    lo, hi = 1e-3, 5.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if clipped_mean(mid) > mean_at_cut:   # a wider spread lowers the mean at a fixed tail share
            lo = mid
        else:
            hi = mid
    sigma = (lo + hi) / 2
    return math.log(cut) - z * sigma, sigma


@dataclasses.dataclass(frozen=True)
class SimConfig:
    shape: ModelShape
    gpu: hardware.GPU
    gpus_per_node: int
    servers: int
    server_tp: int
    trainer: costs.TrainerShape
    batch_size: int
    group_size: int
    eta: int
    max_new_tokens: int
    max_groups_per_server: int = 8
    kv_tokens_per_server: int = 1 << 40
    interruptible: bool = True
    dynamic_sampling: bool = False
    accuracy: float = 0.5              # mean chance an answer is correct (with dynamic sampling)
    lengths: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(DEFAULT_LENGTHS))
    prompt_tokens: int = PROMPT_TOKENS
    reward_latency_s: float = REWARD_LATENCY_S
    weights_across_nodes: bool = True
    steps: int = 6
    seed: int = 0
    #: Costs measured on the machine (CPU topologies) in place of the GPU roofline (`costs.MeasuredCosts`).
    measured: costs.MeasuredCosts | None = None
    #: Engines that time-share one simulated server's device (two rollouts pinned to one core): each busy
    #: engine adds its fixed per-step cost to the device's steps. A server then stands for the device.
    engines_per_server: int = 1
    #: With dynamic sampling, the measured share of finished groups kept (not all answers equally rewarded);
    #: None draws each group's rewards from `accuracy` and filters them with the project's own filter.
    kept_group_share: float | None = None

    def draw_lengths(self, rng: np.random.Generator, n: int) -> np.ndarray:
        spec = self.lengths
        if spec["kind"] == "fixed":
            out = np.full(n, int(spec["tokens"]))
        elif spec["kind"] == "lognormal":
            mu, sigma = lognormal_for(spec["mean_tokens_at_cut"], spec["cut_share"], spec["cut"])
            out = np.ceil(rng.lognormal(mu, sigma, n)).astype(np.int64)
        else:
            raise ValueError(f"lengths.kind: {spec['kind']!r} is not 'fixed' or 'lognormal'")
        return np.clip(out, 1, self.max_new_tokens)


@dataclasses.dataclass
class Step:
    version: int
    start: float             # when its batch was formed
    end: float               # when its weights reached the servers
    tokens: int              # trained tokens (prompt + answer of every answer in the batch)
    train_s: float
    sync_s: float
    staleness: list[int]
    rollout_busy: float = 0.0   # server-seconds busy from the start to `end`
    trainer_busy: float = 0.0   # trainer-seconds busy from the start to `end`


@dataclasses.dataclass
class Result:
    config: SimConfig
    steps: list[Step]
    end: float
    timeline: list[tuple[str, float, float]]   # (lane, start, end): busy intervals for plots
    warmup: int = 1

    @property
    def measured(self) -> list[Step]:
        return self.steps[self.warmup:] if len(self.steps) > self.warmup else self.steps

    @property
    def window(self) -> tuple[float, float]:
        first = self.steps[self.warmup - 1].end if len(self.steps) > self.warmup else 0.0
        return first, self.steps[-1].end

    @property
    def step_time(self) -> float:
        a, b = self.window
        return (b - a) / len(self.measured)

    @property
    def throughput(self) -> float:
        """AReaL's effective training throughput: trained tokens per second of step time."""
        a, b = self.window
        return sum(s.tokens for s in self.measured) / (b - a)

    @property
    def staleness(self) -> dict[int, float]:
        counts = Counter(v for s in self.measured for v in s.staleness)
        total = sum(counts.values())
        return {k: counts[k] / total for k in sorted(counts)}

    def _busy_in_window(self, attr: str) -> float:
        last = getattr(self.steps[-1], attr)
        return last - (getattr(self.steps[self.warmup - 1], attr) if len(self.steps) > self.warmup else 0.0)

    @property
    def rollout_idle(self) -> float:
        """Share of server time in the measured steps spent neither decoding nor prefilling."""
        a, b = self.window
        return max(0.0, 1 - self._busy_in_window("rollout_busy") / (self.config.servers * (b - a)))

    @property
    def trainer_idle(self) -> float:
        """Share of trainer time in the measured steps spent neither training nor sending weights."""
        a, b = self.window
        return max(0.0, 1 - self._busy_in_window("trainer_busy") / (b - a))

    @property
    def weight_sync_s(self) -> float:
        return float(np.mean([s.sync_s for s in self.steps]))

    def summary(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time, "effective_throughput_tok_s": self.throughput,
                "train_s": float(np.mean([s.train_s for s in self.measured])), "weight_sync_s": self.weight_sync_s,
                "rollout_idle": self.rollout_idle, "trainer_idle": self.trainer_idle,
                "staleness": {str(k): v for k, v in self.staleness.items()},
                "tokens_per_step": float(np.mean([s.tokens for s in self.measured]))}


class _Server:
    """One SGLang server's continuous batch. `counter` counts decode steps since the start; an answer that
    joined at counter c with L tokens to go finishes at c + L. State is exact at time `t` (a step boundary)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.t = 0.0
        self.counter = 0
        self.finish: list[tuple[int, int]] = []   # heap of (finish counter, answer id)
        self.start_sum = 0                        # sum over running answers of (join counter - prompt length)
        self.groups: Counter[int] = Counter()     # group -> answers still running here
        self.paused = False
        self.epoch = 0
        self.busy = 0.0

    @property
    def n(self) -> int:
        return len(self.finish)

    def kv(self) -> int:
        """KV tokens held: each answer's prompt plus what it has generated."""
        return self.n * self.counter - self.start_sum


class Simulation:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.gate = StalenessGate(cfg.batch_size, cfg.eta)
        self.servers = [_Server(i) for i in range(cfg.servers)]
        self.open = set(range(cfg.servers))   # servers that may take another group now
        self.open_heap = [(0, i) for i in range(cfg.servers)]   # (groups, index), lazily kept current
        mean_ctx = cfg.prompt_tokens + float(np.mean(cfg.draw_lengths(np.random.default_rng(cfg.seed + 1), 4096)))
        # the buffer's own rule (actors/buffer_state.py rollout_cap)
        self.group_cap = groups_in_kv(cfg.kv_tokens_per_server, cfg.group_size, mean_ctx, cfg.max_groups_per_server)
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.version = 0
        self.answers: dict[int, tuple[int, int, int]] = {}   # answer id -> (group, length, start version)
        self.join: dict[int, int] = {}                        # answer id -> its server's counter when it joined
        self.group_left: dict[int, int] = {}
        self.group_answers: dict[int, list[int]] = {}
        self.ready: deque[int] = deque()
        self.trainer_free = True
        self.next_answer = 0
        self.next_group = 0
        self.steps: list[Step] = []
        self.trainer_busy = 0.0
        self.timeline: list[tuple[str, float, float]] = []
        self._last_span: dict[str, int] = {}
        self.sync_s = cfg.measured.weights_s if cfg.measured else costs.weight_sync_seconds(
            cfg.shape, cfg.gpu, cfg.trainer.tp, cfg.trainer.pp, cfg.gpus_per_node, cfg.weights_across_nodes)
        self._decode: dict[tuple[int, int], costs.DecodeCost] = {}

    # --- event plumbing -------------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def _cost(self, s: _Server) -> costs.DecodeCost:
        """The step cost at s's current batch. Time-sharing engines: groups go to the emptiest engine, so as
        many engines are busy as there are groups, up to the engines the server stands for."""
        key = (s.n, min(self.cfg.engines_per_server, max(1, len(s.groups))))
        if key not in self._decode:
            m = self.cfg.measured
            self._decode[key] = m.decode(*key) if m else costs.decode_cost(self.cfg.shape, self.cfg.gpu,
                                                                           self.cfg.server_tp, key[0])
        return self._decode[key]

    # --- servers ---------------------------------------------------------------------------------
    def _advance(self, s: _Server, now: float) -> None:
        """Bring s to the first step boundary at or after `now` (never past its next finishing answer), and
        hand finished answers on."""
        if s.t >= now:
            return
        if s.paused or s.n == 0:
            s.t = now
            return
        cost, kv0, n = self._cost(s), s.kv(), s.n
        limit = s.finish[0][0] - s.counter
        # smallest j <= limit with t + steps(j) >= now; steps only lengthen, which brackets j
        dt = now - s.t
        lo = min(limit, int(dt / cost.step(kv0 + limit * n)))
        hi = min(limit, int(math.ceil(dt / cost.step(kv0))))
        while lo < hi:
            mid = (lo + hi) // 2
            if s.t + cost.steps(kv0, n, mid) >= now:
                hi = mid
            else:
                lo = mid + 1
        spent = cost.steps(kv0, n, lo)
        self._busy(s, s.t, spent)
        s.t += spent
        s.counter += lo
        while s.finish and s.finish[0][0] <= s.counter:
            _, aid = heapq.heappop(s.finish)
            s.start_sum -= self.join[aid] - self.cfg.prompt_tokens
            self._finish_answer(s, self.answers[aid][0], s.t)

    def _busy(self, s: _Server, t0: float, dt: float) -> None:
        if dt > 0:
            s.busy += dt
            self._span(f"rollout.{s.index}", t0, t0 + dt)

    def _span(self, lane: str, t0: float, t1: float) -> None:
        """Record a busy interval for the plots, merged with the lane's previous one when they touch."""
        last = self._last_span.get(lane)
        if last is not None and self.timeline[last][2] >= t0 - 1e-9:
            self.timeline[last] = (lane, self.timeline[last][1], max(t1, self.timeline[last][2]))
        else:
            self._last_span[lane] = len(self.timeline)
            self.timeline.append((lane, t0, t1))

    def _schedule(self, s: _Server) -> None:
        s.epoch += 1
        if s.paused or s.n == 0:
            return
        j = s.finish[0][0] - s.counter
        self._push(s.t + self._cost(s).steps(s.kv(), s.n, j), "server", (s.index, s.epoch))

    def _finish_answer(self, s: _Server, group: int, t: float) -> None:
        s.groups[group] -= 1
        if s.groups[group] == 0:
            del s.groups[group]
            if not s.paused:
                self._mark_open(s)
        self.group_left[group] -= 1
        if self.group_left[group] == 0:
            self._push(t + self.cfg.reward_latency_s, "reward", group)

    def _prefill(self, s: _Server, tokens: float, sum_sq: float) -> None:
        m = self.cfg.measured
        dt = m.prefill(tokens, sum_sq) if m else costs.prefill_seconds(self.cfg.shape, self.cfg.gpu,
                                                                      self.cfg.server_tp, tokens, sum_sq)
        self._busy(s, s.t, dt)
        s.t += dt

    # --- buffer ----------------------------------------------------------------------------------
    def _dispatch(self, now: float) -> None:
        cfg = self.cfg
        while self.open and self.gate.can_admit():
            s = self._emptiest_open()
            self.gate.admit(1)
            self._advance(s, now)
            group = self.next_group
            self.next_group += 1
            lengths = cfg.draw_lengths(self.rng, cfg.group_size)
            self._prefill(s, cfg.prompt_tokens, cfg.prompt_tokens ** 2)
            self.group_left[group] = cfg.group_size
            self.group_answers[group] = []
            for length in lengths:
                aid = self.next_answer
                self.next_answer += 1
                self.answers[aid] = (group, int(length), self.version)
                self.join[aid] = s.counter
                self.group_answers[group].append(aid)
                heapq.heappush(s.finish, (s.counter + int(length), aid))
                s.start_sum += s.counter - cfg.prompt_tokens
                s.groups[group] += 1
            if len(s.groups) >= self.group_cap:
                self.open.discard(s.index)
            else:
                heapq.heappush(self.open_heap, (len(s.groups), s.index))
            self._schedule(s)

    def _emptiest_open(self) -> _Server:
        """The open server with the fewest groups (lowest index on ties); stale heap entries are skipped."""
        while True:
            count, index = self.open_heap[0]
            s = self.servers[index]
            if index in self.open and count == len(s.groups):
                return s
            heapq.heappop(self.open_heap)   # every open server has a current entry pushed when it changed

    def _mark_open(self, s: _Server) -> None:
        self.open.add(s.index)
        heapq.heappush(self.open_heap, (len(s.groups), s.index))

    def _on_reward(self, group: int, now: float) -> None:
        cfg = self.cfg
        accepted = True
        if cfg.dynamic_sampling and cfg.kept_group_share is not None:
            accepted = bool(self.rng.random() < cfg.kept_group_share)
        elif cfg.dynamic_sampling:
            p = self.rng.beta(2 * cfg.accuracy, 2 * (1 - cfg.accuracy))
            rewards = torch.tensor((self.rng.random(cfg.group_size) < p).astype(np.float32))
            accepted = not is_uniform(rewards)
        self.gate.finish(accepted=accepted)
        if accepted:
            self.ready.append(group)
        self._try_train(now)
        self._dispatch(now)

    # --- trainer ---------------------------------------------------------------------------------
    def _try_train(self, now: float) -> None:
        cfg = self.cfg
        if not self.trainer_free or len(self.ready) < cfg.batch_size or len(self.steps) >= cfg.steps:
            return
        batch = [self.ready.popleft() for _ in range(cfg.batch_size)]
        ids = [a for g in batch for a in self.group_answers[g]]
        lengths = [cfg.prompt_tokens + self.answers[a][1] for a in ids]
        group_of = [self.answers[a][0] for a in ids]
        starts = torch.tensor([self.answers[a][2] for a in ids])
        staleness = sample_staleness(starts, self.version).tolist()
        train_s = cfg.measured.train_step(lengths) if cfg.measured else \
            costs.train_step_seconds(cfg.shape, cfg.gpu, cfg.trainer, lengths, group_of)
        self.trainer_free = False
        self._span("trainer", now, now + train_s)
        self._span("weights", now + train_s, now + train_s + self.sync_s)
        self.trainer_busy += train_s + self.sync_s
        self.steps.append(Step(self.version + 1, now, math.nan, int(sum(lengths)), train_s, self.sync_s, staleness))
        self._push(now + train_s, "trained", None)
        for g in batch:
            for a in self.group_answers.pop(g):
                del self.answers[a], self.join[a]
            del self.group_left[g]

    def _on_trained(self, now: float) -> None:
        for s in self.servers:   # the broadcast pauses every server at its next step boundary
            self._advance(s, now)
            s.paused = True
            s.epoch += 1
        self.open.clear()
        self._push(now + self.sync_s, "synced", None)

    def _on_synced(self, now: float) -> None:
        self.version += 1
        self.gate.set_version(self.version)
        step = self.steps[-1]
        step.end = now
        step.rollout_busy = sum(x.busy for x in self.servers)
        step.trainer_busy = self.trainer_busy
        self.trainer_free = True
        for s in self.servers:
            s.paused = False
            if len(s.groups) < self.group_cap:
                self._mark_open(s)
            s.t = max(s.t, now)
            if self.cfg.interruptible and s.n:   # the KV cache is rebuilt under the new weights
                ctx = np.array([s.counter - self.join[a] + self.cfg.prompt_tokens for _, a in s.finish])
                self._prefill(s, float(ctx.sum()), float((ctx.astype(np.float64) ** 2).sum()))
            self._schedule(s)
        self._try_train(now)
        self._dispatch(now)

    # --- run -------------------------------------------------------------------------------------
    def run(self) -> Result:
        self._dispatch(0.0)
        guard = 0
        while self.events and len([s for s in self.steps if not math.isnan(s.end)]) < self.cfg.steps:
            guard += 1
            if guard > 50_000_000:
                raise RuntimeError("simulation did not finish: an event loop without progress")
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == "server":
                index, epoch = payload
                s = self.servers[index]
                if epoch != s.epoch:
                    continue
                self._advance(s, t)
                self._schedule(s)
                self._dispatch(t)
            elif kind == "reward":
                self._on_reward(payload, t)
            elif kind == "trained":
                self._on_trained(t)
            elif kind == "synced":
                self._on_synced(t)
        done = [s for s in self.steps if not math.isnan(s.end)]
        if not done:
            raise RuntimeError("simulation ended before its first training step: no group can be admitted")
        return Result(self.cfg, done, done[-1].end, [x for x in self.timeline if x[1] < done[-1].end])


def simulate(cfg: SimConfig) -> Result:
    return Simulation(cfg).run()
