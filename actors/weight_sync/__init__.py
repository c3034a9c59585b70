"""Weight sync: how each new version goes from the trainer to the rollouts.

One interface (``base.py``), one class per path, picked once by each actor from the topology:

| path | trainer rank 0 | parameter server | rollout |
|---|---|---|---|
| relay through the parameter server (``train_to_ps`` + ``ps_to_rollout`` links) | :class:`RelaySender` | :class:`RelayFanout` | :class:`LinkReceiver` |
| direct bulk link (one link of ``[trainer.0, rollout]``) | :class:`DirectSender` + :class:`LinkCarrier` | :class:`TrainerFanout` | :class:`LinkReceiver` |
| direct into SGLang servers (NCCL groups the servers join) | :class:`DirectSender` + :class:`ServerGroupCarrier` | :class:`TrainerFanout` | :class:`ServerGroupReceiver` |
| per pipeline stage (each stage's sender, ranks > 0) | :class:`StageSender` (beside rank 0's :class:`DirectSender`) | | |

The parameter server coordinates versions, formations and acknowledgements the same way for every path;
its fanout is the only part that knows which path carries the bytes. The server asks it to take a version,
form a group or push, and gets a result back; the fanout never calls the server. The factories below take
what each side needs from its actor as arguments, and nothing else. Every bucket travels in the one
format of ``transport/bulk.py``. The message sequence of each path is drawn in docs/rl-actors.md.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

from actors.runtime.rank_group import RankGroup
from actors.runtime.recovery import start_weights
from topology.settings import ParamServerSettings, RolloutSettings, TrainerSettings
from transport.bulk import BulkLink, LinkConfig

from .base import (Accepted, Fanout, Formation, PushEnd, StoredVersion, Transfer, WeightReceiver, WeightSender,
                   WeightSyncConfigError, WeightSyncError, WeightsRejected, link_config, weight_group_name)
from .direct import DirectSender, KeptVersions, LinkCarrier, TrainerFanout
from .receivers import LinkReceiver, ServerGroupReceiver, Verify
from .relay import PUBLISH_ATTEMPTS, RelayFanout, RelaySender, load_start_weights
from .servers import ServerGroupCarrier, ServerGroupHost, StageExport, StageSender

__all__ = ["Accepted", "Fanout", "Formation", "PushEnd", "StoredVersion", "Transfer", "WeightReceiver",
           "WeightSender", "WeightSyncConfigError", "WeightSyncError", "WeightsRejected", "link_config", "weight_group_name", "DirectSender", "KeptVersions",
           "LinkCarrier", "TrainerFanout", "LinkReceiver", "ServerGroupReceiver", "PUBLISH_ATTEMPTS", "RelayFanout",
           "RelaySender", "load_start_weights", "ServerGroupCarrier", "ServerGroupHost", "StageExport", "StageSender",
           "kept_bytes", "make_sender", "make_stage_sender", "make_fanout", "make_receiver", "sends_direct"]

MakeLink = Callable[[LinkConfig], BulkLink]   # Actor.make_link: a bulk link of this actor (logged, or a stand-in)


def sends_direct(cfg: TrainerSettings) -> bool:
    """The trainer broadcasts to the rollouts itself: a parameter server coordinates, and the trainer's only
    link is the rollouts' (no train_to_ps), so it keeps the last versions' buckets to send when asked."""
    return bool(cfg.groups.get("param_server")) and "train_to_ps" not in cfg.links and len(cfg.links) == 1


def make_sender(cfg: TrainerSettings, make_link: MakeLink, bus: Any, incarnation: str, counters: Counter,
                log: Any, weight_ranks: RankGroup | None, lock: asyncio.Lock) -> WeightSender | None:
    """Trainer rank 0's side: the relay if the topology links it to the parameter server, direct weights if
    its only link is the rollouts' (it is then that link's rank 0), none without a parameter server.
    ``make_link`` builds a bulk link (``Actor.make_link``); ``weight_ranks``: the pipeline stages' weights
    channel (None without pipeline stages); ``lock``: one formation or broadcast at a time on it."""
    param_server = (cfg.groups.get("param_server") or [None])[0]
    links = cfg.links
    if param_server is None:
        return None
    if "train_to_ps" in links:
        link = make_link(LinkConfig.from_dict(links["train_to_ps"].model_dump()))
        return RelaySender(link, bus, param_server, incarnation, counters, log)
    if not sends_direct(cfg):
        return None
    config = LinkConfig.from_dict(next(iter(links.values())).model_dump())
    link = make_link(config)
    if config.rank != 0:
        raise WeightSyncConfigError(f"links.{config.name}.members: the trainer broadcasts direct weights as "
                                    f"rank 0 and must be listed first, got {config.members}")
    return DirectSender(LinkCarrier(link, log), ServerGroupCarrier(config, weight_ranks, log),
                        bus, param_server, lock, stages=weight_ranks is not None, kept_bytes=kept_bytes(cfg))


def make_stage_sender(cfg: TrainerSettings, stage: int, sender: bool, address: str, log: Any) -> StageSender:
    """A trainer rank > 0's side with pipeline stages: ``sender`` (the stage's data- and tensor-parallel rank
    0 of a stage > 0) keeps and broadcasts its stage's layers; the other ranks only export."""
    return StageSender(stage, sender, address, log, kept_bytes(cfg))


def kept_bytes(cfg: TrainerSettings) -> int | None:
    """The host memory a trainer's direct-weights senders keep versions in (``weights_kept_mb``)."""
    return None if cfg.weights_kept_mb is None else cfg.weights_kept_mb << 20


def make_fanout(cfg: ParamServerSettings, bus: Any, log: Any, counters: Counter, make_link: MakeLink,
                run_dir: Any) -> Fanout:
    """The parameter server's side: the relay if links list it (it receives on ``train_to_ps`` and is rank 0
    of ``ps_to_rollout``), direct weights if none does (the trainer broadcasts; this server holds no bytes).
    ``bus``, ``log``, ``counters``: the parameter server's; ``run_dir``: where a resumed run's start weights
    are found."""
    timing = (cfg.ack_timeout_s, cfg.late_s)
    if not cfg.links:
        trainers, rollouts = cfg.groups.get("trainer") or [], cfg.groups.get("rollout") or []
        if not trainers or not rollouts:
            raise WeightSyncConfigError(f"links: none lists the parameter server, so weights go directly from "
                                        f"the trainer to the rollouts, but groups has trainer {trainers} and "
                                        f"rollout {rollouts}")
        return TrainerFanout(bus, log, counters, *timing, trainers[0], rollouts, start_weights(cfg, run_dir)[0])
    up = link_config(cfg.links, cfg.train_link, "train_to_ps", key="train_link")
    down = link_config(cfg.links, cfg.rollout_link, "ps_to_rollout", key="rollout_link")
    if up is None or down is None or up.name == down.name:
        raise WeightSyncConfigError(f"links: need a train link and a rollout link, got {sorted(cfg.links)}")
    if down.rank != 0:
        raise WeightSyncConfigError(f"links.{down.name}.members: the parameter server must be listed first "
                                    f"(it broadcasts as rank 0), got {down.members}")
    trainers = [m for m in up.members if m != down.members[0]]
    if len(trainers) != 1:
        raise WeightSyncConfigError(f"links.{up.name}.members: expected the trainer and the parameter "
                                    f"server, got {up.members}")
    # The train link is joined at the epoch the trainer's first WeightsPublished names (RelayFanout.accept).
    return RelayFanout(bus, log, counters, *timing, make_link(up), make_link(down), up.rank_of(trainers[0]),
                       make_link, lambda: load_start_weights(cfg, run_dir, cfg.bucket_bytes))


def make_receiver(cfg: RolloutSettings, config: LinkConfig, engine: Any, verify: Verify, make_link: MakeLink,
                  param_server: str | None, counters: Counter, log: Any, active: Callable[[], int]) -> WeightReceiver:
    """A rollout's side: with direct weights (the trainer is the link's rank 0) to an engine whose server can
    join the group itself (SGLang), the server receives; otherwise this process receives on the bulk link.
    ``weights_via_server: false`` makes an SGLang rollout receive here and load the weights from disk, as a
    LoRA run's rollouts always do (an adapter is loaded from its directory: SGLangEngine.load_adapter).
    ``active``: how many groups the rollout has in hand (for the log)."""
    direct = bool(config.members) and config.members[0] != param_server
    if direct and hasattr(engine, "init_weights_group") and cfg.weights_via_server and cfg.model.lora is None:
        tp = cfg.instance.parallel.get("tp", 1)
        return ServerGroupReceiver(config, engine, counters, log, verify, active, tp)
    return LinkReceiver(make_link(config), engine, counters, log, verify, active, cfg.gen.interruptible)
