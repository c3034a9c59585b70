"""The buffer actor: hands prompts to rollouts under the staleness gate and forms training batches.

It owns the dataset cursor and the `StalenessGate` (algo/staleness.py), so it is the actor whose state
decides what is trained: every prompt it admits is either trained exactly once, re-issued (its rollout
died or handed it back, or its answers got too stale before a batch took them), or dropped on purpose
(dynamic sampling: all answers got the same reward). Units: the gate counts prompt *groups*; B =
`algo.batch_size` groups per training step, each of `algo.group_size` answers.

Flow: GenerateGroup -> least-loaded live rollout; ScoredGroup (from a reward actor) -> ready queue;
BatchRequest (from the trainer) -> waits until B fresh groups are ready, then replies with a Batch;
VersionUpdate -> opens the gate; CheckpointRequest -> writes buffer.json for that step.

After a recovery (actors/recovery.py) the buffer restores the cursor and gate from the checkpoint of step
k; what was in flight or ready-but-untrained at step k is re-issued first, and the gate counters are
restored to match, so no prompt is lost, none is trained twice, and the staleness bound still holds.

Lost work: the buffer picks the rollout AND the reward actor of every group, so when either dies
(heartbeats) or says WorkerHello after a restart (which can be faster than heartbeats notice), exactly
the groups it held are issued again; late answers of re-issued groups are ignored. A group with no result
after `buffer.group_timeout_s` is issued again as a last resort.

Settings read: model.path (tokenizer), data.train (through its layout), data.on_bad_line, data.require, seed, algo.batch_size,
algo.group_size, algo.eta, algo.dynamic_sampling, gen.* (sampling of the GenerateGroup),
buffer.max_groups_per_rollout, buffer.max_concurrent_groups, buffer.group_timeout_s.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from actors.base import Actor, handles
from actors.dataset import DEFAULT_MAX_LINE_BYTES, Layout, load_dataset
from actors.engines.tokenizer import load_tokenizer
from actors.recovery import checkpoint_dir, latest_checkpoint, recovering, refuse_restart_within_launch
from algo.staleness import StalenessGate
from transport.protocol import (Batch, BatchRequest, BufferStats, CheckpointDone, CheckpointRequest,
                                GenerateGroup, GroupReturned, RunFinished, ScoredGroup, Task, VersionUpdate,
                                WorkerHello)

Key = tuple[int, int]  # (epoch, index into the dataset): one prompt of one pass over the data


@dataclass
class InFlight:
    key: Key
    rollout: str
    reward: str
    issued_at: float


def group_start_version(group: ScoredGroup) -> int:
    """The oldest weight version that produced any token of the group (the group's staleness origin)."""
    versions = [v for s in group.samples for v in s.versions]
    return min(versions) if versions else 0


class BufferActor(Actor):
    async def on_start(self) -> None:
        s = self.settings
        refuse_restart_within_launch(self)
        algo = s.get("algo") or {}
        self.batch_size = int(algo.get("batch_size", 32))
        self.group_size = int(algo.get("group_size", 8))
        self.eta = int(algo.get("eta", 4))
        self.dynamic_sampling = bool(algo.get("dynamic_sampling", False))
        self.uniform_streak = 0
        buf = s.get("buffer") or {}
        self.max_per_rollout = int(buf.get("max_groups_per_rollout", 8))
        gen = s.get("gen") or {}
        self.gen = {"temperature": float(gen.get("temperature", 1.0)), "top_p": float(gen.get("top_p", 1.0)),
                    "top_k": int(gen.get("top_k", -1)), "max_new_tokens": int(gen.get("max_new_tokens", 64))}
        self.seed = int(s.get("seed", 1))
        data = s.get("data") or {}
        # Math records need an answer; a code task's records carry `tests` instead (data.require: none).
        self.dataset = await asyncio.to_thread(
            load_dataset, data["train"], require=data.get("require", "answer"), on_error=data.get("on_bad_line", "skip"),
            max_line_bytes=int(data.get("max_line_bytes", DEFAULT_MAX_LINE_BYTES)), layout=Layout.from_settings(data))
        tok = await asyncio.to_thread(load_tokenizer, (s.get("model") or {})["path"])
        self.stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
        self.prompt_ids = [tok.encode(r.prompt) for r in self.dataset.records]
        self.rollouts: list[str] = list((s.get("groups") or {}).get("rollout", []))
        if not self.rollouts:
            raise ValueError("groups.rollout: the buffer needs at least one rollout actor")
        self.rewards: list[str] = list((s.get("groups") or {}).get("reward", []))
        if not self.rewards:
            raise ValueError("groups.reward: the buffer needs at least one reward actor")
        # Last resort for a group lost without any sign (a message dropped by a dying process): issue again.
        self.group_timeout_s = float(buf.get("group_timeout_s", 1800.0))
        self.greeted: set[str] = set()  # workers whose current incarnation said WorkerHello
        max_conc = buf.get("max_concurrent_groups")
        self.gate = StalenessGate(self.batch_size, self.eta, int(max_conc) if max_conc else None)

        self.epoch, self.position = 0, 0
        self.order = self._permutation(0)
        self.reissue: deque[Key] = deque()
        self.inflight: dict[str, InFlight] = {}
        self.ready: deque[tuple[Key, ScoredGroup]] = deque()
        self.attempts = 0
        self.stats = BufferStats()
        self.rollout_clocks: dict[str, tuple[float, float]] = {}    # latest (busy, up) seconds per rollout
        self.rollout_versions: dict[str, int] = {}                   # newest weight version seen per rollout
        self.clocks_at_batch: dict[str, tuple[float, float]] = {}   # the same at the previous batch
        self.batches_served = 0
        self.finished = False
        self.ledger_path = self.run_dir / "buffer" / "ledger.jsonl"
        self.ledger_path.parent.mkdir(parents=True, exist_ok=True)
        if recovering(s) and (found := latest_checkpoint(self.run_dir)) is not None:
            self._restore(found[1] / "buffer.json")
        self.changed = asyncio.Event()   # something that may let the dispatcher hand out work
        self.arrived = asyncio.Event()   # a scored group arrived or the version moved (batch waiters)
        self.log.info("buffer_started", prompts=len(self.dataset), skipped_lines=self.dataset.n_skipped,
                      batch_size=self.batch_size, group_size=self.group_size, eta=self.eta,
                      rollouts=self.rollouts, version=self.gate.version)

    async def on_ready(self) -> None:
        self.spawn(self._dispatch_loop(), name="dispatch")
        self.spawn(self._expire_loop(), name="expire", critical=False)
        self.changed.set()

    # --- handing out work -------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _next_key(self) -> Key:
        if self.reissue:
            return self.reissue.popleft()
        if self.position >= len(self.order):
            self.epoch += 1
            self.position = 0
            self.order = self._permutation(self.epoch)
            self.stats.epoch = self.epoch
        key = (self.epoch, self.order[self.position])
        self.position += 1
        return key

    def _least_loaded(self, names: list[str], attr: str, cap: Callable[[str], int | None]) -> str | None:
        load = {r: 0 for r in names if r in self.greeted and self.bus.peer_alive(r)}
        for f in self.inflight.values():
            if getattr(f, attr) in load:
                load[getattr(f, attr)] += 1
        free = [(n, r) for r, n in load.items() if cap(r) is None or n < cap(r)]
        return min(free)[1] if free else None

    def _rollout_cap(self, rollout: str) -> int:
        """Groups a rollout may hold. One while its newest weights are already older than the gate allows:
        everything it generates now will be dropped as stale, and a flood of such work would crowd out the
        heartbeats and weight pushes that let it catch up (the one group tells when it has)."""
        seen = self.rollout_versions.get(rollout)
        if seen is not None and self.gate.version - seen > self.eta:
            return 1
        return self.max_per_rollout

    async def _dispatch_loop(self) -> None:
        while not self.finished:
            await self.changed.wait()
            self.changed.clear()
            while not self.finished and self.gate.can_admit():
                rollout = self._least_loaded(self.rollouts, "rollout", self._rollout_cap)
                reward = self._least_loaded(self.rewards, "reward", lambda _: None)
                if rollout is None or reward is None:
                    break
                key = self._next_key()
                self.gate.admit(1)
                self.attempts += 1
                gid = f"{key[0]}-{key[1]}-{self.attempts}"
                self.inflight[gid] = InFlight(key, rollout, reward, time.time())
                rec = self.dataset.records[key[1]]
                await self.bus.send(rollout, GenerateGroup(
                    group_id=gid, query_id=rec.query_id, prompt_ids=self.prompt_ids[key[1]], n=self.group_size,
                    task=Task(kind=str(rec.extra.get("task", "math")), answer=rec.answer or "",
                              tests=list(rec.extra.get("tests", [])), level=rec.level if rec.level is not None else -1),
                    stop_token_ids=self.stop_ids, seed=1 + (hash((self.seed, key, self.attempts)) & 0x7FFFFFFF),
                    reward=reward, **self.gen))

    def _hand_back(self, gid: str, reason: str) -> None:
        """A group in flight will not come back scored: free its slot and issue its prompt again."""
        f = self.inflight.pop(gid, None)
        if f is None:
            return
        self.gate.finish(accepted=False)
        self.reissue.append(f.key)
        self.stats.returned += 1
        self.log.info("group_reissued", group=gid, rollout=f.rollout, reason=reason)
        self.changed.set()

    def _hand_back_held_by(self, worker: str, reason: str) -> None:
        for gid in [g for g, f in self.inflight.items() if worker in (f.rollout, f.reward)]:
            self._hand_back(gid, reason)

    def on_peer_dead(self, peer: str) -> None:
        self._hand_back_held_by(peer, f"{peer} is dead")

    @handles(WorkerHello)
    def on_worker_hello(self, msg: WorkerHello, env: Any) -> None:
        # Anything assigned to this worker before its (re)start will not come back from it.
        self._hand_back_held_by(env.sender, f"{env.sender} (re)started")
        self.rollout_versions.pop(env.sender, None)
        self.greeted.add(env.sender)
        self.changed.set()

    async def _expire_loop(self) -> None:
        while not self.finished:
            await asyncio.sleep(min(60.0, self.group_timeout_s / 4))
            now = time.time()
            for gid in [g for g, f in self.inflight.items() if now - f.issued_at > self.group_timeout_s]:
                self._hand_back(gid, f"no result after {self.group_timeout_s:.0f} s")

    def on_peer_alive(self, peer: str) -> None:
        self.changed.set()

    @handles(GroupReturned)
    def on_group_returned(self, msg: GroupReturned) -> None:
        if msg.reason.startswith("invalid:"):  # the prompt itself cannot be generated: issuing it again cannot help
            f = self.inflight.pop(msg.group_id, None)
            if f is not None:
                self.gate.finish(accepted=False)
                self._ledger({"event": "dropped_invalid", "key": list(f.key), "reason": msg.reason})
                self.log.warning("group_dropped_invalid", group=msg.group_id, reason=msg.reason)
                self.changed.set()
            return
        self._hand_back(msg.group_id, msg.reason)

    # --- collecting results -----------------------------------------------------------------------
    @handles(ScoredGroup)
    def on_scored(self, msg: ScoredGroup) -> None:
        newest = max((v for s in msg.samples for v in s.versions), default=None)
        if newest is not None:
            self.rollout_versions[msg.rollout] = newest      # the weights it finished this group with
        f = self.inflight.pop(msg.group_id, None)
        if f is None:  # a late answer to a group already re-issued elsewhere: the re-issue wins
            self.counters["late_groups"] += 1
            return
        if msg.up_seconds > 0:
            self.rollout_clocks[msg.rollout] = (msg.busy_seconds, msg.up_seconds)
        rewards = [s.reward for s in msg.samples]
        if self.dynamic_sampling and len(set(rewards)) <= 1:
            self.gate.finish(accepted=False)  # no learning signal: drop it, its slot is refilled
            self.stats.dropped_uniform += 1
            self.uniform_streak += 1
            self._ledger({"event": "dropped_uniform", "key": list(f.key)})
            if self.uniform_streak % (20 * self.batch_size) == 0:
                self.log.warning("dynamic_sampling_starving", dropped_in_a_row=self.uniform_streak,
                                 hint="every group got the same reward for every answer; the trainer gets no "
                                      "batch. Is the model able to solve any prompt? (algo.dynamic_sampling=false "
                                      "trains on them anyway)")
        else:
            self.uniform_streak = 0
            self.gate.finish(accepted=True)
            self.ready.append((f.key, msg))
        self.changed.set()
        self.arrived.set()

    @handles(VersionUpdate)
    def on_version(self, msg: VersionUpdate) -> None:
        if msg.version > self.gate.version:
            self.gate.set_version(msg.version)
        self.changed.set()
        self.arrived.set()

    def _drop_stale(self) -> None:
        """At batch time: a group whose oldest token is more than eta versions old is not trained; its
        prompt is issued again so nothing is lost."""
        fresh: deque[tuple[Key, ScoredGroup]] = deque()
        for key, group in self.ready:
            if self.gate.version - group_start_version(group) > self.eta:
                self.gate.discard(1)
                self.reissue.append(key)
                self.stats.dropped_stale += 1
                self.changed.set()
                if self.stats.dropped_stale % (10 * self.batch_size) == 0:
                    self.log.warning("stale_groups_dropped", total=self.stats.dropped_stale, version=self.gate.version,
                                     rollout=group.rollout, start_version=group_start_version(group),
                                     hint="rollouts generate with weights older than eta allows: is the weight "
                                          "push to them failing? (see the param_server log)")
            else:
                fresh.append((key, group))
        self.ready = fresh

    @handles(BatchRequest)
    async def on_batch_request(self, msg: BatchRequest) -> Batch:
        while True:
            self._drop_stale()
            if len(self.ready) >= self.batch_size:
                break
            self.arrived.clear()
            await self.arrived.wait()
        taken = [self.ready.popleft() for _ in range(self.batch_size)]
        self.batches_served += 1
        self._ledger({"event": "batch", "step": msg.step, "keys": [list(k) for k, _ in taken],
                      "start_versions": [group_start_version(g) for _, g in taken], "version": self.gate.version})
        self.stats.depth = len(self.ready)
        self.stats.running = self.gate.running
        self.stats.accepted = self.gate.accepted
        self.stats.rollout_utilisation = self._rollout_utilisation()
        return Batch(step=msg.step, groups=[g for _, g in taken], stats=BufferStats(**vars(self.stats)))

    def _rollout_utilisation(self) -> float:
        """Time the rollouts had work in hand over time they were up, since the previous batch (-1: no data).
        A restarted rollout's clocks start again from zero; its new clocks count from there."""
        busy = up = 0.0
        for name, (b, u) in self.rollout_clocks.items():
            b0, u0 = self.clocks_at_batch.get(name, (0.0, 0.0))
            if u < u0:
                b0 = u0 = 0.0
            busy, up = busy + b - b0, up + u - u0
        self.clocks_at_batch = dict(self.rollout_clocks)
        return busy / up if up > 0 else -1.0

    def _ledger(self, record: dict[str, Any]) -> None:
        with open(self.ledger_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    # --- checkpoints ------------------------------------------------------------------------------
    @handles(CheckpointRequest)
    def on_checkpoint(self, msg: CheckpointRequest) -> CheckpointDone:
        """Called between steps (the trainer asks before requesting the next batch), so exactly the
        batches of steps <= msg.step have been served. Work not yet trained is recorded for re-issue and
        the gate counters are saved as they must be once it is re-issued."""
        pending = [f.key for f in self.inflight.values()] + [k for k, _ in self.ready] + list(self.reissue)
        gate = self.gate.state_dict()
        gate["accepted"] -= len(self.ready)
        gate["running"] = 0
        state = {"step": msg.step, "epoch": self.epoch, "position": self.position, "gate": gate,
                 "reissue": [list(k) for k in pending], "stats": vars(self.stats), "attempts": self.attempts,
                 "dataset": {"path": self.dataset.path, "records": len(self.dataset)}}
        if msg.step < 0:
            raise ValueError(f"step: {msg.step} is not a training step")
        path = checkpoint_dir(self.run_dir, msg.step) / "buffer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)
        return CheckpointDone(step=msg.step)

    def _restore(self, path: Path) -> None:
        state = json.loads(path.read_text())
        if state["dataset"]["records"] != len(self.dataset):
            raise ValueError(f"{path}: saved for a dataset of {state['dataset']['records']} records, "
                             f"but {self.dataset.path} has {len(self.dataset)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.order = self._permutation(self.epoch)
        self.gate.load_state_dict(state["gate"])
        self.reissue = deque(tuple(k) for k in state["reissue"])
        self.stats = BufferStats(**state["stats"])
        self.attempts = int(state["attempts"])
        # The ledger is the record of what was trained; batches after the checkpoint were rolled back.
        kept = []
        if self.ledger_path.exists():
            for line in self.ledger_path.read_text().splitlines():
                rec = json.loads(line)
                if rec["event"] != "batch" or rec["step"] <= state["step"]:
                    kept.append(line)
        self.ledger_path.write_text("".join(line + "\n" for line in kept))
        self.log.info("buffer_restored", step=state["step"], epoch=self.epoch, position=self.position,
                      reissue=len(self.reissue), gate=repr(self.gate))

    @handles(RunFinished)
    def on_run_finished(self, msg: RunFinished) -> None:
        self.finished = True
        self.changed.set()
        self.request_stop(f"run finished at step {msg.step}")
