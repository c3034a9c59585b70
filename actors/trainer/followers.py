"""Trainer ranks > 0: they make rank 0's engine calls in its order, over the control channel of
actors/runtime/rank_group.py (which explains the channels), until rank 0 says stop."""
from __future__ import annotations

import concurrent.futures
from typing import Any

from actors.runtime.rank_group import EXPORT, SAVE, TRAIN, RankGroup
from actors.runtime.threads import on_daemon_thread
from actors.trainer.step import StepConfig, train_share
from transport.messages import decode
from transport.protocol import BatchTensors


def follow_rank0(ranks: RankGroup, weight_ranks: RankGroup | None, engine: Any, step_cfg: StepConfig,
                 ref_engine: Any, stage_sender: Any, log: Any, name: str) -> None:
    """Ranks > 0 (blocking): rank 0's engine calls and, with pipeline stages, its weights commands beside them
    (``stage_sender.follow``, each channel on a thread of its own), until rank 0 has stopped both. The weights
    channel stops last: returning at the first STOP would leave rank 0 alone in the run's last broadcast. A
    failure on either channel is raised at once."""
    loops = [on_daemon_thread("follow-commands", follow_commands, ranks, engine, step_cfg, ref_engine, stage_sender,
                              log)]
    if weight_ranks is not None:
        loops.append(on_daemon_thread("follow-weights", stage_sender.follow, weight_ranks, name))
    done, _ = concurrent.futures.wait(loops, return_when=concurrent.futures.FIRST_EXCEPTION)
    for loop in done:
        loop.result()


def follow_commands(ranks: RankGroup, engine: Any, step_cfg: StepConfig, ref_engine: Any, stage_sender: Any,
                    log: Any) -> None:
    """Ranks > 0: make rank 0's engine calls, in its order, until it says stop (blocking). A pipeline
    stage's sender (``stage_sender``, actors/weight_sync/servers.py) keeps what it exports."""
    while True:
        command, args = ranks.next_command()
        if command == TRAIN:
            (version,) = args
            _, share = decode(ranks.recv_frames())
            if not isinstance(share, BatchTensors):
                raise TypeError(f"trainer rank {ranks.rank}: expected a batch share, got {type(share).__name__}")
            ranks.gather(train_share(engine, share, step_cfg, version, ref_engine))
        elif command == EXPORT:
            bucket_bytes, version = args
            buckets = engine.export_weights(bucket_bytes)
            if stage_sender is not None:   # keeps them as they come (a stage's sender) or only exports
                ranks.gather(stage_sender.keep(version, buckets))
            else:
                for _ in buckets:   # the export's collectives need every rank
                    pass
        elif command == SAVE:
            engine.save(*args)
        else:
            log.info("trainer_rank_done", rank=ranks.rank)
            return
