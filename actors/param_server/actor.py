"""ParamServerActor: takes each new weight version from the trainer and brings every rollout up to it.

It coordinates; its *fanout* (actors/weight_sync, picked once at start from the links) moves the bytes.
A :class:`WeightsPublished` from the trainer goes to the fanout, which takes the version (the relay
receives and stores its buckets; with direct weights only their description is kept) and offers it here
(``offer``): it becomes the version every rollout is brought to, unless a newer one got there first.

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

Evaluation during the run (``eval.every_versions`` N > 0): every stored version that is a multiple of N
(the start version included) is also kept for the evaluator (``actors/evaluator/actor.py``), which asks for it
bucket by bucket with :class:`EvalWeightsRequest` on the bus, at its own pace: nothing here waits for it,
and a newer multiple replaces a kept one it has not fetched yet. Relay mode only (with direct weights
this server holds no weights).

Settings (all optional): ``train_link`` (default "train_to_ps"), ``rollout_link`` (default
"ps_to_rollout"), ``ack_timeout_s`` (default 120), ``retry_s`` (default 2), ``probation_s`` (default 30: how
long a rollout back from a hang is first left out if the transfer fails with it), ``bucket_bytes`` for the start
weights (default 64 MiB), ``model.dtype`` (the dtype the start weights are held in, as the rollouts load them).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import torch

from actors.runtime.base import Actor, ActorSpec, handles
from actors.param_server.push_policy import Form, Idle, Push, PushPolicy, Wait
from actors.weight_sync import Fanout, StoredVersion, make_fanout
from topology.settings import ParamServerSettings
from transport.bulk import BulkError
from transport.bus import BusError
from transport.protocol import (EvalWeights, EvalWeightsRequest, HelloRequest, LinkReform, RolloutHello,
                                RolloutWeights, RunFinished, ServerDown, WeightsPublished, WeightsStatus,
                                WeightsStatusRequest, WeightsStored)

__all__ = ["ParamServerActor", "kept_for_eval"]


def kept_for_eval(version: int, every: int) -> bool:
    """Whether a version is one the evaluator evaluates: a multiple of ``eval.every_versions`` (0: off)."""
    return every > 0 and version % every == 0


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
        self._busy_with: set[str] = set()       # the rollouts the running formation or push waits on
        self._lost = asyncio.Event()            # one of them was lost: abandon it
        self.pushes = 0
        self.hash_mismatches = 0
        self.sync_seconds: list[float] = []
        self._kick = asyncio.Event()
        self._changed = asyncio.Condition()
        self._waiting_logged: tuple = ()
        self._form_started = 0.0   # time.monotonic() of the running formation's start
        # Hellos can arrive while on_start still loads the start weights; they are applied once it is done.
        self._started = asyncio.Event()
        self._early_hellos: dict[str, RolloutHello] = {}
        self.eval_every = 0
        self.eval_kept: StoredVersion | None = None   # the newest version kept for the evaluator
        self._eval_changed = asyncio.Condition()
        self._eval_closing = False                   # stopping: an evaluator's waiting request returns at once

    # The policy's state, under the names the fanouts (actors/weight_sync) and the tests use.
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
        self.ack_timeout = self.cfg.ack_timeout_s
        self.retry_s = self.cfg.retry_s
        self.policy.probation_s = self.cfg.probation_s
        self.late_s = self.cfg.late_s
        self.eval_every = self.cfg.eval.every_versions
        self.fanout = make_fanout(self.cfg, self, self.make_link, self.run_dir)
        self.rollouts = {m: RolloutWeights() for m in self.fanout.rollouts}
        t0 = time.monotonic()
        self.current = await self.fanout.start_weights()
        self.start_version = self.current.version
        self._keep_for_eval(self.current)
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
        if rollout in self._busy_with:
            self._lost.set()
        if self.fanout is not None:
            self.fanout.lost(rollout, why)
        self._kick.set()

    # ---------------------------------------------------------------------------- trainer -> storage

    @handles(WeightsPublished)
    async def on_published(self, msg: WeightsPublished) -> WeightsStored:
        await self._started.wait()
        assert self.fanout is not None
        return await self.fanout.accept(msg)

    def offer(self, stored: StoredVersion) -> bool:
        """The fanout took a version: the rollouts are brought to it unless it is no newer than the current."""
        if not self.policy.takes(stored.version, self.current.version if self.current is not None else None):
            return False
        self.current = stored
        self.counters["versions_stored"] += 1
        self._keep_for_eval(stored)
        self._kick.set()
        return True

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

    async def unless_lost(self, members: list[str], work: "asyncio.Future[Any]", what: str) -> Any:
        """Await ``work`` (a formation or transfer in a thread) unless one of ``members`` is lost first; then
        abandon it with a BulkError (the thread ends on its own epoch, which nothing uses again)."""
        self._busy_with, lost = set(members), asyncio.ensure_future(self._lost.wait())
        self._lost.clear()
        if any(not (self.rollouts[n].alive and self.rollouts[n].hello) for n in members):
            self._lost.set()   # lost before it started
        try:
            await asyncio.wait({work, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            self._busy_with = set()
        if work.done():
            return work.result()
        work.cancel()
        work.add_done_callback(lambda f: f.cancelled() or f.exception())   # its late error is expected
        gone = sorted(n for n in members if not (self.rollouts[n].alive and self.rollouts[n].hello))
        self.counters["transfers_abandoned"] += 1
        raise BulkError(f"{what} abandoned: {', '.join(gone) or 'a member'} was lost while it ran")

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
            if await self.fanout.push(current, self.epoch, action.members):
                failures = 0
            else:
                failures += 1
            self._kick.set()  # look again: a newer version may have arrived meanwhile (coalesced)

    async def _form(self, members: list[str]) -> bool:
        assert self.fanout is not None
        epoch = self.policy.begin_formation()
        self._form_started = time.monotonic()
        info = await self.fanout.form(epoch, members)
        if info is None:
            return False
        self._formed(epoch, members, self._form_started, **info)
        await self._notify()
        return True

    async def send_link_reform(self, rollout: str, epoch: int, members: list[str]) -> None:
        """Tell a rollout to join ``epoch`` of the link, formed by ``members`` (the link's master first)."""
        await self.bus.send(rollout, LinkReform(epoch=epoch, members=members))

    async def await_formation(self, members: list[str], work: "asyncio.Future[Any]", epoch: int) -> bool:
        """Await a formation (the fanout's ``work``) unless one of ``members`` is lost first; a failure is
        logged and counted, and puts members back from a hang on probation."""
        try:
            await self.unless_lost(members, work, f"forming epoch {epoch}")
        except (BulkError, BusError, TimeoutError) as exc:
            self.counters["link_form_failures"] += 1
            self.log.error("rollout_link_form_failed", epoch=epoch, error=str(exc),
                           retry_in_s=self.retry_s)
            self.failed_with(members, started=self._form_started)
            return False
        return True

    def kick(self) -> None:
        """Have the pusher look again (a transfer ended)."""
        self._kick.set()

    def link_broken(self) -> None:
        """A transfer failed on the formed epoch: the next push forms the group again first."""
        self.policy.need_reform = True

    def weight_ranks(self, rollout: str) -> int:
        """How many ranks ``rollout``'s server joins a weights group with (its hello said; 0: the actor)."""
        return self.rollouts[rollout].weight_ranks

    def _formed(self, epoch: int, members: list[str], t0: float, **info: Any) -> None:
        self.policy.formation_done(epoch, members)
        self.counters["link_formations"] += 1
        left_out = [n for n in self.rollouts if n not in members]
        if left_out:
            self.counters["formations_without_some"] += 1
        self.log.info("rollout_link_formed", epoch=epoch, members=len(members) + 1, left_out=left_out,
                      seconds=round(time.monotonic() - t0, 3), **info)

    def pushed(self, stored: StoredVersion, epoch: int, members: list[str], summary: dict[str, dict[str, Any]],
                sent_s: float, sync_s: float) -> bool:
        ok = all(summary.get(name, {}).get("ack_ok") for name in members)
        self.pushes += 1
        self.sync_seconds.append(sync_s)
        if ok:
            self.policy.pushed_ok(members)
        elif any(not r.get("error", "").startswith("late") for r in summary.values() if "error" in r):
            self.failed_with(members)
        self.log.info("weights_pushed", version=stored.version, epoch=epoch, buckets=stored.n_buckets,
                      nbytes=stored.nbytes, broadcast_s=round(sent_s, 4), sync_s=round(sync_s, 4), rollouts=summary)
        self._notify_soon()
        return ok

    def record_ack(self, name: str, ack: Any, stored: StoredVersion, summary: dict[str, dict[str, Any]]) -> None:
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
        assert self.fanout is not None
        await self.fanout.settled()
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

    def _keep_for_eval(self, stored: StoredVersion) -> None:
        """Keep a stored version for the evaluator (a reference: stored buckets are never changed)."""
        if kept_for_eval(stored.version, self.eval_every) and stored.packed:
            self.eval_kept = stored
            self.spawn(self._notify_eval(), name=f"eval-kept-v{stored.version}")

    async def _notify_eval(self) -> None:
        async with self._eval_changed:
            self._eval_changed.notify_all()

    async def on_drain(self) -> None:
        # A request waiting for the next kept version would hold the drain for up to its timeout_s.
        self._eval_closing = True
        await self._notify_eval()

    @handles(EvalWeightsRequest)
    async def on_eval_weights(self, msg: EvalWeightsRequest) -> EvalWeights:
        await self._started.wait()
        newest = self.current.version if self.current is not None else -1
        if self.fanout is not None and not self.fanout.holds_weights:
            return EvalWeights(version=-1, newest=newest, weights_hash="", n_buckets=0, bucket=msg.bucket, header={},
                               flat=torch.empty(0, dtype=torch.uint8),
                               unavailable="evaluation during the run needs the relay through the parameter "
                                           "server: with direct weights it holds none")
        if self.eval_every <= 0:
            return EvalWeights(version=-1, newest=newest, weights_hash="", n_buckets=0, bucket=msg.bucket, header={},
                               flat=torch.empty(0, dtype=torch.uint8),
                               unavailable="eval.every_versions is 0 in the parameter server's settings")

        def wanted() -> StoredVersion | None:
            kept = self.eval_kept
            if kept is None:
                return None
            if msg.version >= 0:
                return kept if kept.version == msg.version else None
            return kept if kept.version > msg.after else None

        if msg.version < 0 and wanted() is None and msg.timeout_s > 0:
            try:
                async with asyncio.timeout(msg.timeout_s):
                    async with self._eval_changed:
                        await self._eval_changed.wait_for(lambda: wanted() is not None or self._eval_closing)
            except TimeoutError:
                pass
        kept = wanted()
        newest = self.current.version if self.current is not None else -1
        if kept is None or not 0 <= msg.bucket < len(kept.packed):
            return EvalWeights(version=-1, newest=newest, weights_hash="", n_buckets=0, bucket=msg.bucket,
                               header={}, flat=torch.empty(0, dtype=torch.uint8))
        packed = kept.packed[msg.bucket]
        self.counters["eval_buckets_sent"] += 1
        return EvalWeights(version=kept.version, newest=newest, weights_hash=kept.weights_hash,
                           n_buckets=len(kept.packed), bucket=msg.bucket, header=packed.header, flat=packed.flat)

    @handles(RunFinished)
    def on_run_finished(self, msg: RunFinished) -> None:
        self.request_stop(f"run finished at step {msg.step}: {msg.reason}")
