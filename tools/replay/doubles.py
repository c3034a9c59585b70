"""What stands in for the replayed actor's world: the bus (:class:`ReplayBus`: captures what the actor sends,
answers its requests from the log), its bulk links (:class:`ReplayLink`: buckets from the log, each transfer
ending where the original's did, :class:`LinkGate`), and the count of its work on threads (:class:`Work`)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import defaultdict, deque
from typing import Any

import msgpack

from transport.bulk import BulkError
from transport.bus import RemoteError, current_cause, wait_for_tasks
from transport.messages import Error, Message, decode, encode, to_plain
from transport.msglog import LogRecord

from .compare import Sent, bulk_key, wire_key

__all__ = ["LinkGate", "ReplayBus", "ReplayError", "ReplayLink", "TransferNeverEnded", "Work", "counted"]


class ReplayError(RuntimeError):
    """The log cannot drive the actor (e.g. it requests something the original never asked)."""


class ReplayBus:
    """Stands in for transport.bus.Bus: captures what the actor sends, answers requests from the log."""

    def __init__(self, name: str, replies: dict[tuple, list], peers: dict[str, str] | None = None) -> None:
        self.name = name
        self.peers = dict(peers or {})
        self.alive: dict[str, bool] = {}
        self.endpoint = "replay://"
        self.draining = False
        self.frozen = False                      # set once the comparison is done: later sends are dropped
        self._lock = threading.Lock()            # bulk links send from their own threads
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.sent: dict[str | None, list[Sent]] = defaultdict(list)
        self.count = 0                           # messages sent so far, all causes
        self.order: list[tuple[str | None, int]] = []    # (cause, position within that cause) of each send
        self.per_peer_seen: dict[tuple, int] = defaultdict(int)   # (cause, peer) -> sends checked so far
        self.stream_counts: dict[tuple, int] = defaultdict(int)   # (cause, peer) -> sends so far
        self.progress = asyncio.Event()          # set on every send: the driver waits for the actor with it
        self._replies = replies                  # (cause, ordinal of that cause's requests) -> frames
        self._released: dict[tuple, list] = {}   # replies whose place in the log the replay has reached
        self._waiting: dict[tuple, asyncio.Future] = {}
        self._request_counts: dict[str | None, int] = defaultdict(int)
        self._handler_tasks: set[asyncio.Task] = set()
        from collections import Counter
        self.stats: Counter = Counter()
        self.rejected: Counter = Counter()

    def _capture(self, peer: str, msg: Message, cause: str | None, **kw: Any) -> None:
        frames = encode(msg, self.name, **kw)
        key = wire_key(frames, peer)
        self._add(cause, Sent(peer, type(msg).KIND, key, to_plain(msg), msgpack.unpackb(key[2], raw=False),
                               list(key[3])))

    def capture_bulk(self, peer: str, header: dict) -> None:
        """A bucket the actor sent on a (stand-in) bulk link; called from the thread the transfer runs in."""
        self._add(current_cause.get(), Sent(peer, "bulk", bulk_key(peer, header), header, header, []))

    def _add(self, cause: str | None, sent: Sent) -> None:
        with self._lock:
            if self.frozen:
                return
            self.sent[cause].append(sent)
            self.stream_counts[(cause, sent.peer)] += 1
            self.order.append((cause, len(self.sent[cause]) - 1))
            self.count += 1
        if threading.get_ident() == self._loop_thread:
            self.progress.set()
        else:
            self._loop.call_soon_threadsafe(self.progress.set)

    async def send(self, peer: str, msg: Message) -> None:
        self._capture(peer, msg, current_cause.get())

    async def request(self, peer: str, msg: Message, timeout: float | None = None) -> Message:
        cause = current_cause.get()
        self._capture(peer, msg, cause, wants_reply=True)
        n = self._request_counts[cause]
        self._request_counts[cause] += 1
        if (cause, n) not in self._replies:
            # The original got no answer either (the run ended first, or it timed out: then the replay
            # stalls where the original went on, and says so): it waits, as the original did.
            await asyncio.get_running_loop().create_future()
        # The reply comes when the original got it (the driver releases it at its place in the log): a status
        # asked for meanwhile must not see the answer early.
        frames = self._released.get((cause, n))
        if frames is None:
            waiter = self._waiting[(cause, n)] = asyncio.get_running_loop().create_future()
            frames = await waiter
        _, reply = decode(frames)
        if type(reply) is Error:
            raise RemoteError(peer, reply.code, reply.text, reply.kind)
        return reply

    def release(self, key: tuple) -> None:
        """The original received the reply to request ``key`` at this point: hand it over."""
        self._released[key] = self._replies[key]
        waiter = self._waiting.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(self._replies[key])

    def _send_reply(self, ident: Any, msg: Message, to: Any) -> None:
        self._capture(to.sender, msg, to.id, reply_to=to.id)

    def counters(self) -> dict[str, int]:
        return {}

    def peer_alive(self, peer: str) -> bool:
        # As the original's heartbeats said, from the log's peer_dead/peer_alive events.
        return self.alive.get(peer, True)

    # The parts of Bus that Actor._drain uses.
    async def wait_handlers(self, timeout: float | None = None) -> bool:
        return await wait_for_tasks(self._handler_tasks, timeout)

    def cancel_handlers(self) -> int:
        for t in self._handler_tasks:
            t.cancel()
        return len(self._handler_tasks)

    @property
    def inflight(self) -> int:
        return len(self._handler_tasks)


class Work:
    """The replayed actor's work in hand on threads, so the replay can let it finish before the next record,
    as the original (it was not racing a replay) mostly did: what it handed to ``asyncio.to_thread`` (the
    default executor) and its transfers in ``actors.runtime.threads.in_thread`` daemon threads, each counted by the
    executor the replay's loop runs them on (:func:`counted`). A thread waiting on a stand-in link for the place in the log where
    the original's transfer ended is *parked*: not in hand, the driver has to move on to release it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.busy = 0
        self.parked = 0
        self.changed = asyncio.Event()
        self.loop = loop
        self._lock = threading.Lock()

    @property
    def in_hand(self) -> int:
        return self.busy - self.parked

    def count(self, n: int) -> None:
        """``n`` calls started (+) or ended (-), from any thread. An ended call has already handed its result
        to the event loop (queued before this wake-up), so the driver's next turns run what awaited it."""
        with self._lock:
            self.busy += n
        if n < 0 and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.changed.set)

    def park(self, n: int) -> None:
        """``n`` threads began (+) or ended (-, by the driver's release) waiting on a stand-in link."""
        with self._lock:
            self.parked += n
        if n > 0 and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.changed.set)


def counted(base: type) -> type:
    """An executor class like ``base`` whose calls are counted in a :class:`Work` (the replayed actor's default
    executor, and the executor its loop runs ``in_thread`` calls on)."""

    class Counting(base):
        def __init__(self, work: Work, **kw: Any) -> None:
            super().__init__(**kw)
            self.work = work

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
            self.work.count(1)
            fut = super().submit(fn, *args, **kwargs)
            # Counted done after the callback asyncio adds once this returns (run_in_executor, on the loop), so
            # the result is on its way to the loop before the driver hears the work ended.
            self.work.loop.call_soon_threadsafe(fut.add_done_callback, lambda _: self.work.count(-1))
            return fut

    Counting.__name__ = f"Counting{base.__name__}"
    return Counting


class TransferNeverEnded(BulkError):
    """A stand-in link's transfer that the original never finished, failed once the replay is over."""


class LinkGate:
    """The stand-in links' transfers end where the original's did: the n-th formation of a link at its n-th
    ``bulk_formed`` record (failing if that one failed), the n-th bucket received on a link at its n-th
    ``bulk_in`` record, the n-th bucket sent to a peer (``link#rank``) at its n-th ``bulk_out`` record. One the
    original never finished (it stopped first, or it failed) never ends; closing the gate fails those."""

    def __init__(self, work: Work, formations: bool) -> None:
        self.work = work
        self.formations = formations       # the log records formations (else they end at once, as before)
        self._cond = threading.Condition()
        self._started: dict[tuple, int] = defaultdict(int)
        self._released: dict[tuple, int] = defaultdict(int)
        self._errors: dict[tuple, str] = {}
        self._parked: set[tuple] = set()
        self._closed = False
        self._loop_thread = threading.get_ident()

    @staticmethod
    def key(rec: LogRecord) -> tuple[str, str]:
        kind = rec.kind.removeprefix("bulk_")
        return kind, rec.peer if kind == "out" else rec.peer.split("#")[0]

    def wait(self, key: tuple[str, str]) -> None:
        """In the transfer's thread: return once the driver reached the record where the original's ended."""
        if key[0] == "formed" and not self.formations:
            return
        with self._cond:
            n = self._started[key]
            self._started[key] += 1
            # (Called on the event loop itself it cannot wait for the driver: it ends at once, as it used to.)
            if self._released[key] <= n and threading.get_ident() != self._loop_thread:
                self._parked.add((key, n))
                self.work.park(1)
                while self._released[key] <= n and not self._closed:
                    self._cond.wait()
            if (key, n) in self._errors:
                raise BulkError(self._errors[(key, n)])
            if self._released[key] <= n and self._closed:
                raise TransferNeverEnded(f"{key[1]}: the original's transfer never ended (the replay is over)")

    def release(self, rec: LogRecord) -> None:
        """The driver reached ``rec``: the transfer it records ends."""
        key = self.key(rec)
        error = msgpack.unpackb(rec.frames[0], raw=False).get("error") if key[0] == "formed" else None
        with self._cond:
            n = self._released[key]
            self._released[key] += 1
            if error is not None:
                self._errors[(key, n)] = error
            if (key, n) in self._parked:
                self._parked.discard((key, n))
                self.work.park(-1)
            self._cond.notify_all()

    def close(self) -> None:
        """The replay is over: a transfer still waiting fails, so its thread ends."""
        with self._cond:
            self._closed = True
            self.work.park(-len(self._parked))
            self._parked.clear()
            self._cond.notify_all()


class ReplayLink:
    """Stands in for transport.bulk.BulkLink: hands the replayed actor the buckets the original received
    (from the log), and captures the headers of the buckets it sends for comparison. No peer is there to
    wait for: a formation, a bucket received and a bucket sent each end where the original's ended in the
    log (``gate``), a formation failing if the original's failed."""

    def __init__(self, config: Any, buckets: dict[str, deque], bus: ReplayBus, gate: LinkGate) -> None:
        self.config = config
        self.epoch: int | None = None
        self.members: list[str] = list(config.members)
        self._rank = config.rank
        self._in = buckets[config.name]
        self._bus = bus
        self._gate = gate
        self._next_bucket = 0

    def open(self, epoch: int = 0, members: Any = None) -> None:
        self._gate.wait(("formed", self.config.name))
        self.members = list(members) if members else list(self.config.members)
        if self.config.members:
            self._rank = self.members.index(self.config.members[self.config.rank])
        self.epoch = epoch

    def reform(self, epoch: int, members: Any = None) -> None:
        self.open(epoch, members)

    @property
    def rank(self) -> int:
        return self._rank

    def latest_epoch(self) -> int | None:
        return self.epoch

    def close(self) -> None:
        self.epoch = None

    def barrier(self) -> None:
        pass

    def _take(self) -> Any:
        import torch

        from transport.bulk import PackedBucket

        self._gate.wait(("in", self.config.name))
        if not self._in:
            raise ReplayError(f"link {self.config.name!r}: the replayed actor receives one more bucket than the "
                              f"original did")
        frames = self._in.popleft()
        header = msgpack.unpackb(frames[0], raw=False)
        return PackedBucket(header, torch.frombuffer(bytearray(frames[1]), dtype=torch.uint8))

    def _sent(self, peer: str, packed: Any) -> None:
        # Captured once it ended, as the original logged it: one it never finished it never sent.
        self._gate.wait(("out", f"{self.config.name}#{peer}"))
        self._bus.capture_bulk(f"{self.config.name}#{peer}", packed.header)

    def broadcast(self, bucket: Any, src: int = 0, epoch: int | None = None) -> Any:
        from transport.bulk import pack_bucket, unpack_bucket

        if self._rank == src:
            self._sent("all", pack_bucket(bucket, self._take_id()))
            return bucket
        return unpack_bucket(self._take(), self.config.name)

    def broadcast_packed(self, packed: Any, src: int = 0, epoch: int | None = None) -> Any:
        if self._rank == src:
            self._sent("all", packed)
            return packed
        return self._take()

    def send(self, bucket: Any, dst: int, epoch: int | None = None) -> None:
        from transport.bulk import pack_bucket

        self._sent(str(dst), pack_bucket(bucket, self._take_id()))

    def send_packed(self, packed: Any, dst: int, epoch: int | None = None) -> None:
        self._sent(str(dst), packed)

    def recv(self, src: int, epoch: int | None = None) -> Any:
        from transport.bulk import unpack_bucket

        return unpack_bucket(self._take(), self.config.name)

    def _take_id(self) -> int:
        self._next_bucket += 1
        return self._next_bucket - 1
