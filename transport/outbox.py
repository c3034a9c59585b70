"""A peer's outbox: everything the bus (transport/bus.py) sends to one peer, in order, on the peer's DEALER.

Coalescing. Small tensor-free messages sent in one event-loop tick are queued (frame 0 only) and handed to
ZeroMQ as one container at the end of the tick, or at once when the container is full (at most
``batch_max`` messages, ``batch_budget`` bytes). Other messages go straight to the socket once the queue
ahead of them is out.

Backpressure. The socket's queue is bounded (SNDHWM): a message that finds it full waits for room, behind
every message already waiting (``stats["send_waits"]``), so per-peer order is kept and nothing is dropped;
a container left at the end of a tick with the queue full is sent by a task that waits for room.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from .messages import encode_batch

__all__ = ["Outbox", "rearm"]


def rearm(asock: zmq.asyncio.Socket) -> None:
    """Call after a send on a socket's plain shadow. ZeroMQ's notification fd is edge-triggered and any
    call on the socket may consume its edge: a send that happens to process the "messages arrived" command
    leaves the asyncio twin's pending poll() asleep while messages wait, for good if no other command
    follows (an actor that stops answering pings). pyzmq re-checks after its own calls; reading EVENTS
    through the twin makes it re-check after ours."""
    asock.get(zmq.EVENTS)


class Outbox:
    """The messages on their way to one peer: the pending container, and the senders waiting for room."""

    def __init__(self, peer: str, sock: zmq.Socket, asock: zmq.asyncio.Socket, sender: str, batch_max: int,
                 batch_budget: int, stats: Counter, log: Any,
                 spawn: Callable[[Any, str], "asyncio.Task[Any]"]) -> None:
        self.peer, self.sock, self.asock = peer, sock, asock   # the DEALER and its asyncio twin
        self.sender = sender                                     # this bus's name, in each container's header
        self.batch_max, self.batch_budget = batch_max, batch_budget
        self.stats, self.log, self.spawn = stats, log, spawn     # the bus's
        self.lock = asyncio.Lock()
        self.waiters = 0            # senders (and the flusher) waiting for room in this peer's queue
        self.batch: list[bytes] = []   # frame 0 of this tick's small messages, in order
        self.batch_bytes = 0
        self.flush_scheduled = False
        self.flusher: asyncio.Task | None = None
        self.closed = False         # the bus closed, or the peer was re-pointed: nothing more goes out of it

    async def put(self, frames: list, batchable: bool) -> None:
        """Send one encoded message (``batchable``: one small frame, which may share a container); waits
        while the peer's queue is full (never drops)."""
        if batchable:
            # Queue it behind this tick's other small messages; every message to the peer passes through
            # the container or waits until it is empty.
            if not self.waiters:
                if self.add(frames[0]):
                    return
                if self.flush():              # full: hand it over, start a new one with this message
                    self.add(frames[0])
                    return
            await self._send_waiting(frames, True)
            return
        if not self.waiters and (not self.batch or self.flush()):
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                rearm(self.asock)
                self.stats["sent"] += 1
                return
            except zmq.Again:
                pass
        await self._send_waiting(frames, False)

    def add(self, first: bytes) -> bool:
        """Append to the pending container; False when it is full."""
        n = len(first) + 3
        if self.batch and (len(self.batch) >= self.batch_max or self.batch_bytes + n > self.batch_budget):
            return False
        self.batch.append(first)
        self.batch_bytes += n
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_soon)
        return True

    def flush(self) -> bool:
        """Hand the pending container to ZeroMQ without blocking; False (kept) when the queue is full."""
        batch = self.batch
        if not batch:
            return True
        try:
            self.sock.send(batch[0] if len(batch) == 1 else encode_batch(batch, self.sender), zmq.NOBLOCK)
        except zmq.Again:
            return False
        rearm(self.asock)
        self.stats["sent"] += len(batch)
        if len(batch) > 1:
            self.stats["batches"] += 1
        self.batch = []
        self.batch_bytes = 0
        return True

    async def flush_within(self, linger: float) -> None:
        """Hand the pending container over, waiting for room up to ``linger`` seconds; what cannot go is
        counted and logged (the bus closes)."""
        try:
            async with asyncio.timeout(max(linger, 0.001)):
                while self.batch and not self.flush():
                    await self.asock.poll(50, zmq.POLLOUT)
        except (TimeoutError, zmq.ZMQError):
            pass
        if self.batch:
            self.stats["unsent_at_close"] += len(self.batch)
            self.log.warning("unsent_at_close", peer=self.peer, messages=len(self.batch),
                             reason=f"the peer's queue stayed full for the close linger ({linger}s)")
            self.batch, self.batch_bytes = [], 0

    def discard(self) -> None:
        """The peer is re-pointed: as with ZeroMQ's own queue, what cannot go now is discarded."""
        try:
            self.flush()
        except zmq.ZMQError:
            pass
        self.closed = True
        if self.flusher is not None:
            self.flusher.cancel()

    def _flush_soon(self) -> None:
        """End of the tick: send the container, or leave it to a task that waits for room."""
        self.flush_scheduled = False
        if not self.batch or self.flusher is not None or self.closed:
            return
        try:
            if self.flush():
                return
        except zmq.ZMQError as exc:
            self.log.error("send_failed", peer=self.peer, messages=len(self.batch), error=repr(exc))
            return
        self.flusher = self.spawn(self._flush_waiting(), f"flush-{self.peer}")

    async def _flush_waiting(self) -> None:
        self.waiters += 1
        self.stats["send_waits"] += 1
        try:
            async with self.lock:
                while self.batch and not self.flush():
                    await self.asock.poll(flags=zmq.POLLOUT)
        finally:
            self.waiters -= 1
            self.flusher = None

    async def _send_waiting(self, frames: list, batchable: bool) -> None:
        """The peer's queue is full (or others already wait): wait our turn, in order."""
        self.waiters += 1
        self.stats["send_waits"] += 1
        try:
            async with self.lock:
                if batchable:
                    while not self.add(frames[0]):
                        while not self.flush():
                            await self.asock.poll(flags=zmq.POLLOUT)
                    return
                # what was queued before us goes first
                while not self.flush():
                    await self.asock.poll(flags=zmq.POLLOUT)
                await self.asock.send_multipart(frames, copy=False)
                self.stats["sent"] += 1
        finally:
            self.waiters -= 1
            # a container left behind by a cancelled waiter must still go out
            if self.batch and not self.flush_scheduled and not self.closed:
                self.flush_scheduled = True
                asyncio.get_running_loop().call_soon(self._flush_soon)
