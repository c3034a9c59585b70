"""SGLang's weight-update process group, as its model runner forms and uses it: the trainer joins as rank 0
and broadcasts each bucket, every server's tensor-parallel rank r joins as rank_offset + r and receives
(/init_weights_update_group, /update_weights_from_distributed; the receiving half is the server's own, and
the stand-in server's in testsupport/sglang_standin.py). A bucket travels in SGLang's
``flattened_bucket`` layout: the one bucket format of transport/bulk.py with ``align=FLAT_ALIGN``.
"""
from __future__ import annotations

import datetime as _dt
import threading
from typing import Any

from transport.bulk import FLAT_ALIGN, NCCL_ERROR_HANDLING_ENV, pack_bucket, rendezvous_store

from .base import WeightBucket
from .sglang_routes import DEFAULT_GROUP, SGLangError

__all__ = ["join_weight_group", "drop_weight_group", "broadcast_bucket", "WeightGroupSender"]


def join_weight_group(master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str = DEFAULT_GROUP, backend: str = "nccl", timeout_s: float = 300.0) -> Any:
    """Join the weight-update process group the way SGLang's model runner does (``init_custom_process_group``):
    a TCP rendezvous at master_address:master_port (rank 0 hosts the store), keys under ``group_name``, a
    group of its own beside any default group. The trainer calls it with rank 0, each SGLang server's
    tensor-parallel rank r joins as rank_offset + r. Returns the process group."""
    import os

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = _dt.timedelta(seconds=timeout_s)
    if backend == "nccl":   # a member that fails or hangs must not take this process down (transport/bulk.py)
        os.environ.update(NCCL_ERROR_HANDLING_ENV)
    try:
        # as c10d.rendezvous(tcp://...) would, but rank 0's store listens on master_address only
        store = rendezvous_store(master_address, master_port, rank, world_size, timeout)
        store = dist.PrefixStore(group_name, store)
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                               group_name=group_name, timeout=timeout)
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    except Exception as exc:  # torch raises DistStoreError / RuntimeError with little context
        raise SGLangError(f"weight group {group_name!r}: rank {rank}/{world_size} could not join at "
                          f"{master_address}:{master_port} ({backend}) within {timeout_s:g} s: {exc}") from exc
    return pg


def drop_weight_group(pg: Any) -> None:
    """Destroy a weights group without waiting for it. Destroying a group whose peer died mid-collective
    blocks until its pending work gives up (or for good); a caller on an event loop would stop answering
    (heartbeats, HTTP) meanwhile. The group is unusable either way, so its teardown runs on its own thread."""
    import torch.distributed as dist

    def destroy() -> None:
        try:
            dist.destroy_process_group(pg)
        except Exception:  # a group whose peers died cannot always be torn down cleanly
            pass

    threading.Thread(target=destroy, name="drop-weight-group", daemon=True).start()


def broadcast_bucket(pg: Any, bucket: WeightBucket, flattened: bool, timeout_s: float = 300.0) -> None:
    """The trainer's half of one /update_weights_from_distributed call (rank 0 is the source). Every collective
    is waited for with a deadline: a server that hangs fails the bucket after ``timeout_s`` instead of holding
    the trainer (on NCCL a plain wait() would return at once and leave the hang to the watchdog)."""
    import torch.distributed as dist

    timeout = _dt.timedelta(seconds=timeout_s)
    tensors = [pack_bucket(bucket, align=FLAT_ALIGN, checksum=False).flat] if flattened else \
        [t.detach().contiguous() for _, t in bucket]
    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
    for h in handles:
        h.wait(timeout)


class WeightGroupSender:
    """The trainer side of the direct weight path: rank 0 of the group every SGLang server joins.

    Usage (the trainer, while the rollouts call ``SGLangEngine.init_weights_group`` with rank offsets
    1, 1 + tp, ...)::

        sender = WeightGroupSender(addr, port, world_size=1 + sum(tp))
        sender.open()                      # blocks until every server rank joined
        for bucket in buckets:             # while every rollout runs update_weights_from_distributed
            sender.send(bucket)
    """

    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str = DEFAULT_GROUP,
                 backend: str = "nccl", flattened: bool = True, timeout_s: float = 300.0) -> None:
        self.master_address, self.master_port, self.world_size = master_address, master_port, world_size
        self.group_name, self.backend, self.flattened, self.timeout_s = group_name, backend, flattened, timeout_s
        self.pg: Any = None

    def open(self) -> None:
        self.pg = join_weight_group(self.master_address, self.master_port, 0, self.world_size, self.group_name,
                                    self.backend, self.timeout_s)

    def send(self, bucket: WeightBucket) -> None:
        if self.pg is None:
            raise SGLangError(f"weight group {self.group_name!r}: not open (call open() first)")
        if self.backend == "nccl":  # NCCL moves CUDA tensors only; a bucket kept in host memory goes up first
            bucket = [(name, t.cuda()) for name, t in bucket]
        try:
            broadcast_bucket(self.pg, bucket, self.flattened, self.timeout_s)
        except Exception as exc:
            raise SGLangError(f"weight group {self.group_name!r}: broadcast of {len(bucket)} tensors "
                              f"failed: {exc}") from exc

    def close(self) -> None:
        if self.pg is not None:
            drop_weight_group(self.pg)
            self.pg = None
