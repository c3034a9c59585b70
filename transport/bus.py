"""The bus: one bound inbound socket per actor, peers reached by actor name, typed messages both ways.

Sockets. An actor binds one ROUTER at its endpoint (``tcp://host:port``, ``tcp://host:*`` for a free port,
or ``ipc://path``). For every peer in its name -> endpoint map it connects one DEALER. One-way sends and
requests leave on the peer's DEALER; the peer's ROUTER hands replies back on that same connection, so a
requester need not be reachable itself.

Backpressure. Queues are bounded (SNDHWM/RCVHWM = ``hwm`` messages). ``await bus.send()`` first tries a
non-blocking send; when the peer's queue is full it waits until there is room (counted in
``stats["send_waits"]``), keeping per-peer FIFO order. Nothing is dropped silently: the ROUTER runs with
ZMQ_ROUTER_MANDATORY, so a reply to a requester whose queue is full is retried until ``reply_timeout``
and a reply to a vanished requester is counted (``stats["reply_unroutable"]``) and logged. The inbound
side applies backpressure too: coroutine handlers run as tasks, at most ``max_inflight`` at once; when
that many are busy the bus stops reading, the ROUTER's queue fills and the senders wait.

Bad input never kills the actor. Every frame list that fails :func:`transport.messages.decode` (malformed,
unknown kind, schema version, bad field, frame over ``max_frame_bytes``, tensor size mismatch) is counted
in ``rejected[reason]`` and logged with the sender and reason (rate-limited), and a sender that asked for a
reply gets an :class:`~transport.messages.Error` reply, which ``request()`` raises as :class:`RemoteError`.
Frames over ``hard_max_frame_bytes`` (default 2x the limit) are cut off by libzmq (ZMQ_MAXMSGSIZE) before
they are buffered in full, which protects memory.

The bus's parts. Sockets, decoding, dispatch and recording are here; what goes out to each peer, in order
and under backpressure, is the peer's :class:`~transport.outbox.Outbox` (coalescing included); which peers
are alive or restarted is :class:`~transport.liveness.PeerLiveness`'s, from what the bus hears.

Heartbeats. Every ``heartbeat_interval`` seconds the bus pings each peer; any message from a peer (a
reply or pong on its connection, or its own pings and requests) counts as a sign of life. A peer silent
for ``heartbeat_timeout`` is declared dead (``on_peer_dead(name)``, ``stats["peer_dead"]``);
``on_peer_alive(name)`` fires when it answers again; ``first_contact_timeout`` (default six heartbeat
timeouts) for one never heard from, and time this bus's loop was blocked is not counted against anyone
(transport/liveness.py). Pings and pongs are handled inside the bus and never reach the actor.

Restarts. Each bus has an ``incarnation`` (random, drawn when it starts) that its pings carry, and its first
ping to each peer leaves at connect, ahead of any message (one connection delivers in order): so a peer hears
of a new process before it hears anything from it. A known peer whose ping carries an incarnation other
than the last one seen from it is a new process: the one before it is gone, with whatever it held
(``on_peer_restarted(name)``, ``stats["peer_restarted"]``, logged ``peer_restarted``). The first incarnation
seen from a peer is not a restart, and a peer that was only silent (stopped, starved of CPU) keeps its
incarnation. A ping passes the same sender check as any message (``roles``, below), so under CURVE or tokens
one actor cannot announce another's restart.

CurveZMQ (``curve=CurveConfig``): the ROUTER is a CURVE server whose ZAP handler admits only the run's
public keys; DEALERs are CURVE clients. Without CURVE, per-run tokens (``tokens=TokenConfig``): the ROUTER is
a PLAIN server whose ZAP handler admits only the run's actors, each by its own name and token. Denied
handshakes are counted in ``rejected["auth_denied"]``. Either way a connection is bound to one actor, and with
``roles`` a message whose header names another sender is refused (``spoofed_sender``). A bus with neither (a
test's) trusts the header. An ipc socket is made 0600 once bound (a directory the bus creates for it is 0700).
"""
from __future__ import annotations

import asyncio
import contextvars
import errno
import os
import time
import weakref
from collections import Counter
from typing import Any, Awaitable, Callable, Iterable

import structlog
import zmq
import zmq.asyncio

from .auth import CurveConfig, TokenConfig, start_authenticator
from .liveness import PeerLiveness
from .messages import (BATCH_MAX_BYTES, BATCH_MAX_MESSAGES, DecodeError, EncodeError, Error, FrameTooLarge, Header,
                       Message, Ping, Pong, decode, encode, is_batch, new_message_id, split_batch)
from .outbox import Outbox, rearm

__all__ = ["Bus", "Envelope", "BusError", "UnknownPeer", "MessageTooLarge", "RequestTimeout", "RemoteError",
           "BusClosed", "current_cause", "wait_for_tasks"]

# The id of the inbound message whose handler is running; outbound records carry it so replay can
# attribute every message an actor sends to the message that caused it.
current_cause: contextvars.ContextVar[str | None] = contextvars.ContextVar("current_cause", default=None)

_DRAIN_BATCH = 512          # messages read per wake-up before yielding to other tasks
_COALESCE_ITEM_MAX = 4096   # tensor-free messages up to this size (frame 0) may share a ZeroMQ message
_LOG_FIRST = 20             # rejections of one reason logged in full before sampling
_LOG_EVERY = 1000


def _release_zmq(sockets: list[zmq.Socket], ctx: zmq.Context, auth: Any) -> None:
    """Close a dropped bus's sockets (no linger) and its context; runs at garbage collection or exit."""
    if auth is not None:
        auth.stop()
    for sock in sockets:
        try:
            sock.close(linger=0)
        except Exception:       # its event loop may be gone already; the handle still closes
            pass
    ctx.term()


HEARTBEAT_TIMEOUT_S = 5.0   # a peer silent this long is dead (pings go every second by default)
# A peer never heard from is given this many heartbeat timeouts from our start: the run's processes start
# seconds apart (imports, a loaded machine, nodes launched one after another), and a peer that is not up yet
# is not dead.
FIRST_CONTACT_FACTOR = 6
MAX_INFLIGHT = 64           # coroutine handlers running at once; more wait, and so does the socket behind them


async def wait_for_tasks(tasks: set[asyncio.Task], timeout: float | None = None) -> bool:
    """Wait until every task of ``tasks`` has ended; False if ``timeout`` expired first."""
    if not tasks:
        return True
    _, pending = await asyncio.wait(set(tasks), timeout=timeout)
    return not pending


class BusError(RuntimeError):
    pass


class UnknownPeer(BusError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown peer"


class MessageTooLarge(BusError, ValueError):
    pass


class RequestTimeout(BusError, TimeoutError):
    pass


class BusClosed(BusError):
    pass


class RemoteError(BusError):
    """The peer answered a request with an Error. ``code`` is its reason code (see messages.Error)."""

    def __init__(self, peer: str, code: str, text: str, kind: str | None = None) -> None:
        super().__init__(f"{peer} rejected {kind or 'request'}: [{code}] {text}")
        self.peer, self.code, self.text, self.kind = peer, code, text, kind


class Envelope:
    """A received message with its header; ``reply()`` answers it when the sender asked for a reply."""

    __slots__ = ("header", "msg", "frames", "_ident", "_bus", "replied")

    def __init__(self, header: Header, msg: Any, frames: list, ident: bytes | None, bus: "Bus | None") -> None:
        self.header, self.msg, self.frames = header, msg, frames
        self._ident, self._bus = ident, bus
        self.replied = False

    @property
    def sender(self) -> str:
        return self.header.sender

    @property
    def wants_reply(self) -> bool:
        return self.header.wants_reply

    def reply(self, msg: Message) -> None:
        """Send ``msg`` as the reply (once; later calls are ignored). Never blocks: a full queue is retried
        in the background until the bus's reply_timeout."""
        if self.replied or not self.header.wants_reply:
            return
        self.replied = True
        if self._bus is not None:
            self._bus._send_reply(self._ident, msg, self.header)


Handler = Callable[[Envelope], "Message | None | Awaitable[Message | None]"]


class _Peer:
    __slots__ = ("name", "endpoint", "sock", "asock", "outbox", "reader")

    def __init__(self, name: str, endpoint: str, sock: zmq.Socket, asock: zmq.asyncio.Socket, outbox: Outbox) -> None:
        self.name, self.endpoint, self.sock, self.asock = name, endpoint, sock, asock
        self.outbox = outbox        # what goes out to it (transport/outbox.py)
        self.reader: asyncio.Task | None = None


class Bus:
    def __init__(self, name: str, endpoint: str, peers: dict[str, str] | None = None, *,
                 handler: Handler | None = None,
                 curve: CurveConfig | None = None,
                 tokens: TokenConfig | None = None,
                 hwm: int = 1000,
                 max_frame_bytes: int = 256 << 20,
                 hard_max_frame_bytes: int | None = None,
                 max_inflight: int = MAX_INFLIGHT,
                 heartbeat_interval: float | None = 1.0,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
                 first_contact_timeout: float | None = None,
                 on_peer_dead: Callable[[str], Any] | None = None,
                 on_peer_alive: Callable[[str], Any] | None = None,
                 on_peer_restarted: Callable[[str], Any] | None = None,
                 reply_timeout: float = 30.0,
                 recorder: Any = None,
                 record_outbound: bool = False,
                 coalesce: bool = True,
                 roles: dict[str, str] | None = None,
                 log: Any = None) -> None:
        if heartbeat_interval is not None and heartbeat_timeout <= heartbeat_interval:
            raise ValueError("heartbeat_timeout must be longer than heartbeat_interval")
        self.name = name
        self.endpoint = endpoint
        self.handler = handler
        if curve is not None and tokens is not None:
            raise ValueError("a bus authenticates by CURVE keys or by tokens, not both")
        self.curve = curve
        self.tokens = tokens
        # what binds a connection to one actor of the run (None: nothing, the header's name is trusted)
        self._credentials: CurveConfig | TokenConfig | None = curve if curve is not None else tokens
        # name -> role (its actor group) of everyone who may send us messages: with it, a kind that declares
        # its senders (@message(..., senders=...)) is accepted only from those roles, and under CURVE or tokens
        # the sender is the actor the connection authenticated as, whatever name the header claims.
        self.roles = roles
        self.hwm = hwm
        self.max_frame_bytes = max_frame_bytes
        self.hard_max_frame_bytes = hard_max_frame_bytes or 2 * max_frame_bytes
        self.max_inflight = max_inflight
        self.heartbeat_interval = heartbeat_interval
        first_contact_timeout = (first_contact_timeout if first_contact_timeout is not None
                                 else FIRST_CONTACT_FACTOR * heartbeat_timeout)
        if first_contact_timeout < heartbeat_timeout:
            raise ValueError("first_contact_timeout must be at least heartbeat_timeout")
        self.on_peer_dead = on_peer_dead
        self.on_peer_alive = on_peer_alive
        self.on_peer_restarted = on_peer_restarted
        self.incarnation = ""     # drawn by start(): this process's bus, as its pings tell its peers
        self.reply_timeout = reply_timeout
        self.recorder = recorder
        self.record_outbound = record_outbound
        # At most hwm/16 messages per container (64 at most): a small hwm, chosen for tight backpressure,
        # keeps one ZeroMQ message per bus message (below 2 coalescing is off).
        self._batch_max = min(BATCH_MAX_MESSAGES, hwm // 16)
        self.coalesce = coalesce and self._batch_max >= 2
        # container budget: items + their msgpack bin headers, leaving room for the container's own header
        self._batch_budget = BATCH_MAX_BYTES - 256 - len(name.encode())
        self.log = log if log is not None else structlog.get_logger("transport.bus").bind(bus=name)
        self.stats: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.liveness = PeerLiveness(heartbeat_interval, heartbeat_timeout, first_contact_timeout, self.stats,
                                     self.log)
        self.draining = False
        self._peer_endpoints = dict(peers or {})
        self._peers: dict[str, _Peer] = {}
        self._pending: dict[str, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self._handler_tasks: set[asyncio.Task] = set()
        # What this bus is doing, for the status a stalled run is diagnosed from (`activity`): its requests
        # without a reply yet, the requests it is still answering, and the last message of each kind in and out.
        self._asking: dict[str, tuple[str, str, float]] = {}          # message id -> (peer, kind, since)
        self._serving: dict[asyncio.Task, tuple[str, str, float]] = {}
        self.last_in: dict[str, tuple[str, float]] = {}               # kind -> (sender, time.time())
        self.last_out: dict[str, tuple[str, float]] = {}              # kind -> (peer, time.time())
        self._slots: asyncio.Semaphore | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._auth = None
        self._router: zmq.Socket | None = None
        self._arouter: zmq.asyncio.Socket | None = None
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> "Bus":
        """Bind the inbound socket, connect to every peer, start reading and heart-beating."""
        if self._started:
            return self
        self._started = True
        self.incarnation = os.urandom(8).hex()
        self._slots = asyncio.Semaphore(self.max_inflight)
        # A context per bus: its ZAP handler (CURVE) is per context, and closing it frees its IO thread.
        self._ctx = zmq.asyncio.Context()
        if self._credentials is not None:
            self._auth = start_authenticator(self._ctx, self._credentials, on_deny=self._on_auth_denied)
        # A bus dropped without close() (a failed test, an actor dying of an exception) must not hang its
        # process at exit: garbage collection clears the context's weak references to its sockets before
        # the context's own finaliser runs term(), which then waits forever for sockets nobody will close.
        self._zmq_sockets: list[zmq.Socket] = []
        self._release = weakref.finalize(self, _release_zmq, self._zmq_sockets, self._ctx, self._auth)
        # The asyncio socket waits for readiness; a plain shadow of it does the non-blocking fast path.
        self._arouter = self._ctx.socket(zmq.ROUTER)
        self._zmq_sockets.append(self._arouter)
        router = self._router = zmq.Socket.shadow(self._arouter.underlying)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, self.hwm)
        router.setsockopt(zmq.RCVHWM, self.hwm)
        router.setsockopt(zmq.MAXMSGSIZE, max(self.hard_max_frame_bytes, BATCH_MAX_BYTES))
        router.setsockopt(zmq.LINGER, 0)
        if self._credentials is not None:
            self._credentials.apply_server(router)
        _prepare_ipc(self.endpoint)
        router.bind(self.endpoint)
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        _private_ipc(self.endpoint)
        for peer, ep in self._peer_endpoints.items():
            self._connect(peer, ep)
        self._spawn(self._inbound_loop(), "inbound")
        if self.heartbeat_interval:
            self._spawn(self._heartbeat_loop(), "heartbeat")
        return self

    async def close(self, linger: float = 1.0) -> None:
        """Stop reading, flush queued outbound messages for up to ``linger`` seconds, free the sockets."""
        if self._closed:
            return
        self._closed = True
        for p in self._peers.values():
            p.outbox.closed = True
        for p in self._peers.values():
            if p.outbox.batch:
                await p.outbox.flush_within(linger)
        for t in list(self._tasks):
            t.cancel()
        for p in self._peers.values():
            if p.reader is not None:
                p.reader.cancel()
        await asyncio.gather(*self._tasks, *(p.reader for p in self._peers.values() if p.reader),
                             return_exceptions=True)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(BusClosed(f"bus {self.name} closed"))
        self._pending.clear()
        linger_ms = max(0, int(linger * 1000))
        for p in self._peers.values():
            p.asock.close(linger=linger_ms)
        if self._arouter is not None:
            self._arouter.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            # term() waits for the DEALERs' linger (bounded above); run it off the loop.
            await asyncio.get_running_loop().run_in_executor(None, self._ctx.term)
            self._release.detach()

    async def wait_handlers(self, timeout: float | None = None) -> bool:
        """Wait until no handler task runs; False if ``timeout`` expired first."""
        return await wait_for_tasks(self._handler_tasks, timeout)

    def cancel_handlers(self) -> int:
        """Cancel running handler tasks (their requesters get Error("draining")); returns how many."""
        tasks = list(self._handler_tasks)
        for t in tasks:
            t.cancel()
        return len(tasks)

    @property
    def inflight(self) -> int:
        return len(self._handler_tasks)

    def counters(self) -> dict[str, int]:
        out = {f"bus.{k}": v for k, v in self.stats.items()}
        out.update({f"bus.rejected.{k}": v for k, v in self.rejected.items()})
        return out

    def peer_alive(self, peer: str) -> bool:
        self._peer(peer)
        return self.liveness.alive(peer)

    def activity(self) -> dict[str, Any]:
        """Who this bus waits on and who waits on it, and the last message of each kind each way, as plain data:
        ``asking``/``serving`` list {peer, kind, for_s}; ``last_in``/``last_out`` map a kind to {peer, time}."""
        now = time.time()
        def waits(items: Iterable[tuple[str, str, float]]) -> list[dict[str, Any]]:
            return [{"peer": peer, "kind": kind, "for_s": round(now - since, 1)}
                    for peer, kind, since in sorted(items, key=lambda item: item[2])]
        return {"asking": waits(self._asking.values()), "serving": waits(self._serving.values()),
                "last_in": {k: {"peer": p, "time": t} for k, (p, t) in self.last_in.items()},
                "last_out": {k: {"peer": p, "time": t} for k, (p, t) in self.last_out.items()},
                "peers_dead": self.liveness.dead()}

    @property
    def peers(self) -> dict[str, str]:
        return {n: p.endpoint for n, p in self._peers.items()}

    def add_peer(self, name: str, endpoint: str) -> None:
        """Add (or re-point) a peer after start."""
        old = self._peers.pop(name, None)
        seen = self.liveness.forget(name)
        if old is not None:
            old.outbox.discard()
            if old.reader is not None:
                old.reader.cancel()
            old.asock.close(linger=0)
            self._zmq_sockets.remove(old.asock)
        self._peer_endpoints[name] = endpoint
        if self._started and not self._closed:
            # the same actor, moved: a new process there is still a restart
            self._connect(name, endpoint, seen.incarnation if old is not None and seen is not None else "")

    # --------------------------------------------------------------------------------------- sending

    async def send(self, peer: str, msg: Message) -> None:
        """One-way send; waits while the peer's queue is full (never drops)."""
        await self._send(peer, msg, None, False)

    async def request(self, peer: str, msg: Message, timeout: float | None = 30.0) -> Message:
        """Send ``msg`` and return the peer's reply. Raises RemoteError on an Error reply, RequestTimeout
        when no reply comes within ``timeout`` seconds (the wait for queue room included)."""
        mid = new_message_id()
        fut = asyncio.get_running_loop().create_future()
        self._pending[mid] = fut
        self._asking[mid] = (peer, type(msg).KIND, time.time())
        try:
            async with asyncio.timeout(timeout):
                await self._send(peer, msg, mid, True)
                header, reply = await fut
        except TimeoutError:
            self.stats["request_timeouts"] += 1
            raise RequestTimeout(f"{peer} did not answer {type(msg).KIND!r} within {timeout}s") from None
        finally:
            self._pending.pop(mid, None)
            self._asking.pop(mid, None)
        if type(reply) is Error:
            raise RemoteError(peer, reply.code, reply.text, reply.kind or type(msg).KIND)
        return reply

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            if self._closed:
                raise BusClosed(f"bus {self.name} is closed")
            raise UnknownPeer(f"{self.name}: no endpoint for peer {peer!r} (known: {sorted(self._peers)})")
        return p

    async def _send(self, peer: str, msg: Message, mid: str | None, wants_reply: bool) -> None:
        p = self._peer(peer)
        self.last_out[type(msg).KIND] = (peer, time.time())
        frames = encode(msg, self.name, msg_id=mid, wants_reply=wants_reply)
        first = frames[0]
        limit = self.max_frame_bytes
        if len(frames) > 1 or len(first) > limit:
            for i, f in enumerate(frames):
                n = f.nbytes if type(f) is memoryview else len(f)
                if n > limit:
                    raise MessageTooLarge(f"{type(msg).KIND}: frame {i} is {n} bytes, over max_frame_bytes={limit}")
        if self.recorder is not None and self.record_outbound:
            self.recorder.record("out", frames, peer=peer, cause=current_cause.get())
        await p.outbox.put(frames, len(frames) == 1 and self.coalesce and len(first) <= _COALESCE_ITEM_MAX)

    def _send_reply(self, ident: bytes | None, msg: Message, to: Header) -> None:
        if ident is None or self._router is None or self._closed:
            return
        try:
            frames = encode(msg, self.name, reply_to=to.id)
        except EncodeError as exc:
            self.log.error("reply_encode_failed", to=to.sender, kind=to.kind, error=str(exc))
            frames = encode(Error("handler_error", f"reply could not be encoded: {exc}", to.kind),
                            self.name, reply_to=to.id)
        if self.recorder is not None and self.record_outbound and type(msg) is not Pong:
            self.recorder.record("out", frames, peer=to.sender, cause=to.id)
        if not self._send_router([ident, *frames], to):
            self._spawn(self._retry_reply(ident, frames, to), "reply-retry")

    def _send_router(self, frames: list, to: Header) -> bool:
        """True when sent or definitively undeliverable; False when the requester's queue is full."""
        try:
            self._router.send_multipart(frames, zmq.NOBLOCK, copy=False)
            rearm(self._arouter)
            self.stats["replies"] += 1
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                self.stats["reply_unroutable"] += 1
                self.log.warning("reply_unroutable", to=to.sender, kind=to.kind,
                                 reason="the requester disconnected before the reply")
                return True
            raise

    async def _retry_reply(self, ident: bytes, frames: list, to: Header) -> None:
        self.stats["reply_waits"] += 1
        deadline = time.monotonic() + self.reply_timeout
        delay = 0.001
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)
            if self._send_router(frames, to):
                return
            delay = min(delay * 2, 0.05)
        self.stats["reply_dropped"] += 1
        self.log.error("reply_dropped", to=to.sender, kind=to.kind,
                       reason=f"requester's queue stayed full for {self.reply_timeout}s")

    # ------------------------------------------------------------------------------------- receiving

    def _connect(self, peer: str, endpoint: str, incarnation: str = "") -> None:
        asock = self._ctx.socket(zmq.DEALER)
        self._zmq_sockets.append(asock)
        sock = zmq.Socket.shadow(asock.underlying)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.hard_max_frame_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        if self._credentials is not None:
            self._credentials.apply_client(sock, peer)
        sock.connect(endpoint)
        p = _Peer(peer, endpoint, sock, asock, Outbox(peer, sock, asock, self.name, self._batch_max,
                                                       self._batch_budget, self.stats, self.log, self._spawn))
        self._peers[peer] = p
        self.liveness.track(peer, incarnation)
        p.reader = asyncio.get_running_loop().create_task(self._peer_loop(p), name=f"bus-{self.name}-{peer}")
        if self.heartbeat_interval:
            # First on the connection, before anything the actor sends: the peer learns this process is a new
            # one (its incarnation) before it handles any message of it, a hello included.
            self._ping(p, 0)

    def _spawn(self, coro: Any, what: str) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=f"bus-{self.name}-{what}")
        self._tasks.add(t)
        t.add_done_callback(self._task_done)
        return t

    def _task_done(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            self.log.error("bus_task_failed", task=t.get_name(), error=repr(t.exception()))

    @staticmethod
    def _recv_message(sock: zmq.Socket, with_ident: bool, user: list | None = None) -> tuple[bytes | None, list]:
        """One whole message, without blocking (raises zmq.Again when none is queued).

        The header frame is copied (small); further frames stay zmq.Frame objects so tensors alias them.
        With `user`, the ZAP User-Id of the connection (the z85 CURVE key that sent it) is put in it.
        """
        if user is not None:
            first = sock.recv(zmq.NOBLOCK, copy=False)
            user[:] = [first.get("User-Id")]
            ident = first.bytes
        else:
            ident = sock.recv(zmq.NOBLOCK) if with_ident else None
        if with_ident and not sock.getsockopt(zmq.RCVMORE):
            return ident, []
        frames: list = [sock.recv(zmq.NOBLOCK)]
        while sock.getsockopt(zmq.RCVMORE):
            frames.append(sock.recv(zmq.NOBLOCK, copy=False))
        return ident, frames

    async def _inbound_loop(self) -> None:
        sock, asock, slots = self._router, self._arouter, self._slots
        user: list | None = [] if self._credentials is not None and self.roles is not None else None
        while True:
            await asock.poll(flags=zmq.POLLIN)
            for _ in range(_DRAIN_BATCH):
                try:
                    ident, frames = self._recv_message(sock, True, user)
                except zmq.Again:
                    break
                key = user[0] if user else None
                if frames and is_batch(frames[0]):
                    items = self._split_batch(ident, frames)
                    if not items:
                        continue
                    # each message in the container is handled exactly as if it had arrived alone
                    for item in items:
                        coro = self._handle_inbound(ident, [item], key)
                        if coro is not None:
                            await slots.acquire()
                            self._start_handler(coro)
                    continue
                coro = self._handle_inbound(ident, frames, key)
                if coro is not None:
                    # Bounded concurrency: when max_inflight handlers run, stop reading (backpressure).
                    await slots.acquire()
                    self._start_handler(coro)
            else:
                await asyncio.sleep(0)

    def _split_batch(self, ident: bytes | None, frames: list) -> list[bytes]:
        size = len(frames[0])
        limit = max(self.max_frame_bytes, BATCH_MAX_BYTES)
        try:
            if size > limit:
                raise FrameTooLarge(f"batch container is {size} bytes, over the limit of {limit}")
            items = split_batch(frames)
        except DecodeError as exc:
            self._reject(exc.reason, str(exc), exc.header, ident, frames, time.time())
            return []
        self.stats["batches_received"] += 1
        return items

    def _handle_inbound(self, ident: bytes | None, frames: list, key: str | None = None) -> tuple | None:
        """Decode and dispatch one inbound message; returns (env, coroutine) for async handlers."""
        try:
            header, msg = decode(frames, self.max_frame_bytes)
        except DecodeError as exc:
            self._reject(exc.reason, str(exc), exc.header, ident, frames, time.time())
            return None
        refusal = self._refusal(header, type(msg), key)
        if refusal is not None:
            self._reject(refusal[0], refusal[1], header, ident, frames, time.time())
            return None
        sender = self._peers.get(header.sender)
        if sender is not None:
            # Its own pings and requests show a peer is alive too: one whose handlers are all busy stops
            # reading (and answering our pings) but keeps pinging us.
            self._mark_alive(sender)
        if type(msg) is Ping:
            if sender is not None and msg.incarnation and self.liveness.incarnation(sender.name, msg.incarnation):
                self._callback(self.on_peer_restarted, sender.name)
            if header.wants_reply:
                self._send_reply(ident, Pong(msg.seq), header)
            return None
        self.stats["received"] += 1
        self.last_in[header.kind] = (header.sender, time.time())
        now = 0.0
        if self.recorder is not None:
            now = time.time()
            self.recorder.record("in", frames, peer=header.sender, t=now)
        if header.reply_to is not None:
            self._reject("unexpected_reply", f"reply {header.kind!r} arrived on the inbound socket", header,
                         None, frames, now, record=False)
            return None
        env = Envelope(header, msg, frames, ident, self)
        if self.draining and header.wants_reply:
            self.stats["refused_draining"] += 1
            env.reply(Error("draining", f"{self.name} is shutting down; send it elsewhere or later", header.kind))
            return None
        handler = self.handler
        if handler is None:
            self._reject("no_handler", f"{self.name} has no handler", header, ident, frames, now, record=False)
            return None
        # The cause is only needed when outbound messages are recorded (for replay); skip it otherwise.
        token = current_cause.set(header.id) if self.record_outbound else None
        try:
            result = handler(env)
        except Exception as exc:
            self._handler_failed(env, exc)
            return None
        finally:
            if token is not None:
                current_cause.reset(token)
        if result is None:
            return None
        if isinstance(result, Message):
            env.reply(result)
            return None
        if asyncio.iscoroutine(result):
            return env, result
        self._handler_failed(env, TypeError(f"handler returned {type(result).__name__}, expected a Message, "
                                            f"None or a coroutine"))
        return None

    def _start_handler(self, item: tuple) -> None:
        env, coro = item
        token = current_cause.set(env.header.id) if self.record_outbound else None
        try:
            t = asyncio.get_running_loop().create_task(coro)
        finally:
            if token is not None:
                current_cause.reset(token)
        self._handler_tasks.add(t)
        if env.wants_reply:
            self._serving[t] = (env.sender, env.header.kind, time.time())
        t.add_done_callback(lambda t, env=env: self._handler_done(env, t))

    def _handler_done(self, env: Envelope, t: asyncio.Task) -> None:
        self._handler_tasks.discard(t)
        self._serving.pop(t, None)
        self._slots.release()
        if t.cancelled():
            if env.wants_reply and not env.replied:
                env.reply(Error("draining", f"{self.name} stopped before answering", env.header.kind))
            return
        exc = t.exception()
        if exc is not None:
            self._handler_failed(env, exc)
            return
        result = t.result()
        if isinstance(result, Message):
            env.reply(result)

    def _handler_failed(self, env: Envelope, exc: BaseException) -> None:
        self.stats["handler_errors"] += 1
        self.log.error("handler_failed", kind=env.header.kind, sender=env.sender, error=repr(exc),
                       exc_info=exc)
        if env.wants_reply and not env.replied:
            env.reply(Error("handler_error", f"{type(exc).__name__}: {exc}", env.header.kind))

    def _refusal(self, header: Header, cls: type, key: str | None) -> tuple[str, str] | None:
        """(reason, text) when the sender may not send this message, else None (see ``roles``)."""
        if self.roles is None:
            return None
        sender = header.sender
        creds = self._credentials
        if creds is not None:
            sender = creds.actor_of(key or "")
            if sender != header.sender:
                return ("spoofed_sender", f"the message says it is from {header.sender!r}, but its "
                                          f"{creds.credential} is {sender or 'no actor'}'s")
        allowed = getattr(cls, "SENDERS", None)
        if allowed is not None and self.roles.get(sender) not in allowed:
            return ("sender_not_allowed", f"{header.kind} is sent by {', '.join(sorted(allowed))} only; "
                                          f"{sender!r} is {self.roles.get(sender) or 'not an actor of this run'}")
        return None

    def _reject(self, reason: str, text: str, header: Header | None, ident: bytes | None, frames: list,
                now: float, record: bool = True) -> None:
        n = self.rejected[reason] = self.rejected[reason] + 1
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            self.log.warning("message_rejected", reason=reason, sender=header.sender if header else None,
                             kind=header.kind if header else None, error=text, count=n)
        if record and self.recorder is not None:
            first = frames[0] if frames else b""
            self.recorder.record("in", [first if len(first) <= 65536 else first[:65536]],
                                 peer=header.sender if header else "", t=now, rejected=reason)
        if header is not None and header.wants_reply and ident is not None:
            self._send_reply(ident, Error(reason, text, header.kind), header)

    def _on_auth_denied(self, key: str) -> None:
        n = self.rejected["auth_denied"] = self.rejected["auth_denied"] + 1
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            self.log.warning("message_rejected", reason="auth_denied", client_key=key, count=n)

    async def _peer_loop(self, p: _Peer) -> None:
        """Read replies and pongs arriving on a peer's DEALER."""
        sock, asock = p.sock, p.asock
        while True:
            await asock.poll(flags=zmq.POLLIN)
            for _ in range(_DRAIN_BATCH):
                try:
                    _, frames = self._recv_message(sock, False)
                except zmq.Again:
                    break
                self._mark_alive(p)
                self._handle_reply(p, frames)
            else:
                await asyncio.sleep(0)

    def _handle_reply(self, p: _Peer, frames: list) -> None:
        try:
            header, msg = decode(frames, self.max_frame_bytes)
        except DecodeError as exc:
            self._reject(exc.reason, str(exc), None, None, frames, time.time())
            fut = self._pending.get(exc.header.reply_to) if exc.header and exc.header.reply_to else None
            if fut is not None and not fut.done():
                fut.set_exception(RemoteError(p.name, exc.reason, f"undecodable reply: {exc}"))
            return
        if type(msg) is Pong:
            return
        if self.recorder is not None:
            self.recorder.record("in", frames, peer=p.name)
        fut = self._pending.get(header.reply_to) if header.reply_to else None
        if fut is None:
            if type(msg) is Error:
                self.log.warning("error_from_peer", peer=p.name, code=msg.code, text=msg.text)
            self.stats["late_replies"] += 1
            return
        if not fut.done():
            fut.set_result((header, msg))

    # ------------------------------------------------------------------------------------ heartbeats

    def _mark_alive(self, p: _Peer) -> None:
        if self.liveness.heard(p.name):
            self._callback(self.on_peer_alive, p.name)

    def _callback(self, fn: Callable[[str], Any] | None, peer: str) -> None:
        if fn is None:
            return
        try:
            r = fn(peer)
            if asyncio.iscoroutine(r):
                self._spawn(r, "peer-callback")
        except Exception as exc:
            self.log.error("peer_callback_failed", peer=peer, error=repr(exc))

    async def _heartbeat_loop(self) -> None:
        seq = 0
        self.liveness.started()
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            seq += 1
            for name in self.liveness.check():
                self._callback(self.on_peer_dead, name)
            for p in list(self._peers.values()):
                self._ping(p, seq)

    def _ping(self, p: _Peer, seq: int) -> None:
        try:
            # Heartbeats are lossy on purpose: a full queue to a stuck peer must not block us.
            p.sock.send_multipart(encode(Ping(seq, self.incarnation), self.name, wants_reply=True), zmq.NOBLOCK)
            rearm(p.asock)
        except zmq.Again:
            self.stats["heartbeat_skipped"] += 1


def _ipc_path(endpoint: str) -> str | None:
    """The file of an ipc endpoint (None: not ipc, or Linux's abstract namespace, which has no file)."""
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else ""
    return path if path and not path.startswith("@") else None


def _prepare_ipc(endpoint: str) -> None:
    if (path := _ipc_path(endpoint)) is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)


def _private_ipc(endpoint: str) -> None:
    """Only this user may connect to a bound ipc socket (connecting needs write permission on its file)."""
    if (path := _ipc_path(endpoint)) is not None:
        os.chmod(path, 0o600)
