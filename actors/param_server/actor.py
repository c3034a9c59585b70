"""ParamServerActor: takes each new weight version from the trainer and brings every rollout up to it.

It coordinates; its *fanout* (actors/weight_sync, picked once at start from the links) moves the bytes.
The direction is one way: this server asks the fanout to take a version, form a group or push, and gets a
result back (``Accepted``, ``Formation``, ``Transfer``); the fanout never calls it. A
:class:`WeightsPublished` from the trainer goes to the fanout, which takes the version (the relay receives
its buckets and hashes and packs them; with direct weights only their description is kept): it becomes
the version every rollout is brought to, unless a newer one got there first.

One task, the *pusher*, owns the rollout link, so formation and transfers never interleave:

* Forming. An epoch ``e`` of the link is formed by the rollouts that are *ready*: they said
  :class:`RolloutHello` and are alive by the bus heartbeats. :class:`LinkReform` (e, its members) goes to
  each of them, then this side joins in a thread. The first formation waits until every live rollout has
  said hello (they start together), but only while none of those that did is behind: a rollout whose server
  is still starting (minutes, at 7B and up) joins late, and must not keep the others from new weights. After
  that no rollout is waited for: one that is dead, hung (its
  heartbeats stop), or whose SGLang server died (:class:`ServerDown`, until its next hello) is left out,
  and the others form without it. When the ready set changes (a member is lost, one comes back or
  restarts and says hello) the link is formed again. A failed rendezvous is retried at a newer epoch
  after ``retry_s``.
* Pushing. Whenever a member of the formed epoch is behind the newest stored version, the pusher
  has the fanout send :class:`WeightsReady` to every member as a request and move the bytes, and collects
  the :class:`WeightsAck` replies (``ack_timeout_s``). Each ack's hash is compared with the trainer's; a
  mismatch is logged as an error and counted. Versions that arrive while a push runs are coalesced: the
  next push sends only the newest. A member lost while a formation or a push runs ends it at once: the
  blocked transfer is abandoned on its old epoch (its thread ends there, see transport/bulk.py) and
  the rest form a new one and get the version without waiting for the lost one, which catches up when it
  is back.

At start the server holds the start weights (:func:`actors.runtime.recovery.start_weights`), so a rollout that
starts late or restarts is brought to the current version even before the trainer publishes anything new.
:class:`WeightsStatusRequest` reports the per-rollout state and can wait for a version.

How a formation and a push move bytes is the fanout's: the relay's :class:`~actors.weight_sync.RelayFanout`
(this server receives each version on ``train_to_ps``, is rank 0 of ``ps_to_rollout`` and sends on a lane
per rollout), or, with direct weights (GPU topologies: one link of ``[trainer.0, rollout]``, this server in
none), :class:`~actors.weight_sync.TrainerFanout`: the trainer keeps its last two exported versions, is
rank 0 of the rollouts' group, forms it when asked (:class:`LinkReform` as a request) and broadcasts when
asked (:class:`WeightsBroadcast`). The pusher is the same either way, and the rollouts cannot tell the
difference. The start version's hash is not known with direct weights (nothing is loaded here), so a
rollout at the start version counts as up to date, as in the relay mode.

Evaluation during the run (``eval.every_versions`` N > 0): the versions the evaluator evaluates are kept
in a store of their own, which answers its :class:`EvalWeightsRequest` (actors/param_server/eval_store.py).

Settings (all optional): ``train_link`` (default "train_to_ps"), ``rollout_link`` (default
"ps_to_rollout"), ``ack_timeout_s`` (default 120), ``retry_s`` (default 2), ``probation_s`` (default 30: how
long a rollout back from a hang is first left out if the transfer fails with it), ``bucket_bytes`` for the start
weights (default 64 MiB), ``model.dtype`` (the dtype the start weights are held in, as the rollouts load them).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Coroutine
from typing import Any

from actors.runtime.base import Actor, ActorSpec, handles
from actors.param_server.eval_store import EvalWeightsStore
from actors.param_server.push_policy import Form, Idle, Push, PushPolicy, Wait
from actors.weight_sync import Fanout, StoredVersion, make_fanout
from topology.settings import ParamServerSettings
from transport.protocol import (EvalWeights, EvalWeightsRequest, HelloRequest, RolloutHello, RolloutWeights,
                                RunFinished, ServerDown, WeightsAck, WeightsPublished, WeightsStatus,
                                WeightsStatusRequest, WeightsStored)

__all__ = ["ParamServerActor"]


class ParamServerActor(Actor):
    Settings = ParamServerSettings
    cfg: ParamServerSettings

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        self.current: StoredVersion | None = None
        self.start_version = 0
        # Which rollouts form the link, when it is formed again, what is pushed to whom, probation: the
        # decisions (actors/param_server/push_policy.py); this actor carries them out.
        self.policy = PushPolicy()
        self.fanout: Fanout | None = None       # how a version reaches the rollouts: the relay, or the trainer
        self._storing: set[asyncio.Task] = set()   # published versions being hashed and packed
        self.pushes = 0
        self.hash_mismatches = 0
        self.sync_seconds: list[float] = []
        self._kick = asyncio.Event()
        self._changed = asyncio.Condition()
        self._waiting_logged: tuple = ()
        # Hellos can arrive while on_start still loads the start weights; they are applied once it is done.
        self._started = asyncio.Event()
        self._early_hellos: dict[str, RolloutHello] = {}
        self.eval_store: EvalWeightsStore | None = None   # the versions kept for the evaluator

    # The policy's state, under the names the status and the tests use.
    @property
    def rollouts(self) -> dict[str, RolloutWeights]:
        return self.policy.rollouts

    @rollouts.setter
    def rollouts(self, value: dict[str, RolloutWeights]) -> None:
        self.policy.rollouts = value

    @property
    def epoch(self) -> int | None:
        """The formed epoch of the rollout link, None while none is formed."""
        return self.policy.epoch

    @property
    def formed(self) -> list[str]:
        """The rollouts of the formed epoch, in link order."""
        return self.policy.formed

    # ------------------------------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        self.retry_s = self.cfg.retry_s
        self.policy.probation_s = self.cfg.probation_s
        self.fanout = make_fanout(self.cfg, self.bus, self.log, self.counters, self.make_link, self.run_dir)
        self.eval_store = EvalWeightsStore(self.cfg.eval.every_versions, self.fanout.holds_weights, self.counters)
        self.rollouts = {m: RolloutWeights() for m in self.fanout.rollouts}
        t0 = time.monotonic()
        self.current = await self.fanout.start_weights()
        self.start_version = self.current.version
        self.eval_store.keep(self.current)
        self.log.info("start_weights", version=self.current.version, hash=self.current.weights_hash,
                      path=type(self.fanout).__name__, rollouts=len(self.rollouts),
                      buckets=len(self.current.packed), nbytes=self.current.nbytes,
                      seconds=round(time.monotonic() - t0, 3))
        self._mark_started()

    def _mark_started(self) -> None:
        self._started.set()
        for sender, hello in self._early_hellos.items():
            self._hello(sender, hello)
        self._early_hellos.clear()

    def progress(self) -> dict[str, Any]:
        return {"version": self.current.version if self.current is not None else None, "epoch": self.epoch,
                "pushes": self.pushes, "rollouts": {n: {"version": r.version, "alive": r.alive, "hello": r.hello}
                                                     for n, r in self.rollouts.items()}}

    async def on_ready(self) -> None:
        self.spawn(self._pusher(), name="pusher")
        for name in self.rollouts:   # after a restart in place this is how it learns where they are
            await self.bus.send(name, HelloRequest())

    async def on_stop(self) -> None:
        if self.fanout is not None:
            self.fanout.close()
        times = sorted(self.sync_seconds)
        self.log.info("param_server_stats", pushes=self.pushes, hash_mismatches=self.hash_mismatches,
                      version=self.current.version if self.current else None,
                      sync_median_s=round(times[len(times) // 2], 4) if times else None)

    # ------------------------------------------------------------------------------ peers and hellos

    def on_peer_dead(self, peer: str) -> None:
        state = self.rollouts.get(peer)
        if state is not None:
            state.alive = False
            self.log.warning("rollout_dead", rollout=peer)
            self._member_changed(peer, "it is dead")

    def on_peer_alive(self, peer: str) -> None:
        state = self.rollouts.get(peer)
        if state is not None:
            state.alive = True
            self.log.info("rollout_alive", rollout=peer)
            self._kick.set()

    def on_peer_restarted(self, peer: str) -> None:
        """A rollout's new process is up, not yet ready (no hello): a group formed with it now would wait its
        whole link timeout for a member that cannot join. It is left out until its hello, as after ServerDown."""
        self._early_hellos.pop(peer, None)   # the old process's, not applied yet
        state = self.rollouts.get(peer)
        if state is None or not self._started.is_set():
            return
        state.hello = False
        self.log.warning("rollout_restarted", rollout=peer)
        self._member_changed(peer, "it restarted")

    @handles(RolloutHello)
    def on_hello(self, msg: RolloutHello, env: Any) -> None:
        if not self._started.is_set():
            self._early_hellos[env.sender] = msg
            return
        self._hello(env.sender, msg)

    def _hello(self, sender: str, hello: RolloutHello) -> None:
        state = self.rollouts.get(sender)
        if state is None:
            self.log.warning("hello_from_unknown", sender=sender, members=sorted(self.rollouts))
            return
        if state.hello and hello.incarnation and hello.incarnation == state.incarnation \
                and hello.version == state.version:
            return   # the same process saying hello again (it answers HelloRequest too): nothing changed
        # The same process at another version: its server restarted on its launch weights (a hello it sent while
        # the server was down still carried the old version), and it must be formed in and pushed to again.
        first = not state.hello
        version = hello.version
        state.hello, state.alive, state.incarnation = True, True, hello.incarnation
        state.hello_at = time.monotonic()
        self.policy.said_hello(sender)
        state.version, state.ack_ok, state.weight_ranks = version, False, hello.weight_ranks
        # Any hello after the link was formed comes from a (re)started member: it needs a new group.
        self._member_changed(sender, "it restarted")
        self.log.info("rollout_hello", rollout=sender, version=version, first=first,
                      current=self.current.version if self.current else None, reform=self.policy.need_reform)

    @handles(ServerDown)
    def on_server_down(self, msg: ServerDown, env: Any) -> None:
        """A rollout's server died: wait for its hello (sent once the server is back) before forming a group,
        rather than form one now that waits the link timeout for ranks that cannot join."""
        if not self._started.is_set():
            self._early_hellos.pop(env.sender, None)
            return
        state = self.rollouts.get(env.sender)
        if state is None:
            self.log.warning("server_down_from_unknown", sender=env.sender, members=sorted(self.rollouts))
            return
        state.hello = False
        self.log.warning("rollout_server_down", rollout=env.sender, restarts=msg.restarts)
        self._member_changed(env.sender, "its server died")

    def _member_changed(self, rollout: str, why: str) -> None:
        """A member died, restarted or lost its server: a formed group must be formed again, the running
        formation or push stops waiting for it, and the pusher looks again."""
        self.policy.member_changed()
        if self.fanout is not None:
            self.fanout.lost(rollout, why)
        self._kick.set()

    # ---------------------------------------------------------------------------- trainer -> storage

    @handles(WeightsPublished)
    async def on_published(self, msg: WeightsPublished) -> WeightsStored:
        await self._started.wait()
        assert self.fanout is not None
        accepted = await self.fanout.accept(msg, self.current.version if self.current is not None else None)
        if accepted.stored is not None:
            self._offer(accepted.stored, accepted.answer.receive_seconds)
        elif accepted.storing is not None:   # hashed and packed after the answer, off the trainer's step
            task = self.spawn(self._store(accepted.storing, accepted.answer.receive_seconds),
                              name=f"store-v{msg.version}")
            self._storing.add(task)
            task.add_done_callback(self._storing.discard)
        return accepted.answer

    async def _store(self, storing: Coroutine[Any, Any, StoredVersion], receive_s: float) -> None:
        self._offer(await storing, receive_s)

    def _offer(self, stored: StoredVersion, receive_s: float) -> None:
        """A version was taken: the rollouts are brought to it unless it is no newer than the current."""
        current = self.current.version if self.current is not None else None
        if not self.policy.takes(stored.version, current):
            self.log.warning("stale_version_ignored", version=stored.version, current=current)
            return
        self.current = stored
        self.counters["versions_stored"] += 1
        assert self.eval_store is not None
        self.eval_store.keep(stored)
        self._kick.set()
        self.log.info("weights_stored", version=stored.version, buckets=stored.n_buckets, nbytes=stored.nbytes,
                      receive_s=round(receive_s, 4))

    # ---------------------------------------------------------------------------- storage -> rollouts

    def _ready(self) -> list[str]:
        """The rollouts an epoch is formed of now: said hello, alive, and not on probation."""
        return self.policy.ready(time.monotonic())

    def failed_with(self, members: list[str], started: float | None = None) -> None:
        """A formation or push failed: members back from a hang are left out for a while (`PushPolicy.
        failed_with`), so that they cannot keep the others from their weights; their next hello lets them in."""
        for name, period in self.policy.failed_with(members, time.monotonic(), started):
            asyncio.get_running_loop().call_later(period, self._kick.set)
            self.counters["rollouts_on_probation"] += 1
            self.log.warning("rollout_on_probation", rollout=name, seconds=round(period, 1),
                             hint="a formation or push failed with it just back; the others go on without it")

    async def _pusher(self) -> None:
        failures = 0
        while True:
            if failures:
                # Back off after a failed formation or push, but wake early on a hello or a death.
                try:
                    await asyncio.wait_for(self._kick.wait(), self.retry_s)
                except TimeoutError:
                    pass
            else:
                await self._kick.wait()
            self._kick.clear()
            current = self.current
            assert current is not None
            action = self.policy.next_action(time.monotonic(), current.version, self.fanout.busy)
            if isinstance(action, Wait):
                if (action.no_hello, action.dead) != self._waiting_logged:
                    self._waiting_logged = (action.no_hello, action.dead)
                    self.log.info("waiting_for_rollouts", no_hello=action.no_hello, dead=action.dead)
                failures = 0
                continue
            if isinstance(action, Form):
                if not await self._form(action.members):
                    failures += 1
                    continue
                current = self.current   # a newer version may have been stored while it formed
                assert current is not None
                action = self.policy.push_or_idle(current.version, self.fanout.busy)
            if isinstance(action, Idle):
                failures = 0
                continue
            assert isinstance(action, Push)
            if await self._push(current, action.members):
                failures = 0
            else:
                failures += 1
            self._kick.set()  # look again: a newer version may have arrived meanwhile (coalesced)

    async def _form(self, members: list[str]) -> bool:
        assert self.fanout is not None
        epoch = self.policy.begin_formation()
        started = time.monotonic()
        formation = await self.fanout.form(epoch, members, {n: self.rollouts[n].weight_ranks for n in members})
        if formation.error:
            self.counters["link_form_failures"] += 1
            self.log.error("rollout_link_form_failed", epoch=epoch, error=formation.error, retry_in_s=self.retry_s)
            if formation.members_failed:
                self.failed_with(members, started=started)
            return False
        self.policy.formation_done(epoch, members)
        self.counters["link_formations"] += 1
        left_out = [n for n in self.rollouts if n not in members]
        if left_out:
            self.counters["formations_without_some"] += 1
        self.log.info("rollout_link_formed", epoch=epoch, members=len(members) + 1, left_out=left_out,
                      seconds=round(time.monotonic() - started, 3), **formation.info)
        await self._notify()
        return True

    async def _push(self, stored: StoredVersion, members: list[str]) -> bool:
        """Have the fanout move ``stored`` to ``members`` of the formed epoch; each ack is recorded as it comes.
        Whether every member acked it correctly."""
        assert self.fanout is not None and self.epoch is not None
        epoch, started = self.epoch, time.monotonic()
        summary: dict[str, dict[str, Any]] = {}
        transfer = self.fanout.push(stored, epoch, members)
        for name, ack in transfer.acks.items():
            ack.add_done_callback(functools.partial(self._acked, name, stored, summary, transfer.lanes))
        end = await transfer.end
        members = list(transfer.acks)
        if end.failed:
            self.policy.need_reform = True   # the group is formed again before the next push
            self.failed_with(members, started=started)
            self.counters["push_failures"] += 1
            self.log.error("weights_push_failed", version=stored.version, epoch=epoch, error=end.failed,
                           acked=sorted(summary))
            return False
        summary.update({name: {"error": reason[:200]} for name, reason in end.errors.items()})
        ok = all(summary.get(name, {}).get("ack_ok") for name in members)
        self.pushes += 1
        self.sync_seconds.append(end.sync_s)
        if ok:
            self.policy.pushed_ok(members)
        elif any(not r.get("error", "").startswith("late") for r in summary.values() if "error" in r):
            self.failed_with(members)
        self.log.info("weights_pushed", version=stored.version, epoch=epoch, buckets=stored.n_buckets,
                      nbytes=stored.nbytes, broadcast_s=round(end.sent_s, 4), sync_s=round(end.sync_s, 4),
                      rollouts=summary)
        self._notify_soon()
        return ok

    def _acked(self, name: str, stored: StoredVersion, summary: dict[str, dict[str, Any]], lane: bool,
               ack: "asyncio.Future[WeightsAck]") -> None:
        """A member's ack (or its failure) came, during the push or, from a late lane, after it."""
        if not ack.cancelled() and ack.exception() is None:
            self._record_ack(name, ack.result(), stored, summary)
        if lane:   # a lane of its own ended: a failed one left its side of the group broken
            if not ack.cancelled() and ack.exception() is not None:
                self.policy.need_reform = True
            self._kick.set()

    def _record_ack(self, name: str, ack: WeightsAck, stored: StoredVersion,
                    summary: dict[str, dict[str, Any]]) -> None:
        state = self.rollouts[name]
        state.version, state.weights_hash, state.verified = ack.version, ack.weights_hash, ack.verified
        state.receive_seconds, state.stall_seconds = ack.receive_seconds, ack.stall_seconds
        # A server that cannot read its weights back (SGLang) acks the version it reports after loading every
        # bucket, and with no hash from the trainer (it hashes only where a receiver checks one) a version
        # check is all there is to do.
        state.ack_ok = ack.version == stored.version and (
            ack.verified == "version" or not stored.weights_hash or ack.weights_hash == stored.weights_hash)
        if not state.ack_ok:
            self.hash_mismatches += 1
            self.counters["hash_mismatches"] += 1
            self.log.error("ROLLOUT_WEIGHTS_HASH_MISMATCH", rollout=name, version=stored.version,
                           acked_version=ack.version, expected=stored.weights_hash, got=ack.weights_hash)
        summary[name] = {"recv_s": round(ack.receive_seconds, 4), "stall_s": round(ack.stall_seconds, 4),
                         "ack_ok": state.ack_ok, "verified": ack.verified}

    def _notify_soon(self) -> None:
        self.spawn(self._notify(), name="notify", critical=False)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ---------------------------------------------------------------------------------------- status

    def _status(self, req: WeightsStatusRequest) -> WeightsStatus:
        current = self.current
        assert current is not None
        epoch = self.epoch if self.epoch is not None else -1
        # A rollout still at the start version has had nothing pushed, so there is no ack hash to check.
        reached = (epoch >= req.min_epoch
                   and all(s.hello and s.alive and s.version >= req.min_version
                           and (s.ack_ok or s.version <= self.start_version) for s in self.rollouts.values()))
        return WeightsStatus(version=current.version, weights_hash=current.weights_hash, epoch=epoch,
                             rollouts={n: dataclasses.replace(s) for n, s in self.rollouts.items()},
                             pushes=self.pushes, hash_mismatches=self.hash_mismatches,
                             last_sync_seconds=self.sync_seconds[-1] if self.sync_seconds else 0.0,
                             reached=reached if req.min_version >= 0 else True)

    @handles(WeightsStatusRequest)
    async def on_status(self, msg: WeightsStatusRequest) -> WeightsStatus:
        await self._started.wait()
        # A published version still being hashed and packed is answered for once stored (milliseconds): the
        # answer then depends on the messages received, not on how fast the hashing thread ran, so a replay
        # of the log gives the same answer.
        if self._storing:
            await asyncio.wait(set(self._storing), timeout=30.0)
        if msg.min_version < 0 or msg.timeout_s <= 0:
            return self._status(msg)
        try:
            async with asyncio.timeout(msg.timeout_s):
                async with self._changed:
                    await self._changed.wait_for(lambda: self._status(msg).reached)
        except TimeoutError:
            pass
        return self._status(msg)

    # ------------------------------------------------------------------------------ the evaluator

    async def on_drain(self) -> None:
        if self.eval_store is not None:
            self.eval_store.close()

    @handles(EvalWeightsRequest)
    async def on_eval_weights(self, msg: EvalWeightsRequest) -> EvalWeights:
        await self._started.wait()
        assert self.eval_store is not None
        return await self.eval_store.serve(msg, lambda: self.current.version if self.current is not None else -1)

    @handles(RunFinished)
    def on_run_finished(self, msg: RunFinished) -> None:
        self.request_stop(f"run finished at step {msg.step}: {msg.reason}")
