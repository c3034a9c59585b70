"""What every weights path shares: the interfaces of its three sides, and the helpers they all use.

A path moves each new version from the trainer to the rollouts. Its sides:

* :class:`WeightSender`: trainer rank 0. ``publish`` is called after every training step with the
  exported buckets; a path whose bytes the trainer sends when the parameter server asks for them also
  answers ``form`` (:class:`LinkReform`) and ``broadcast`` (:class:`WeightsBroadcast`).
* :class:`Fanout`: the parameter server's hands. The server decides *when* a group is formed and a
  version pushed, and records the acks; the fanout decides *how*: it takes each version the trainer
  announces (its bytes, or only what the rollouts need to know of it), forms the group of an epoch
  and moves the stored version's bytes to its members (itself, or by asking the trainer). It reports
  what happened to the server through one typed interface, :class:`Coordinator`, and through nothing
  else: the server calls the fanout, the fanout reports back.
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
from collections.abc import Iterable
from typing import Any, Protocol

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


class Coordinator(Protocol):
    """The parameter server as its :class:`Fanout` sees it (``actors.param_server.actor.ParamServerActor``
    implements it). The server decides which rollouts form each epoch, when a version is pushed and who is
    left out for a while; a fanout asks and reports through these members only."""

    name: str
    bus: Any                        # transport.bus.Bus: what the rollouts and the trainer are told
    log: Any
    counters: Counter
    ack_timeout: float              # how long a rollout's ack or the trainer's answer is waited for
    late_s: float                   # how long a push waits for the other members after the first ack
    retry_s: float                  # how soon a failed formation is tried again (for the log)
    current: StoredVersion | None   # the version the rollouts are brought to

    def weight_ranks(self, rollout: str) -> int:
        """How many ranks ``rollout``'s server joins a weights group with (0: the actor receives itself)."""

    def spawn(self, coro: Any, name: str) -> "asyncio.Task[Any]":
        """Run ``coro`` in the background for as long as the server runs."""

    def offer(self, stored: StoredVersion) -> bool:
        """A version was taken: the rollouts are brought to it unless it is no newer than ``current``."""

    async def send_link_reform(self, rollout: str, epoch: int, members: list[str]) -> None:
        """Tell ``rollout`` to join ``epoch`` of the link, formed by ``members`` (the link's master first)."""

    async def await_formation(self, members: list[str], work: "asyncio.Future[Any]", epoch: int) -> bool:
        """Await a formation unless a member is lost first; False if it failed (logged and counted)."""

    async def unless_lost(self, members: list[str], work: "asyncio.Future[Any]", what: str) -> Any:
        """Await a transfer unless a member is lost first (then a BulkError)."""

    def record_ack(self, name: str, ack: WeightsAck, stored: StoredVersion,
                   summary: dict[str, dict[str, Any]]) -> None:
        """A member acked ``stored``: its state, and its line of the push's ``summary``."""

    def pushed(self, stored: StoredVersion, epoch: int, members: list[str], summary: dict[str, dict[str, Any]],
               sent_s: float, sync_s: float) -> bool:
        """A push ended (``summary``: each member's ack or error); whether every member acked it correctly."""

    def failed_with(self, members: list[str], started: float | None = None) -> None:
        """A formation or push failed with ``members``: those back from a hang are left out for a while."""

    def link_broken(self) -> None:
        """A transfer failed on the formed epoch: the group must be formed again before the next push."""

    def kick(self) -> None:
        """Look again for work (a transfer ended)."""


class Fanout(abc.ABC):
    """The parameter server's side: takes each version the trainer announces, forms an epoch's group
    and moves a stored version over it, reporting to its :class:`Coordinator`."""

    #: whether the parameter server holds the bytes of each version (it can keep some for the evaluator)
    holds_weights: bool = False
    #: the rollouts this path brings to each version
    rollouts: list[str]

    @abc.abstractmethod
    async def start_weights(self) -> StoredVersion:
        """The version the run starts from (a resumed run's checkpoint, else the model's)."""

    @abc.abstractmethod
    async def accept(self, msg: WeightsPublished) -> WeightsStored:
        """The trainer announced a version: take it and ``offer`` it to the parameter server; the answer.
        Raises WeightsRejected if it cannot be taken."""

    async def settled(self) -> None:
        """Return once every version accepted so far is offered (one may be hashed after its answer)."""

    @abc.abstractmethod
    async def form(self, epoch: int, members: list[str]) -> dict[str, Any] | None:
        """Form ``epoch`` of the rollouts' group of ``members``; returns what to log about it, or None
        if it failed (logged and counted here; the parameter server retries at a newer epoch)."""

    @abc.abstractmethod
    async def push(self, stored: StoredVersion, epoch: int, members: list[str]) -> bool:
        """Move ``stored`` to ``members`` and record their acks; whether every one acked it correctly."""

    def busy(self, rollout: str) -> bool:
        """Whether a transfer to ``rollout`` still runs (it is not pushed to again until it ends)."""
        return False

    def lost(self, rollout: str, why: str) -> None:
        """``rollout`` died, restarted or lost its server: stop waiting for it."""

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
