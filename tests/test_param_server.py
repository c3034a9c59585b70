"""ParamServerActor in-process with this test as the trainer: hash check on publish, storage, status,
stale versions, configuration errors. (The push to rollouts is in test_weight_sync.py.)"""
from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import pytest

from actors.runtime.base import ActorSpec
from actors.engines.checkpoint import hf_state_dict, load_model
from actors.param_server.actor import ParamServerActor
from actors.weight_sync import load_start_weights
from actors.weights import weights_hash
from testsupport.bounded import run_bounded
from testsupport.local_actors import actor_spec, gloo_link, ipc_endpoints
from testsupport.tiny_models import tiny_weight_buckets
from topology.experiment import ExperimentConfig
from transport.bulk import BulkLink, LinkConfig
from transport.bus import Bus, RemoteError
from transport.ports import free_port
from transport.protocol import (LinkReform, RolloutHello, ServerDown, WeightsPublished, WeightsStatus,
                                WeightsStatusRequest, WeightsStored)

run = functools.partial(run_bounded, timeout=60.0)


def spec(tmp_path: Path, model_dir: Path, ports: dict[str, int], roll_members: list[str]) -> ActorSpec:
    links = {"train_to_ps": gloo_link("train_to_ps", ports["train_to_ps"], ["trainer", "param_server"], "param_server"),
             "ps_to_rollout": gloo_link("ps_to_rollout", ports["ps_to_rollout"], roll_members, "param_server")}
    return actor_spec("param_server", "actors.param_server:ParamServerActor",
                      ipc_endpoints(tmp_path, ["param_server", "trainer", "rollout.0"]),
                      {"model": {"path": str(model_dir), "dtype": "float32"}, "run": {"recover": "off"},
                       "links": links, "log_console": False, "bus": {"heartbeat_interval": None},
                       "bucket_bytes": 32 << 10}, tmp_path, env={})


async def trainer_side(tmp_path: Path, s: ActorSpec, port: int) -> tuple[BulkLink, asyncio.Future, Bus]:
    """This test as the trainer: its end of the train link (joining at epoch 0, as the parameter server does
    at the epoch the first announcement names) and its bus."""
    link = BulkLink(LinkConfig.from_dict(gloo_link("train_to_ps", port, ["trainer", "param_server"], "trainer")))
    opening = asyncio.ensure_future(asyncio.to_thread(link.open, 0))
    bus = await Bus("trainer", f"ipc://{tmp_path}/trainer", {"param_server": s.endpoint},
                    heartbeat_interval=None).start()
    return link, opening, bus


async def publish(trainer: Bus, link: BulkLink, opening: asyncio.Future, version: int, seed: int | None = None,
                  **fields: Any) -> tuple[Any, str]:
    """The trainer's publish of `version` (tiny buckets drawn from `seed`, else from the version): its
    announcement (the buckets' own hash unless `fields` names another), then the buckets on `link` once it is
    open; the parameter server's reply and the buckets' hash."""
    buckets, digest = tiny_weight_buckets(version if seed is None else seed)
    reply = asyncio.ensure_future(trainer.request("param_server", WeightsPublished(
        version=version, n_buckets=len(buckets), **{"weights_hash": digest, **fields}), timeout=30))
    await opening
    await asyncio.to_thread(lambda: [link.send(b, dst=1) for b in buckets])
    return await reply, digest


def test_start_weights_hash_matches_a_loaded_model(tmp_path: Path, random_model_dir: Path) -> None:
    model_dir = random_model_dir
    cfg = ExperimentConfig.model_validate({"model": {"path": str(model_dir), "dtype": "float32"},
                                           "run": {"recover": "off"}})
    stored = load_start_weights(cfg, tmp_path, 32 << 10)
    assert stored.version == 0 and len(stored.packed) > 1
    assert stored.weights_hash == weights_hash(hf_state_dict(load_model(str(model_dir))).items())


def test_hashes_of_parts_combine_into_the_hash_of_the_whole(random_model_dir: Path) -> None:
    # A pipeline-parallel trainer hashes each stage's tensors where they live and combines the digests.
    from actors.weights import combine_digests, tensor_digests

    named = list(hf_state_dict(load_model(str(random_model_dir))).items())
    stage0, stage1 = named[: len(named) // 2], named[len(named) // 2:]
    assert combine_digests(tensor_digests(stage1) + tensor_digests(stage0)) == weights_hash(named)
    changed = [(n, t + 1 if i == 3 else t) for i, (n, t) in enumerate(named)]
    assert weights_hash(changed) != weights_hash(named)
    renamed = [(n + "x" if i == 0 else n, t) for i, (n, t) in enumerate(named)]
    assert weights_hash(renamed) != weights_hash(named)


def test_publish_checks_the_hash_and_stores_the_newest(tmp_path: Path, random_model_dir: Path) -> None:
    ports = {"train_to_ps": free_port(), "ps_to_rollout": free_port()}
    s = spec(tmp_path, random_model_dir, ports, ["param_server", "rollout.0"])

    async def main() -> None:
        actor = ParamServerActor(s)
        task = asyncio.create_task(actor.run())
        trainer_link, opening, trainer = await trainer_side(tmp_path, s, ports["train_to_ps"])

        with pytest.raises(RemoteError, match=r"version 1: buckets hash to \w+, the trainer announced bogus"):
            await publish(trainer, trainer_link, opening, 1, seed=1, weights_hash="bogus")
        stored, h1 = await publish(trainer, trainer_link, opening, 1, seed=1)
        assert isinstance(stored, WeightsStored) and stored.version == 1
        status = await trainer.request("param_server", WeightsStatusRequest(), timeout=10)
        assert isinstance(status, WeightsStatus) and status.version == 1 and status.weights_hash == h1
        assert status.epoch == -1 and status.pushes == 0   # no rollout said hello: no link yet
        assert not status.rollouts["rollout.0"].hello
        # A version not newer than the stored one is acknowledged but does not replace it.
        stale, _ = await publish(trainer, trainer_link, opening, 1, seed=9)
        assert isinstance(stale, WeightsStored)
        status = await trainer.request("param_server", WeightsStatusRequest(), timeout=10)
        assert status.weights_hash == h1 and actor.counters["versions_stored"] == 1
        # A trainer that announces no hash (it hashes only where a receiver checks one) is answered at once;
        # the server hashes what it received itself, after answering, and pushes with that.
        stored, h2 = await publish(trainer, trainer_link, opening, 2, seed=2, weights_hash="")
        assert isinstance(stored, WeightsStored) and stored.version == 2
        for _ in range(100):
            status = await trainer.request("param_server", WeightsStatusRequest(), timeout=10)
            if status.version == 2:
                break
            await asyncio.sleep(0.05)   # polling the background hash: bounded
        assert status.version == 2 and status.weights_hash == h2
        actor.request_stop("test over")
        assert await task == 0
        await trainer.close(linger=0)

    run(main())


def test_a_restarted_trainer_is_met_on_a_fresh_train_link_at_the_epoch_it_names(tmp_path: Path,
                                                                             random_model_dir: Path) -> None:
    # A trainer restarted in place counts its train-link epochs from 0 again, the epoch the server's link to the
    # old process was still at. That announcement was taken for the old (broken) link: the server received on it
    # and failed, while the new trainer waited at the rendezvous for the link's whole timeout (30 s in the
    # embedded default, every step held) before it moved on to epoch 1.
    ports = {"train_to_ps": free_port(), "ps_to_rollout": free_port()}
    s = spec(tmp_path, random_model_dir, ports, ["param_server", "rollout.0"])

    async def main() -> None:
        actor = ParamServerActor(s)
        task = asyncio.create_task(actor.run())
        old_link, opening, trainer = await trainer_side(tmp_path, s, ports["train_to_ps"])

        stored, _ = await publish(trainer, old_link, opening, 1, link_epoch=0, incarnation="pid-1")
        assert isinstance(stored, WeightsStored)
        old_link.close()   # the trainer process is gone; its restart opens the train link at epoch 0 again
        new_link = BulkLink(LinkConfig.from_dict(gloo_link("train_to_ps", ports["train_to_ps"],
                                                           ["trainer", "param_server"], "trainer")))
        opening = asyncio.ensure_future(asyncio.to_thread(new_link.open, 0))
        stored, _ = await publish(trainer, new_link, opening, 2, link_epoch=0, incarnation="pid-2")
        assert isinstance(stored, WeightsStored) and stored.version == 2
        status = await trainer.request("param_server", WeightsStatusRequest(), timeout=10)
        assert status.version == 2 and status.weights_hash == tiny_weight_buckets(2)[1]
        actor.request_stop("test over")
        assert await task == 0
        await trainer.close(linger=0)
        new_link.close()

    run(main())
    log = (tmp_path / "logs" / "param_server.jsonl").read_text()
    assert log.count('"train_link_formed"') == 2 and '"weights_receive_failed"' not in log


def test_a_rollout_whose_server_died_is_waited_for_until_its_hello(tmp_path: Path, random_model_dir: Path) -> None:
    # ServerDown makes a rollout count as not yet hello'd: no group is formed that would wait out the link
    # timeout for ranks that cannot join. rollout.1 never says hello here, so nothing is formed at all.
    ports = {"train_to_ps": free_port(), "ps_to_rollout": free_port()}
    s = spec(tmp_path, random_model_dir, ports, ["param_server", "rollout.0", "rollout.1"])
    s.peers["rollout.1"] = f"ipc://{tmp_path}/rollout.1"

    async def main() -> None:
        actor = ParamServerActor(s)
        task = asyncio.create_task(actor.run())
        rollout = await Bus("rollout.0", s.peers["rollout.0"], {"param_server": s.endpoint},
                            heartbeat_interval=None).start()

        async def hello_flag() -> bool:
            status = await rollout.request("param_server", WeightsStatusRequest(), timeout=30)
            return status.rollouts["rollout.0"].hello

        await rollout.send("param_server", RolloutHello(version=0))
        assert await hello_flag()
        await rollout.send("param_server", ServerDown(restarts=0))
        assert not await hello_flag()
        await rollout.send("param_server", RolloutHello(version=0))   # its server is back
        assert await hello_flag()
        assert actor.counters["link_formations"] == 0
        # One process's hellos: one sent while its server was down still says the weights it had (version 3);
        # the one after the server's restart says version 0, its launch weights. Once that second hello was
        # taken for a repeat (same incarnation), and the server was never pushed to again: the run stalled.
        await rollout.send("param_server", ServerDown(restarts=0))
        await rollout.send("param_server", RolloutHello(version=3, incarnation="pid-1"))
        await rollout.send("param_server", RolloutHello(version=0, incarnation="pid-1"))
        status = await rollout.request("param_server", WeightsStatusRequest(), timeout=30)
        assert status.rollouts["rollout.0"].hello and status.rollouts["rollout.0"].version == 0, status
        actor.request_stop("test over")
        assert await task == 0
        await rollout.close(linger=0)

    run(main())
    log = (tmp_path / "logs" / "param_server.jsonl").read_text()
    assert '"rollout_server_down"' in log and '"no_hello": ["rollout.0", "rollout.1"]' in log


def test_a_restarted_rollout_is_left_out_until_its_new_process_says_hello(tmp_path: Path,
                                                                          random_model_dir: Path) -> None:
    # Killed and restarted by its supervisor, a rollout's new process pings before it is ready: it counted as
    # alive and hello'd (its old process's hello), so a group was formed with it that waited out the link
    # timeout for a member that could not join. Its first ping now says it is a new process. (rollout.1 never
    # says hello: no group is formed at all, so none waits for rollout.0 here.)
    ports = {"train_to_ps": free_port(), "ps_to_rollout": free_port()}
    s = spec(tmp_path, random_model_dir, ports, ["param_server", "rollout.0", "rollout.1"])
    s.peers["rollout.1"] = f"ipc://{tmp_path}/rollout.1"

    async def main() -> None:
        actor = ParamServerActor(s)
        task = asyncio.create_task(actor.run())

        def rollout() -> Bus:   # a process of rollout.0: its pings carry its bus's incarnation
            return Bus("rollout.0", s.peers["rollout.0"], {"param_server": s.endpoint}, heartbeat_interval=0.05)

        old = await rollout().start()

        async def hello_flag(bus: Bus) -> bool:
            status = await bus.request("param_server", WeightsStatusRequest(), timeout=30)
            return status.rollouts["rollout.0"].hello

        await old.send("param_server", RolloutHello(version=0, incarnation="old"))
        assert await hello_flag(old)
        await old.close(linger=0)
        new = await rollout().start()
        assert not await hello_flag(new)           # its first ping went before this request
        assert actor.bus.stats["peer_restarted"] == 1
        await new.send("param_server", RolloutHello(version=0, incarnation="new"))
        assert await hello_flag(new)
        assert actor.counters["link_formations"] == 0
        actor.request_stop("test over")
        assert await task == 0
        await new.close(linger=0)

    run(main())
    log = (tmp_path / "logs" / "param_server.jsonl").read_text()
    assert '"rollout_restarted"' in log


def test_a_rollout_whose_server_is_still_starting_does_not_hold_back_new_weights(tmp_path: Path,
                                                                                random_model_dir: Path) -> None:
    # A rollout reports ready only once its SGLang server is up (minutes at 7B); the run starts without it.
    # While it has not said hello the first group waited for it, so a new version reached nobody and the
    # trainer stalled at the staleness bound. Now the first group forms once a version waits for the others.
    ports = {"train_to_ps": free_port(), "ps_to_rollout": free_port()}
    s = spec(tmp_path, random_model_dir, ports, ["param_server", "rollout.0", "rollout.1"])
    s.peers["rollout.1"] = f"ipc://{tmp_path}/rollout.1"

    async def main() -> list[LinkReform]:
        actor = ParamServerActor(s)
        task = asyncio.create_task(actor.run())
        trainer_link, opening, trainer = await trainer_side(tmp_path, s, ports["train_to_ps"])
        reforms: asyncio.Queue[LinkReform] = asyncio.Queue()
        rollout = await Bus("rollout.0", s.peers["rollout.0"], {"param_server": s.endpoint},
                            handler=lambda env: isinstance(env.msg, LinkReform) and reforms.put_nowait(env.msg),
                            heartbeat_interval=None).start()
        await rollout.send("param_server", RolloutHello(version=0))       # rollout.1's server is not up yet
        stored, _ = await publish(trainer, trainer_link, opening, 1)
        assert isinstance(stored, WeightsStored)
        first = await asyncio.wait_for(reforms.get(), 30)
        actor.request_stop("test over")
        await task
        await trainer.close(linger=0)
        await rollout.close(linger=0)
        trainer_link.close()
        return [first]

    [first] = run(main())
    assert first.members == ["param_server", "rollout.0"]   # formed without the late one


def test_param_server_must_be_first_on_the_rollout_link(tmp_path: Path, random_model_dir: Path) -> None:
    ports = {"train_to_ps": free_port(), "ps_to_rollout": free_port()}
    s = spec(tmp_path, random_model_dir, ports, ["rollout.0", "param_server"])
    actor = ParamServerActor(s)
    assert run(actor.run()) == 1
    log = (tmp_path / "logs" / "param_server.jsonl").read_text()
    assert "the parameter server must be listed first" in log


def test_a_rollout_that_restarted_during_a_failed_formation_is_not_put_on_probation(tmp_path: Path,
                                                                                      random_model_dir: Path) -> None:
    # A killed rollout comes back alive before its new process says hello; a formation started then is
    # abandoned by that hello. Probation is for one back from a hang: treating the restarted rollout as hung
    # would keep it out of the weights for probation_s (a test run would end before it got any).
    import time

    from transport.protocol import RolloutWeights

    s = spec(tmp_path, random_model_dir, {"train_to_ps": 1, "ps_to_rollout": 2},
             ["param_server", "rollout.0", "rollout.1"])

    async def main() -> None:
        actor = ParamServerActor(s)
        started = time.monotonic()
        actor.rollouts = {"rollout.0": RolloutWeights(hello=True, hello_at=started - 10),
                          "rollout.1": RolloutWeights(hello=True, hello_at=started + 1)}   # hello during it
        actor.policy.last_good, actor.policy.probation_s = {"rollout.0"}, 30.0   # set in on_start, which needs the links
        actor.failed_with(["rollout.0", "rollout.1"], started=started)
        assert actor._ready() == ["rollout.0", "rollout.1"]
        actor.rollouts["rollout.1"].hello_at = started - 1       # the same process, back from a hang
        actor.failed_with(["rollout.0", "rollout.1"], started=started)
        assert actor._ready() == ["rollout.0"] and actor.counters["rollouts_on_probation"] == 1

    run(main())


def test_the_evaluators_store_keeps_every_nth_version_and_wakes_a_waiting_request() -> None:
    from collections import Counter

    import torch

    from actors.param_server.eval_store import EvalWeightsStore
    from actors.weight_sync import StoredVersion
    from transport.bulk import pack_buckets
    from transport.protocol import EvalWeightsRequest

    def stored(version: int) -> StoredVersion:
        packed = pack_buckets([[("w", torch.full((4,), float(version)))]])
        return StoredVersion(version, f"hash-{version}", packed, sum(p.flat.numel() for p in packed))

    async def scenario() -> None:
        counters: Counter = Counter()
        store = EvalWeightsStore(every=2, holds_weights=True, counters=counters)
        store.keep(stored(0))
        store.keep(stored(1))   # not a multiple of 2: the kept one stays version 0
        newest = lambda: 5   # noqa: E731
        got = await store.serve(EvalWeightsRequest(version=-1, after=-1, bucket=0, timeout_s=0), newest)
        assert (got.version, got.weights_hash, got.n_buckets, got.newest) == (0, "hash-0", 1, 5)
        waiting = asyncio.ensure_future(store.serve(EvalWeightsRequest(version=-1, after=0, bucket=0, timeout_s=30),
                                                    newest))
        await asyncio.sleep(0)
        assert not waiting.done()
        store.keep(stored(2))
        got = await asyncio.wait_for(waiting, 30)
        assert got.version == 2 and torch.equal(got.flat, stored(2).packed[0].flat) and counters["eval_buckets_sent"] == 2
        asked = await store.serve(EvalWeightsRequest(version=0, after=-1, bucket=0, timeout_s=0), newest)
        assert asked.version == -1 and not asked.unavailable   # replaced by a newer multiple
        closing = asyncio.ensure_future(store.serve(EvalWeightsRequest(version=-1, after=2, bucket=0, timeout_s=30),
                                                    newest))
        await asyncio.sleep(0)
        store.close()   # the server drains: a waiting request returns at once, empty
        assert (await asyncio.wait_for(closing, 30)).version == -1
        direct = EvalWeightsStore(every=2, holds_weights=False, counters=counters)
        direct.keep(stored(4))
        refused = await direct.serve(EvalWeightsRequest(version=-1, after=-1, bucket=0, timeout_s=0), newest)
        assert refused.version == -1 and "direct weights" in refused.unavailable

    run(scenario())
