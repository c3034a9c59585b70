"""A pipeline-parallel trainer's two control channels (actors/runtime/rank_group.py, actors/trainer/followers.py) on a real gloo world: a rank > 0
leaves only when rank 0 has stopped both, so the run's last weights broadcast, which rank 0 can still be
leading when the last step's STOP goes out, completes; and rank 0 leads nothing after its STOP."""
from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import torch.distributed as dist

from actors.runtime.rank_group import BROADCAST, STOP, RankGroup
from actors.trainer.followers import follow_rank0
from actors.weight_sync import StageSender

TIMEOUT_S = 60


class _QueueLog:
    """The follower's log: each event's name goes to the leader, which waits on what the follower did."""

    def __init__(self, events: Any) -> None:
        self.events = events

    def info(self, event: str, **_: Any) -> None:
        self.events.put(event)


def _channels(store: str, rank: int) -> tuple[RankGroup, RankGroup]:
    """The engine calls' channel, then the weights channel, created in the trainer's order."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    return RankGroup(timeout_s=TIMEOUT_S), RankGroup(timeout_s=TIMEOUT_S)


def _leader(store: str, events: Any, out: Any) -> None:
    ranks, weights = _channels(store, 0)
    try:
        # The end of the run as it happened (trainer.0, trainer.1, test_pipeline_stages_...): the parameter
        # server asked for the last version's broadcast, and the last step ended while it ran.
        weights.lead(BROADCAST, 4, 0)
        ranks.lead(STOP)
        first = events.get(timeout=TIMEOUT_S)   # rank 1 has handled the engine calls' STOP
        errors = weights.gather("")             # every stage's answer to the broadcast
        weights.lead(STOP)
        try:
            weights.lead(BROADCAST, 5, 0)
            late = "led after STOP"
        except RuntimeError as exc:
            late = str(exc)
        out.put(("ok", first, errors, late))
    except Exception as exc:
        out.put(("failed", repr(exc)))
    finally:
        dist.destroy_process_group()


def _follower(store: str, events: Any) -> None:
    ranks, weights = _channels(store, 1)
    log = _QueueLog(events)
    code = 0
    try:
        follow_rank0(ranks, weights, None, None, None, StageSender(1, False, "127.0.0.1", log), log, "trainer.1")
    except BaseException:
        code = 1
    events.close()
    events.join_thread()
    os._exit(code)   # as actors.runtime.run ends an actor: what still runs on its other threads ends with it


def test_a_rank_leaves_only_once_rank0_has_stopped_the_weights_channel_too(tmp_path) -> None:
    ctx = mp.get_context("fork")
    events, out = ctx.Queue(), ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_leader, args=(store, events, out)), ctx.Process(target=_follower, args=(store, events))]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=2 * TIMEOUT_S)
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()
    assert result[:3] == ("ok", "trainer_rank_done", ["", ""]), result
    assert "told to stop" in result[3], result
    assert [p.exitcode for p in procs] == [0, 0]
