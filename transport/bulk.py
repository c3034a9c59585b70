"""Bulk tensor links: named-tensor buckets between actor groups over torch.distributed.

The control bus carries small typed messages; weights and other large tensors move here instead, over
gloo on CPU and NCCL on GPU (GPUDirect RDMA when the topology enables it). One *link* is one process
group among the instances the topology lists in its ``links`` section, with its own rendezvous
address and port. Several links can live in one process (the parameter server sits in one link with
the trainer and another with the rollouts), so a link never touches torch.distributed's single
default group: it builds its process group directly on a ``TCPStore`` wrapped in a ``PrefixStore``.

The rendezvous. torch's TCPStore (2.13) has no authentication of its own and, left to itself, its server
listens on every interface: anyone who reaches the port can read and write its keys (gloo's addresses among
them). So the master's store listens on the link's master address only (:func:`rendezvous_server`: loopback
when every member is on one node), and with a per-run secret (``LinkConfig.secret_file``, made by the launcher,
0600 in the run directory) every value goes through :class:`SignedStore`: written with an HMAC of the secret,
checked when read, so a key written by anyone else fails the formation with :class:`RendezvousForgery`
instead of steering a member's connections. What the store cannot hide: the keys and values can be read
(gloo's listening addresses), and gloo's own data connections are not authenticated; buckets carry a
checksum, so bytes injected there are refused, not trained on.

The prefix carries an *epoch* number. When a member dies and is restarted, the survivors and the
newcomer agree (through the control bus) on epoch e+1 and call :meth:`BulkLink.reform` /
:meth:`BulkLink.open` with it; the fresh prefix keeps the new rendezvous clear of the dead group's keys.
An epoch may also be formed by some of the members only (``members``), so that a member that hangs
does not hold the others: each member's rank in that epoch is its place in the list. An operation
runs to its end on the group it started on, so a transfer abandoned on an old epoch (a thread still
blocked in it) never touches the group formed after it.

A bucket is a list of ``(name, tensor)``; :func:`pack_bucket` lays it out as the one wire format every
weight path uses (:class:`PackedBucket`): a header (each tensor's :class:`TensorMeta` and byte offset, a
checksum) and one flat byte buffer holding every tensor, so receivers get views into a single allocation
and only one large collective runs per bucket. On a link it travels as three pieces: a length, the
msgpack header and the buffer, each tensor at a 16-byte aligned offset; the receiver recomputes the
checksum and raises :class:`ChecksumMismatch` (naming the link, bucket and checksums) instead of returning
bad weights. SGLang's ``flattened_bucket`` load format is the same buffer with the tensors back to back
(``align=FLAT_ALIGN``): its servers are told the metas (``/update_weights_from_distributed``), never the
header, and find each tensor with :func:`unpack_flat`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import hmac
import os
import secrets
import socket
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Sequence

import msgpack
import torch
import torch.distributed as dist
import xxhash

from transport.files import atomic_write

__all__ = [
    "BulkError",
    "ChecksumMismatch",
    "LinkRendezvousError",
    "RendezvousForgery",
    "SignedStore",
    "generate_rendezvous_secret",
    "rendezvous_server",
    "rendezvous_store",
    "LinkConfig",
    "TensorMeta",
    "PackedBucket",
    "BulkLink",
    "bucket_metas",
    "pack_bucket",
    "pack_buckets",
    "pack_to_host",
    "bucket_views",
    "unpack_bucket",
    "unpack_flat",
    "flat_order",
    "flat_misaligned",
    "bucket_checksum",
    "FLAT_ALIGN",
    "NCCL_ERROR_HANDLING_ENV",
]

Bucket = list[tuple[str, torch.Tensor]]

#: Set before every NCCL group a weights path forms (bulk links, SGLang's weight-update groups). torch's
#: default, 3 ("SkipCleanUp", ProcessGroupNCCL.cpp: ``getCvarInt(TORCH_NCCL_ASYNC_ERROR_HANDLING, 3)``), has
#: the watchdog take the whole process down when a collective times out or fails: a rollout's server that
#: hangs mid-broadcast would kill trainer rank 0 and with it the trainer's world. 2 ("CleanUpOnly") aborts
#: the failed group's communicator and raises in the waiting call; the process and its other groups live on.
#: Read when a ProcessGroupNCCL is built, so groups built before (the trainer's world) keep their own mode.
NCCL_ERROR_HANDLING_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}

_ALIGN = 16
FLAT_ALIGN = 1   # SGLang's "flattened_bucket": every tensor's bytes back to back, no padding
_HEADER_VERSION = 2   # 2: XXH3-64 checksums on CPU (1: CRC32)


class BulkError(RuntimeError):
    """A bulk link failed; the message names the link and what went wrong."""


class ChecksumMismatch(BulkError):
    """A received bucket's bytes do not hash to the checksum its sender computed."""

    def __init__(self, link: str, bucket: int, expected: int, got: int, names: Sequence[str]):
        shown = ", ".join(list(names)[:4]) + (", ..." if len(names) > 4 else "")
        super().__init__(
            f"link {link!r}: bucket {bucket} checksum mismatch: sender {expected:#x}, "
            f"received {got:#x} (tensors: {shown})"
        )
        self.link, self.bucket, self.expected, self.got = link, bucket, expected, got


class LinkRendezvousError(BulkError):
    """The members of a link did not all arrive at the rendezvous in time."""


class RendezvousForgery(BulkError):
    """A rendezvous value was not written by a holder of the run's secret."""


@dataclasses.dataclass
class LinkConfig:
    """Everything one member needs to join a link. The launcher writes it into
    ``spec.settings["links"][name]`` (see topology/placement.py); :meth:`from_dict` reads it back."""

    name: str
    backend: str  # "gloo" | "nccl"
    master_addr: str
    master_port: int
    rank: int
    world_size: int
    members: list[str] = dataclasses.field(default_factory=list)  # instance names, in rank order
    bind_addr: str = ""  # address gloo binds on this member (fake SLURM nodes use 127.0.0.x)
    timeout_s: float = 300.0
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # NCCL_* / GLOO_* for this process
    secret_file: str = ""  # the run's rendezvous secret (generate_rendezvous_secret); "": values unsigned

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise BulkError(f"link {self.name!r}: backend must be gloo or nccl, got {self.backend!r}")
        if not 0 <= self.rank < self.world_size:
            raise BulkError(f"link {self.name!r}: rank {self.rank} outside world size {self.world_size}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LinkConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise BulkError(f"link config: unknown key(s) {unknown}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def rank_of(self, member: str) -> int:
        """Rank of an instance name in this link (ranks follow the order of ``members``)."""
        try:
            return self.members.index(member)
        except ValueError:
            raise BulkError(f"link {self.name!r}: {member!r} is not a member ({self.members})") from None


@dataclasses.dataclass
class TensorMeta:
    """Name, dtype name ("bfloat16") and shape of one tensor of a bucket: what a receiver allocates before
    the bytes come (an SGLang server is told them in /update_weights_from_distributed)."""

    name: str
    dtype: str
    shape: list[int]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        return cls(name, str(tensor.dtype).removeprefix("torch."), [int(d) for d in tensor.shape])

    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise BulkError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        return dtype

    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= int(d)
        return numel * torch.empty((), dtype=self.torch_dtype()).element_size()


def bucket_metas(bucket: Bucket) -> list[TensorMeta]:
    return [TensorMeta.of(name, t) for name, t in bucket]


@dataclasses.dataclass
class PackedBucket:
    """A bucket ready for the wire: the header (plain data) and one flat uint8 tensor."""

    header: dict[str, Any]
    flat: torch.Tensor

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(e["name"], e["dtype"], list(e["shape"])) for e in self.header["tensors"]]


def bucket_checksum(flat: torch.Tensor, algo: str | None = None) -> int:
    """Checksum of a flat uint8 buffer by ``algo`` (default: the one native to the buffer's device).

    ``xxh3_64`` (CPU): about 5x faster than zlib's CRC32 on 64 MiB (``parts_ms`` of the benchmark below;
    the sender and every receiver pay it once per bucket). ``wsum`` (GPU): a position-weighted sum of
    32-bit words computed on the device, so the bytes never cross PCIe just to be hashed. A receiver
    verifies with the sender's algorithm (the header names it), whatever its own device: a GPU trainer
    can send to a CPU parameter server."""
    algo = algo or ("xxh3_64" if flat.device.type == "cpu" else "wsum")
    if algo == "xxh3_64":
        return xxhash.xxh3_64_intdigest(memoryview(flat.cpu().numpy()))
    if algo != "wsum":
        raise BulkError(f"unknown bucket checksum algorithm {algo!r}")
    n = flat.numel() - flat.numel() % 4
    words = flat[:n].view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1
    tail = flat[n:].to(torch.int64).sum() if n < flat.numel() else 0
    return int(((words * weights).sum() + tail).item()) & 0xFFFFFFFFFFFFFFFF


def _layout(metas: Sequence[TensorMeta], align: int) -> tuple[list[dict[str, Any]], int]:
    """Each tensor's header entry (meta, byte offset, byte count) and the buffer's size."""
    entries, offset = [], 0
    for meta in metas:
        nbytes = meta.nbytes()
        entries.append({"name": meta.name, "dtype": meta.dtype, "shape": list(meta.shape), "offset": offset,
                        "nbytes": nbytes})
        offset += (nbytes + align - 1) // align * align
    return entries, offset


def flat_misaligned(metas: Sequence[TensorMeta]) -> tuple[TensorMeta, int] | None:
    """The first tensor (and its byte offset) that does not start at a multiple of its element size when the
    tensors lie back to back (``FLAT_ALIGN``); None when every one does. SGLang 0.5.23 refuses such a bucket
    before receiving it, and 0.5.6 fails viewing the bytes as the tensor's dtype (testsupport/sglang_standin.py
    cites both)."""
    entries, _ = _layout(metas, FLAT_ALIGN)
    for meta, entry in zip(metas, entries):
        if entry["offset"] % torch.empty((), dtype=meta.torch_dtype()).element_size():
            return meta, entry["offset"]
    return None


def flat_order(bucket: Bucket) -> Bucket:
    """The bucket's tensors widest element first (stable otherwise). Element sizes are powers of two, so back to
    back (``FLAT_ALIGN``) every tensor then starts at a multiple of its own element size: a bucket of fp32
    norms and bf16 matrices in any order becomes one SGLang's flattened receive takes (:func:`flat_misaligned`)."""
    return sorted(bucket, key=lambda item: -item[1].element_size())


def pack_bucket(bucket: Bucket, bucket_id: int = 0, *, align: int = _ALIGN, checksum: bool = True) -> PackedBucket:
    """Lay a bucket's tensors into one flat byte buffer and describe them in a header. ``align``: each
    tensor's offset is a multiple of it (``FLAT_ALIGN``: SGLang's layout, where a bucket whose tensors would
    not start at a multiple of their element size is refused: order it with :func:`flat_order`).
    ``checksum`` False: the header has none (SGLang's servers are never told one)."""
    if not bucket:
        raise BulkError("pack_bucket: empty bucket")
    for name, tensor in bucket:
        if not isinstance(tensor, torch.Tensor):
            raise BulkError(f"pack_bucket: {name!r} is {type(tensor).__name__}, not a tensor")
    devices = {t.device for _, t in bucket}
    if len(devices) != 1:
        raise BulkError(f"pack_bucket: tensors on several devices {sorted(map(str, devices))}")
    device = devices.pop()
    metas = bucket_metas(bucket)
    misaligned = flat_misaligned(metas) if align == FLAT_ALIGN else None
    if misaligned is not None:
        meta, offset = misaligned
        raise BulkError(f"pack_bucket: {meta.name!r} ({meta.dtype}) would start at byte {offset}, not a multiple of "
                        f"its element size: order the bucket with flat_order")
    entries, size = _layout(metas, align)
    flat = torch.empty(size if align == FLAT_ALIGN else max(size, 1), dtype=torch.uint8, device=device)
    _SyncCopier().copy(_placed(flat, entries, bucket))
    return PackedBucket(_header(bucket_id, flat, entries, checksum), flat)


def _placed(flat: torch.Tensor, entries: Sequence[dict[str, Any]], bucket: Bucket) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) byte ranges that lay ``bucket`` into ``flat``; the alignment padding between them
    is zeroed here, so the same bucket always packs to the same bytes."""
    pairs = []
    ends = [e["offset"] for e in entries[1:]] + [flat.numel()]
    for entry, end, (_, tensor) in zip(entries, ends, bucket):
        start, stop = entry["offset"], entry["offset"] + entry["nbytes"]
        if entry["nbytes"]:
            pairs.append((flat[start:stop], tensor.detach().contiguous().reshape(-1).view(torch.uint8)))
        if end > stop:
            flat[stop:end].zero_()
    return pairs


def _header(bucket_id: int, flat: torch.Tensor, entries: list[dict[str, Any]], checksum: bool) -> dict[str, Any]:
    header = {"v": _HEADER_VERSION, "bucket": bucket_id, "size": flat.numel(), "tensors": entries}
    if checksum:
        header.update(algo="xxh3_64" if flat.device.type == "cpu" else "wsum", checksum=bucket_checksum(flat))
    return header


def pack_buckets(buckets: Sequence[Bucket]) -> list[PackedBucket]:
    """Each bucket of a version packed for a link, numbered in order."""
    return [pack_bucket(b, i) for i, b in enumerate(buckets)]


class _SyncCopier:
    """How :func:`pack_to_host` moves bytes: here at once (tensors already in host memory)."""

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
        """Start copying each source into its destination; returns the wait for all of them."""
        for dst, src in pairs:
            dst.copy_(src)
        return lambda: None


class _CudaCopier(_SyncCopier):
    """Device-to-host copies on a CUDA stream of this process's own, into page-locked memory, with an event.

    The default stream runs training; copies queued behind its kernels would wait for them, and a push
    waited for there would hold the training step. The stream first waits for the work queued so far on
    the current stream (the export that made the tensors), then copies while training goes on."""

    _streams: dict[int, Any] = {}

    def __init__(self, device: torch.device) -> None:
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        self.stream = self._streams[index]

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done.synchronize


def pack_to_host(buckets: Iterable[Bucket], first_id: int = 0, in_flight: int = 2,
                 copier: _SyncCopier | None = None) -> Iterator[PackedBucket]:
    """Each bucket packed straight into host memory as it comes, numbered from ``first_id``, in order.

    A bucket on a GPU is copied tensor by tensor into its place in a page-locked host buffer on a CUDA stream
    of its own (:class:`_CudaCopier`); at most ``in_flight`` buckets are being copied at once, and a bucket's
    GPU tensors are held until their copy is done, so the GPU holds at most ``in_flight`` exported buckets
    however large the model (holding every bucket and a packed copy of each would take twice the
    weights). The checksum (XXH3) is computed on the host once the bytes are there. Buckets in host
    memory are packed at once. ``copier``: how the bytes move (tests pass their own)."""
    pending: deque[tuple[int, torch.Tensor, list[dict[str, Any]], Any, Callable[[], None]]] = deque()

    def finish() -> PackedBucket:
        bucket_id, flat, entries, _sources, wait = pending.popleft()
        wait()   # then the bucket's tensors (and contiguous copies of them) may go: nothing reads them any more
        return PackedBucket(_header(bucket_id, flat, entries, True), flat)

    for bucket_id, bucket in enumerate(buckets, first_id):
        if not bucket:
            raise BulkError("pack_to_host: empty bucket")
        devices = {t.device for _, t in bucket}
        if len(devices) != 1:
            raise BulkError(f"pack_to_host: tensors on several devices {sorted(map(str, devices))}")
        device = devices.pop()
        mover = copier or (_CudaCopier(device) if device.type == "cuda" else _SyncCopier())
        entries, size = _layout(bucket_metas(bucket), _ALIGN)
        flat = mover.buffer(max(size, 1))
        pairs = _placed(flat, entries, bucket)
        pending.append((bucket_id, flat, entries, (bucket, pairs), mover.copy(pairs)))
        while len(pending) > in_flight:
            yield finish()
    while pending:
        yield finish()


def _views(flat: torch.Tensor, entries: Sequence[dict[str, Any]], link: str) -> Bucket:
    out: Bucket = []
    for entry in entries:
        dtype = getattr(torch, entry["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise BulkError(f"link {link!r}: tensor {entry['name']!r} has unknown dtype {entry['dtype']!r}")
        raw = flat[entry["offset"]: entry["offset"] + entry["nbytes"]]
        out.append((entry["name"], raw.view(dtype).view(list(entry["shape"]))))
    return out


def unpack_bucket(packed: PackedBucket, link: str = "?") -> Bucket:
    """Verify a received bucket's checksum and return views into its flat buffer."""
    header, flat = packed.header, packed.flat
    try:
        got = bucket_checksum(flat, header.get("algo"))
    except BulkError as exc:
        raise BulkError(f"link {link!r}: bucket {header.get('bucket')}: {exc}") from None
    if got != header["checksum"]:
        raise ChecksumMismatch(link, header["bucket"], header["checksum"], got,
                               [e["name"] for e in header["tensors"]])
    return _views(flat, header["tensors"], link)


def bucket_views(packed: PackedBucket, link: str = "?") -> Bucket:
    """Views into a packed bucket's buffer, unverified: for a copy of a bucket already verified (a kept bucket
    moved to the GPU to be sent)."""
    return _views(packed.flat, packed.header["tensors"], link)


def unpack_flat(flat: torch.Tensor, metas: Sequence[TensorMeta], link: str = "?") -> Bucket:
    """Views into a buffer of SGLang's layout (``FLAT_ALIGN``), found by the metas its receiver was told."""
    entries, size = _layout(metas, FLAT_ALIGN)
    if size != flat.numel():
        raise BulkError(f"link {link!r}: flattened bucket has {flat.numel()} bytes, its tensors take {size}")
    return _views(flat, entries, link)


class BulkLink:
    """One member's end of a link. Typical use::

        link = BulkLink(LinkConfig.from_dict(spec.settings["links"]["weights"]))
        link.open(epoch=0)
        link.broadcast(bucket, src=0)            # on the sender
        bucket = link.broadcast(None, src=0)     # on every receiver
        link.reform(epoch=1)                     # after a member was restarted
        link.close()
    """

    def __init__(self, config: LinkConfig, recorder: Any = None):
        self.config = config
        # A transport.msglog.MessageLogWriter: every bucket received is logged whole and every bucket sent
        # by its header, so tools.replay can stand in for the link.
        self.recorder = recorder
        self.epoch: int | None = None
        self.members: list[str] = list(config.members)   # who formed the current epoch, in rank order
        self._server: dist.TCPStore | None = None   # the rendezvous server, on the master
        self._store: dist.TCPStore | None = None    # this member's connection to it, for the current epoch
        self._pg: Any = None
        self._rank = config.rank
        self._wanted: int | None = None   # the epoch the newest open() call is forming
        self._next_bucket = 0
        self._device = torch.device("cpu")
        self._recv_buffers = _RecvBuffers()

    # -- forming and re-forming ------------------------------------------------------------------

    def open(self, epoch: int = 0, members: Sequence[str] | None = None) -> None:
        """Join the link's rendezvous at ``epoch`` and build its process group, of every configured
        member or of ``members`` only (configured names, this one and the master among them; ranks follow
        their order, the master first). Blocks until every one of them has joined, or raises
        :class:`LinkRendezvousError`."""
        cfg = self.config
        members = list(members) if members else list(cfg.members)
        rank, world = self._place(members), len(members) if members else cfg.world_size
        self._wanted = epoch
        os.environ.update(cfg.env)  # NCCL reads its settings from the environment at init
        timeout = _dt.timedelta(seconds=cfg.timeout_s)
        try:
            if cfg.rank == 0 and self._server is None:
                self._server = rendezvous_server(cfg.master_addr, cfg.master_port, cfg.world_size, timeout)
            # A connection of its own per formation: the master may itself be the member that restarted, and
            # a formation abandoned while it waits must not hold the connection the next one talks on.
            store = dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, is_master=False,
                                  timeout=timeout, wait_for_workers=False)
            if cfg.secret_file:
                store = SignedStore(store, read_rendezvous_secret(cfg.secret_file), cfg.name)
            prefix = dist.PrefixStore(f"{cfg.name}/epoch{epoch}", store)
            pg = self._make_group(prefix, timeout, rank, world)
            if self._wanted != epoch:   # abandoned while it waited for a member: a newer one is forming
                raise BulkError(f"link {cfg.name!r} epoch {epoch}: superseded by epoch "
                                f"{self._wanted} while forming")
            self._pg, self._store = pg, store
            if cfg.rank == 0:
                store.set(f"{cfg.name}/latest_epoch", str(epoch))
        except BulkError as exc:
            self._record_formed(epoch, members, rank, str(exc))
            raise
        except Exception as exc:  # torch raises DistStoreError/RuntimeError with little context
            error = LinkRendezvousError(
                f"link {cfg.name!r} epoch {epoch}: rank {rank}/{world} could not "
                f"form the group at {cfg.master_addr}:{cfg.master_port} within {cfg.timeout_s:g} s: {exc}")
            self._record_formed(epoch, members, rank, str(error))
            raise error from exc
        self.epoch, self.members, self._rank = epoch, members, rank
        self._record_formed(epoch, members, rank)

    def _record_formed(self, epoch: int, members: list[str], rank: int, error: str | None = None) -> None:
        """Log when a formation ended, and how: an actor acts on it (the parameter server pushes the version
        it holds then), and tools.replay completes the stand-in link's formation at that place."""
        outcome: dict[str, Any] = {"epoch": epoch, "members": members, "rank": rank}
        if error is not None:
            outcome["error"] = error
        self._record("formed", "all", outcome, None)

    def _place(self, members: list[str]) -> int:
        """This member's rank among ``members`` (the configured rank when the link names no members)."""
        cfg = self.config
        if not cfg.members:
            if len(members) not in (0, cfg.world_size):
                raise BulkError(f"link {cfg.name!r}: a subset of members needs the configured member names")
            return cfg.rank
        unknown = sorted(set(members) - set(cfg.members))
        if unknown or len(set(members)) != len(members):
            raise BulkError(f"link {cfg.name!r}: members {members} are not distinct configured members "
                            f"({cfg.members})")
        if members[0] != cfg.members[0]:
            raise BulkError(f"link {cfg.name!r}: the master {cfg.members[0]!r} must come first in {members}")
        me = cfg.members[cfg.rank]
        if me not in members:
            raise BulkError(f"link {cfg.name!r}: {me!r} is not among the members {members} of this epoch")
        return members.index(me)

    def _make_group(self, store: dist.Store, timeout: _dt.timedelta, rank: int, world: int) -> Any:
        cfg = self.config
        if cfg.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            iface = cfg.env.get("GLOO_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME", "")
            if cfg.bind_addr:
                device = dist.ProcessGroupGloo.create_device(hostname=cfg.bind_addr)
            elif iface:
                device = dist.ProcessGroupGloo.create_device(interface=iface)
            elif _is_loopback(cfg.master_addr):  # a one-machine link stays on loopback
                device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
            else:
                device = dist.ProcessGroupGloo.create_device()
            opts._devices = [device]
            self._device = torch.device("cpu")
            return dist.ProcessGroupGloo(store, rank, world, opts)
        if not hasattr(dist, "ProcessGroupNCCL") or not torch.cuda.is_available():
            raise BulkError(f"link {cfg.name!r}: backend nccl needs CUDA and a torch built with NCCL")
        os.environ.update({**NCCL_ERROR_HANDLING_ENV, **cfg.env})
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        self._device = torch.device("cuda", torch.cuda.current_device())
        return dist.ProcessGroupNCCL(store, rank, world, opts)

    def reform(self, epoch: int, members: Sequence[str] | None = None) -> None:
        """Drop the current group and form a new one at ``epoch`` (after a member restarted or hung),
        of ``members`` only if given (see :meth:`open`)."""
        self._pg = None
        self.open(epoch, members)

    @property
    def rank(self) -> int:
        """This member's rank in the current epoch."""
        return self._rank

    def latest_epoch(self) -> int | None:
        """The epoch the link's master formed last, or None if it has not formed one yet."""
        if self._store is None:
            return None
        key = f"{self.config.name}/latest_epoch"
        return int(self._store.get(key)) if self._store.check([key]) else None

    def close(self) -> None:
        self._pg = None
        self._store = self._server = None
        self.epoch = None

    # -- moving buckets --------------------------------------------------------------------------

    def broadcast(self, bucket: Bucket | None, src: int = 0, epoch: int | None = None) -> Bucket:
        """Send ``bucket`` from rank ``src`` to every other member; receivers pass None and get it back.
        Returns the bucket on every rank (receivers get views into one buffer, checksum verified).
        ``epoch``: the group it is meant for; a :class:`BulkError` if the link is on another one."""
        if self._rank == src:
            if bucket is None:
                raise BulkError(f"link {self.config.name!r}: the source rank must pass a bucket")
            self._send(self._operation(epoch, root=src), self._wire_source(bucket), "all")
            return bucket
        return self._unpacked(self._receive(self._operation(epoch, root=src), str(src), verify=True))

    def broadcast_packed(self, packed: PackedBucket | None, src: int = 0,
                         epoch: int | None = None) -> PackedBucket:
        """Lower-level :meth:`broadcast` of an already packed bucket; receivers get it unverified."""
        op = self._operation(epoch, root=src)
        if packed is not None:
            self._send(op, _PackedSource(packed, self._to_link), "all")
            return packed
        return self._receive(op, str(src), verify=False)

    def send(self, bucket: Bucket, dst: int, epoch: int | None = None) -> None:
        """Point-to-point: send ``bucket`` to rank ``dst`` (which calls :meth:`recv`)."""
        self._send(self._operation(epoch, peer=dst, sending=True), self._wire_source(bucket), str(dst))

    def send_packed(self, packed: PackedBucket, dst: int, epoch: int | None = None) -> None:
        self._send(self._operation(epoch, peer=dst, sending=True), _PackedSource(packed, self._to_link), str(dst))

    def recv(self, src: int, epoch: int | None = None) -> Bucket:
        """Receive one bucket sent by rank ``src`` with :meth:`send`; checksum verified."""
        return self._unpacked(self._receive(self._operation(epoch, peer=src), str(src), verify=True))

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0, epoch: int | None = None) -> torch.Tensor:
        """One raw collective of ``tensor`` on the link's group, no header and no checksum (every rank passes
        a tensor of the same size): what a bucket broadcast is measured against (`python -m tools.bench bulk`)."""
        op = self._operation(epoch, root=src)
        tensor = self._to_link(tensor)
        op.wait(op.start(tensor, 0))
        return tensor

    def barrier(self) -> None:
        flag = torch.zeros(1, dtype=torch.int64, device=self._device)
        op = self._operation()
        op.wait(op.start_collective("allreduce", [flag]))

    # The wire: [length][header, its checksum left out][the buffer's ranges, one transfer each][checksum].
    # A bucket in host memory goes out from its own tensors (no packing copy), hashed as it goes, each range
    # sent while the next is hashed; the receiver hashes each range as it lands while the next arrives, into
    # a recycled buffer (_RecvBuffers). The header the receiver returns is the one pack_bucket writes.

    def _wire_source(self, bucket: Bucket) -> "_WireSource":
        bucket = self._on_link_device(bucket)
        bucket_id = self._take_bucket_id()
        if self._device.type == "cpu":
            return _StreamedSource(bucket, bucket_id)
        return _PackedSource(pack_bucket(bucket, bucket_id), self._to_link)   # packing on a GPU costs little

    def _send(self, op: "_Transfers", source: "_WireSource", peer: str) -> None:
        head_bytes = msgpack.packb(source.wire_header)
        works = [op.start(self._to_link(torch.tensor([len(head_bytes)], dtype=torch.int64)), 0),
                 op.start(self._to_link(torch.frombuffer(bytearray(head_bytes), dtype=torch.uint8)), 1)]
        ranges = _wire_ranges(source.wire_header["tensors"])
        for i, piece in enumerate(source.pieces(ranges)):
            works.append(op.start(piece, 2 + i))
        checksum = source.checksum()
        works.append(op.start(self._to_link(torch.tensor([_signed64(checksum)], dtype=torch.int64)), 2 + len(ranges)))
        for work in works:
            op.wait(work)
        self._record("out", peer, {**source.wire_header, "checksum": checksum}, None)

    def _receive(self, op: "_Transfers", peer: str, verify: bool) -> PackedBucket:
        length = torch.empty(1, dtype=torch.int64, device=self._device)
        op.wait(op.start(length, 0))
        head = torch.empty(int(length.item()), dtype=torch.uint8, device=self._device)
        op.wait(op.start(head, 1))
        header = self._decode_header(head)
        size = int(header["size"])
        ranges = _wire_ranges(header["tensors"])
        flat = (self._recv_buffers.take(size) if self._device.type == "cpu"
                else torch.empty(size, dtype=torch.uint8, device=self._device))
        works = [op.start(flat[a:b], 2 + i) for i, (a, b, _) in enumerate(ranges)]
        trailer = torch.empty(1, dtype=torch.int64, device=self._device)
        works.append(op.start(trailer, 2 + len(ranges)))
        pos = 0
        for a, b, _ in ranges + [(size, size, [])]:   # what no range covers is padding: zeros
            if a > pos:
                flat[pos:a].zero_()
            pos = max(pos, b)
        # XXH3 over each range as it lands (and the zeros before it), while the next one arrives
        hasher = xxhash.xxh3_64() if verify and header.get("algo") == "xxh3_64" and flat.device.type == "cpu" else None
        done = 0
        for (_, b, _), work in zip(ranges, works):
            op.wait(work)
            if hasher is not None:
                hasher.update(memoryview(flat[done:b].numpy()))
                done = b
        op.wait(works[-1])
        header["checksum"] = int(trailer.item()) & 0xFFFFFFFFFFFFFFFF
        if verify:
            if hasher is not None:
                hasher.update(memoryview(flat[done:].numpy()))
            got = hasher.intdigest() if hasher is not None else bucket_checksum(flat, header.get("algo"))
            if got != header["checksum"]:
                raise ChecksumMismatch(self.config.name, header["bucket"], header["checksum"], got,
                                       [e["name"] for e in header["tensors"]])
        self._record("in", peer, header, flat)
        return PackedBucket(header, flat)

    def _unpacked(self, packed: PackedBucket) -> Bucket:
        return _views(packed.flat, packed.header["tensors"], self.config.name)

    def _record(self, direction: str, peer: str, header: dict[str, Any], flat: torch.Tensor | None) -> None:
        if self.recorder is not None:
            from transport.bus import current_cause   # the message whose handler started this transfer

            self.recorder.record_bulk(direction, self.config.name, f"{self.config.name}#{peer}", header,
                                      flat.cpu().numpy() if direction == "in" else None, cause=current_cause.get())

    # -- internals -------------------------------------------------------------------------------

    def _to_link(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device this link's backend moves: CPU for gloo, this process's GPU for NCCL (which
        moves CUDA tensors only, lengths and headers included)."""
        return t if t.device == self._device else t.to(self._device)

    def _on_link_device(self, bucket: Bucket) -> Bucket:
        """The bucket's tensors on the device this link's backend moves (CPU for gloo, this process's GPU
        for NCCL): a trainer on a GPU may sit in a gloo link, whose send/recv read host memory only."""
        return [(name, self._to_link(t)) for name, t in bucket]

    def _take_bucket_id(self) -> int:
        self._next_bucket += 1
        return self._next_bucket - 1

    def _decode_header(self, head: torch.Tensor) -> dict[str, Any]:
        try:
            header = msgpack.unpackb(head.cpu().numpy().tobytes())
        except Exception as exc:
            raise BulkError(f"link {self.config.name!r}: undecodable bucket header: {exc}") from exc
        if not isinstance(header, dict) or header.get("v") != _HEADER_VERSION:
            raise BulkError(f"link {self.config.name!r}: bucket header version {header!r:.60} not understood")
        return header

    def _operation(self, expected: int | None = None, root: int | None = None, peer: int | None = None,
                   sending: bool = False) -> "_Transfers":
        """The transfers of one bucket (a broadcast from ``root``, or point to point with ``peer``) bound to
        the current group: every step of one transfer runs on the epoch it started on, even if the link is
        re-formed while it is blocked. With ``expected``, a transfer meant for an older epoch fails instead
        of starting on a newer one."""
        pg, epoch = self._pg, self.epoch
        if pg is None:
            raise BulkError(f"link {self.config.name!r}: not open (call open(epoch) first)")
        if expected is not None and expected != epoch:
            raise BulkError(f"link {self.config.name!r} epoch {expected}: superseded (the link is at "
                            f"epoch {epoch})")
        return _Transfers(pg, self.config.name, epoch, self._rank, _dt.timedelta(seconds=self.config.timeout_s),
                          root=root, peer=peer, sending=sending)


class _Transfers:
    """Starts and waits for the process-group operations of one bucket's transfer (a broadcast from ``root``,
    or a send to / receive from ``peer``), with the link's deadline on every wait and errors that name the
    link, epoch and rank."""

    def __init__(self, pg: Any, link: str, epoch: int | None, rank: int, timeout: _dt.timedelta,
                 root: int | None = None, peer: int | None = None, sending: bool = False) -> None:
        self.pg, self.link, self.epoch, self.rank, self.timeout = pg, link, epoch, rank, timeout
        self.root, self.peer, self.sending = root, peer, sending

    def start(self, tensor: torch.Tensor, tag: int) -> tuple[str, Any]:
        """Start the ``tag``-th piece of the transfer; wait for it with :meth:`wait`."""
        if self.root is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = self.root
            return self._call("broadcast", lambda: self.pg.broadcast([tensor], opts))
        what = "send" if self.sending else "recv"
        return self._call(what, lambda: getattr(self.pg, what)([tensor], self.peer, tag))

    def start_collective(self, what: str, tensors: list[torch.Tensor]) -> tuple[str, Any]:
        return self._call(what, lambda: getattr(self.pg, what)(tensors))

    def _call(self, what: str, fn: Callable[[], Any]) -> tuple[str, Any]:
        try:
            return what, fn()
        except Exception as exc:
            raise self._error(what, exc) from exc

    def wait(self, work: tuple[str, Any]) -> None:
        what, handle = work
        try:
            # A deadline on the waiting host thread too: an NCCL work's plain wait() returns at once and
            # leaves a hung peer to the watchdog.
            handle.wait(self.timeout)
        except Exception as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: Exception) -> BulkError:
        return BulkError(f"link {self.link!r} epoch {self.epoch}: {what} failed on rank {self.rank}: {exc}")


#: A tensor at least this large travels from its own memory, in transfers of at most _PIECE_BYTES (so that
#: one piece is hashed while the next travels); smaller ones are copied together into one run of up to
#: _RUN_BYTES (a transfer each would cost more in latency than the copy).
_DIRECT_BYTES = 1 << 20
_PIECE_BYTES = 8 << 20
_RUN_BYTES = 4 << 20


def _wire_ranges(entries: Sequence[dict[str, Any]]) -> list[tuple[int, int, list[int]]]:
    """How a bucket's buffer travels: byte ranges [start, stop) of it, one transfer each, with the entries
    they hold: a piece of a large tensor, or a run of small ones with the padding between them. What no
    range covers is padding (zeros). Sender and receiver derive the same ranges from the header."""
    ranges: list[tuple[int, int, list[int]]] = []
    run: list[int] = []
    for i, e in enumerate(entries):
        start, stop = e["offset"], e["offset"] + e["nbytes"]
        if e["nbytes"] == 0:
            continue
        if run and (e["nbytes"] >= _DIRECT_BYTES or stop - entries[run[0]]["offset"] > _RUN_BYTES):
            ranges.append((entries[run[0]]["offset"], entries[run[-1]]["offset"] + entries[run[-1]]["nbytes"], run))
            run = []
        if e["nbytes"] >= _DIRECT_BYTES:
            ranges.extend((a, min(a + _PIECE_BYTES, stop), [i]) for a in range(start, stop, _PIECE_BYTES))
        else:
            run.append(i)
    if run:
        ranges.append((entries[run[0]]["offset"], entries[run[-1]]["offset"] + entries[run[-1]]["nbytes"], run))
    return ranges


def _signed64(checksum: int) -> int:
    """A 64-bit checksum as the int64 the trailer tensor holds."""
    return checksum - (1 << 64) if checksum >= 1 << 63 else checksum


class _WireSource:
    """What a sender puts on the wire: the header (checksum left out) and the bytes of each range."""

    wire_header: dict[str, Any]

    def pieces(self, ranges: list[tuple[int, int, list[int]]]) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def checksum(self) -> int:
        raise NotImplementedError


class _PackedSource(_WireSource):
    """An already packed bucket: each range is a view of its buffer (moved to the link's device once)."""

    def __init__(self, packed: PackedBucket, to_link: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if "checksum" not in packed.header:
            raise BulkError(f"bucket {packed.header.get('bucket')}: packed without a checksum, which a link needs")
        self.packed, self.to_link = packed, to_link
        self.wire_header = {k: v for k, v in packed.header.items() if k != "checksum"}

    def pieces(self, ranges: list[tuple[int, int, list[int]]]) -> Iterator[torch.Tensor]:
        flat = self.to_link(self.packed.flat)
        for start, stop, _ in ranges:
            yield flat[start:stop]

    def checksum(self) -> int:
        return int(self.packed.header["checksum"])


class _StreamedSource(_WireSource):
    """A bucket in host memory, sent from its own tensors without packing it: the header pack_bucket would
    write, the checksum (XXH3 over the bytes pack_bucket would lay out, padding zeros included) computed
    range by range as the ranges go out."""

    def __init__(self, bucket: Bucket, bucket_id: int) -> None:
        if not bucket:
            raise BulkError("pack_bucket: empty bucket")
        for name, tensor in bucket:
            if not isinstance(tensor, torch.Tensor):
                raise BulkError(f"pack_bucket: {name!r} is {type(tensor).__name__}, not a tensor")
        self.tensors = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
        entries, size = _layout(bucket_metas(bucket), _ALIGN)
        self.size = max(size, 1)
        self.wire_header = {"v": _HEADER_VERSION, "bucket": bucket_id, "size": self.size, "tensors": entries,
                            "algo": "xxh3_64"}
        self.hasher = xxhash.xxh3_64()

    def pieces(self, ranges: list[tuple[int, int, list[int]]]) -> Iterator[torch.Tensor]:
        entries, pos = self.wire_header["tensors"], 0
        for start, stop, held in ranges:
            self.hasher.update(bytes(start - pos))   # padding before the range
            if len(held) == 1 and entries[held[0]]["nbytes"] >= _DIRECT_BYTES:   # a piece of a large tensor
                offset = start - entries[held[0]]["offset"]
                piece = self.tensors[held[0]][offset:offset + stop - start]
            else:   # a run of small tensors, laid out as in the packed buffer
                piece = torch.zeros(stop - start, dtype=torch.uint8)
                for i in held:
                    offset = entries[i]["offset"] - start
                    piece[offset:offset + entries[i]["nbytes"]].copy_(self.tensors[i])
            yield piece   # on its way while it is hashed
            self.hasher.update(memoryview(piece.numpy()))
            pos = stop
        self.hasher.update(bytes(self.size - pos))

    def checksum(self) -> int:
        return self.hasher.intdigest()


class _RecvBuffers:
    """Receive buffers a CPU link reuses once nothing outside it holds a view of them.

    A fresh buffer costs its page faults as the bytes land (`python -m tools.bench bulk` sets the kept mode
    beside a receiver that keeps every bucket, so each lands in fresh memory). Receivers mostly copy a bucket
    and let it go
    (an engine stages its own copy), so the link keeps up to ``keep`` buffers and hands one out again when
    torch's storage use count says only the link holds it. A caller that keeps its views (the parameter
    server keeps whole versions) makes the link allocate afresh, and such buffers leave the pool oldest first,
    so the ones callers let go are reused again."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.buffers: list[tuple[torch.Tensor, int]] = []   # (buffer, its use count when only the link holds it)

    @staticmethod
    def _use_count(t: torch.Tensor) -> int | None:
        count = getattr(torch._C, "_storage_Use_Count", None)   # absent from a torch: no reuse, no harm
        return None if count is None else int(count(t.untyped_storage()._cdata))

    def take(self, nbytes: int) -> torch.Tensor:
        free = [(i, buf) for i, (buf, alone) in enumerate(self.buffers) if self._use_count(buf) == alone]
        for _, buf in free:
            if buf.numel() >= nbytes:
                return buf[:nbytes]
        fresh = torch.empty(nbytes, dtype=torch.uint8)
        alone = self._use_count(fresh)
        if alone is not None:
            if len(self.buffers) >= self.keep:
                # make room: a free buffer too small for this bucket, else the oldest one a caller kept (it
                # stays theirs; the link stops waiting for it)
                self.buffers.pop(free[0][0] if free else 0)
            self.buffers.append((fresh, alone))
        return fresh


def rendezvous_server(addr: str, port: int, world_size: int, timeout: _dt.timedelta) -> dist.TCPStore:
    """The server of a rendezvous store, listening on ``addr`` only (the address its members are given:
    127.0.0.1 when every member is on one node), where a plain TCPStore server listens on every interface."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
    except OSError as exc:
        raise LinkRendezvousError(f"rendezvous address {addr}:{port}: {exc}") from exc
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        raise LinkRendezvousError(f"rendezvous address {addr}:{port}: {exc.strerror or exc}") from exc
    # the store owns the descriptor from here on (it closes it with the server)
    return dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def rendezvous_store(addr: str, port: int, rank: int, world_size: int, timeout: _dt.timedelta) -> dist.TCPStore:
    """A member's store of a torch.distributed rendezvous at ``addr:port``: rank 0 hosts it, listening on ``addr``
    only (:func:`rendezvous_server`); the others connect. What ``tcp://`` and ``env://`` init methods build,
    less the server listening on every interface."""
    if rank == 0:
        return rendezvous_server(addr, port, world_size, timeout)
    return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)


def generate_rendezvous_secret(run_dir: str | os.PathLike) -> str:
    """A fresh random secret for the run's rendezvous stores, ``run_dir/rendezvous.secret`` (0600); its path."""
    path = os.path.join(run_dir, "rendezvous.secret")
    atomic_write(path, secrets.token_hex(32) + "\n", mode=0o600)
    return path


def read_rendezvous_secret(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            secret = fh.read().strip()
    except OSError as exc:
        raise BulkError(f"rendezvous secret {path}: {exc.strerror}") from None
    if len(secret) < 32:
        raise BulkError(f"rendezvous secret {path}: {len(secret)} bytes, expected at least 32")
    return secret


class SignedStore(dist.Store):
    """A store whose values carry an HMAC-SHA256 of the run's secret over their key and bytes: a value read
    back that was not written through a SignedStore of the same secret raises :class:`RendezvousForgery`.
    Counters (``add``) cannot be signed; gloo's rendezvous sets, waits for and gets, and so do the links."""

    _MAC = 32

    def __init__(self, inner: dist.Store, secret: bytes, what: str = "rendezvous") -> None:
        super().__init__()
        self.inner, self.secret, self.what = inner, secret, what

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self.secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, self._mac(key, data) + data)

    def get(self, key: str) -> bytes:
        raw = self.inner.get(key)
        mac, data = raw[:self._MAC], raw[self._MAC:]
        if len(mac) != self._MAC or not hmac.compare_digest(mac, self._mac(key, data)):
            raise RendezvousForgery(f"{self.what}: rendezvous key {key!r} was not written by a member of this run "
                                    f"(its signature does not match the run's secret)")
        return data

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: _dt.timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: _dt.timedelta) -> None:
        self.inner.set_timeout(timeout)


def _is_loopback(addr: str) -> bool:
    return addr in ("localhost", "") or addr.startswith("127.")
