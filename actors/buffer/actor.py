"""The buffer actor: hands prompts to rollouts under the staleness gate and forms training batches.

Its decisions live in `BufferState` (actors/buffer/state.py): the dataset cursor, the staleness gate, the
groups in flight and ready, dynamic sampling, the batch-time staleness check, the checkpointed counters
and what a restart serves again. Its files are `BufferFiles`' (below): the ledger (buffer/ledger.jsonl:
every batch's keys, every prompt dropped on purpose), the batches served since the newest checkpoint and
the checkpoint's buffer.json. This actor is the adapter between them: messages in, calls on the state,
messages, log lines and files out.

Flow: GenerateGroup -> least-loaded live rollout; ScoredGroup (from a reward actor) -> ready queue;
BatchRequest (from the trainer) -> waits until B fresh groups are ready, then replies with a BatchTensors;
VersionUpdate -> opens the gate; CheckpointRequest -> writes buffer.json for that step.

After a recovery (actors/runtime/recovery.py) the buffer restores the cursor and gate from the checkpoint of step
k; what was in flight or ready-but-untrained at step k is re-issued first, and the gate counters are
restored to match, so no prompt is lost, none is trained twice, and the staleness bound still holds.

Lost work: the buffer picks the rollout AND the reward actor of every group, so when either is restarted (its
new process's first ping carries a new incarnation: `on_peer_restarted`, before that process says anything; or
its WorkerHello), or stays silent for `buffer.worker_lost_after_s` (unset: SILENT_HEARTBEAT_TIMEOUTS of its bus's
heartbeat timeouts), exactly the groups it held are issued again; late answers of re-issued groups are ignored.
A restarted worker gets no new group until its hello. One missed heartbeat timeout alone hands nothing back:
a live worker starved of CPU for a moment still generates its groups (BufferState, "Silent workers"). A group
with no result in its time (`BufferState.group_timeout`: `buffer.group_timeout_s`, or derived from
gen.max_new_tokens and the measured pace) is aborted on its rollout (AbortGroup, a request) and issued again once the rollout says
its copy stopped, or cannot answer: never while a copy may still run.

Each rollout holds at most the groups its server's KV pool fits (the pool its WorkerHello reports).

Settings read: model.path (tokenizer), data.train (through its layout), data.on_bad_line, data.require,
data.max_prompt_tokens (longer prompts are left out, logged), seed, algo.batch_size,
algo.group_size, algo.eta, algo.dynamic_sampling, gen.* (sampling of the GenerateGroup, the timeouts' pace),
buffer.max_groups_per_rollout, buffer.max_concurrent_groups, buffer.group_timeout_s, buffer.worker_lost_after_s.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgpack

from actors.runtime.base import Actor, handles
from actors.batch import Batch, BatchGroup, from_batch
from actors.buffer.state import BufferState, InFlight, ledger_after_resume, plan_resume
from actors.dataset import Layout, Record, load_dataset, within_prompt_cap
from actors.engines.tokenizer import load_tokenizer
from actors.runtime.spans import SpanLog
from actors.runtime.recovery import checkpoint_dir, latest_checkpoint, recovering, restarted_in_place
from actors.runtime.threads import costed
from algo.serving import DecodePace
from topology.settings import BufferSettings
from transport.bus import HEARTBEAT_TIMEOUT_S, BusError
from transport.files import atomic_write
from transport.messages import Error, decode, encode
from transport.protocol import (AbortGroup, BatchRequest, BatchTensors, CheckpointDone, CheckpointRequest, GenerateGroup,
                                GroupAborted, GroupReturned, HelloRequest, RunFinished, ScoredGroup, Task, VersionUpdate,
                                WorkerHello)

# A worker unheard for this many of the bus's heartbeat timeouts is taken for lost (buffer.worker_lost_after_s
# overrides). Live actors starved of CPU went 1.08-1.16 timeouts without a heartbeat in a rehearsal on 2 cores at
# a load average above 30 (docs/plan.md, the kill-node fault); a restarted worker is known sooner, by its hello.
SILENT_HEARTBEAT_TIMEOUTS = 6


class BufferFiles:
    """What the buffer keeps on disk under `run_dir`: buffer/ledger.jsonl (every batch's keys, every prompt
    dropped on purpose), buffer/served/step_N.msgpack (each batch served since the newest complete
    checkpoint, with its ledger record and the buffer's state right after serving it: a restart of either
    side resumes from there) and the checkpoint's buffer.json."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.ledger_path = self.run_dir / "buffer" / "ledger.jsonl"
        self.served_dir = self.run_dir / "buffer" / "served"
        self.served_dir.mkdir(parents=True, exist_ok=True)

    def clear(self) -> None:
        """A fresh start (run.recover: off), whatever an earlier run left here."""
        for old in self.served_dir.glob("step_*.msgpack"):
            old.unlink()
        self.ledger_path.unlink(missing_ok=True)

    # --- the ledger -------------------------------------------------------------------------------
    def append_ledger(self, record: dict[str, Any]) -> None:
        with open(self.ledger_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def ledger(self) -> list[dict[str, Any]]:
        if not self.ledger_path.exists():
            return []
        return [json.loads(line) for line in self.ledger_path.read_text().splitlines()]

    def write_ledger(self, records: list[dict[str, Any]]) -> None:
        self.ledger_path.write_text("".join(json.dumps(r) + "\n" for r in records))

    # --- served batches ---------------------------------------------------------------------------
    def served_path(self, step: int) -> Path:
        return self.served_dir / f"step_{step:06d}.msgpack"

    def served_steps(self) -> list[int]:
        return sorted(int(p.stem.split("_")[1]) for p in self.served_dir.glob("step_*.msgpack"))

    def write_served(self, listed: Batch, record: dict[str, Any], state: dict[str, Any]) -> BatchTensors:
        """The batch in its wire form, on disk before the reply. The file is one msgpack map whose "batch" is
        the header frame and "tensors" the tensor frames, written frame by frame (not joined in memory)."""
        batch = from_batch(listed)
        frames = encode(batch)
        packer = msgpack.Packer()
        parts: list[Any] = [packer.pack_map_header(4), packer.pack("batch"), packer.pack(frames[0]),
                            packer.pack("tensors"), packer.pack_array_header(len(frames) - 1)]
        for frame in frames[1:]:
            parts += [b"\xc6" + memoryview(frame).nbytes.to_bytes(4, "big"), frame]   # msgpack bin 32
        parts += [packer.pack("ledger"), packer.pack(record), packer.pack("state"), packer.pack(state)]
        atomic_write(self.served_path(listed.step), parts)
        return batch

    def read_served(self, step: int) -> tuple[BatchTensors, dict[str, Any], dict[str, Any]]:
        """The batch served for `step`, its ledger record, and the buffer's state right after serving it."""
        path = self.served_path(step)
        try:
            saved = msgpack.unpackb(path.read_bytes())
            _, batch = decode([saved["batch"], *saved["tensors"]])
            if not isinstance(batch, BatchTensors):
                raise TypeError(f"it holds a {type(batch).__name__}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"{path}: the batch served for step {step} cannot be read back: {exc}") from exc
        return batch, saved["ledger"], saved["state"]

    def remove_served(self, steps: list[int]) -> None:
        for step in steps:
            self.served_path(step).unlink(missing_ok=True)

    # --- checkpoints ------------------------------------------------------------------------------
    def write_checkpoint(self, step: int, state: dict[str, Any]) -> Path:
        """The state as buffer.json in the checkpoint of `step`, in this run's own directory. Batches up to
        the newest complete checkpoint will never be asked for again and are removed (`step`'s checkpoint
        is not complete yet: until it is, a resume starts from the one before)."""
        if step < 0:
            raise ValueError(f"step: {step} is not a training step")
        path = checkpoint_dir(self.run_dir, step) / "buffer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(state))
        if (done := latest_checkpoint(self.run_dir)) is not None:
            self.remove_served([k for k in self.served_steps() if k <= done[0]])
        return path


def level_of(rec: Record) -> int:
    """The record's difficulty level; -1 (the wire's "none") when it has none."""
    return rec.level if rec.level is not None else -1


class BufferActor(Actor):
    Settings = BufferSettings
    cfg: BufferSettings

    async def on_start(self) -> None:
        cfg = self.cfg
        in_place = self.restarted = restarted_in_place(self)
        self.group_size = cfg.algo.group_size
        gen = cfg.gen
        self.gen = {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k,
                    "max_new_tokens": gen.max_new_tokens}
        data = cfg.data
        # Math records need an answer; a code task's records carry `tests` instead (data.require: none).
        self.dataset = await asyncio.to_thread(
            load_dataset, data.train, require=data.require, on_error=data.on_bad_line or "skip",
            max_line_bytes=data.max_line_bytes, layout=Layout.from_settings(data), max_bad_share=data.max_bad_share)
        tok = await asyncio.to_thread(load_tokenizer, cfg.model.path)
        self.stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
        self.prompt_ids = [tok.encode(r.prompt) for r in self.dataset.records]
        kept = within_prompt_cap(self.prompt_ids, data.max_prompt_tokens)
        if len(kept) < len(self.prompt_ids):
            if not kept:
                raise ValueError(f"data.max_prompt_tokens: every prompt of {data.train} is longer than "
                                 f"{data.max_prompt_tokens} tokens")
            self.log.warning("prompts_over_length_left_out", prompts=len(self.prompt_ids) - len(kept),
                             kept=len(kept), max_prompt_tokens=data.max_prompt_tokens)
            self.dataset.records = [self.dataset.records[i] for i in kept]
            self.prompt_ids = [self.prompt_ids[i] for i in kept]
        self.state = BufferState(
            n_records=len(self.dataset), rollouts=list(cfg.groups.get("rollout", [])),
            rewards=list(cfg.groups.get("reward", [])), batch_size=cfg.algo.batch_size,
            eta=cfg.algo.eta, seed=cfg.seed, dynamic_sampling=cfg.algo.dynamic_sampling,
            max_per_rollout=cfg.buffer.max_groups_per_rollout, max_concurrent=cfg.buffer.max_concurrent_groups,
            # Last resort for a group lost without any sign (a message dropped by a dying process, a hung
            # server): abort it where it runs, then issue it again.
            group_timeout_s=cfg.buffer.group_timeout_s, group_size=cfg.algo.group_size,
            max_new_tokens=gen.max_new_tokens * gen.max_turns,   # an episode's turns share one group's time
            prompt_tokens=sum(map(len, self.prompt_ids)) / max(1, len(self.prompt_ids)),
            pace=DecodePace(gen.assumed_tokens_per_s, gen.timeout_slack, gen.timeout_floor_s),
            silence_limit_s=self.worker_lost_after_s())
        self.finished = False
        self._batch_waited_for: int | None = None   # the step whose batch a request waits for (status)
        self.files = BufferFiles(self.run_dir)
        self.trace = SpanLog(self.run_dir, self.name) if cfg.run.trace else None
        self._serving = asyncio.Lock()
        if in_place or recovering(cfg):
            found = latest_checkpoint(self.run_dir) if recovering(cfg) else None
            self._restore(found[0] if found else 0, found[1] / "buffer.json" if found else None)
        else:   # run.recover: off
            self.files.clear()
        self.changed = asyncio.Event()   # something that may let the dispatcher hand out work
        self.arrived = asyncio.Event()   # a scored group arrived or the version moved (batch waiters)
        self.log.info("buffer_started", prompts=len(self.dataset), skipped_lines=self.dataset.n_skipped,
                      batch_size=self.state.batch_size, group_size=self.group_size, eta=self.state.eta,
                      rollouts=self.state.rollouts, version=self.state.gate.version)

    def heartbeat_timeout(self) -> float:
        """Seconds of silence after which this actor's bus declares a peer dead (its settings, else the bus's)."""
        return self.cfg.bus.heartbeat_timeout or HEARTBEAT_TIMEOUT_S

    def worker_lost_after_s(self) -> float:
        """Seconds a worker may stay unheard before its groups are issued again."""
        configured = self.cfg.buffer.worker_lost_after_s
        return configured if configured is not None else SILENT_HEARTBEAT_TIMEOUTS * self.heartbeat_timeout()

    def progress(self) -> dict[str, Any]:
        st: BufferState | None = getattr(self, "state", None)
        if st is None:
            return {}
        return {"version": st.gate.version, "served_through": st.served_through,
                # accepted groups that were not dropped as stale: a stall shows as this standing still
                "groups_kept": st.served_through * st.batch_size + len(st.ready),
                "ready": len(st.ready), "batch_size": st.batch_size, "in_flight": len(st.inflight),
                "gate": repr(st.gate), "gate_open": st.gate.can_admit(), "eta": st.eta,
                "dropped_stale": st.stats.dropped_stale, "dropped_uniform": st.stats.dropped_uniform,
                "uniform_streak": st.uniform_streak, "rollout_versions": dict(st.rollout_versions),
                "workers_greeted": sorted(st.greeted), "batch_waited_for": self._batch_waited_for,
                "finished": self.finished}

    async def on_ready(self) -> None:
        if self.restarted:   # it knows no worker yet, and the trainer may be waiting on a request it never got
            trainers = (self.cfg.groups.get("trainer") or [])[:1]
            for peer in self.state.rollouts + self.state.rewards + trainers:
                await self.bus.send(peer, HelloRequest())
        self.spawn(self._dispatch_loop(), name="dispatch")
        self.spawn(self._expire_loop(), name="expire", critical=False)
        self.changed.set()

    # --- handing out work -------------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while not self.finished:
            await self.changed.wait()
            self.changed.clear()
            # One group at a time: a worker declared dead while a send awaits gets no more work.
            while not self.finished and (issue := self.state.issue_next(self.bus.peer_alive, time.time())):
                index = issue.key[1]
                rec = self.dataset.records[index]
                await self.bus.send(issue.rollout, GenerateGroup(
                    group_id=issue.group_id, prompt_ids=self.prompt_ids[index], n=self.group_size,
                    task=Task(kind=str(rec.extra.get("task", "math")), answer=rec.answer or "",
                              tests=list(rec.extra.get("tests", [])),
                              answers=list(rec.answers) if len(rec.answers) > 1 else [],
                              tool=str(rec.extra.get("tool") or "")),
                    stop_token_ids=self.stop_ids, seed=issue.seed, reward=issue.reward, **self.gen))
                if self.trace is not None:
                    self.trace.write("issue", t=time.time(), group=issue.group_id, key=list(issue.key),
                                     rollout=issue.rollout, reward=issue.reward)

    def _handed_back(self, handed_back: dict[str, InFlight], reason: str) -> None:
        for gid, f in handed_back.items():
            self.log.info("group_reissued", group=gid, rollout=f.rollout, reason=reason)
        if handed_back:
            self.changed.set()

    def on_peer_dead(self, peer: str) -> None:
        # Not handed back yet: it may be alive and short of CPU. A restart shows at its first ping; a lost one
        # stays silent.
        if peer not in self.state.rollouts and peer not in self.state.rewards:
            return
        self.state.worker_silent(peer, time.time() - self.heartbeat_timeout())
        held = self.state.rollout_load[peer] + self.state.reward_load[peer]
        self.log.warning("worker_silent", worker=peer, groups_held=held,
                         lost_after_s=round(self.state.silence_limit_s, 1))

    def on_peer_restarted(self, peer: str) -> None:
        # Its new process holds nothing of the old one's: hand it all back now, not at a hello that may never come.
        if getattr(self, "state", None) is None or (peer not in self.state.rollouts and peer not in self.state.rewards):
            return
        handed_back = self.state.worker_restarted(peer)
        self.log.warning("worker_restarted", worker=peer, groups_reissued=len(handed_back))
        self._handed_back(handed_back, f"{peer} restarted")

    @handles(WorkerHello)
    def on_worker_hello(self, msg: WorkerHello, env: Any) -> None:
        self._handed_back(self.state.worker_hello(env.sender, msg.kv_tokens), f"{env.sender} (re)started")
        if msg.kv_tokens > 0:
            self.log.info("rollout_kv_pool", rollout=env.sender, kv_tokens=msg.kv_tokens,
                          groups=self.state.rollout_cap(env.sender), context_tokens=round(self.state.context_tokens()))
        self.changed.set()

    async def _expire_loop(self) -> None:
        while not self.finished:
            await asyncio.sleep(self.state.expire_every_s)   # a period, not synchronisation
            self._expire(time.time())

    def _expire(self, now: float) -> None:
        """Overdue groups are aborted where they run, then issued again; a silent worker's are issued again."""
        timeout = self.state.group_timeout()
        for gid, f in self.state.overdue(now).items():
            self.spawn(self._abort_overdue(gid, f, timeout), name=f"abort-{gid}", critical=False)
        lost = self.state.silent_too_long(now)
        self._handed_back(lost, f"unheard for {self.state.silence_limit_s:.0f} s")
        for gid, f in lost.items():   # should it wake after all, its copy stops rather than run beside the new one
            self.spawn(self._abort_abandoned(gid, f), name=f"abort-{gid}", critical=False)

    async def _abort_abandoned(self, group_id: str, f: InFlight) -> None:
        try:
            await self.bus.request(f.rollout, AbortGroup(group_id=group_id, reason="its worker was unheard too long"),
                                   timeout=self.cfg.drain_timeout)
        except BusError as exc:
            self.log.info("group_abort_unanswered", group=group_id, rollout=f.rollout, error=str(exc))

    async def _abort_overdue(self, group_id: str, f: InFlight, timeout: float) -> None:
        """Have the rollout stop a group whose time ran out, then issue it again: a second copy while the
        first still runs would double that server's work, and time out in its turn."""
        reason = f"no result after {timeout:.0f} s"
        self.log.warning("group_overdue", group=group_id, rollout=f.rollout, timeout_s=round(timeout, 1),
                         overdue_groups=self.state.overdue_groups)
        try:
            reply = await self.bus.request(f.rollout, AbortGroup(group_id=group_id, reason=reason),
                                           timeout=self.cfg.drain_timeout)
            if isinstance(reply, GroupAborted) and not reply.stopped:
                self.log.warning("group_abort_unconfirmed", group=group_id, rollout=f.rollout)
        except BusError as exc:   # a rollout that cannot answer holds nothing that will come back
            self.log.warning("group_abort_unanswered", group=group_id, rollout=f.rollout, error=str(exc))
        handed = self.state.hand_back(group_id)
        self._handed_back({group_id: handed} if handed is not None else {}, reason)

    def on_peer_alive(self, peer: str) -> None:
        self.state.worker_heard(peer)
        self.changed.set()

    @handles(GroupReturned)
    def on_group_returned(self, msg: GroupReturned) -> None:
        if msg.reason.startswith("invalid:"):  # the prompt itself cannot be generated: issuing it again cannot help
            f = self.state.drop_invalid(msg.group_id)
            if f is not None:
                self.files.append_ledger({"event": "dropped_invalid", "key": list(f.key), "reason": msg.reason})
                self.log.warning("group_dropped_invalid", group=msg.group_id, reason=msg.reason)
                self.changed.set()
            return
        f = self.state.hand_back(msg.group_id)
        self._handed_back({msg.group_id: f} if f is not None else {}, msg.reason)

    # --- collecting results -----------------------------------------------------------------------
    @handles(ScoredGroup)
    def on_scored(self, msg: ScoredGroup) -> None:
        held = self.state.inflight.get(msg.group_id)
        result = self.state.scored(msg.group_id, msg.answers)
        if self.trace is not None:
            self._trace_group(msg, held, result.outcome)
        if result.outcome == "late":
            self.counters["late_groups"] += 1
            return
        if result.outcome == "uniform":
            assert result.key is not None
            self.files.append_ledger({"event": "dropped_uniform", "key": list(result.key)})
            streak = self.state.uniform_streak
            if streak % (20 * self.state.batch_size) == 0:
                self.log.warning("dynamic_sampling_starving", dropped_in_a_row=streak,
                                 hint="every group got the same reward for every answer; the trainer gets no "
                                      "batch. Is the model able to solve any prompt? (algo.dynamic_sampling=false "
                                      "trains on them anyway)")
        self.changed.set()
        self.arrived.set()

    def _trace_group(self, msg: ScoredGroup, held: InFlight | None, outcome: str) -> None:
        """One line per scored group: when it was issued and came back, its generation and grading seconds,
        and per answer [oldest version, newest version, answer tokens, reward, finish reason]."""
        answers = []
        for s in msg.answers.samples:
            own = [v for v in s.versions if v >= 0]
            answers.append([min(own, default=-1), max(own, default=-1), len(s.output_ids), s.reward,
                            s.finish_reason])
        self.trace.write("group", t=time.time(), group=msg.group_id, outcome=outcome,
                         key=list(held.key) if held else None, issued=held.issued_at if held else None,
                         rollout=msg.answers.rollout, reward=held.reward if held else None,
                         gen_s=round(msg.answers.gen_seconds, 4), score_s=round(msg.score_seconds, 4),
                         answers=answers)

    @handles(VersionUpdate)
    def on_version(self, msg: VersionUpdate) -> None:
        if not self.state.version_reachable(msg.version):
            self.counters["versions_refused"] += 1
            self.log.warning("version_refused", version=msg.version, gate_version=self.state.gate.version,
                             served_through=self.state.served_through,
                             reason=f"no batch past step {self.state.served_through} was served, so the trainer "
                                    f"cannot have finished step {msg.version}; the gate stays where it is")
            return
        self.state.set_version(msg.version)
        self.changed.set()
        self.arrived.set()

    def _drop_stale(self) -> None:
        before = self.state.stats.dropped_stale
        dropped = self.state.drop_stale()
        for i, group in enumerate(dropped, start=before + 1):
            if i % (10 * self.state.batch_size) == 0:
                self.log.warning("stale_groups_dropped", total=i, version=self.state.gate.version,
                                 rollout=group.answers.rollout, start_version=group.start_version,
                                 hint="rollouts generate with weights older than eta allows: is the weight "
                                      "push to them failing? (see the param_server log)")
        if dropped:
            if self.trace is not None:
                self.trace.write("stale", t=time.time(), version=self.state.gate.version,
                                 groups=[g.group_id for g in dropped], start_versions=[g.start_version for g in dropped])
            self.changed.set()

    @handles(BatchRequest)
    async def on_batch_request(self, msg: BatchRequest) -> BatchTensors | Error:
        if self.state.version_reachable(msg.step - 1):   # it finished that step: a VersionUpdate lost in a restart
            self.state.set_version(msg.step - 1)
        async with self._serving:   # one step at a time: a restarted trainer may ask while its old request waits
            if self.state.serves_again(msg.step):
                batch = self.files.read_served(msg.step)[0]
                self.counters["batches_served_again"] += 1
                self.log.info("batch_served_again", step=msg.step, groups=len(batch.levels))
                return batch
            self._batch_waited_for = msg.step
            asked = time.time()
            while True:
                self._drop_stale()
                if (taken := self.state.take_batch()) is not None:
                    break
                if self.draining:   # stopping: nothing is taken, the trainer asks the next buffer again
                    self._batch_waited_for = None
                    return Error("draining", f"{self.name} is stopping; batch {msg.step} was not taken",
                                 BatchRequest.KIND)
                self.arrived.clear()
                await self.arrived.wait()
            self._batch_waited_for = None
            taken_at = time.time()
            record = {"event": "batch", "step": msg.step, "keys": [list(g.key) for g in taken],
                      "start_versions": [g.start_version for g in taken], "version": self.state.gate.version}
            # An agent's answers continue the prompt its rollout rendered (Answers.prompt_ids), not the issued one.
            groups = [BatchGroup(prompt_ids=g.answers.prompt_ids or self.prompt_ids[g.key[1]],
                                 level=level_of(self.dataset.records[g.key[1]]), samples=g.answers.samples)
                      for g in taken]
            listed = Batch(step=msg.step, groups=groups, stats=self.state.batch_stats())
            state = self._state_dict()
            # Converting and writing a recipe-sized batch (GBs) takes seconds: off the event loop, which
            # must keep answering heartbeats and taking scored groups meanwhile. Nothing here touches the
            # state; the taken groups are no longer the state's.
            batch, cost = await asyncio.to_thread(costed, self.files.write_served, listed, record, state)
            self.files.append_ledger(record)
            self.state.served(msg.step)
            # The trainer waits for both: groups still to come, then the serve (tools.bench serve times its parts).
            # The serve's CPU and its wait for a core tell a busy machine from a slow serve or a slow disk.
            self.log.info("batch_served", step=msg.step, answer_tokens=sum(batch.output_lens),
                          waited_for_groups_s=round(taken_at - asked, 4), serve_s=round(time.time() - taken_at, 4),
                          serve_cpu_s=round(cost.cpu_s, 4),
                          serve_core_wait_s=None if cost.core_wait_s is None else round(cost.core_wait_s, 4))
            if self.trace is not None:
                self.trace.write("batch", step=msg.step, asked=asked, taken=taken_at, served=time.time(),
                                 groups=[g.group_id for g in taken], depth=len(self.state.ready),
                                 in_flight=len(self.state.inflight))
            return batch

    def _state_dict(self) -> dict[str, Any]:
        return {**self.state.state_dict(), "dataset": {"path": self.dataset.path, "records": len(self.dataset)}}

    # --- checkpoints ------------------------------------------------------------------------------
    @handles(CheckpointRequest)
    def on_checkpoint(self, msg: CheckpointRequest) -> CheckpointDone:
        """Called between steps (the trainer asks before requesting the next batch), so exactly the
        batches of steps <= msg.step have been served."""
        # served_through is ahead of msg.step after a trainer restarted in place
        self.files.write_checkpoint(msg.step, {"step": msg.step, **self._state_dict(),
                                               "served_through": self.state.served_through})
        return CheckpointDone(step=msg.step)

    def _restore(self, step: int, checkpoint: Path | None) -> None:
        """Take up the run after a restart in place or a relaunch from the checkpoint of `step` (its
        buffer.json: `checkpoint`), as `plan_resume` decides from the served batches on disk."""
        resume = plan_resume(self.files.served_steps(), step)
        if resume.discarded:
            self.log.warning("served_batches_discarded", steps=resume.discarded, checkpoint=step)
            self.files.remove_served(resume.discarded)
        records: dict[int, dict[str, Any]] = {}
        state = None
        for k in resume.served_again:   # the newest one's state is the state right after it was served
            _, records[k], state = self.files.read_served(k)
        if state is None and checkpoint is not None:
            state = json.loads(checkpoint.read_text())
        if state is not None and state["dataset"]["records"] != len(self.dataset):
            raise ValueError(f"the buffer's saved state (step {resume.served_through}) is for a dataset of "
                             f"{state['dataset']['records']} records, but {self.dataset.path} has "
                             f"{len(self.dataset)}")
        self.state.resume(resume, state)
        self.files.write_ledger(ledger_after_resume(self.files.ledger(), resume, records))
        if state is None:
            return
        self.log.info("buffer_restored", step=step, served_through=resume.served_through, data_pass=self.state.data_pass,
                      position=self.state.position, reissue=len(self.state.reissue), gate=repr(self.state.gate))

    async def on_drain(self) -> None:
        # A batch request waiting for groups still being generated would hold the drain its whole budget:
        # it is answered now, with nothing taken.
        self.arrived.set()

    async def on_stop(self) -> None:
        # What became of every prompt handed out: tools/bench/chaos.py counts lost and twice-trained ones.
        if getattr(self, "state", None) is not None:
            final = {**self._state_dict(), "served_through": self.state.served_through,
                     "issued": [list(k) for k in self.state.issued_keys()]}
            atomic_write(self.run_dir / "buffer" / "final_state.json", json.dumps(final))

    @handles(RunFinished)
    def on_run_finished(self, msg: RunFinished) -> None:
        self.finished = True
        self.changed.set()
        self.request_stop(f"run finished at step {msg.step}")
