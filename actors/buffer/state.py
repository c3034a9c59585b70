"""The buffer's decisions as plain state: what to hand out, to whom, what to keep and what forms a batch.

`BufferState` holds the dataset cursor, the groups in flight and ready, and the staleness gate
(algo/staleness.py); it takes plain data (worker names, group ids, answers, clock readings) and returns
plain data. It sends nothing, reads no clock and writes no file: actors/buffer/actor.py turns messages into
calls on it and its answers into messages, log lines and the ledger.

Every prompt it admits is either trained exactly once, issued again (its worker died, restarted or
handed it back, its time ran out, or its answers got too stale before a batch took them), or dropped on
purpose (dynamic sampling: all answers got the same reward; or the prompt itself cannot be generated).
Units: the gate counts prompt *groups*; a batch is `batch_size` groups.

Long generations. A group whose time ran out (`overdue`) is not issued again at once: its copy may still be
generating, and a second copy would double the server's work, time out in turn and pile up. It stays in
flight, holding its rollout's slot, until the caller has the rollout abort it and calls `hand_back`. The
time a group may take is `group_timeout()`: fixed when configured, else derived from `max_new_tokens` and
the pace of recent groups (algo/serving.py). A rollout holds at most the groups its server's KV pool
fits (`rollout_cap`, algo.serving.groups_in_kv over the KV pool it reported in its hello and the mean context
of recent answers), so work does not wait in a server's queue while its time runs.

Silent workers. A worker the bus declares dead (no heartbeat answered for its timeout) keeps its groups: a
live rollout starved of CPU for a few seconds still generates them, and issuing them again would run two
copies of each (a node's restart on a loaded machine once had 7 live rollouts declared dead and 56 groups
generated twice). Its groups are handed back when it is known to be a new process: the bus saw its new
incarnation (`worker_restarted`, at the new process's first ping, before it says anything) or it says hello
(`worker_hello`); or when it has stayed silent for `silence_limit_s` (`silent_too_long`). A restarted
worker gets no work until it says hello: its new process may never get ready (a server that never becomes
healthy), and groups sent to it would wait there for their whole timeout.
"""
from __future__ import annotations

import random
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

import torch

from algo.dynamic_sampling import is_uniform
from algo.serving import DecodePace, groups_in_kv
from algo.staleness import StalenessGate, filter_stale, sample_staleness
from transport.protocol import Answers, BufferStats

Key = tuple[int, int]  # (data pass, index into the dataset): one prompt of one pass over the data


@dataclass
class InFlight:
    """A group handed to a rollout (and the reward actor that scores it) and not yet back. `aborting`: its
    time ran out and its rollout is asked to abort it; it keeps its slot until it is handed back."""

    key: Key
    rollout: str
    reward: str
    issued_at: float
    aborting: bool = False


@dataclass
class Issue:
    """One group to send: the dataset's prompt `key[1]`, to `rollout`, scored by `reward`, sampled with `seed`."""

    group_id: str
    key: Key
    rollout: str
    reward: str
    seed: int


@dataclass
class ReadyGroup:
    """A scored group waiting for a batch. `start_version`: the oldest weight version that produced any of
    its tokens (-1: no token, never stale)."""

    key: Key
    answers: Answers
    start_version: int
    group_id: str = ""


@dataclass
class Scored:
    """What became of a scored group: "late" (not in flight: it was issued again, the re-issue wins),
    "uniform" (dropped by dynamic sampling) or "accepted" (waits for a batch). `key`: its prompt (None
    when late)."""

    outcome: Literal["late", "uniform", "accepted"]
    key: Key | None = None


@dataclass
class Resume:
    """How a restarted buffer takes up the run from the checkpoint of `step`: the batches it served after
    that step are served again, in order, to the trainer (which resumes at `step`), so nothing is lost and
    nothing trained twice. `served_again`: those steps (the newest one's saved state is the buffer's
    state); `discarded`: served batches after a gap, which cannot be served in order; `served_through`:
    the newest step a batch is held for."""

    served_again: list[int]
    discarded: list[int]
    served_through: int


def plan_resume(served_steps: Iterable[int], step: int) -> Resume:
    """Which of the served batches on disk (`served_steps`) a buffer resuming at checkpoint `step` keeps."""
    since = sorted(k for k in served_steps if k > step)
    if since != list(range(step + 1, step + 1 + len(since))):
        return Resume(served_again=[], discarded=since, served_through=step)
    return Resume(served_again=since, discarded=[], served_through=since[-1] if since else step)


def ledger_after_resume(records: list[dict[str, Any]], resume: Resume,
                        served: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The ledger's records as they must be after `resume`: batches after the newest one kept were rolled
    back (the trainer trains them again), and a kept batch whose line a crash lost just after it was
    written to disk gets it back. `served`: the ledger record saved with each batch served again."""
    kept = [r for r in records if r["event"] != "batch" or r["step"] <= resume.served_through]
    logged = {r["step"] for r in records if r["event"] == "batch"}
    return kept + [served[k] for k in resume.served_again if k not in logged]


def group_start_version(answers: Answers) -> int:
    """The oldest weight version among the group's generated tokens (-1 when it has none, as algo.staleness
    counts it): an episode's environment tokens carry -1 and were sampled by no weights, so its staleness
    counts from its first generated token. Taken on the lists as they arrive: converting a long group's lists
    to a tensor costs more."""
    starts = []
    for s in answers.samples:
        low = min(s.versions, default=-1)
        if low < 0:   # environment tokens among them (or a version the engine never had): skip those
            low = min((v for v in s.versions if v >= 0), default=-1)
        if low >= 0:
            starts.append(low)
    return min(starts, default=-1)


class BufferState:
    """The buffer's state and decisions. Not thread-safe: the buffer actor's event loop owns it."""

    def __init__(self, *, n_records: int, rollouts: list[str], rewards: list[str], batch_size: int, eta: int,
                 seed: int, dynamic_sampling: bool = False, max_per_rollout: int = 8,
                 max_concurrent: int | None = None, group_timeout_s: float | None = None,
                 group_size: int = 1, max_new_tokens: int = 64, prompt_tokens: float = 1.0,
                 pace: DecodePace | None = None, silence_limit_s: float = 30.0) -> None:
        """``group_timeout_s``: fixed, or None to derive it from ``max_new_tokens`` and ``pace``;
        ``prompt_tokens``: the mean prompt length (the context a group's answers hold in a KV pool);
        ``silence_limit_s``: how long a worker may go unheard before its groups are issued again."""
        if not rollouts:
            raise ValueError("groups.rollout: the buffer needs at least one rollout actor")
        if not rewards:
            raise ValueError("groups.reward: the buffer needs at least one reward actor")
        self.n_records = n_records
        self.rollouts, self.rewards = list(rollouts), list(rewards)
        self.batch_size, self.eta, self.seed = batch_size, eta, seed
        self.dynamic_sampling = dynamic_sampling
        self.max_per_rollout = max_per_rollout
        self.group_timeout_s = group_timeout_s
        self.silence_limit_s = silence_limit_s
        self.silent_since: dict[str, float] = {}                     # workers unheard, since when
        self.group_size, self.max_new_tokens, self.prompt_tokens = group_size, max_new_tokens, prompt_tokens
        self.pace = pace or DecodePace()
        self.answer_tokens: deque[int] = deque(maxlen=1024)          # lengths of recent answers
        self._answer_sum = 0                                         # their sum (rollout_cap reads it per issue)
        self.kv_tokens: dict[str, int] = {}                          # KV pool each rollout's server reported
        self.overdue_groups = 0                                      # groups whose time ran out, so far
        # Per rollout, what was decided about its groups so far: "issued", "handed_back" (issued again: its
        # worker was lost or its time ran out), "overdue" (its time ran out: aborted before it was issued again).
        self.per_rollout: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.gate = StalenessGate(batch_size, eta, max_concurrent)

        self.data_pass, self.position = 0, 0
        self.order = self._permutation(0)
        self.reissue: deque[Key] = deque()
        self.inflight: dict[str, InFlight] = {}                     # changed only by _hold and _release
        # Groups in flight per rollout and per reward actor, kept as groups are issued and released, so that
        # picking the least-loaded worker does not scan every group in flight.
        self.rollout_load: Counter[str] = Counter()
        self.reward_load: Counter[str] = Counter()
        self.ready: deque[ReadyGroup] = deque()
        self.attempts = 0
        self.stats = BufferStats()
        self.uniform_streak = 0                                     # uniform groups dropped in a row
        self.greeted: set[str] = set()                              # workers whose current incarnation said hello
        self.rollout_versions: dict[str, int] = {}                  # newest weight version seen per rollout
        self.rollout_clocks: dict[str, tuple[float, float]] = {}    # latest (busy, up) seconds per rollout
        self.clocks_at_batch: dict[str, tuple[float, float]] = {}   # the same at the previous batch
        self.served_through = 0                                     # the newest step a batch was served for

    # --- handing out work -------------------------------------------------------------------------
    def _permutation(self, data_pass: int) -> list[int]:
        order = list(range(self.n_records))
        random.Random(self.seed * 1_000_003 + data_pass).shuffle(order)
        return order

    def _next_key(self) -> Key:
        if self.reissue:
            return self.reissue.popleft()
        if self.position >= len(self.order):
            self.data_pass += 1
            self.position = 0
            self.order = self._permutation(self.data_pass)
            self.stats.data_pass = self.data_pass
        key = (self.data_pass, self.order[self.position])
        self.position += 1
        return key

    def issued_keys(self) -> list[Key]:
        """Every prompt the cursor has handed out so far, in order: each is trained, dropped on purpose,
        or still pending (in flight, ready or waiting to be issued again). tools/bench/chaos.py checks it."""
        done = [(e, i) for e in range(self.data_pass) for i in self._permutation(e)]
        return done + [(self.data_pass, i) for i in self.order[:self.position]]

    def rollout_cap(self, rollout: str) -> int:
        """Groups a rollout may hold. One while its newest weights are already older than the gate allows:
        everything it generates now will be dropped as stale, and a flood of such work would crowd out the
        heartbeats and weight pushes that let it catch up (the one group tells when it has). Else as many as
        its server's KV pool fits (when it reported one), at most max_per_rollout."""
        seen = self.rollout_versions.get(rollout)
        if seen is not None and self.gate.version - seen > self.eta:
            return 1
        kv = self.kv_tokens.get(rollout, 0)
        if kv <= 0:
            return self.max_per_rollout
        return groups_in_kv(kv, self.group_size, self.context_tokens(), self.max_per_rollout)

    def context_tokens(self) -> float:
        """What one answer holds in a KV pool: the mean prompt plus the mean of recent answers (the full
        max_new_tokens before any answer came back)."""
        answer = self._answer_sum / len(self.answer_tokens) if self.answer_tokens else self.max_new_tokens
        return self.prompt_tokens + max(1.0, answer)

    def group_timeout(self) -> float:
        """Seconds a group may go without a result before it is aborted and issued again."""
        return self.group_timeout_s if self.group_timeout_s is not None else self.pace.timeout(self.max_new_tokens)

    def _least_loaded(self, names: list[str], load: Counter[str], alive: Callable[[str], bool],
                      cap: Callable[[str], int | None]) -> str | None:
        """The greeted live worker of `names` holding the fewest groups below its cap (ties: the least name),
        or None. `load` counts each worker's groups in flight. The workers are tried from the least loaded
        on and the first below its cap wins, so a cap (which may be costly: `rollout_cap`) is asked for only
        until one has room."""
        for name in sorted(sorted(names), key=load.__getitem__):   # stable: ties stay in name order
            if name in self.greeted and alive(name):
                limit = cap(name)
                if limit is None or load[name] < limit:
                    return name
        return None

    def _hold(self, group_id: str, f: InFlight) -> None:
        self.inflight[group_id] = f
        self.rollout_load[f.rollout] += 1
        self.reward_load[f.reward] += 1

    def _release(self, group_id: str) -> InFlight | None:
        f = self.inflight.pop(group_id, None)
        if f is not None:
            self.rollout_load[f.rollout] -= 1
            self.reward_load[f.reward] -= 1
        return f

    def issue_next(self, alive: Callable[[str], bool], now: float) -> Issue | None:
        """The next group to hand out, to the least-loaded greeted live rollout and reward actor, or None
        while the gate is closed or no worker has room. `alive(name)`: the bus's view of that worker."""
        if not self.gate.can_admit():
            return None
        rollout = self._least_loaded(self.rollouts, self.rollout_load, alive, self.rollout_cap)
        if rollout is None:
            return None
        reward = self._least_loaded(self.rewards, self.reward_load, alive, lambda _: None)
        if reward is None:
            return None
        key = self._next_key()
        self.gate.admit(1)
        self.attempts += 1
        gid = f"{key[0]}-{key[1]}-{self.attempts}"
        self._hold(gid, InFlight(key, rollout, reward, now))
        self.per_rollout[rollout]["issued"] += 1
        # A fresh sampling seed per attempt: a re-issued prompt gets new answers, a replay the same ones.
        seed = 1 + (hash((self.seed, key, self.attempts)) & 0x7FFFFFFF)
        return Issue(gid, key, rollout, reward, seed)

    # --- work that will not come back -------------------------------------------------------------
    def hand_back(self, group_id: str) -> InFlight | None:
        """A group in flight will not come back scored: free its slot and issue its prompt again. None if
        the group is not in flight (already back or already handed back)."""
        f = self._release(group_id)
        if f is None:
            return None
        self.gate.finish(accepted=False)
        self.reissue.append(f.key)
        self.stats.returned += 1
        self.per_rollout[f.rollout]["handed_back"] += 1
        return f

    def hand_back_held_by(self, worker: str) -> dict[str, InFlight]:
        """Every group `worker` held (as its rollout or its reward actor), handed back."""
        held = [g for g, f in self.inflight.items() if worker in (f.rollout, f.reward)]
        return {g: f for g in held if (f := self.hand_back(g)) is not None}

    def worker_hello(self, worker: str, kv_tokens: int = 0) -> dict[str, InFlight]:
        """A worker (re)started: what it held before will not come back from it; it may get work now.
        ``kv_tokens``: the KV pool of a rollout's server (0: unknown)."""
        handed_back = self.hand_back_held_by(worker)
        self.silent_since.pop(worker, None)
        self.rollout_versions.pop(worker, None)
        # its clocks may start again from zero: count them from there (a restart slower than the old process's
        # uptime would otherwise subtract the old clocks from the new ones)
        self.rollout_clocks.pop(worker, None)
        self.clocks_at_batch.pop(worker, None)
        self.kv_tokens[worker] = kv_tokens
        self.greeted.add(worker)
        return handed_back

    def worker_restarted(self, worker: str) -> dict[str, InFlight]:
        """`worker` is a new process (the bus saw another incarnation): what the one before held will not come
        back, and the new one gets no work until it says hello. Its hello then finds nothing to hand back."""
        handed_back = self.hand_back_held_by(worker)
        self.silent_since.pop(worker, None)
        self.greeted.discard(worker)
        return handed_back

    def worker_silent(self, worker: str, since: float) -> None:
        """Nothing was heard from `worker` since `since` (the bus declared it dead). Its groups stay in flight:
        see "Silent workers" above."""
        self.silent_since.setdefault(worker, since)

    def worker_heard(self, worker: str) -> None:
        """`worker` answers again: what it holds will come back from it."""
        self.silent_since.pop(worker, None)

    def silent_too_long(self, now: float) -> dict[str, InFlight]:
        """Every group held by a worker unheard for `silence_limit_s` by `now`, handed back (once: the worker
        counts as heard from again until the bus declares it dead anew)."""
        gone = [w for w, since in self.silent_since.items() if now - since >= self.silence_limit_s]
        handed: dict[str, InFlight] = {}
        for worker in gone:
            del self.silent_since[worker]
            handed.update(self.hand_back_held_by(worker))
        return handed

    @property
    def expire_every_s(self) -> float:
        """How often `overdue` and `silent_too_long` are called: a group is found overdue, or a worker silent
        too long, at most a quarter of its limit late (and at least once a minute)."""
        return min(60.0, max(0.05, min(self.group_timeout(), self.silence_limit_s) / 4))

    def overdue(self, now: float) -> dict[str, InFlight]:
        """Groups with no result after `group_timeout()`, now marked aborting (each once). They are not
        issued again here: the caller has each one's rollout abort it, then calls `hand_back` (also when
        the rollout cannot be reached), so that no two copies of a group are ever generated at once."""
        limit = self.group_timeout()
        late = {g: f for g, f in self.inflight.items() if not f.aborting and now - f.issued_at > limit}
        for f in late.values():
            f.aborting = True
            self.per_rollout[f.rollout]["overdue"] += 1
        self.overdue_groups += len(late)
        return late

    def drop_invalid(self, group_id: str) -> InFlight | None:
        """The prompt itself cannot be generated: issuing it again cannot help, so it is dropped."""
        f = self._release(group_id)
        if f is not None:
            self.gate.finish(accepted=False)
        return f

    # --- collecting results -----------------------------------------------------------------------
    def scored(self, group_id: str, answers: Answers) -> Scored:
        """A reward actor scored a group: accept it for a batch or drop it (dynamic sampling)."""
        newest = max((v for s in answers.samples for v in s.versions), default=None)
        if newest is not None:
            self.rollout_versions[answers.rollout] = newest      # the weights it finished this group with
        f = self._release(group_id)
        if f is None:
            return Scored("late")
        if answers.up_seconds > 0:
            self.rollout_clocks[answers.rollout] = (answers.busy_seconds, answers.up_seconds)
        lengths = [len(s.output_ids) for s in answers.samples]
        for n in lengths:
            if len(self.answer_tokens) == self.answer_tokens.maxlen:
                self._answer_sum -= self.answer_tokens[0]   # the oldest leaves the window
            self.answer_tokens.append(n)
            self._answer_sum += n
        if lengths:   # the group took as long as its longest answer
            self.pace.observe(answers.gen_seconds, max(lengths))
        if self.dynamic_sampling and is_uniform([s.reward for s in answers.samples]):
            self.gate.finish(accepted=False)  # no learning signal: drop it, its slot is refilled
            self.stats.dropped_uniform += 1
            self.uniform_streak += 1
            return Scored("uniform", f.key)
        self.uniform_streak = 0
        self.gate.finish(accepted=True)
        self.ready.append(ReadyGroup(f.key, answers, group_start_version(answers), group_id))
        return Scored("accepted", f.key)

    def version_reachable(self, version: int) -> bool:
        """Whether the trainer can have finished step `version`: it trains only batches this buffer served, so a
        version past the newest batch served (a VersionUpdate jumping to 1,000,000) is refused, never obeyed:
        the gate would open for rollouts the trainer never asks for, and every group then looks stale."""
        return 0 <= version <= self.served_through

    def set_version(self, version: int) -> None:
        """The trainer finished step `version`: the gate opens for it (a late, older update changes nothing)."""
        if version > self.gate.version:
            self.gate.set_version(version)

    # --- forming batches --------------------------------------------------------------------------
    def drop_stale(self) -> list[ReadyGroup]:
        """The second staleness check, at batch time: a ready group whose oldest token is more than eta
        versions old is not trained; its prompt is issued again so nothing is lost. Returns those dropped."""
        if not self.ready:
            return []
        version = self.gate.version
        # A rollout can hold weights newer than this version for a moment (its VersionUpdate is still on
        # the way, or a recovery rolled the version back): such a group is fresh, not an error.
        starts = torch.tensor([g.start_version for g in self.ready], dtype=torch.int64).clamp(max=version)
        keep = filter_stale(sample_staleness(starts, version), self.eta).tolist()
        dropped = [g for g, k in zip(self.ready, keep) if not k]
        if dropped:
            self.ready = deque(g for g, k in zip(self.ready, keep) if k)
            self.gate.discard(len(dropped))
            self.reissue.extend(g.key for g in dropped)
            self.stats.dropped_stale += len(dropped)
        return dropped

    def take_batch(self) -> list[ReadyGroup] | None:
        """The oldest `batch_size` ready groups, or None while fewer are ready. Call `drop_stale` first."""
        if len(self.ready) < self.batch_size:
            return None
        return [self.ready.popleft() for _ in range(self.batch_size)]

    def serves_again(self, step: int) -> bool:
        """A batch for `step` was served before, to a trainer that died before its next checkpoint (or to a
        relaunched run): it gets the same batch again, so nothing is lost and nothing trained twice."""
        return step <= self.served_through

    def served(self, step: int) -> None:
        """The batch for `step` is on disk and on its way to the trainer."""
        self.served_through = step

    def batch_stats(self) -> BufferStats:
        """The counters sent with a batch; rollout utilisation counts from the previous call."""
        self.stats.depth = len(self.ready)
        self.stats.running = self.gate.running
        self.stats.accepted = self.gate.accepted
        self.stats.rollout_utilisation = self._rollout_utilisation()
        return BufferStats(**vars(self.stats))

    def _rollout_utilisation(self) -> float:
        """Time the rollouts had work in hand over time they were up, since the previous batch (-1: no data).
        A restarted rollout's clocks start again from zero; its new clocks count from there (from its hello, or
        from when they went backwards). A rollout's busy time never counts past its up time: the ratio is a share."""
        busy = up = 0.0
        for name, (b, u) in self.rollout_clocks.items():
            b0, u0 = self.clocks_at_batch.get(name, (0.0, 0.0))
            if u < u0:
                b0 = u0 = 0.0
            gained_up = max(0.0, u - u0)
            busy, up = busy + min(max(0.0, b - b0), gained_up), up + gained_up
        self.clocks_at_batch = dict(self.rollout_clocks)
        return busy / up if up > 0 else -1.0

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The cursor and counters as they must be after a restart: work not yet trained (in flight, ready
        or waiting to be re-issued) is recorded for re-issue, and the gate counts it as it will once it is.
        Valid between steps, when exactly the batches served so far have been trained."""
        pending = [f.key for f in self.inflight.values()] + [g.key for g in self.ready] + list(self.reissue)
        gate = self.gate.state_dict()
        gate["accepted"] -= len(self.ready)
        gate["running"] = 0
        return {"data_pass": self.data_pass, "position": self.position, "gate": gate,
                "reissue": [list(k) for k in pending], "stats": vars(self.stats).copy(), "attempts": self.attempts}

    def resume(self, resume: Resume, saved: dict[str, Any] | None) -> None:
        """Take up the run as `resume` says, from `saved` (the state saved with the newest batch served
        again, or the checkpoint's; None: nothing was saved, a fresh start is the state)."""
        if saved is not None:
            self.load_state_dict(saved)
        self.served_through = resume.served_through

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # "epoch": the key a checkpoint written before the data pass had its own name holds it under
        self.data_pass = int(state["data_pass"] if "data_pass" in state else state["epoch"])
        self.position = int(state["position"])
        self.order = self._permutation(self.data_pass)
        self.gate.load_state_dict(state["gate"])
        self.reissue = deque((int(k[0]), int(k[1])) for k in state["reissue"])
        self.stats = BufferStats(**state["stats"])
        self.attempts = int(state["attempts"])
