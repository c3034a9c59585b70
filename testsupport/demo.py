"""A small real pair of actors for launcher tests and as a demo of the runtime: pingers and an echoer.

Each :class:`Pinger` sends ``rounds`` :class:`DemoPing` requests to the echoer over the bus and checks
every :class:`DemoPong`. When the topology puts the two groups in a bulk link (``settings["links"]``),
every pinger also asks for a tensor bucket, which the echoer sends point-to-point over that link
(gloo on CPU); the pinger checks checksum and content against the same seeded bucket. A pinger then
reports :class:`DemoDone` to the echoer and finishes (exit 0). The echoer finishes once every pinger
has reported, after writing ``RUN_DIR/demo/summary.json``. So a demo run ends by itself, cleanly.

Settings: :class:`DemoSettings`. ``crash_once``: a pinger exits 3 after its first round unless
``RUN_DIR/demo/<name>.crashed`` exists (a supervisor restart inside a launched run); ``crash_always``: exits 3
every time (the supervisor giving up).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from typing import Any

import torch

from pydantic import Field

from actors.runtime.base import Actor, handles
from topology.settings import ActorSettings
from transport.bulk import BulkLink, LinkConfig
from transport.messages import Message, message

__all__ = ["DemoPing", "DemoPong", "DemoBulkRequest", "DemoBulkSent", "DemoDone", "Echoer", "Pinger",
           "demo_bucket"]


@message("demo.ping")
class DemoPing(Message):
    seq: int
    payload: str


@message("demo.pong")
class DemoPong(Message):
    seq: int
    payload: str
    echoed_by: str
    node: str


@message("demo.bulk_request")
class DemoBulkRequest(Message):
    rank: int
    elems: int
    seed: int


@message("demo.bulk_sent")
class DemoBulkSent(Message):
    tensors: int
    nbytes: int


@message("demo.done")
class DemoDone(Message):
    rounds: int
    bulk_ok: bool
    node: str
    restarts_seen: int
    cores: list[int]  # the CPU affinity this process ran with (the topology's `cpus:` placement)


def demo_bucket(elems: int, seed: int = 7) -> list[tuple[str, torch.Tensor]]:
    """The bucket both ends can rebuild from the seed, so the receiver can check every byte."""
    g = torch.Generator().manual_seed(seed)
    return [("w", torch.randn(elems, generator=g)), ("b", torch.randn(max(elems // 8, 1), generator=g).bfloat16()),
            ("step", torch.tensor(seed))]


def _node_name() -> str:
    # Fake SLURM nodes share one hostname; the SLURM node name tells them apart.
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class DemoSettings(ActorSettings):
    rounds: int = Field(10, ge=1, description="pings each pinger sends")
    tensor_elems: int = Field(1024, ge=1, description="elements of the bucket a pinger asks for over the link")
    link: str | None = Field(None, description="the bulk link (unset: the first one listed)")
    crash_once: bool = Field(False, description="a pinger exits 3 after its first round, once")
    crash_always: bool = Field(False, description="a pinger exits 3 after its first round, every time")


def _link_config(actor: Actor) -> LinkConfig | None:
    links = actor.cfg.links
    if not links:
        return None
    return LinkConfig.from_dict(links[actor.cfg.link or next(iter(links))].model_dump())


class Echoer(Actor):
    """Answers pings; serves a bucket over the bulk link to each pinger that asks for one."""

    Settings = DemoSettings
    cfg: DemoSettings

    async def on_start(self) -> None:
        self.expected = set(self.cfg.groups.get("ping", []))
        self.done: dict[str, dict[str, Any]] = {}
        self.link: BulkLink | None = None
        self.link_lock = asyncio.Lock()
        config = _link_config(self)
        if config is not None:
            self.link = self.make_link(config)
            # Forming the group is collective: it completes once every pinger has joined too.
            self.spawn(asyncio.to_thread(self.link.open, 0), name="link_open")

    @handles(DemoPing)
    def on_ping(self, msg: DemoPing) -> DemoPong:
        self.counters["pings"] += 1
        return DemoPong(seq=msg.seq, payload=msg.payload, echoed_by=self.name, node=_node_name())

    @handles(DemoBulkRequest)
    async def on_bulk_request(self, msg: DemoBulkRequest) -> DemoBulkSent:
        if self.link is None:
            raise RuntimeError("no bulk link configured")
        async with self.link_lock:  # one point-to-point transfer at a time on the link
            while self.link.epoch is None:
                await asyncio.sleep(0.01)  # group formation runs in its thread; bounded by the link timeout
            bucket = demo_bucket(msg.elems, msg.seed)
            await asyncio.to_thread(self.link.send, bucket, msg.rank)
        self.counters["buckets_sent"] += 1
        return DemoBulkSent(tensors=len(bucket), nbytes=sum(t.numel() * t.element_size() for _, t in bucket))

    @handles(DemoDone)
    def on_done(self, msg: DemoDone, env: Any) -> None:
        self.done[env.sender] = {"rounds": msg.rounds, "bulk_ok": msg.bulk_ok, "node": msg.node,
                                 "restarts_seen": msg.restarts_seen, "cores": msg.cores}
        self.log.info("pinger_done", pinger=env.sender, **self.done[env.sender])
        if self.expected and self.expected <= set(self.done):
            out = self.run_dir / "demo"
            out.mkdir(parents=True, exist_ok=True)
            summary = {"echo": self.name, "node": _node_name(), "pings": self.counters["pings"],
                       "buckets_sent": self.counters["buckets_sent"], "pingers": self.done}
            (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
            self.request_stop("every pinger is done")


class Pinger(Actor):
    """Pings the echoer ``rounds`` times, fetches one bucket over the bulk link, reports, finishes."""

    Settings = DemoSettings
    cfg: DemoSettings

    async def on_ready(self) -> None:
        self.spawn(self.work(), name="work")

    async def work(self) -> None:
        rounds = self.cfg.rounds
        echo = self.cfg.groups.get("echo", ["echo"])[0]
        marker = self.run_dir / "demo" / f"{self.name}.crashed"
        marker.parent.mkdir(parents=True, exist_ok=True)
        restarts_seen = 1 if marker.exists() else 0
        config = _link_config(self)
        link = self.make_link(config) if config is not None else None
        opening = asyncio.ensure_future(asyncio.to_thread(link.open, 0)) if link is not None else None
        for seq in range(rounds):
            payload = f"{self.name}:{seq}"
            reply = await self.bus.request(echo, DemoPing(seq=seq, payload=payload), timeout=30)
            if not (isinstance(reply, DemoPong) and reply.seq == seq and reply.payload == payload):
                raise RuntimeError(f"bad pong for round {seq}: {reply!r}")
            if seq == 0 and (self.cfg.crash_always or (self.cfg.crash_once and not marker.exists())):
                marker.write_text("crashed once on purpose\n")
                self.log.warning("crashing_on_purpose")
                os._exit(3)
        bulk_ok = False
        if link is not None:
            await asyncio.wait_for(opening, timeout=config.timeout_s + 5)
            elems, seed = self.cfg.tensor_elems, 7 + config.rank
            sent, bucket = await asyncio.gather(
                self.bus.request(echo, DemoBulkRequest(rank=config.rank, elems=elems, seed=seed),
                                 timeout=config.timeout_s),
                asyncio.to_thread(link.recv, 0))  # checksum verified inside recv
            expected = demo_bucket(elems, seed)
            same = [n == m and torch.equal(a, b) for (n, a), (m, b) in zip(bucket, expected)]
            bulk_ok = isinstance(sent, DemoBulkSent) and len(bucket) == len(expected) and all(same)
            self.log.info("bucket_received", ok=bulk_ok, tensors=len(bucket), same=same, reply=repr(sent)[:80])
        await self.bus.send(echo, DemoDone(rounds=rounds, bulk_ok=bulk_ok, node=_node_name(),
                                           restarts_seen=restarts_seen, cores=sorted(os.sched_getaffinity(0))))
        self.request_stop("rounds done")
