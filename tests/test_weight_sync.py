"""The weight path end to end with real processes: trainer (this test) -> param server -> 3 rollouts.

The system runs under the Supervisor: a ParamServerActor, three RolloutActors (two interruptible, one
with ``gen.interruptible: false``, the synchronous baseline) and a MathReward. This test process plays
the trainer (its own BulkLink on train_to_ps, WeightsPublished requests) and the buffer (a Bus bound at
the buffer's endpoint that sends GenerateGroup and collects ScoredGroup / GroupReturned). The tests share
one running system and run in file order: live swap, restart of a killed rollout, clean end of the run.
"""
from __future__ import annotations

import asyncio
import functools
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import uvloop

from actors.runtime.base import ActorSpec
from actors.runtime.supervisor import Supervisor
from testsupport.bounded import run_bounded
from testsupport.local_actors import actor_spec, gloo_link, ipc_endpoints
from testsupport.tiny_models import tiny_model_dir, tiny_weight_buckets
from transport.bulk import BulkLink, LinkConfig, unpack_bucket
from transport.bus import Bus, Envelope
from transport.ports import free_port
from transport.protocol import (GenerateGroup, GroupReturned, HelloRequest, RunFinished, ScoredGroup, Task,
                                WeightsPublished, WeightsStatus, WeightsStatusRequest, WeightsStored, WorkerHello)

ROLLOUTS = ["rollout.0", "rollout.1", "rollout.2"]      # rollout.2 pauses for weights (not interruptible)
# Each actor class accepts its own keys only (topology/settings.py).
OWN_SETTINGS: dict[str, dict[str, Any]] = {
    "actors.rollout:RolloutActor": {"stats_every_s": 0},
    "actors.param_server:ParamServerActor": {"ack_timeout_s": 60, "retry_s": 1.0},
}
WAIT_S = 90.0
LINK_TIMEOUT_S = 30.0


class System:
    """The actors under a Supervisor plus this process's trainer and buffer ends, on one event loop."""

    def __init__(self, root: Path) -> None:
        self.loop = uvloop.new_event_loop()
        self.root = root
        self.run_dir = root / "run"
        self.model_dir = tiny_model_dir(root / "model")
        sock = root / "s"
        sock.mkdir()
        names = ["param_server", *ROLLOUTS, "reward.0", "trainer", "buffer"]
        self.endpoints = ipc_endpoints(sock, names)
        self.train_members, self.roll_members = ["trainer", "param_server"], ["param_server", *ROLLOUTS]
        self.ports = {"train_to_ps": free_port(), "ps_to_rollout": free_port()}
        self.scored: asyncio.Queue[ScoredGroup] = asyncio.Queue()
        self.returned: asyncio.Queue[GroupReturned] = asyncio.Queue()
        self.worker_hellos: asyncio.Queue[str] = asyncio.Queue()
        self.hashes: dict[int, str] = {}

    def links_of(self, name: str) -> dict[str, Any]:
        out = {}
        for lname, members in (("train_to_ps", self.train_members), ("ps_to_rollout", self.roll_members)):
            if name in members:
                out[lname] = gloo_link(lname, self.ports[lname], members, name, LINK_TIMEOUT_S)
        return out

    def spec(self, name: str, cls: str, index: int, **extra: Any) -> ActorSpec:
        settings: dict[str, Any] = {
            "model": {"path": str(self.model_dir), "dtype": "float32"},
            "algo": {"reward_correct": 5.0, "reward_wrong": -5.0},
            "gen": {"interruptible": True},
            "run": {"recover": "off"},
            "groups": {"param_server": ["param_server"], "rollout": ROLLOUTS, "reward": ["reward.0"],
                       "buffer": ["buffer"], "trainer": ["trainer"]},
            "instance": {"index": index, "cpu_workers": 1},
            "links": self.links_of(name),
            "bus": {"heartbeat_interval": 0.5, "heartbeat_timeout": 3.0},
            "log_console": False, "drain_timeout": 10, "seed": 3,
            **OWN_SETTINGS.get(cls, {}),
        }
        settings.update(extra)
        return actor_spec(name, cls, self.endpoints, settings, self.run_dir)

    def run(self, coro: Any, timeout: float = WAIT_S) -> Any:
        return run_bounded(coro, timeout, self.loop)

    async def start(self) -> None:
        specs = [self.spec("param_server", "actors.param_server:ParamServerActor", 0)]
        for i, name in enumerate(ROLLOUTS):
            extra = {"gen": {"interruptible": False}} if name == "rollout.2" else {}
            specs.append(self.spec(name, "actors.rollout:RolloutActor", i, **extra))
        specs.append(self.spec("reward.0", "actors.reward.math:MathReward", 0))
        self.sup = Supervisor(specs, self.run_dir, backoff_initial=0.2, ready_timeout=WAIT_S, stop_timeout=20)
        self.trainer_link = BulkLink(LinkConfig.from_dict(gloo_link("train_to_ps", self.ports["train_to_ps"],
                                                                    self.train_members, "trainer", LINK_TIMEOUT_S)))
        # The trainer is the train link's rendezvous master; the parameter server joins at the epoch the first
        # announcement names. Opened with that announcement, not now: on a loaded machine the actors take longer
        # to start than the link's rendezvous timeout.
        self.opening: asyncio.Future | None = None
        self.trainer = await Bus("trainer", self.endpoints["trainer"],
                                 {n: self.endpoints[n] for n in ["param_server", *ROLLOUTS, "reward.0"]},
                                 heartbeat_interval=None).start()
        self.buffer = await Bus("buffer", self.endpoints["buffer"],
                                {n: self.endpoints[n] for n in ["param_server", *ROLLOUTS, "reward.0"]},
                                handler=self.on_buffer, heartbeat_interval=None).start()
        await self.sup.start()

    def on_buffer(self, env: Envelope) -> None:
        if isinstance(env.msg, ScoredGroup):
            self.scored.put_nowait(env.msg)
        elif isinstance(env.msg, GroupReturned):
            self.returned.put_nowait(env.msg)
        elif isinstance(env.msg, WorkerHello):
            self.worker_hellos.put_nowait(env.sender)

    async def publish(self, version: int, seed: int) -> WeightsStored:
        buckets, digest = tiny_weight_buckets(seed)
        self.hashes[version] = digest
        if self.opening is None:
            self.opening = asyncio.ensure_future(asyncio.to_thread(self.trainer_link.open, 0))
        reply = asyncio.ensure_future(self.trainer.request(
            "param_server", WeightsPublished(version=version, n_buckets=len(buckets), weights_hash=digest),
            timeout=WAIT_S))
        await self.opening
        await asyncio.to_thread(lambda: [self.trainer_link.send(b, dst=1) for b in buckets])
        stored = await reply
        assert isinstance(stored, WeightsStored) and stored.version == version
        return stored

    async def status(self, min_version: int = -1, min_epoch: int = -1, timeout_s: float = 0.0) -> WeightsStatus:
        reply = await self.trainer.request("param_server", WeightsStatusRequest(min_version, min_epoch, timeout_s),
                                           timeout=timeout_s + 10)
        assert isinstance(reply, WeightsStatus)
        return reply

    async def generate(self, rollout: str, group_id: str, max_new_tokens: int, n: int = 2) -> None:
        prompt = [int(t) for t in torch.randint(1, 272, (12,), generator=torch.Generator().manual_seed(len(group_id)))]
        await self.buffer.send(rollout, GenerateGroup(group_id=group_id, prompt_ids=prompt, n=n,
                                                      task=Task(kind="math", answer="42"), temperature=1.0,
                                                      max_new_tokens=max_new_tokens, seed=17))

    async def collect(self, queue: asyncio.Queue, count: int) -> dict[str, Any]:
        out = {}
        while len(out) < count:
            item = await queue.get()
            out[item.group_id] = item
        return out

    async def close(self) -> None:
        if getattr(self, "sup", None) is not None:
            await self.sup.stop()
        for bus in (getattr(self, "trainer", None), getattr(self, "buffer", None)):
            if bus is not None:
                await bus.close(linger=0)
        self.trainer_link.close()


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    sysm = System(tmp_path_factory.mktemp("wsync"))
    try:
        sysm.run(sysm.start())
        yield sysm
    finally:
        sysm.run(sysm.close(), timeout=60)
        sysm.loop.close()


def test_weights_reach_every_rollout_while_generation_continues(system: System) -> None:
    async def body() -> None:
        # The link forms once all three rollouts said hello (they start at the start weights, version 0).
        st = await system.status(min_version=0, min_epoch=0, timeout_s=WAIT_S)
        assert st.reached and st.version == 0 and st.epoch >= 0, st
        # Long answers in flight on every rollout, then version 1 arrives during them.
        for r in ROLLOUTS:
            await system.generate(r, f"live-{r}", max_new_tokens=1500)
        stored = await system.publish(1, seed=1)
        assert stored.receive_seconds > 0
        st = await system.status(min_version=1, timeout_s=WAIT_S)
        assert st.reached, st
        assert st.version == 1 and st.weights_hash == system.hashes[1] and st.hash_mismatches == 0
        for name in ROLLOUTS:
            assert st.rollouts[name].version == 1 and st.rollouts[name].weights_hash == system.hashes[1], name
        groups = await system.collect(system.scored, len(ROLLOUTS))
        for r in ROLLOUTS:
            group = groups[f"live-{r}"].answers
            assert group.rollout == r and group.gen_seconds > 0 and len(group.samples) == 2
            for s in group.samples:
                assert s.finish_reason == "length" and len(s.output_ids) == 1500
                assert len(s.logprobs) == len(s.versions) == 1500
                # The answer was started under version 0 and finished under version 1, switching once.
                assert s.versions[0] == 0 and s.versions[-1] == 1, (r, s.versions[:3], s.versions[-3:])
                assert s.versions == sorted(s.versions)
                assert s.reward == -5.0 and not s.correct   # random tokens carry no boxed 42
        # Interruptible rollouts stall only for the swap at a step boundary; the synchronous baseline
        # stops generating for the whole transfer.
        assert st.rollouts["rollout.2"].stall_seconds >= st.rollouts["rollout.2"].receive_seconds
        for r in ("rollout.0", "rollout.1"):
            assert st.rollouts[r].stall_seconds < st.rollouts[r].receive_seconds + st.last_sync_seconds
        # A second version, published twice as fast as it can be pushed, still ends everywhere.
        await system.publish(2, seed=2)
        await system.publish(3, seed=3)
        st = await system.status(min_version=3, timeout_s=WAIT_S)
        assert st.reached and all(s.weights_hash == system.hashes[3] for s in st.rollouts.values()), st
        assert st.pushes <= 3 + 1  # v1, then v2 and v3 (or v3 alone when coalesced)
        print(f"\nweight sync (tiny model, 3 rollouts, gloo): last push {st.last_sync_seconds * 1000:.1f} ms; "
              f"recv {[round(s.receive_seconds * 1000, 1) for s in st.rollouts.values()]} ms, "
              f"stall {[round(s.stall_seconds * 1000, 1) for s in st.rollouts.values()]} ms")

    system.run(body(), timeout=180)


def test_killed_rollout_is_restarted_and_brought_to_the_current_version(system: System) -> None:
    async def body() -> None:
        before = await system.status()
        if before.version < 3:   # run without the test before it (alone, or that one ran on another worker)
            await system.publish(3, seed=3)
            before = await system.status(min_version=3, timeout_s=WAIT_S)
        assert before.version == 3
        os.kill(system.sup.pids()["rollout.1"], signal.SIGKILL)
        # The supervisor restarts it; its hello (version 0) makes the server re-form the link at a new
        # epoch and push version 3 to everyone.
        st = await system.status(min_version=3, min_epoch=before.epoch + 1, timeout_s=WAIT_S)
        assert st.reached, st
        assert system.sup.restarts["rollout.1"] == 1
        assert st.rollouts["rollout.1"].version == 3 and st.rollouts["rollout.1"].weights_hash == system.hashes[3]
        # The new group carries later versions and the restarted rollout generates with them.
        await system.publish(4, seed=4)
        st = await system.status(min_version=4, timeout_s=WAIT_S)
        assert st.reached and st.hash_mismatches == 0, st
        await system.generate("rollout.1", "after-restart", max_new_tokens=20)
        group = (await system.collect(system.scored, 1))["after-restart"]
        assert all(s.versions == [4] * 20 for s in group.answers.samples)

    system.run(body(), timeout=180)


def test_run_finished_hands_unfinished_groups_back(system: System) -> None:
    async def body() -> None:
        for r in ROLLOUTS:
            await system.generate(r, f"unfinished-{r}", max_new_tokens=4000)
        # RunFinished comes from the trainer's bus, which has no order with the buffer's: a rollout that got it
        # first had stopped before the group arrived, and the group was never handed back. A rollout answers the
        # buffer's HelloRequest after taking the buffer's earlier messages, so its WorkerHello says it has the group.
        while not system.worker_hellos.empty():      # the hellos every worker sent when it started
            system.worker_hellos.get_nowait()
        for r in ROLLOUTS:
            await system.buffer.send(r, HelloRequest())
        answered: set[str] = set()
        while answered != set(ROLLOUTS):
            sender = await system.worker_hellos.get()
            answered |= {sender} & set(ROLLOUTS)
        for name in ["param_server", *ROLLOUTS, "reward.0"]:
            await system.trainer.send(name, RunFinished(step=4))
        returned = await system.collect(system.returned, len(ROLLOUTS))
        assert set(returned) == {f"unfinished-{r}" for r in ROLLOUTS}
        assert all(g.reason in ("draining", "aborted") for g in returned.values()), returned
        codes = await asyncio.gather(*(c.proc.wait() for c in system.sup.children.values()))
        assert codes == [0] * len(codes), {n: c.proc.returncode for n, c in system.sup.children.items()}
        assert system.scored.empty()

    system.run(body(), timeout=120)


def test_sglang_layout_is_the_one_bucket_format_without_padding() -> None:
    # SGLang's flattened_bucket is the link's packed buffer with the tensors back to back: a server told
    # the metas finds every tensor, and a buffer of the wrong size is refused naming both sizes.
    from transport.bulk import FLAT_ALIGN, BulkError, bucket_metas, pack_bucket, unpack_bucket, unpack_flat

    gen = torch.Generator().manual_seed(0)
    bucket = [("a", torch.randn(3, 5, generator=gen).bfloat16()), ("b", torch.randn(7, generator=gen).bfloat16())]
    flat = pack_bucket(bucket, align=FLAT_ALIGN, checksum=False)
    assert torch.equal(flat.flat, torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket]))
    assert "checksum" not in flat.header and flat.metas() == bucket_metas(bucket)
    for (name, want), (got_name, got) in zip(bucket, unpack_flat(flat.flat, bucket_metas(bucket))):
        assert name == got_name and torch.equal(want, got)
    with pytest.raises(BulkError, match="has 45 bytes, its tensors take 44"):
        unpack_flat(torch.zeros(45, dtype=torch.uint8), bucket_metas(bucket))
    linked = pack_bucket(bucket)   # the link's layout: aligned offsets and a checksum
    assert linked.header["tensors"][1]["offset"] == 32 and linked.metas() == bucket_metas(bucket)
    assert all(torch.equal(t, u) for (_, t), (_, u) in zip(bucket, unpack_bucket(linked)))


def test_kept_versions_stream_in_and_are_capped_by_bytes() -> None:
    from actors.weight_sync import KeptVersions

    def version(v: int, seen: list, kept: KeptVersions):
        for i in range(3):   # 3 buckets of 4 KiB each
            if i == 0:
                seen.append(sorted(kept.versions))   # what is kept while this version comes in
            yield [(f"w{i}", torch.full((1024,), float(v)))]

    size = 3 * 4096
    # unset: the newest version while the next comes in (two at most), never three
    kept, seen = KeptVersions(), []
    for v in (1, 2, 3):
        kept.keep(v, version(v, seen, kept))
    assert seen == [[], [1], [2]] and sorted(kept.versions) == [2, 3]
    assert kept.nbytes(3) == size and float(unpack_bucket(kept.get(3)[1])[0][1][0]) == 3.0
    with pytest.raises(RuntimeError, match="version 1 is not kept"):
        kept.get(1)
    # room for 2.5 versions: two, and while a third comes in, one
    kept, seen = KeptVersions(int(2.5 * size)), []
    for v in (1, 2, 3):
        kept.keep(v, version(v, seen, kept))
    assert seen == [[], [1], [2]] and sorted(kept.versions) == [2, 3]
    # room for 3.5: three kept, two while the next comes in
    kept, seen = KeptVersions(int(3.5 * size)), []
    for v in (1, 2, 3, 4):
        kept.keep(v, version(v, seen, kept))
    assert seen == [[], [1], [1, 2], [2, 3]] and sorted(kept.versions) == [2, 3, 4]
    # less than a version: nothing while one comes in, and the newest is kept whatever its size
    kept, seen = KeptVersions(size // 2), []
    for v in (1, 2):
        kept.keep(v, version(v, seen, kept))
    assert seen == [[], []] and sorted(kept.versions) == [2]


def test_each_actor_picks_its_weights_path_once_from_the_topology() -> None:
    from types import SimpleNamespace

    from actors.weight_sync import (DirectSender, LinkReceiver, RelaySender, ServerGroupReceiver,
                                    WeightSyncConfigError, make_receiver, make_sender)
    from topology.settings import RolloutSettings, TrainerSettings

    def settings(links: dict[str, Any], settings_cls: Any = RolloutSettings, **values: Any) -> Any:
        return settings_cls.model_validate({"links": links, "groups": {"param_server": ["param_server"]}, **values})

    def sender(cfg: Any) -> Any:   # what a trainer hands the factory: its settings and its parts, no more
        return make_sender(cfg, BulkLink, None, "", Counter(), None, None, asyncio.Lock())

    def receiver(cfg: Any, config: LinkConfig, engine: Any) -> Any:
        return make_receiver(cfg, config, engine, None, BulkLink, "param_server", Counter(), None, lambda: 0)

    relay = {"train_to_ps": gloo_link("train_to_ps", 1, ["trainer.0", "param_server"], "trainer.0")}
    direct = gloo_link("weights", 2, ["trainer.0", "rollout.0"], "trainer.0")
    trainer = functools.partial(settings, settings_cls=TrainerSettings)
    assert isinstance(sender(trainer(relay)), RelaySender)
    direct_sender = sender(trainer({"weights": direct}, weights_kept_mb=100))
    assert isinstance(direct_sender, DirectSender) and direct_sender.kept.max_bytes == 100 << 20
    with pytest.raises(WeightSyncConfigError, match="must be listed first"):
        sender(trainer({"weights": gloo_link("weights", 2, ["rollout.0", "trainer.0"], "trainer.0")}))
    alone = trainer(relay)
    alone.groups = {}
    assert sender(alone) is None   # no parameter server: nothing to publish to

    server = SimpleNamespace(init_weights_group=None)   # an engine whose server joins the group itself
    on_rollout = LinkConfig.from_dict(gloo_link("weights", 2, ["trainer.0", "rollout.0"], "rollout.0"))
    from_ps = LinkConfig.from_dict(gloo_link("ps_to_rollout", 3, ["param_server", "rollout.0"], "rollout.0"))
    assert isinstance(receiver(settings({}), on_rollout, server), ServerGroupReceiver)
    assert isinstance(receiver(settings({}, weights_via_server=False), on_rollout, server), LinkReceiver)
    assert isinstance(receiver(settings({}), from_ps, server), LinkReceiver)   # the relay
    assert isinstance(receiver(settings({}), on_rollout, object()), LinkReceiver)
