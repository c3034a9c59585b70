"""What every weights path shares: the interfaces of its three sides, and the helpers they all use.

A path moves each new version from the trainer to the rollouts. Its sides:

* :class:`WeightSender`: trainer rank 0. ``publish`` is called after every training step with the
  exported buckets; a path whose bytes the trainer sends when the parameter server asks for them also
  answers ``form`` (:class:`LinkReform`) and ``broadcast`` (:class:`WeightsBroadcast`).
* :class:`Fanout`: the parameter server's hands. The server decides *when* a group is formed and a
  version pushed, and records the acks; the fanout decides *how*: it takes each version the trainer
  announces (its bytes, or only what the rollouts need to know of it), forms the group of an epoch
  and moves the stored version's bytes to its members (itself, or by asking the trainer). One direction
  only: the server asks (``accept``, ``form``, ``push``) and gets a result back (:class:`Accepted`,
  :class:`Formation`, :class:`Transfer`); the fanout never calls the server.
* :class:`WeightReceiver`: a rollout. It joins each epoch the parameter server names and turns a
  :class:`WeightsReady` into a :class:`WeightsAck`.

Each actor picks its class once, from the topology, when it starts (``actors/weight_sync/__init__.py``).
"""
from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Coroutine, Iterable
from typing import Any

from topology.settings import LinkSettings
from transport.bulk import BulkError, LinkConfig, PackedBucket, pack_to_host
from transport.protocol import (LinkFormed, LinkReform, WeightsAck, WeightsBroadcast, WeightsBroadcastDone,
                                WeightsPublished, WeightsReady, WeightsStored)

Bucket = list[tuple[str, Any]]


class WeightSyncConfigError(ValueError):
    """A weights link's settings are unusable; the message names the key."""


class WeightSyncError(RuntimeError):
    """A weight update could not be received or applied; the message names the version and cause."""


class WeightsRejected(RuntimeError):
    """A published version was not stored (hash mismatch, link failure); the message says why."""


@dataclasses.dataclass
class StoredVersion:
    """The version the parameter server brings the rollouts to: its bytes (the relay), or what the rollouts
    must be told of bytes the trainer keeps (direct weights)."""

    version: int
    weights_hash: str
    packed: list[PackedBucket]      # empty with direct weights: the trainer keeps them
    nbytes: int
    n_buckets: int = -1
    specs: list = dataclasses.field(default_factory=list)   # direct weights: TensorMeta lists per bucket
    stage_buckets: list[int] = dataclasses.field(default_factory=list)   # per trainer pipeline stage

    def __post_init__(self) -> None:
        if self.n_buckets < 0:
            self.n_buckets = len(self.packed)


_PUSH_STREAMS: dict[int, Any] = {}


def push_stream(on_gpu: bool) -> contextlib.AbstractContextManager:
    """Where a push's GPU work runs (use it on the thread that pushes): a CUDA stream of its own, so the
    kept buckets' host-to-device copies, their repacking and the collectives' dependencies queue neither
    behind the training step on the default stream nor in front of it. A context that does nothing
    without a GPU (``on_gpu`` False, or no CUDA)."""
    import torch

    if not on_gpu or not torch.cuda.is_available():
        return contextlib.nullcontext()
    device = torch.cuda.current_device()
    if device not in _PUSH_STREAMS:
        _PUSH_STREAMS[device] = torch.cuda.Stream(device=device)
    return torch.cuda.stream(_PUSH_STREAMS[device])


def link_config(links: dict[str, LinkSettings], name: str | None, default: str,
                key: str = "link") -> LinkConfig | None:
    """The LinkConfig of ``links[name]``, ``name`` being the setting ``key`` (unset: ``default``; the only
    listed link if just one)."""
    if name is not None and name not in links:
        raise WeightSyncConfigError(f"{key}: link {name!r} is not in settings.links ({sorted(links)})")
    name = name or default
    if name not in links:
        if len(links) != 1:
            return None
        name = next(iter(links))
    try:
        return LinkConfig.from_dict(links[name].model_dump())
    except (BulkError, TypeError) as exc:
        raise WeightSyncConfigError(f"links.{name}: {exc}") from exc


def weight_group_name(link: str, epoch: int, stage: int) -> str:
    """The name of a weights group the servers join: one per link epoch and trainer pipeline stage."""
    return f"{link}-e{epoch}" + (f"-pp{stage}" if stage else "")


class WeightSender(abc.ABC):
    """Trainer rank 0's side of a path."""

    def take(self, version: int, buckets: Iterable[Bucket]) -> list[PackedBucket]:
        """This rank's buckets of ``version`` as the engine exports them (blocking; the export runs meanwhile),
        each packed into host memory as it comes (:func:`transport.bulk.pack_to_host`): the GPU holds a few
        buckets at a time, never a copy of the weights."""
        return list(pack_to_host(buckets))

    @abc.abstractmethod
    async def publish(self, version: int, packed: list[PackedBucket], stages: list[Any]) -> None:
        """Make ``version`` (this rank's buckets as :meth:`take` packed them; with pipeline stages, what the
        other stages' senders keep) available to the rollouts; returns once the parameter server has it."""

    async def form(self, msg: LinkReform) -> LinkFormed:
        raise WeightSyncError(f"this trainer's weights path ({type(self).__name__}) forms no group with the "
                              f"rollouts: the parameter server does")

    async def broadcast(self, msg: WeightsBroadcast) -> WeightsBroadcastDone:
        raise WeightSyncError(f"this trainer's weights path ({type(self).__name__}) sends to the parameter "
                              f"server, not to the rollouts")

    def close(self) -> None:
        """Release the link or groups (the actor stops)."""


@dataclasses.dataclass
class Accepted:
    """What a fanout made of a version the trainer announced: the trainer's answer, and the version the
    rollouts are to be brought to, taken now (``stored``) or once it is hashed and packed off the trainer's
    step (``storing``, which the parameter server runs); neither for a version no newer than the current."""

    answer: WeightsStored
    stored: StoredVersion | None = None
    storing: Coroutine[Any, Any, StoredVersion] | None = None


@dataclasses.dataclass
class Formation:
    """How forming an epoch's group ended: ``info`` to log, or the ``error`` it failed with."""

    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str = ""
    #: the failure may be a member's (one back from a hang): the parameter server leaves those out a while
    members_failed: bool = False


@dataclasses.dataclass
class PushEnd:
    """How a push ended: each member that did not ack and why (``errors``), how long the bytes took to send
    and until the last ack, or the ``failed`` error of a push that broke as a whole (the group is formed again
    before the next one)."""

    errors: dict[str, str]
    sent_s: float
    sync_s: float
    failed: str = ""


@dataclasses.dataclass
class Transfer:
    """A push under way: each member's ack as it comes (a future per member, resolving to its
    :class:`WeightsAck`), and the push's end (``end``, resolving to a :class:`PushEnd`). With ``lanes``, every
    member's bytes travel on a lane of its own: a lane that failed leaves the group broken, and one still
    running when the push ends (late) finishes on its own."""

    acks: dict[str, "asyncio.Future[WeightsAck]"]
    end: "asyncio.Future[PushEnd]"
    lanes: bool = False


class Abandoned(BulkError):
    """A formation or transfer was left because a member it waited on was lost."""


class LossWatch:
    """The members a running formation or push waits on: a loss among them (:meth:`Fanout.lost`) abandons
    the blocked transfer at once (its thread ends on its own epoch, which nothing uses again)."""

    def __init__(self, counters: Counter) -> None:
        self.counters = counters
        self.members: set[str] = set()
        self.gone: list[str] = []
        self._event = asyncio.Event()

    def begin(self, members: list[str]) -> None:
        self.members, self.gone = set(members), []
        self._event.clear()

    def lost(self, rollout: str) -> None:
        if rollout in self.members:
            self.gone.append(rollout)
            self._event.set()

    async def unless_lost(self, work: "asyncio.Future[Any]", what: str) -> Any:
        """Await ``work`` unless a member is lost first; then abandon it with a BulkError."""
        lost = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait({work, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            self.members = set()
        if work.done():
            return work.result()
        work.cancel()
        work.add_done_callback(lambda f: f.cancelled() or f.exception())   # its late error is expected
        self.counters["transfers_abandoned"] += 1
        raise Abandoned(f"{what} abandoned: {', '.join(sorted(set(self.gone))) or 'a member'} was lost "
                        f"while it ran")


class Fanout(abc.ABC):
    """The parameter server's side of a path: it takes each version the trainer announces, forms an
    epoch's group and pushes a stored version over it, when the parameter server asks, and answers with
    what happened (:class:`Accepted`, :class:`Formation`, :class:`Transfer`). It never calls the server: it
    has its own bus, log and counters, and is told of lost members (:meth:`lost`)."""

    #: whether the parameter server holds the bytes of each version (it can keep some for the evaluator)
    holds_weights: bool = False
    #: the rollouts this path brings to each version
    rollouts: list[str]

    def __init__(self, bus: Any, log: Any, counters: Counter, ack_timeout: float, late_s: float) -> None:
        self.bus, self.log, self.counters = bus, log, counters   # what the rollouts and the trainer are told
        self.ack_timeout = ack_timeout   # how long a rollout's ack or the trainer's answer is waited for
        self.late_s = late_s             # how long a push waits for the other members after the first ack
        self.watch = LossWatch(counters)

    @abc.abstractmethod
    async def start_weights(self) -> StoredVersion:
        """The version the run starts from (a resumed run's checkpoint, else the model's)."""

    @abc.abstractmethod
    async def accept(self, msg: WeightsPublished, current: int | None) -> Accepted:
        """The trainer announced a version (``current``: the newest the parameter server holds). Raises
        WeightsRejected if it cannot be taken."""

    @abc.abstractmethod
    async def form(self, epoch: int, members: list[str], ranks: dict[str, int]) -> Formation:
        """Form ``epoch`` of the rollouts' group of ``members`` (``ranks``: how many ranks each member's server
        joins a weights group with, 0: the actor receives itself)."""

    @abc.abstractmethod
    def push(self, stored: StoredVersion, epoch: int, members: list[str]) -> Transfer:
        """Start moving ``stored`` to ``members`` (those not still busy with a transfer)."""

    def busy(self, rollout: str) -> bool:
        """Whether a transfer to ``rollout`` still runs (it is not pushed to again until it ends)."""
        return False

    def lost(self, rollout: str, why: str) -> None:
        """``rollout`` died, restarted or lost its server: stop waiting for it."""
        self.watch.lost(rollout)

    def close(self) -> None:
        """Release the links (the actor stops)."""


class WeightReceiver(abc.ABC):
    """A rollout's side of a path."""

    config: LinkConfig
    epoch: int | None = None

    @property
    def ranks(self) -> int:
        """How many ranks this rollout's server joins the trainer's group with (0: this process receives)."""
        return 0

    @abc.abstractmethod
    async def form(self, msg: LinkReform) -> None:
        """Join the group of ``msg.epoch`` (cancellable: a newer LinkReform may overtake it)."""

    @abc.abstractmethod
    async def receive(self, msg: WeightsReady) -> WeightsAck:
        """Receive ``msg.version`` and make the engine sample with it; the ack."""

    def abandon_before(self, epoch: int) -> None:
        """A LinkReform of ``epoch`` came: a transfer of an older epoch will never be finished."""

    def server_lost(self) -> None:
        """The engine's server died or restarted: whatever group it had joined went with it."""

    def close(self) -> None:
        """Release the link or groups (the actor stops)."""
