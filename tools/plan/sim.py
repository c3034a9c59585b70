"""A discrete-event simulation of the run in virtual time, driving the run's own decision code.

The decisions are the actors' own objects, called as the actors call them: the buffer's `BufferState`
(actors/buffer/state.py: which prompt goes to which rollout, the staleness gate, in-flight caps, timeouts and
re-issue, dynamic sampling, the batch-time staleness check, batch forming) through the same public methods
`actors/buffer/actor.py` calls, in the same situations; and the parameter server's `PushPolicy`
(actors/param_server/push_policy.py: forming the link, what is pushed when, coalescing). A change to those rules changes
the plan without a change here (tests/test_plan.py monkeypatches one and watches the counters move).

What the actors wait on is replaced by cost models: the rollout engines by `engines.Device` (SGLang's
admission, retraction and new_token_ratio from its 0.5.6 source, or the embedded engine's row limit; each
decode step costs what `costs.decode_cost` says, summed in closed form between events), the trainer's step by
`costs.train_step_seconds` (the project's own packing), the weight path by `costs.weight_sync`, grading by a
fixed latency. On CPU topologies the costs are the ones measured on the machine (`costs.MeasuredCosts`).

Time runs as the actors run it. The trainer asks for a batch (the buffer first drops stale groups, then takes
the oldest B, and serves it: `ServeCost`, measured, before the trainer has it), trains, and (eta > 0) opens the
gate at once and publishes; with eta = 0 it publishes and waits until the servers hold the new weights before
opening the gate (actors/trainer/actor.py). A published version is
offered to the push policy; a push pauses every server (SGLang aborts its requests and they are resubmitted
with their tokens when it resumes). A finished group is graded after the reward latency and handed to
`BufferState.scored`. Every `BufferState.expire_every_s` the buffer's overdue check runs; an overdue group's
copy is aborted on its server and the group handed back, then issued again (never two copies at once, as the
buffer actor does it; a result that was already on its way is late, ignored, and counted here).

The figures (`Result.summary()`) are the ones the rehearsal of the real control plane reports for the same
topology (`Result.figures()`, compared by `agreement`).
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections import Counter
from typing import Any

import numpy as np

from actors.buffer.state import BufferState
from actors.param_server.push_policy import Form, Push, PushPolicy
from algo.serving import DecodePace
from launch.plan import hardware
from launch.plan.shapes import ModelShape, builtin_size
from tools.plan import costs
from tools.plan.engines import (Device, EmbeddedAdmission, Req, SGLangAdmission, sglang_max_running)
from transport.protocol import Answers, RolloutWeights, Sample

#: Answer lengths of AReaL's distilled reasoning models: the tutorial's 7B training log reports avg_seq_len
#: 7,773-8,204 (prompt included, avg_prompt_len 106-112) and no_eos_ratio 0.118-0.138, the share of answers
#: cut at max_new_tokens, then 16,384 (the log is of a 16k run: AReaL's first tutorial commit names its
#: command line). A lognormal with those two figures at that cut (mean 7,800 - 108, 12.5 % cut) has these
#: parameters (`lognormal_for`); cut at 27,648 instead it cuts 3.7 % of answers, which agrees with the v0.2
#: notes' "truncation rate remained below 5 %" at 27K. It stands for the 7B, for the 32B (no published figure
#: of R1-Distill-Qwen-32B's answer lengths in training) and for any model not built in (`LENGTHS_BY_SIZE`).
DEFAULT_LENGTHS = {"kind": "lognormal", "mean_tokens_at_cut": 7692, "cut_share": 0.125, "cut": 16384}
#: Average prompt in the same log.
PROMPT_TOKENS = 108
#: Seconds from a group's last answer to its rewards: stated 1 s (the math checker grades thousands of
#: answers a second on a 32-worker pool, docs/reward-math.md), small against decoding.
REWARD_LATENCY_S = 1.0
#: Prompts in the simulated dataset: the cursor's epochs do not matter to the timing.
N_RECORDS = 1 << 16


@dataclasses.dataclass(frozen=True)
class ServeCost:
    """Seconds from the buffer taking a batch to the trainer holding it: `per_batch_s + per_token_s x answer
    tokens` (BufferActor.on_batch_request: the lists become tensors, the served copy is encoded and written, the
    reply sent, received and decoded). The defaults are the CPU time `python -m tools.bench serve --repeat 5`
    measured on a 2-core AMD EPYC VM (docs/measurements/bench-serve-cpu.txt: 9.25 ms a batch, 104 ns an answer
    token); the 7B batch of topology/64node.yaml, 512 x 16 answers of 8.6k tokens on average, costs about 7.3 s. That is the elapsed time on cores of
    its own: a machine shared with other work stretches it (`tools.rehearse` scales it by the stretch it
    measures during the run)."""

    per_batch_s: float = 9.25e-3
    per_token_s: float = 1.039e-7

    def scaled(self, by: float, token_scale: float = 1.0) -> "ServeCost":
        """This cost `by` times longer, for answers each standing for `token_scale` of the ones served."""
        return ServeCost(self.per_batch_s * by, self.per_token_s * by / token_scale)

    def seconds(self, answer_tokens: float) -> float:
        return self.per_batch_s + self.per_token_s * answer_tokens


def clipped_lognormal_mean(mu: float, sigma: float, cut: float) -> float:
    """The mean of lognormal(mu, sigma) draws once every draw above `cut` is cut to it."""
    from statistics import NormalDist

    z = (math.log(cut) - mu) / sigma
    return math.exp(mu + sigma ** 2 / 2) * NormalDist().cdf(z - sigma) + cut * (1 - NormalDist().cdf(z))


@functools.lru_cache(maxsize=64)
def lognormal_for(mean_at_cut: float, cut_share: float, cut: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal whose share above `cut` is `cut_share` and whose mean after cutting
    at `cut` is `mean_at_cut` (bisection on sigma; mu follows from the share)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(1 - cut_share)
    lo, hi = 1e-3, 5.0
    for _ in range(100):
        mid = (lo + hi) / 2
        # a wider spread lowers the mean at a fixed tail share
        if clipped_lognormal_mean(math.log(cut) - z * mid, mid, cut) > mean_at_cut:
            lo = mid
        else:
            hi = mid
    sigma = (lo + hi) / 2
    return math.log(cut) - z * sigma, sigma


#: The spread (sigma of the log) of the 7B's lengths, for a size whose share cut is not published.
SIGMA_7B = lognormal_for(DEFAULT_LENGTHS["mean_tokens_at_cut"], DEFAULT_LENGTHS["cut_share"],
                         DEFAULT_LENGTHS["cut"])[1]
#: Answer lengths per built-in model size (`shapes.BUILTIN`'s keys).
#:
#: 1.5B: AReaL's only published measurement of R1-Distill-Qwen-1.5B's answers in training is Figure 1 of the v0.1
#: blog (blog/AReaL_v0_1.md and assets/distill_1.5b_24k_curve.png since AReaL's first commit 2963a67; unchanged
#: at v0.3.0): "Training rewards and response lengths during RL training. The base model is
#: DeepSeek-R1-Distill-Qwen-1.5B. Curves are averaged with a window size of 25." (16 nodes of H800, 1,024
#: prompts x 8 answers of DeepScaleR's 40k math problems, answers cut at 8K, then 16K from step 200, then 24K
#: from step 357). The curve read off the figure's pixels (axis ticks 4,000-7,000 and steps 100-400; one pixel
#: is 11 tokens) averages 6,870 tokens over the 24K stage (steps 358-436, from 6,269 to 7,155), the stage cut
#: nearest the published runs' 27,648; earlier it falls from 5,756 (step 23, cut at 8K) to 4,139 (steps 190-199)
#: and rises to 6,258 (step 357, 16K). The share cut is not published, so the spread is the 7B's
#: (`SIGMA_7B`): 2.8 % cut at 24,576, and cut at 27,648 a mean of 6,948 (6,880-7,069 for a sigma of 0.5-1.2,
#: so the missing share barely matters there; docs/plan.md has the commands). The 1.5B thus answers 18 % shorter
#: than the 7B's 8,491 at 27,648. (Were the curve's "response length" to count the prompt, as the 7B log's
#: avg_seq_len does, the answers would be about 100 tokens, 1.5 %, shorter still.)
#:
#: 32B: no published figure of R1-Distill-Qwen-32B's answer lengths in training was found (AReaL's blogs v0.1-v0.3,
#: tutorial, configs and benchmark notes; its v0.2 32B model is an SFT of 200 samples, with no RL curve), so the
#: 32B keeps the 7B's distribution.
LENGTHS_BY_SIZE: dict[str, dict[str, Any]] = {
    "1.5B": {"kind": "lognormal", "mean_tokens_at_cut": 6870, "sigma": SIGMA_7B, "cut": 24576},
    "7B": DEFAULT_LENGTHS,
    "32B": DEFAULT_LENGTHS,
}


@functools.lru_cache(maxsize=64)
def lognormal_mu_for(mean_at_cut: float, sigma: float, cut: float) -> float:
    """mu of the lognormal of spread `sigma` whose mean after cutting at `cut` is `mean_at_cut` (bisection: the
    clipped mean grows with mu)."""
    if not 0 < mean_at_cut < cut:
        raise ValueError(f"lengths: mean_tokens_at_cut {mean_at_cut} must lie between 0 and the cut {cut}")
    lo, hi = math.log(mean_at_cut) - 10 * sigma - 10, math.log(cut) + 10 * sigma + 10
    for _ in range(200):
        mid = (lo + hi) / 2
        if clipped_lognormal_mean(mid, sigma, cut) > mean_at_cut:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def lengths_for(shape: ModelShape) -> dict[str, Any]:
    """The answer lengths of `shape`'s model: its built-in size's (`LENGTHS_BY_SIZE`), else the 7B's."""
    return dict(LENGTHS_BY_SIZE.get(builtin_size(shape) or "", DEFAULT_LENGTHS))


@dataclasses.dataclass(frozen=True)
class SimConfig:
    shape: ModelShape
    gpu: hardware.GPU
    gpus_per_node: int
    servers: int                       # simulated devices (an SGLang server, or a CPU core)
    server_tp: int
    trainer: costs.TrainerShape
    batch_size: int
    group_size: int
    eta: int
    max_new_tokens: int
    #: buffer.max_groups_per_rollout, buffer.max_concurrent_groups, buffer.group_timeout_s (BufferState's; None
    #: derives it from max_new_tokens and the pace of the answers, as the buffer does).
    max_groups_per_rollout: int = 8
    max_concurrent_groups: int | None = None
    group_timeout_s: float | None = None
    #: gen.assumed_tokens_per_s, gen.timeout_slack, gen.timeout_floor_s (the buffer's `DecodePace`).
    pace: tuple[float, float, float] = (5.0, 3.0, 60.0)
    #: The engine: "sglang" (SGLang's admission over a KV pool of `kv_tokens_per_server`) or "embedded".
    engine: str = "sglang"
    kv_tokens_per_server: int = 1 << 40
    context_len: int = 131072          # the model's max_position_embeddings (SGLang's request pool)
    max_running: int = 256             # embedded engine: rows decoded at once
    interruptible: bool = True
    dynamic_sampling: bool = False
    accuracy: float = 0.5              # mean chance an answer is correct (with dynamic sampling)
    lengths: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(DEFAULT_LENGTHS))
    prompt_tokens: int = PROMPT_TOKENS
    reward_latency_s: float = REWARD_LATENCY_S
    rewards: int = 1                   # reward actors (BufferState spreads groups over them)
    weights_across_nodes: bool = True
    steps: int = 6
    seed: int = 0
    #: Costs measured on the machine (CPU topologies) in place of the GPU roofline (`costs.MeasuredCosts`).
    measured: costs.MeasuredCosts | None = None
    #: Engines (rollout actors) that time-share one simulated device (two rollouts pinned to one core): each
    #: busy engine adds its fixed per-step cost to the device's steps.
    engines_per_server: int = 1
    #: With dynamic sampling, the measured share of finished groups kept (not all answers equally rewarded);
    #: None draws each group's rewards from `accuracy` and filters them with the project's own filter.
    kept_group_share: float | None = None
    #: The buffer's rules: the project's `BufferState`, or a subclass that changes one (tools.plan.published
    #: models AReaL's controller so).
    buffer_rules: type[BufferState] = BufferState
    #: The evaluator's prompts on the rollouts (weights_from: rollouts): every `eval_every` versions (0: none) the
    #: devices' newest version reaches, `eval_prompts` greedy answers (one each, lengths drawn as the training
    #: answers'), at most `eval_per_rollout` in flight on one rollout, beside the groups (actors/evaluator/actor.py).
    eval_every: int = 0
    eval_prompts: int = 0
    eval_per_rollout: int = 2
    #: What serving a batch costs before the trainer can train it (the buffer's conversion, served copy and reply).
    serve: ServeCost = ServeCost()
    #: Virtual seconds without a training step after which the run is declared stuck (an error naming the
    #: decisions' counters): a timeout shorter than a group's generation re-issues every group forever.
    stall_s: float = 3 * 86400.0

    def draw_lengths(self, rng: np.random.Generator, n: int) -> np.ndarray:
        spec = self.lengths
        if spec["kind"] == "fixed":
            out = np.full(n, int(spec["tokens"]))
        elif spec["kind"] == "lognormal" and ("cut_share" in spec or "sigma" in spec):
            if "cut_share" in spec:
                mu, sigma = lognormal_for(spec["mean_tokens_at_cut"], spec["cut_share"], spec["cut"])
            else:
                sigma = float(spec["sigma"])
                mu = lognormal_mu_for(spec["mean_tokens_at_cut"], sigma, spec["cut"])
            out = np.ceil(rng.lognormal(mu, sigma, n)).astype(np.int64)
        else:
            raise ValueError(f"lengths: {spec!r} is not 'fixed' (tokens) or 'lognormal' (mean_tokens_at_cut, cut and "
                             f"either cut_share or sigma)")
        return np.clip(out, 1, self.max_new_tokens)

    @property
    def rollout_names(self) -> list[str]:
        return [f"rollout.{i}" for i in range(self.servers * self.engines_per_server)]


@dataclasses.dataclass
class Step:
    version: int
    start: float             # when the trainer took its batch
    end: float               # when the trainer was done with it (as actors/trainer/actor.py counts step_seconds)
    tokens: int              # trained tokens (prompt + answer of every answer in the batch)
    wait_s: float            # the trainer waiting for the batch
    train_s: float
    export_s: float
    sync_wait_s: float       # eta = 0: waiting until the servers hold the new weights
    staleness: list[int]
    clocks: dict[str, float] = dataclasses.field(default_factory=dict)   # cumulative clocks at `end`


@dataclasses.dataclass
class _Group:
    gid: str
    rollout: str
    device: int
    answers: list[Req]
    lengths: list[int]
    start_version: int
    left: int
    end_version: int = -1
    done_at: float = math.nan
    issued_at: float = 0.0


@dataclasses.dataclass
class Result:
    config: SimConfig
    steps: list[Step]
    end: float
    timeline: list[tuple[str, float, float]]   # (lane, start, end): busy intervals for plots
    counters: dict[str, Any]
    warmup: int = 1
    # (actor, record): the trace records the actors write (actors/runtime/spans.py) and the log events
    # tools.trace reads, as the simulated run would have written them (`Simulation(cfg, trace=True)`)
    records: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)

    @property
    def measured(self) -> list[Step]:
        return self.steps[self.warmup:] if len(self.steps) > self.warmup else self.steps

    @property
    def window(self) -> tuple[float, float]:
        first = self.steps[self.warmup - 1].end if len(self.steps) > self.warmup else 0.0
        return first, self.steps[-1].end

    def _clock(self, name: str) -> float:
        a = self.steps[self.warmup - 1].clocks.get(name, 0.0) if len(self.steps) > self.warmup else 0.0
        return self.steps[-1].clocks.get(name, 0.0) - a

    def step_times(self) -> list[float]:
        """Seconds of each measured step, end to end (from the previous step's end)."""
        ends = [0.0] + [s.end for s in self.steps]
        start = self.warmup if len(self.steps) > self.warmup else 0
        return [b - a for a, b in zip(ends[start:], ends[start + 1:])]

    def stability(self) -> dict[str, float]:
        """How settled the measured steps are: their spread (min, max over the mean) and the drift, the mean
        of the second half of the measured steps over the first half's, minus 1 (a run still filling its
        pipeline, or one whose gate has not yet bound, drifts)."""
        times = np.asarray(self.step_times())
        mean = float(times.mean())
        half = len(times) // 2
        drift = float(times[half:].mean() / times[:half].mean() - 1) if half else 0.0
        return {"steps": len(times), "step_min_over_mean": float(times.min()) / mean,
                "step_max_over_mean": float(times.max()) / mean, "drift": drift}

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

    def shares(self) -> dict[str, dict[str, float]]:
        """Per group, the share of its time in the measured window spent on each kind of work."""
        a, b = self.window
        span = b - a
        rollout_time = self.config.servers * span
        roll = {k: self._clock(f"rollout.{k}") / rollout_time for k in ("decode", "prefill", "paused")}
        roll["idle"] = max(0.0, 1 - sum(roll.values()))
        train = {k: self._clock(f"trainer.{k}") / span for k in ("train", "export", "wait_batch", "wait_weights")}
        return {"rollout": roll, "trainer": train, "param_server": {"push": self._clock("ps.push") / span}}

    @property
    def rollout_idle(self) -> float:
        return self.shares()["rollout"]["idle"]

    @property
    def trainer_idle(self) -> float:
        t = self.shares()["trainer"]
        return t["wait_batch"] + t["wait_weights"]

    def _mean(self, attr: str) -> float:
        return float(np.mean([getattr(s, attr) for s in self.measured]))

    def summary(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time, "effective_throughput_tok_s": self.throughput,
                "train_s": self._mean("train_s"), "export_s": self._mean("export_s"),
                "wait_batch_s": self._mean("wait_s"), "wait_weights_s": self._mean("sync_wait_s"),
                "weight_sync_s": self._mean("export_s") + self.counters["push_s"],
                "rollout_idle": self.rollout_idle, "trainer_idle": self.trainer_idle,
                "staleness": {str(k): v for k, v in self.staleness.items()},
                "tokens_per_step": float(np.mean([s.tokens for s in self.measured])),
                "time_shares": self.shares(), "counters": self.counters, "figures": self.figures(),
                "stability": self.stability()}

    def figures(self) -> dict[str, float]:
        """The figures the rehearsal of the real control plane reports for the same run (`agreement`): step
        time, effective throughput, the trainer's wait, the rollouts' busy share, mean staleness, and the
        decisions' rates per measured step."""
        per_step = 1 / len(self.measured)
        stale = self.staleness
        c = self.counters["measured"]
        return {"step_time_s": self.step_time, "effective_throughput_tok_s": self.throughput,
                "trainer_wait_share": self.trainer_idle, "rollout_busy_share": 1 - self.rollout_idle,
                "staleness_mean": sum(k * v for k, v in stale.items()),
                "reissued_per_step": c["reissued"] * per_step, "dropped_stale_per_step": c["dropped_stale"] * per_step}


def agreement(simulated: dict[str, float], measured: dict[str, float], tolerance: float = 0.15) -> dict[str, Any]:
    """Figure by figure, simulated / measured (None where the measured figure is 0 and the simulated is not) and
    whether it is within `tolerance`. Figures near zero on both sides, as rates of rare decisions, agree when both
    are below 0.05 (`near_zero`): there the ratio is shown but not held to the tolerance."""
    rows = {}
    for k, m in measured.items():
        s = simulated.get(k)
        if s is None:
            continue
        ratio = s / m if m else (1.0 if not s else None)
        near_zero = abs(m) < 0.05 and abs(s) < 0.05
        rows[k] = {"simulated": s, "measured": m, "ratio": ratio, "near_zero": near_zero,
                   "agrees": near_zero or (ratio is not None and abs(ratio - 1) <= tolerance)}
    return {"rows": rows, "all_agree": all(r["agrees"] for r in rows.values())}


class Simulation:
    def __init__(self, cfg: SimConfig, trace: bool = False) -> None:
        self.cfg = cfg
        self.records: list[tuple[str, dict[str, Any]]] | None = [] if trace else None
        self.rng = np.random.default_rng(cfg.seed)
        self.now = 0.0
        names = cfg.rollout_names
        self.rewards = [f"reward.{i}" for i in range(max(1, cfg.rewards))]
        self.state = cfg.buffer_rules(n_records=N_RECORDS, rollouts=names, rewards=self.rewards,
                                      batch_size=cfg.batch_size, eta=cfg.eta, seed=cfg.seed,
                                      dynamic_sampling=cfg.dynamic_sampling,
                                      max_per_rollout=cfg.max_groups_per_rollout,
                                      max_concurrent=cfg.max_concurrent_groups, group_timeout_s=cfg.group_timeout_s,
                                      group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                                      prompt_tokens=float(cfg.prompt_tokens), pace=DecodePace(*cfg.pace))
        # a rollout's hello reports its server's KV pool (an SGLang server's max_total_num_tokens; the embedded
        # engine reports none), from which the buffer caps the groups it holds
        kv = int(cfg.kv_tokens_per_server) if cfg.engine == "sglang" and cfg.kv_tokens_per_server < 1 << 40 else 0
        for name in names:
            self.state.worker_hello(name, kv_tokens=kv)
        for name in self.rewards:
            self.state.worker_hello(name)
        self.device_of = {name: i // cfg.engines_per_server for i, name in enumerate(names)}
        self.devices = [self._device(i) for i in range(cfg.servers)]
        self.device_version = [0] * cfg.servers
        self.policy = PushPolicy(rollouts={n: RolloutWeights(version=0, hello=True, alive=True) for n in names})
        self.current_version = 0
        self.pushing: tuple[int, list[str], float] | None = None   # (version, members, started)
        self.sync = cfg.measured.weights_s if cfg.measured else None
        self.weight_sync = None if cfg.measured else costs.weight_sync(
            cfg.shape, cfg.gpu, cfg.trainer.tp, cfg.trainer.pp, cfg.gpus_per_node, cfg.weights_across_nodes,
            ep=cfg.trainer.ep, etp=cfg.trainer.etp, lora_params=cfg.trainer.lora_params)
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.groups: dict[str, _Group] = {}
        self.version = 0                      # the trainer's
        self.trainer = "wait_batch"           # wait_batch | train | export | wait_weights | done
        self.serving = False                  # a batch taken and being served (its time counts as wait_batch)
        self.trainer_since = 0.0
        self.pending_step: Step | None = None
        self.steps: list[Step] = []
        self.clocks: Counter[str] = Counter()
        self.counters: Counter[str] = Counter({k: 0 for k in (
            "issued", "expired", "aborted_groups", "aborted_requests", "late_groups", "late_answer_tokens", "dropped_uniform", "pushes",
            "interrupted_requests", "evaluations", "eval_answers", "eval_answer_tokens")})
        self.inflight: Counter[str] = Counter()    # groups in flight per rollout, as BufferState holds them
        self.inflight_area: Counter[str] = Counter()
        self.inflight_max: Counter[str] = Counter()
        self.inflight_t = 0.0
        self.timeline: list[tuple[str, float, float]] = []
        self._last_span: dict[str, int] = {}
        self._decode: dict[tuple[int, int], costs.DecodeCost] = {}
        self._last_busy: dict[int, float] = {}          # device -> busy seconds already drawn on the timeline
        self._gid_of: dict[int, str] = {}               # answer id -> its group's id
        self._eval_due = 0                              # the version whose evaluation comes next (0: at the start)
        self._eval_left = 0                             # prompts of the running evaluation not yet sent
        self._eval_on: Counter[str] = Counter()         # its answers in flight per rollout
        self._eval_aids: dict[int, tuple[str, int]] = {}   # answer id -> the rollout answering it, its length
        self._accepted: dict[tuple[int, int], str] = {}  # a ready group's key -> its group id
        self.next_answer = 0

    # --- the devices -----------------------------------------------------------------------------------
    def _device(self, index: int) -> Device:
        cfg = self.cfg
        if cfg.engine == "sglang":
            admission: SGLangAdmission | EmbeddedAdmission = SGLangAdmission(
                pool=int(cfg.kv_tokens_per_server),
                max_running=sglang_max_running(int(cfg.kv_tokens_per_server), cfg.context_len))
        elif cfg.engine == "embedded":
            admission = EmbeddedAdmission(max_running=cfg.max_running)
        else:
            raise ValueError(f"engine: {cfg.engine!r} is not 'sglang' or 'embedded'")
        return Device(index, admission, self._decode_cost, self._prefill_cost, self._answer_done,
                      interruptible=cfg.interruptible)

    def _decode_cost(self, n: int, engines: int) -> costs.DecodeCost:
        key = (n, min(engines, self.cfg.engines_per_server))
        if key not in self._decode:
            m = self.cfg.measured
            self._decode[key] = m.decode(*key) if m else costs.decode_cost(self.cfg.shape, self.cfg.gpu,
                                                                           self.cfg.server_tp, n)
        return self._decode[key]

    def _prefill_cost(self, tokens: float, sum_sq: float, prefills: int) -> float:
        m = self.cfg.measured
        if m:
            return max(0.0, prefills * m.prefill_a_s + m.prefill_token_s * tokens + m.prefill_sq_s * sum_sq)
        return costs.prefill_seconds(self.cfg.shape, self.cfg.gpu, self.cfg.server_tp, tokens, sum_sq)

    def _schedule(self, d: Device) -> None:
        d.epoch += 1
        t = d.next_event_time()
        if t is not None:
            self._push_event(t, "device", (d.index, d.epoch))
        self._span_device(d)

    def _span_device(self, d: Device) -> None:
        busy = d.seconds["decode"] + d.seconds["prefill"]
        last = self._last_busy.get(d.index, 0.0)
        if busy > last:
            self._span(f"rollout.{d.index}", d.t - (busy - last), d.t)
            self._last_busy[d.index] = busy

    def _answer_done(self, d: Device, r: Req, t: float) -> None:
        if r.aid in self._eval_aids:
            rollout, length = self._eval_aids.pop(r.aid)
            self._eval_on[rollout] -= 1
            self.counters["eval_answers"] += 1
            self.counters["eval_answer_tokens"] += length
            self._push_event(t, "eval", None)   # the next prompt, once the device's step is done
            return
        g = self.groups[self._gid_of.pop(r.aid)]
        g.left -= 1
        if g.left == 0:
            g.end_version = self.device_version[d.index]
            g.done_at = t
            self._push_event(t + self.cfg.reward_latency_s, "reward", g.gid)

    # --- event plumbing --------------------------------------------------------------------------------
    def _push_event(self, t: float, kind: str, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def _span(self, lane: str, t0: float, t1: float) -> None:
        """A busy interval for the plots, merged with the lane's previous one when they touch."""
        last = self._last_span.get(lane)
        if last is not None and self.timeline[last][2] >= t0 - 1e-9:
            self.timeline[last] = (lane, self.timeline[last][1], max(t1, self.timeline[last][2]))
        else:
            self._last_span[lane] = len(self.timeline)
            self.timeline.append((lane, t0, t1))

    def _record(self, actor: str, **record: Any) -> None:
        if self.records is not None:
            self.records.append((actor, record))

    def _trainer_to(self, state: str) -> None:
        self.clocks[f"trainer.{self.trainer}"] += self.now - self.trainer_since
        if self.trainer in ("train", "export"):
            self._span("trainer" if self.trainer == "train" else "weights", self.trainer_since, self.now)
        self.trainer, self.trainer_since = state, self.now

    def _inflight_change(self, rollout: str, delta: int) -> None:
        dt = self.now - self.inflight_t
        for name, n in self.inflight.items():
            self.inflight_area[name] += n * dt
        self.inflight_t = self.now
        self.inflight[rollout] += delta
        self.inflight_max[rollout] = max(self.inflight_max[rollout], self.inflight[rollout])

    # --- the buffer (as actors/buffer/actor.py drives BufferState) ---------------------------------------------
    def _dispatch(self) -> None:
        """The buffer's dispatch loop: issue while the state hands out work."""
        cfg = self.cfg
        touched = set()
        while (issue := self.state.issue_next(lambda _: True, self.now)) is not None:
            d = self.devices[self.device_of[issue.rollout]]
            d.advance(self.now)
            lengths = [int(x) for x in cfg.draw_lengths(self.rng, cfg.group_size)]
            reqs = []
            for length in lengths:
                r = Req(aid=self.next_answer, group=self.counters["issued"], engine=issue.rollout,
                        prompt=cfg.prompt_tokens, origin=cfg.prompt_tokens, max_new=cfg.max_new_tokens, left=length)
                self._gid_of[r.aid] = issue.group_id
                self.next_answer += 1
                reqs.append(r)
            self.groups[issue.group_id] = _Group(issue.group_id, issue.rollout, d.index, reqs, lengths,
                                                 self.device_version[d.index], len(reqs), issued_at=self.now)
            self._inflight_change(issue.rollout, +1)
            self.counters["issued"] += 1
            self._record("buffer", ev="issue", t=self.now, group=issue.group_id, key=list(issue.key),
                         rollout=issue.rollout, reward=issue.reward)
            d.submit(reqs)
            touched.add(d.index)
        for i in touched:
            self._schedule(self.devices[i])

    def _on_reward(self, gid: str) -> None:
        cfg = self.cfg
        g = self.groups[gid]
        if cfg.dynamic_sampling and cfg.kept_group_share is not None:
            kept = bool(self.rng.random() < cfg.kept_group_share)
            rewards = [1.0, 0.0] + [0.0] * (cfg.group_size - 2) if kept else [0.0] * cfg.group_size
        elif cfg.dynamic_sampling:
            p = self.rng.beta(2 * cfg.accuracy, 2 * (1 - cfg.accuracy))
            rewards = [float(x) for x in (self.rng.random(cfg.group_size) < p)]
        else:
            rewards = [1.0] * cfg.group_size
        # What BufferState reads of the answers: each sample's reward, its length and the weight versions of its
        # tokens (the oldest and the newest), and the group's generation time (the pace its timeouts follow).
        # The per-token lists are not materialised: a range stands for the output ids, whose length alone is read.
        samples = [Sample(output_ids=range(n), logprobs=[], versions=[g.start_version, g.end_version],  # type: ignore[arg-type]
                          finish_reason="length" if n >= cfg.max_new_tokens else "stop", reward=rw)
                   for n, rw in zip(g.lengths, rewards[:len(g.lengths)])]
        in_flight = gid in self.state.inflight
        held = self.state.inflight.get(gid)
        if self.records is not None:
            self._record("buffer", ev="group", t=self.now, group=gid, key=list(held.key) if held else None,
                         issued=g.issued_at, rollout=g.rollout, reward=held.reward if held else None,
                         gen_s=g.done_at - g.issued_at, score_s=self.now - g.done_at, answers=[
                             [s.versions[0], s.versions[-1], len(s.output_ids), s.reward, s.finish_reason]
                             for s in samples], outcome="pending")
        result = self.state.scored(gid, Answers(samples=samples, rollout=g.rollout, gen_seconds=g.done_at - g.issued_at))
        if self.records is not None:
            self.records[-1][1]["outcome"] = result.outcome
        if result.outcome == "late":
            self.counters["late_groups"] += 1
            self.counters["late_answer_tokens"] += sum(g.lengths)
            del self.groups[gid]
            return
        if in_flight:
            self._inflight_change(g.rollout, -1)
        if result.outcome == "uniform":
            self.counters["dropped_uniform"] += 1
            del self.groups[gid]
        else:
            assert result.key is not None
            self._accepted[result.key] = gid
        self._dispatch()
        self._try_train()

    def _on_expire(self) -> None:
        """The buffer's overdue check, as actors/buffer/actor.py acts on it: each overdue group's rollout aborts its
        copy (its requests leave the server at once here), then the group is handed back and issued again."""
        for gid, f in self.state.overdue(self.now).items():
            g = self.groups.get(gid)
            if g is not None and g.left > 0:   # still generating: aborted, so no result will come
                d = self.devices[g.device]
                d.advance(self.now)
                aborted = d.abort({r.aid for r in g.answers})
                for r in g.answers:
                    self._gid_of.pop(r.aid, None)
                self.counters["aborted_requests"] += aborted
                self.counters["aborted_groups"] += 1
                del self.groups[gid]
                self._schedule(d)
            if self.state.hand_back(gid) is not None:
                self._inflight_change(f.rollout, -1)
                self.counters["expired"] += 1
        self._dispatch()
        if self.trainer != "done":
            self._push_event(self.now + self.state.expire_every_s, "expire", None)

    # --- the evaluator (weights_from: rollouts, as actors/evaluator/actor.py sends its prompts) -----------------
    def _evaluate(self) -> None:
        """Start the evaluation that is due (the newest version on the devices reached it, and none runs), and
        send its prompts while rollouts have room: at most `eval_per_rollout` on each, least loaded first."""
        cfg = self.cfg
        if cfg.eval_every <= 0 or cfg.eval_prompts <= 0:
            return
        if self._eval_left == 0 and not self._eval_aids and max(self.device_version) >= self._eval_due:
            newest = max(self.device_version)
            self._eval_due = (newest // cfg.eval_every + 1) * cfg.eval_every
            self._eval_left = cfg.eval_prompts
            self.counters["evaluations"] += 1
        touched = set()
        while self._eval_left > 0:
            load, name = min((self._eval_on[n], n) for n in cfg.rollout_names)
            if load >= cfg.eval_per_rollout:
                break
            d = self.devices[self.device_of[name]]
            d.advance(self.now)
            length = int(cfg.draw_lengths(self.rng, 1)[0])
            r = Req(aid=self.next_answer, group=-1, engine=name, prompt=cfg.prompt_tokens, origin=cfg.prompt_tokens,
                    max_new=cfg.max_new_tokens, left=length)
            self.next_answer += 1
            self._eval_aids[r.aid] = (name, length)
            self._eval_on[name] += 1
            self._eval_left -= 1
            d.submit([r])
            touched.add(d.index)
        for i in touched:
            self._schedule(self.devices[i])

    # --- the trainer (as actors/trainer/actor.py runs its loop) -----------------------------------------------
    def _try_train(self) -> None:
        cfg = self.cfg
        if self.trainer != "wait_batch" or self.serving or len(self.steps) >= cfg.steps:
            return
        dropped = self.state.drop_stale()   # their prompts are issued again
        if dropped:
            self._record("buffer", ev="stale", t=self.now, version=self.state.gate.version,
                         groups=[g.group_id for g in dropped], start_versions=[g.start_version for g in dropped])
        for g in dropped:
            del self.groups[self._accepted.pop(g.key)]
        if dropped:
            self._dispatch()
        batch = self.state.take_batch()
        if batch is None:
            return
        ids = [self._accepted.pop(g.key) for g in batch]
        groups = [self.groups.pop(gid) for gid in ids]
        lengths = [cfg.prompt_tokens + n for g in groups for n in g.lengths]
        group_of = [i for i, g in enumerate(groups) for _ in g.lengths]
        staleness = [max(0, self.version - g.start_version) for g in groups for _ in g.lengths]
        train_s = cfg.measured.train_step(lengths) if cfg.measured else \
            costs.train_step_seconds(cfg.shape, cfg.gpu, cfg.trainer, lengths, group_of)
        serve_s = cfg.serve.seconds(sum(n for g in groups for n in g.lengths))
        step = Step(self.version + 1, self.now + serve_s, math.nan, int(sum(lengths)),
                    self.now + serve_s - self.trainer_since, train_s, 0.0, 0.0, staleness)
        self.pending_step = step
        self._record("buffer", ev="batch", step=step.version, asked=self.trainer_since, taken=self.now,
                     served=self.now + serve_s, groups=ids)
        self.serving = True
        self._push_event(self.now + serve_s, "served", train_s)

    def _on_served(self, train_s: float) -> None:
        self.serving = False
        self._trainer_to("train")
        self._push_event(self.now + train_s, "trained", None)

    def _on_trained(self) -> None:
        self.version += 1
        self._trainer_to("export")
        if self.cfg.eta > 0:   # asynchronous: the gate opens at once; samples begun on older weights are fine
            self.state.set_version(self.version)
            self._dispatch()
        export_s = self.sync if self.weight_sync is None else self.weight_sync.export_s
        self.pending_step.export_s = export_s
        self._record("trainer", ev="publish", version=self.version, export=[self.now, self.now + export_s],
                     send=[self.now + export_s, self.now + export_s])
        self._push_event(self.now + export_s, "exported", None)

    def _on_exported(self) -> None:
        # The fanout stored the version; the push policy takes it unless a newer one got there first.
        if PushPolicy.takes(self.version, self.current_version):
            self.current_version = self.version
        self._pusher()
        if self.cfg.eta == 0:
            self._trainer_to("wait_weights")
            self._finish_step_if_synced()
        else:
            self._finish_step()

    def _finish_step_if_synced(self) -> None:
        if self.trainer == "wait_weights" and all(
                self.policy.rollouts[n].version >= self.version for n in self.policy.formed):
            self.pending_step.sync_wait_s = self.now - self.trainer_since
            self.state.set_version(self.version)
            self._finish_step()
            self._dispatch()

    def _finish_step(self) -> None:
        step = self.pending_step
        assert step is not None
        self.pending_step = None
        step.end = self.now
        self._record("trainer", ev="step", step=step.version, wait=[step.start - step.wait_s, step.start],
                     train=[step.start, step.start + step.train_s], end=step.end)
        self._trainer_to("wait_batch" if len(self.steps) + 1 < self.cfg.steps else "done")
        self._snapshot(step)
        self.steps.append(step)
        self._try_train()

    def _snapshot(self, step: Step) -> None:
        clocks = dict(self.clocks)
        for d in self.devices:
            d.advance(self.now)
            self._schedule(d)
            for k in d.seconds:
                clocks[f"rollout.{k}"] = clocks.get(f"rollout.{k}", 0.0) + d.clock(k, self.now)
        if self.pushing is not None:
            clocks["ps.push"] = clocks.get("ps.push", 0.0) + self.now - self.pushing[2]
        counts = self._decisions()
        for k, v in counts.items():
            clocks[f"count.{k}"] = float(v)
        step.clocks = clocks

    # --- the parameter server (its PushPolicy) -----------------------------------------------------------
    def _pusher(self) -> None:
        if self.pushing is not None:
            return   # a push is running; a newer version waits for the next (coalesced)
        action = self.policy.next_action(self.now, self.current_version, lambda _: False)
        if isinstance(action, Form):   # all servers are up here: the formation is taken as instant
            epoch = self.policy.begin_formation()
            self.policy.formation_done(epoch, action.members)
            action = self.policy.push_or_idle(self.current_version, lambda _: False)
        if not isinstance(action, Push):
            return
        push_s = 0.0 if self.weight_sync is None else self.weight_sync.push_s
        self.pushing = (action.version, action.members, self.now)
        self.counters["pushes"] += 1
        for i in sorted({self.device_of[n] for n in action.members}):
            d = self.devices[i]
            d.advance(self.now)
            d.pause(self.now)
            self.counters["interrupted_requests"] += d.n + len(d.waiting) if self.cfg.interruptible else 0
        self._push_event(self.now + push_s, "pushed", None)

    def _on_pushed(self) -> None:
        assert self.pushing is not None
        version, members, started = self.pushing
        self.pushing = None
        self.clocks["ps.push"] += self.now - started
        self._record("param_server", event="weights_pushed", t=self.now, version=version,
                     sync_s=self.now - started)
        self._span("push", started, self.now)
        for n in members:
            self.policy.rollouts[n].version = version   # its ack
        self.policy.pushed_ok(members)
        for i in sorted({self.device_of[n] for n in members}):
            d = self.devices[i]
            self.device_version[i] = version
            d.resume(self.now)
            self._schedule(d)
        self._finish_step_if_synced()
        self._pusher()
        self._dispatch()
        self._evaluate()

    # --- run ---------------------------------------------------------------------------------------------
    def run(self) -> Result:
        self._pusher()   # the first formation
        self._dispatch()
        self._evaluate()   # version 0, as the evaluator's first look finds it
        self._push_event(self.state.expire_every_s, "expire", None)
        while self.events and len(self.steps) < self.cfg.steps:
            t, _, kind, payload = heapq.heappop(self.events)
            self.now = t
            if t - (self.steps[-1].end if self.steps else 0.0) > self.cfg.stall_s:
                raise RuntimeError(
                    f"no training step in {self.cfg.stall_s:,.0f} s of virtual time after step {len(self.steps)}: "
                    f"the run makes no progress (issued {self.counters['issued']}, re-issued "
                    f"{self.state.stats.returned}, expired {self.counters['expired']} of which "
                    f"{self.counters['aborted_groups']} aborted while generating, late results "
                    f"{self.counters['late_groups']}); is buffer.group_timeout_s shorter than a group's generation?")
            if kind == "device":
                index, epoch = payload
                d = self.devices[index]
                if epoch != d.epoch:
                    continue
                d.advance(t)
                self._schedule(d)
            elif kind == "reward":
                self._on_reward(payload)
            elif kind == "expire":
                self._on_expire()
            elif kind == "eval":
                self._evaluate()
            elif kind == "served":
                self._on_served(payload)
            elif kind == "trained":
                self._on_trained()
            elif kind == "exported":
                self._on_exported()
            elif kind == "pushed":
                self._on_pushed()
        if not self.steps:
            raise RuntimeError("simulation ended before its first training step: no group can be admitted")
        return Result(self.cfg, self.steps, self.steps[-1].end,
                      [x for x in self.timeline if x[1] < self.steps[-1].end], self._counters(),
                      records=self.records or [])

    def _decisions(self) -> dict[str, int]:
        """The counters the simulation keeps, and the buffer's own: every prompt issued again (handed back after
        a timeout or a lost worker, or dropped as stale at batch time) and how. aborted_before_reissue: overdue
        groups whose running copy was aborted on its server before the group was issued again
        (`BufferState.overdue`), aborted_requests their answers."""
        stats = self.state.stats
        return dict(self.counters, handed_back=stats.returned, dropped_stale=stats.dropped_stale,
                    reissued=stats.returned + stats.dropped_stale,
                    aborted_before_reissue=self.counters["aborted_groups"])

    def _counters(self) -> dict[str, Any]:
        """The decisions' counters over the whole run, and over the measured steps."""
        self._inflight_change(next(iter(self.cfg.rollout_names)), 0)
        span = max(self.now, 1e-9)
        devices = [d.counters for d in self.devices]
        names = self.cfg.rollout_names
        mean_inflight = [self.inflight_area[n] / span for n in names]
        whole = self._decisions()
        # Per rollout, the buffer's own counts of what it decided (BufferState.per_rollout) and the groups it held.
        whole["per_rollout"] = {n: {**{k: self.state.per_rollout[n][k] for k in ("issued", "handed_back", "overdue")},
                                    "inflight_mean": self.inflight_area[n] / span,
                                    "inflight_max": self.inflight_max[n]} for n in names}
        first = self.steps[0].clocks if len(self.steps) > 1 else {}
        last = self.steps[-1].clocks
        measured = {k: last.get(f"count.{k}", 0.0) - first.get(f"count.{k}", 0.0)
                    for k in ("issued", "reissued", "handed_back", "expired", "dropped_stale", "dropped_uniform",
                              "late_groups", "pushes", "interrupted_requests", "aborted_before_reissue",
                              "aborted_requests")}
        push_s = 0.0 if self.weight_sync is None else self.weight_sync.push_s
        return {**whole, "measured": measured, "push_s": push_s,
                "retractions": sum(c["retractions"] for c in devices),
                "retracted_requests": sum(c["retracted"] for c in devices),
                "recomputed_tokens": sum(c["recomputed_tokens"] for c in devices),
                "admission_refused_for_memory": sum(c["batch_full"] for c in devices),
                "inflight_groups_per_rollout": {"mean": float(np.mean(mean_inflight)),
                                                "max": int(max(self.inflight_max.values(), default=0))},
                "inflight_per_server": self._inflight_per_server(span),
                "retractions_per_server": {"mean": float(np.mean([c["retractions"] for c in devices])),
                                           "max": int(max(c["retractions"] for c in devices))}}


    def _inflight_per_server(self, span: float) -> dict[str, Any]:
        """What each server held over the run, spread over the servers (min, mean, max): groups in flight (the
        buffer's, of the rollouts it serves; time-weighted), requests in its running batch (time-weighted over
        the run), its largest running batch and its longest queue of requests waiting for admission."""
        per_device: list[float] = [0.0] * len(self.devices)
        for name in self.cfg.rollout_names:
            per_device[self.device_of[name]] += self.inflight_area[name] / span

        def spread(values: list[float]) -> dict[str, float]:
            return {"min": float(min(values)), "mean": float(np.mean(values)), "max": float(max(values))}
        return {"groups": spread(per_device),
                "running_requests": spread([d.batch_area / span for d in self.devices]),
                "running_requests_peak": spread([float(d.counters["max_running"]) for d in self.devices]),
                "waiting_requests_peak": spread([float(d.counters["max_waiting"]) for d in self.devices])}


def simulate(cfg: SimConfig, trace: bool = False) -> Result:
    """The simulated run; with ``trace``, its `Result.records` are the records its actors would have written."""
    return Simulation(cfg, trace=trace).run()
