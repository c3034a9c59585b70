"""Direct weights into the rollouts' SGLang servers: the trainer hosts an NCCL group per pipeline stage
(SGLang's weight-update group), each server joins at its rank offset, and every bucket is broadcast in
SGLang's flattened layout while each server runs /update_weights_from_distributed for it.

Rank 0 hosts stage 0's group (:class:`ServerGroupCarrier`); with a pipeline-parallel trainer each other
stage's sender hosts its own and broadcasts its own layers (:class:`StageSender`, on a thread of its own
that follows rank 0's weights channel: HOST, BROADCAST, STOP, see actors/runtime/rank_group.py).
"""
from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from actors.runtime.rank_group import BROADCAST, HOST, RankGroup
from actors.runtime.threads import in_thread, on_daemon_thread
from transport.bulk import LinkConfig, PackedBucket, TensorMeta, bucket_views, unpack_bucket
from transport.protocol import LinkFormed, LinkReform

from .base import Bucket, WeightSender, WeightSyncError, push_stream, weight_group_name
from .direct import Carrier, KeptVersions


@dataclass
class StageExport:
    """What a pipeline stage's sender (a rank > 0) exported and keeps: rank 0 announces it with its own."""

    stage: int
    specs: list[list[TensorMeta]]
    digests: list[Any]


class ServerGroupHost:
    """One trainer rank's weights group with the rollouts' servers: hosted on a free port, joined on a thread
    while the servers join, broadcast into once every rank is in."""

    def __init__(self, address: str, backend: str, timeout_s: float, bind_addr: str = "") -> None:
        self.address, self.backend, self.timeout_s = address, backend, timeout_s
        self.bind_addr = bind_addr or "0.0.0.0"
        self.epoch: int | None = None
        self._sender: Any = None
        self._joined: concurrent.futures.Future | None = None

    def host(self, epoch: int, world_size: int, group_name: str) -> int:
        """Start a group of this epoch (closing the previous one); returns its port at once."""
        from actors.engines.sglang_group import WeightGroupSender
        from transport.ports import free_port

        self.close()
        port = free_port(self.bind_addr)
        sender = WeightGroupSender(self.address, port, world_size, group_name=group_name, backend=self.backend,
                                   timeout_s=self.timeout_s)
        joined = on_daemon_thread(f"join-{group_name}", sender.open)
        self._sender, self._joined, self.epoch = sender, joined, epoch
        return port

    def broadcast(self, version: int, epoch: int, packed: list[PackedBucket], link_name: str) -> None:
        """One SGLang-format broadcast per bucket (the servers run /update_weights_from_distributed for
        each), once every server rank has joined; blocking."""
        sender, joined = self._sender, self._joined
        if sender is None or joined is None or self.epoch != epoch:
            raise RuntimeError(f"no weights group of epoch {epoch} is hosted here")
        try:
            joined.result(timeout=self.timeout_s + 5)
            with push_stream(self.backend == "nccl"):
                for bucket in packed:
                    views = unpack_bucket(bucket, link_name)   # checked in host memory, where it is kept
                    if self.backend == "nccl":   # up to the GPU, on the push's own stream
                        views = bucket_views(PackedBucket(bucket.header, bucket.flat.cuda(non_blocking=True)))
                    sender.send(views)
        except BaseException:
            # Tear the broken group down now: the servers still inside its collective then fail at once
            # instead of waiting out their own timeout, and the next group can form.
            self.close()
            raise

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._sender, self._joined, self.epoch = None, None, None


class ServerGroupCarrier(Carrier):
    """Trainer rank 0: stage 0's group here; with pipeline stages, rank 0 leads every other stage's sender
    to host its own (HOST) and to broadcast with it (BROADCAST)."""

    def __init__(self, config: LinkConfig, weight_ranks: RankGroup | None, log: Any) -> None:
        self.config, self.weight_ranks, self.log = config, weight_ranks, log
        self.host = ServerGroupHost(config.master_addr, config.backend, config.timeout_s, config.bind_addr)

    @property
    def epoch(self) -> int | None:   # type: ignore[override]
        return self.host.epoch

    async def form(self, msg: LinkReform) -> LinkFormed:
        """Host a fresh group per stage and answer with them at once; the joining finishes in the background
        while the servers come (the first broadcast waits for it)."""
        cfg, epoch, world_size = self.config, msg.epoch, msg.world_size
        t0 = time.monotonic()
        port = self.host.host(epoch, world_size, weight_group_name(cfg.name, epoch, 0))
        addrs, ports = [cfg.master_addr], [port]
        if self.weight_ranks is not None:
            ranks = self.weight_ranks

            def host_stages() -> list[Any]:
                ranks.lead(HOST, epoch, world_size, cfg.name, cfg.backend, cfg.timeout_s)
                return ranks.gather(None) or []

            for _, addr, stage_port in sorted(h for h in await in_thread(host_stages) if h is not None):
                addrs.append(addr)
                ports.append(stage_port)
        self.log.info("weights_group_hosted", epoch=epoch, ports=ports, world_size=world_size)
        return LinkFormed(epoch=epoch, seconds=time.monotonic() - t0, master_addrs=addrs,
                          master_ports=ports)

    async def broadcast(self, version: int, epoch: int, packed: list[PackedBucket]) -> None:
        await in_thread(self._broadcast, version, epoch, packed)

    def _broadcast(self, version: int, epoch: int, packed: list[PackedBucket]) -> None:
        """Stage 0's buckets on its group; with pipeline stages every other stage's sender broadcasts its
        own at the same time (the servers take the stages in order), and says whether that worked."""
        if self.weight_ranks is None:
            self.host.broadcast(version, epoch, packed, self.config.name)
            return
        self.weight_ranks.lead(BROADCAST, version, epoch)
        failure: Exception | None = None
        try:
            self.host.broadcast(version, epoch, packed, self.config.name)
        except Exception as exc:   # the other stages still answer: gather before raising
            failure = exc
        errors = [e for e in self.weight_ranks.gather("") or [] if e]
        if failure is not None:
            raise failure
        if errors:
            raise RuntimeError("; ".join(errors))

    def close(self) -> None:
        self.host.close()


class StageSender(WeightSender):
    """A pipeline stage's sender (data- and tensor-parallel rank 0 of a stage > 0): keeps its own layers'
    buckets of each version and broadcasts them on the group it hosts, as rank 0 leads. Rank 0 announces
    them (:meth:`keep` hands it their description) and forms the groups; this side follows its commands
    (:meth:`follow`). On a rank that is not a stage's sender it only takes part in the export."""

    def __init__(self, stage: int, sender: bool, address: str, log: Any, kept_bytes: int | None = None) -> None:
        self.stage, self.sender, self.address, self.log = stage, sender, address, log
        self.kept = KeptVersions(kept_bytes)
        self.host: ServerGroupHost | None = None

    def take(self, version: int, buckets: Iterable[Bucket]) -> list[PackedBucket]:
        """Keep this stage's buckets of ``version`` as they are exported; on a rank that is not a stage's
        sender, iterate them to the end (the export's collectives need every rank) and keep none."""
        if not self.sender:
            for _ in buckets:
                pass
            return []
        return self.kept.keep(version, buckets)

    async def publish(self, version: int, packed: list[PackedBucket], stages: list[Any]) -> None:
        raise WeightSyncError("a pipeline stage's buckets are announced by trainer rank 0 with its own (the "
                              "StageExport that keep() hands it), not by the stage")

    def keep(self, version: int, buckets: Iterable[Bucket]) -> StageExport | None:
        """:meth:`take`, and what rank 0 announces of it: the buckets' names and shapes (for the specs every
        server receives by). None on ranks that are not a stage's sender."""
        packed = self.take(version, buckets)
        # No digests: the servers are checked by the version they report.
        return StageExport(self.stage, [p.metas() for p in packed], []) if self.sender else None

    def close(self) -> None:
        if self.host is not None:
            self.host.close()

    def follow(self, weight_ranks: RankGroup, name: str) -> None:
        """Rank 0's weights commands, until STOP (blocking: run on a thread of its own, as they come while a
        training step runs). A stage's sender hosts and broadcasts; the other ranks only answer."""
        link_name = ""
        while True:
            command, args = weight_ranks.next_command()
            if command == HOST:
                epoch, world_size, link_name, backend, timeout_s = args
                hosted = None
                if self.sender:
                    if self.host is None:
                        self.host = ServerGroupHost(self.address, backend, timeout_s)
                    port = self.host.host(epoch, world_size, weight_group_name(link_name, epoch, self.stage))
                    hosted = (self.stage, self.address, port)
                    self.log.info("weights_group_hosted", epoch=epoch, stage=self.stage, port=port,
                                  world_size=world_size)
                weight_ranks.gather(hosted)
            elif command == BROADCAST:
                version, epoch = args
                error = ""
                if self.sender:
                    t0 = time.monotonic()
                    try:
                        if self.host is None:
                            raise RuntimeError(f"no weights group of epoch {epoch} is hosted here")
                        self.host.broadcast(version, epoch, self.kept.get(version), link_name)
                    except Exception as exc:
                        error = f"stage {self.stage} ({name}): {exc}"
                    self.log.info("stage_weights_sent", version=version, epoch=epoch, stage=self.stage,
                                  buckets=len(self.kept.versions.get(version, [])),
                                  seconds=round(time.monotonic() - t0, 4), error=error or None)
                weight_ranks.gather(error)
            else:
                if self.host is not None:
                    self.host.close()
                return
