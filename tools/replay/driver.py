"""Driving a replay: a fresh actor built from the spec in the log, fed the recorded inbound messages and
replies in log order, each once it has sent what the original had sent before it; then the comparison."""
from __future__ import annotations

import asyncio
import concurrent.futures
import tempfile
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topology import TopologyError, apply_overrides, parse_override
from topology.experiment import switched_loss
from topology.settings import SettingsError
from transport.bus import MAX_INFLIGHT, Envelope, current_cause
from transport.messages import Message, decode, decode_header
from transport.msglog import LogRecord, read_log

from .compare import BULK_HEADER, Divergence, differs_so_far, expected_key, first_divergence
from .doubles import LinkGate, ReplayBus, ReplayError, ReplayLink, TransferNeverEnded, Work, counted
from .metrics import read_metrics

__all__ = ["ReplayResult", "replay_into"]


@dataclass
class ReplayResult:
    fed: int = 0
    sent: int = 0
    compared: bool = False
    divergence: Divergence | None = None
    notes: list[str] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)   # what the replayed actor wrote to metrics.jsonl


def load_segment(path: str, segment: int) -> tuple[dict, list[LogRecord], str | None]:
    records, torn = read_log(path)
    metas = [r for r in records if r.kind == "meta"]
    if segment >= len(metas):
        raise ReplayError(f"{path} has {len(metas)} segment(s); segment {segment} does not exist")
    return metas[segment].meta, [r for r in records if r.kind != "meta" and r.segment == segment], torn


async def caught_up(bus: ReplayBus, streams: list[tuple], done: list[int], upto: int, idle_timeout: float) -> bool:
    """Wait until the actor has sent what the original had sent before a record: for each of the first
    ``upto`` outbound records (``streams``: its (cause, peer) and its place there), as many messages on that
    stream. False once the actor sent nothing for ``idle_timeout`` s. ``done``: how far it got, kept between
    calls (what was sent stays sent)."""
    while done[0] < upto:
        stream, k = streams[done[0]]
        if bus.stream_counts[stream] > k:
            done[0] += 1
            continue
        bus.progress.clear()
        try:
            await asyncio.wait_for(bus.progress.wait(), idle_timeout)
        except TimeoutError:
            return False
    return True


async def settle(work: Work, idle_timeout: float) -> bool:
    """Let work the actor has handed to threads finish and its continuations run; False if it is still
    busy after ``idle_timeout`` s. Nothing to do (no work in threads) costs no yield, so messages that
    arrived together are still handled together."""
    try:
        async with asyncio.timeout(idle_timeout):
            while work.in_hand > 0:
                while work.in_hand > 0:
                    work.changed.clear()
                    await work.changed.wait()
                for _ in range(8):   # the awaiting coroutines resume, and may hand over more work
                    await asyncio.sleep(0)
    except TimeoutError:
        return False
    return True


def quiet_after_the_replay(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The replay's event loop's exception handler: a transfer failed once the replay was over is nobody's
    concern (the task that awaited it was cancelled, nothing is compared any more); the rest as usual."""
    if not isinstance(context.get("exception"), TransferNeverEnded):
        loop.default_exception_handler(context)


class Deliverer:
    """Delivers messages as the Bus does: the handler is called on receipt (a plain ``def`` runs there and
    then), a coroutine handler is started as a task once fewer than ``max_inflight`` run (the Bus stops
    reading meanwhile, so the log already holds the later messages after it), its reply sent when it ends."""

    def __init__(self, actor: Any, bus: ReplayBus, result: ReplayResult, max_inflight: int) -> None:
        self.actor, self.bus, self.result, self.max_inflight = actor, bus, result, max_inflight
        self.waiting: deque[tuple[Envelope, Any]] = deque()

    def deliver(self, env: Envelope) -> None:
        token = current_cause.set(env.header.id)
        try:
            out = self.actor.dispatch(env)
        except Exception as exc:   # the Bus logs it and goes on; so does the replay, noting it
            self.result.notes.append(f"handler of {env.header.kind} failed: {exc!r}")
            return
        finally:
            current_cause.reset(token)
        if asyncio.iscoroutine(out):
            self.waiting.append((env, out))
            self._pump()
        elif isinstance(out, Message):
            env.reply(out)

    def _pump(self) -> None:
        while self.waiting and self.bus.inflight < self.max_inflight:
            env, coro = self.waiting.popleft()
            token = current_cause.set(env.header.id)
            try:
                task = asyncio.get_running_loop().create_task(coro)
            finally:
                current_cause.reset(token)
            self.bus._handler_tasks.add(task)
            task.add_done_callback(lambda t, env=env: self._done(env, t))

    def _done(self, env: Envelope, t: asyncio.Task) -> None:
        self.bus._handler_tasks.discard(t)
        if not t.cancelled():
            if t.exception() is not None:
                self.result.notes.append(f"handler of {env.header.kind} failed: {t.exception()!r}")
            elif isinstance(t.result(), Message):
                env.reply(t.result())
        self._pump()

    def close(self) -> None:
        for _, coro in self.waiting:
            coro.close()
        self.waiting.clear()


@dataclass
class Recording:
    """One segment of a message log, laid out for the driver: the original's inbound messages, the replies it
    received, what it sent (per cause, in order), and the schedule of everything that happened to it."""

    meta: dict
    outbound_recorded: bool
    # each inbound message (not a reply), its header, and how many messages the original had sent before it
    inbound: list[tuple[LogRecord, Any, int]] = field(default_factory=list)
    # inbound messages, replies, heartbeat events and the ends of link transfers, in log order
    schedule: list[tuple[LogRecord, Any, int]] = field(default_factory=list)
    originals: dict[str | None, list[tuple]] = field(default_factory=lambda: defaultdict(list))   # cause -> sent
    streams: list[tuple] = field(default_factory=list)   # each outbound record's (cause, peer) and its place there
    n_out: int = 0
    buckets: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))   # link -> buckets received
    replies: dict[tuple, list] = field(default_factory=dict)     # (cause, n-th request of that cause) -> frames
    reply_key: dict[str, tuple] = field(default_factory=dict)    # the original's request id -> (cause, n)
    stop_at: LogRecord | None = None   # where the original began to stop (a signal, or a handler asked)

    @property
    def stop_index(self) -> int | None:
        """The log record where the original began to stop; what it sent from there on is not compared."""
        return self.stop_at.index if self.stop_at is not None else None


def read_recording(path: str, segment: int, result: ReplayResult) -> Recording:
    """The original's requests in order per cause, the replies it received (by the request's id), and for
    every inbound message how many outbound ones the original had sent before it arrived: the replay
    delivers it only once the actor has caught up that far, so background work (a dispatch loop, a handler
    still waiting) interleaves with the inbound messages as it did in the original."""
    meta, records, torn = load_segment(path, segment)
    if torn:
        result.notes.append(f"{torn} (skipped)")
    if "spec" not in meta:
        raise ReplayError(f"{path}: segment {segment} has no actor spec (not written by an Actor)")
    recording = Recording(meta, bool(meta.get("outbound")))
    replies_by_id = {}
    original_requests: dict[str | None, list[str]] = defaultdict(list)
    stream_len: dict[tuple, int] = defaultdict(int)
    for rec in records:
        if rec.rejected:
            continue
        if rec.kind == "event" and rec.event == "stopping":
            recording.stop_at = recording.stop_at or rec
            continue
        if rec.kind == "event" or rec.kind.startswith("bulk_"):
            # a verdict on a peer, or a link transfer that ended here (the stand-in link's ends here too)
            recording.schedule.append((rec, None, recording.n_out))
        if rec.kind in ("event", "bulk_formed"):
            continue
        if rec.kind == "bulk_in":
            if not rec.tensors_stored:
                raise ReplayError(f"{path}: bucket record {rec.index} has a checksum only; replay needs tensors='store'")
            recording.buckets[rec.peer.split("#")[0]].append(rec.frames)
            continue
        header = BULK_HEADER if rec.kind == "bulk_out" else decode_header(rec.frames)[0]
        if rec.kind == "in":
            if header.reply_to is not None:
                replies_by_id[header.reply_to] = rec
            else:
                recording.inbound.append((rec, header, recording.n_out))
            recording.schedule.append((rec, header, recording.n_out))
        else:
            recording.n_out += 1
            stream = (rec.cause, rec.peer)
            recording.streams.append((stream, stream_len[stream]))
            stream_len[stream] += 1
            recording.originals[rec.cause].append((rec, header))
            if header.wants_reply:
                original_requests[rec.cause].append(header.id)
    for cause, ids in original_requests.items():
        for n, mid in enumerate(ids):
            recording.reply_key[mid] = (cause, n)
            if mid in replies_by_id:
                rec = replies_by_id[mid]
                if not rec.tensors_stored:
                    raise ReplayError(f"{path}: reply record {rec.index} has tensor checksums only; "
                                      f"replay needs tensors='store'")
                recording.replies[(cause, n)] = rec.frames
    return recording


def fresh_actor(recording: Recording, cls_path: str, run_dir: str, overrides: Sequence[str]) -> Any:
    """A fresh ``cls_path`` actor from the spec in the log: run_dir replaced, message logging and console
    logging off, ``overrides`` applied to its settings."""
    from actors.runtime.base import ActorSpec, load_actor_class

    spec_dict = dict(recording.meta["spec"])
    settings = {k: v for k, v in (spec_dict.get("settings") or {}).items() if k != "message_log"}
    settings["log_console"] = False
    plain = [o.removeprefix("experiment.") for o in overrides]
    try:
        problems = apply_overrides(settings, plain)
        keys = {".".join(parse_override(o)[0]) for o in plain}
    except TopologyError as exc:
        raise ReplayError("; ".join(exc.problems)) from None
    if problems:
        raise ReplayError("; ".join(problems))
    if "algo.loss" in keys and isinstance(settings.get("algo"), dict):
        # Replaying into another loss: the recorded values of what that loss fixes give way to its own.
        settings["algo"] = switched_loss(settings["algo"], {k.removeprefix("algo.") for k in keys})
    spec_dict.update(cls=cls_path, run_dir=run_dir, settings=settings, curve=None, tokens=None)
    spec = ActorSpec.from_dict(spec_dict)
    _apply_threads(spec.env)
    try:
        return load_actor_class(cls_path)(spec)
    except SettingsError as exc:   # settings the overrides made invalid: a usage error, said in one line
        raise ReplayError(str(exc)) from None


async def _replay(path: str, cls_path: str, segment: int, idle_timeout: float = 60.0,
                  overrides: Sequence[str] = (), float_tol: float = 0.0,
                  to_end: bool = False) -> ReplayResult:
    from actors.runtime.threads import DaemonThreads, run_blocking_on

    result = ReplayResult()
    recording = read_recording(path, segment, result)
    with tempfile.TemporaryDirectory(prefix="replay-") as run_dir:
        actor = fresh_actor(recording, cls_path, run_dir, overrides)
        bus = ReplayBus(actor.name, recording.replies, actor.spec.peers)
        actor.bus = bus
        loop = asyncio.get_running_loop()
        work = Work(loop)
        gate = LinkGate(work, formations=bool(recording.meta.get("link_formations")))
        actor.make_link = lambda config: ReplayLink(config, recording.buckets, bus, gate)
        # request_stop() works as in a run: a handler that ends the actor (RunFinished) gets its drain.
        actor._stop_event, actor._force_event = asyncio.Event(), asyncio.Event()
        deliverer = Deliverer(actor, bus, result, actor.cfg.bus.max_inflight or MAX_INFLIGHT)
        # Its work on threads is counted where it runs: the default executor, and the executor this loop runs
        # actors.runtime.threads.in_thread calls on.
        loop.set_default_executor(counted(concurrent.futures.ThreadPoolExecutor)(
            work, max_workers=4, thread_name_prefix="replay-work"))
        run_blocking_on(loop, counted(DaemonThreads)(work))
        loop.set_exception_handler(quiet_after_the_replay)
        started = stopped = stopped_early = False
        try:
            await actor.start()
            started = True
            await actor.on_ready()
            stopped_early = await _deliver(recording, actor, bus, gate, work, deliverer, result, path, idle_timeout,
                                           float_tol, to_end)
            if not stopped_early and actor._stop_event.is_set():
                async with asyncio.timeout(idle_timeout):
                    await actor._drain()
                    await actor.on_stop()
                stopped = True
            result.metrics = read_metrics(Path(run_dir) / "metrics.jsonl")
        finally:
            deliverer.close()
            for t in [*actor._background, *bus._handler_tasks]:
                t.cancel()
            await asyncio.gather(*actor._background, *bus._handler_tasks, return_exceptions=True)
            if started and not stopped:
                # Its worker pools, threads and links still need closing; what it sends now is not compared.
                bus.frozen = True
                try:
                    async with asyncio.timeout(idle_timeout):
                        await actor.on_stop()
                except Exception as exc:
                    result.notes.append(f"on_stop after the replay failed: {exc!r}")
            # Transfers the original never finished still wait on the stand-in links: they fail now (what the
            # actor makes of that is not compared), and their threads end before the loop does.
            bus.frozen = True
            gate.close()
            await settle(work, idle_timeout)
            run_blocking_on(loop, None)
    result.sent = bus.count
    if actor.exit_code:    # a critical background task failed (Actor.spawn): say why, not just "nothing"
        result.notes.append(f"the replayed actor stopped with exit code {actor.exit_code}: {actor._stop_reason}")
    if not recording.outbound_recorded:
        result.notes.append("the log has no outbound records (message_log.outbound was off): nothing to compare")
        return result
    _compare(recording, bus, result, stopped_early, float_tol)
    return result


async def _deliver(recording: Recording, actor: Any, bus: ReplayBus, gate: LinkGate, work: Work, deliverer: Deliverer,
                   result: ReplayResult, path: str, idle_timeout: float, float_tol: float, to_end: bool) -> bool:
    """Feed the actor the recording's schedule, each record once the actor has caught up to it; whether the
    replay stopped early (a divergence already, or the actor stalled: a note says where)."""
    # What the original sent once it began to stop is not compared (_compare), so it cannot end the replay
    # early either: the replay would then stop before sending what the original had answered earlier.
    stop_index = recording.stop_index
    expected_keys: dict[tuple, list] = defaultdict(list)
    for cause, recs in recording.originals.items():
        for e in recs:
            if stop_index is None or e[0].index < stop_index:
                expected_keys[(cause, e[0].peer)].append(expected_key(e))
    checked, caught = [0], [0]
    streams = recording.streams
    stalled = None
    for rec, header, before in recording.schedule:
        # A pair that already differs is the answer: no need to wait for what can no longer match.
        if recording.outbound_recorded and not to_end and differs_so_far(bus, expected_keys, checked, float_tol):
            return True
        if rec.kind != "event" and not rec.tensors_stored:
            raise ReplayError(f"{path}: record {rec.index} kept tensor checksums only; replay needs tensors='store'")
        if not await caught_up(bus, streams, caught, before, idle_timeout):
            stalled = (rec, before)
            break
        if not await settle(work, idle_timeout):
            stalled = (rec, before)
            break
        if rec.kind.startswith("bulk_"):    # the original's transfer ended here
            gate.release(rec)
            continue
        if rec.kind == "event":            # the original's bus declared a peer dead, alive or restarted here
            if rec.event == "peer_restarted":
                actor.on_peer_restarted(rec.peer)
                continue
            bus.alive[rec.peer] = rec.event == "peer_alive"
            (actor.on_peer_alive if bus.alive[rec.peer] else actor.on_peer_dead)(rec.peer)
            continue
        if header.reply_to is not None:    # a reply to one of the actor's requests
            if header.reply_to in recording.reply_key:
                bus.release(recording.reply_key[header.reply_to])
            continue
        header, msg = decode(rec.frames)
        deliverer.deliver(Envelope(header, msg, rec.frames, None, bus))
        # No yield here: the next message follows at once unless the original sent something in
        # between (then caught_up waits for it), as messages that arrived together are handled
        # together by the Bus before any handler task runs.
        result.fed += 1
    if stalled is None and not await caught_up(bus, streams, caught, recording.n_out, idle_timeout):
        stalled = (None, recording.n_out)
    if stalled is None:
        return False
    rec, count = stalled
    where = f"before log record {rec.index}" if rec is not None else "by the end of the log"
    (cause, peer), k = streams[caught[0]]
    result.notes.append(f"the original had sent {count} messages {where}; the replay never sent "
                        f"message #{k} to {peer} caused by {cause or 'startup/background work'} "
                        f"(it sent {bus.count} in all, then nothing for {idle_timeout:g} s)")
    return True


def _compare(recording: Recording, bus: ReplayBus, result: ReplayResult, stopped_early: bool, float_tol: float) -> None:
    """The first divergence between what the replay sent and what the original did, and the notes on what
    is left out of the comparison."""
    inbound, originals = recording.inbound, recording.originals
    result.compared = True
    # What the original received after the last message it answered, and never answered, it received as it
    # stopped (the run ended): the log cannot say what it would have sent, so the replay's answers to those
    # are not compared.
    answered = [pos for pos, (_, h, _) in enumerate(inbound) if h.id in originals]
    tail = inbound[answered[-1] + 1:] if answered else []
    unanswered = {h.id for _, h, _ in tail}
    if extra := sum(len(bus.sent.get(cause, [])) for cause in unanswered):
        result.notes.append(f"the original answered none of the last {len(tail)} inbound messages (it stopped "
                            f"first); the replay's {extra} message(s) answering them are not compared")
    stop_index = recording.stop_index
    if stop_index is not None and (late := sum(r.index > stop_index for sent in originals.values() for r, _ in sent)):
        result.notes.append(f"the original began to stop at log record {stop_index}: the {late} message(s) it "
                            f"sent from then on (as it drained) are not compared")
    # Stopped early, the replay lacks what it never got to send: a pair that differs is the divergence, and
    # only without one is the first missing message.
    result.divergence = \
        (stopped_early and first_divergence(inbound, originals, bus, True, float_tol, unanswered, stop_index)) or \
        first_divergence(inbound, originals, bus, False, float_tol, unanswered, stop_index)


def _apply_threads(env: dict[str, str]) -> None:
    """The original's thread count (float sums depend on it): OMP_NUM_THREADS from its spec's env."""
    if env.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def replay_into(path: str, cls_path: str, segment: int = 0, idle_timeout: float = 60.0,
                overrides: Sequence[str] = (), float_tol: float = 0.0, to_end: bool = False) -> ReplayResult:
    """Replay ``path``'s inbound messages into a fresh ``cls_path`` actor and compare what it sends.
    ``overrides``: settings changed for the replay (``KEY=VALUE``, the launcher's grammar, e.g. "algo.batch_size=8";
    the actor's settings model checks them). ``to_end``:
    deliver the whole log even after a divergence (offline re-training with changed settings)."""
    import uvloop

    return uvloop.run(_replay(path, cls_path, segment, idle_timeout, overrides, float_tol, to_end))
