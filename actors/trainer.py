"""The trainer actor: takes a batch, recomputes proximal log-probs, trains decoupled PPO, publishes weights.

One training step (version v -> v + 1):

    BatchTensors (B groups x n answers, token columns as tensor frames) from the buffer; in a trainer
    world, trainer.0 sends each other rank only the tokens of its data-parallel replica's sequences
    -> pack prompt+answer sequences (padding-free), loss mask on answer tokens
    -> proximal log-probs under the current weights (before this step's updates)
    -> group-normalised advantages (algo.advantages), then `algo.ppo_minibatches` optimizer updates,
       each on micro-batches under a token budget (algo.packing), loss = decoupled PPO (algo.ppo)
       normalised by the minibatch's global token count
    -> VersionUpdate(v + 1) to the buffer (opens the staleness gate)
    -> weights to the parameter server over the train_to_ps bulk link (WeightsPublished + buckets), or,
       with direct weights (a link of [trainer.0, rollout] and none to the parameter server, as GPU
       topologies have), kept here and broadcast to the rollouts when the parameter server asks
    -> metrics (metrics.jsonl + TensorBoard), and a checkpoint every `run.checkpoint_every_steps`

Versions count training steps; the engine's own optimizer-step counter (several per step) only drives
the learning-rate schedule. The run ends after `run.total_steps` with a final checkpoint and RunFinished
to every actor.

A trainer that dies mid-run is not silently restarted into a different history: the buffer, rollouts and
parameter server already hold data and weights newer than the last checkpoint. A restarted trainer
therefore stops the run with a message; relaunching with `run.recover: auto` resumes every actor
consistently from the last checkpoint.
"""
from __future__ import annotations

import asyncio
import os
import concurrent.futures
import json
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.base import Actor, ActorSpec, handles
from actors.engines.base import PackedBatch, TokenLogProbs, TrainEngine, engine_device, require_device
from actors.engines.torch_train import TorchTrainEngine, TrainConfig
from actors.param_server import WeightsStatus, WeightsStatusRequest, pack_buckets
from actors.rank_group import BROADCAST, EXPORT, HOST, SAVE, STOP, TRAIN, RankGroup
from actors.recovery import (COMPLETE, checkpoint_dir, complete_checkpoints, mark_complete, mark_run_finished,
                             recovering, restarted_in_place, start_weights)
from actors.rollout import in_thread, weight_group_name
from actors.weights import TensorDigest, combine_digests, tensor_digests
from algo.advantages import AdvNorm, KLEstimator, compute_advantages, kl_penalty
from algo.packing import allocate_micro_batches, split_by_rank
from algo.ppo import PPOConfig, PPOStats, count_loss_tokens, ppo_loss
from algo.staleness import sample_staleness
from transport.bulk import BulkError, BulkLink, LinkConfig, PackedBucket, TensorMeta, bucket_metas, unpack_bucket
from transport.bus import BusError
from transport.messages import decode, encode
from transport.protocol import (Batch, BatchRequest, BatchTensors, CheckpointDone, CheckpointRequest, HelloRequest, LinkFormed,
                                LinkReform, RunFinished, VersionUpdate, WeightsBroadcast, WeightsBroadcastDone,
                                WeightsPublished, WeightsStored)


def trainer_placement(settings: dict[str, Any]) -> dict[str, str]:
    """Where and how the trainer's engine runs, as the engine will be built and as --dry-run prints it: the
    device (the instance's GPU by default), the parameter dtype (Megatron: bf16 by default on a GPU; the
    torch backend keeps float32 weights and autocasts to bf16 on a GPU), the parallel layout and the
    process-group backend of its world."""
    backend = str(settings.get("backend", "torch"))
    device = engine_device(settings)
    parallel = (settings.get("instance") or {}).get("parallel") or {}
    if backend == "megatron":
        dtype = "bfloat16" if bool(settings.get("bf16", device == "cuda")) else "float32"
    else:
        dtype = "float32 (bf16 autocast)" if device == "cuda" else "float32"
    layout = " ".join(f"{k}={parallel[k]}" for k in ("dp", "tp", "pp") if k in parallel) or "dp=1"
    if backend == "megatron":
        memory = (("sp " if settings.get("sequence_parallel") and int(parallel.get("tp", 1)) > 1 else "")
                  + f"recompute={settings.get('recompute', 'none')} "
                  + f"logprob_chunk={settings.get('logprob_chunk_tokens') or 'off'}")
    else:
        memory = "-"
    return {"engine": backend, "device": device, "dtype": dtype, "parallel": layout, "memory": memory,
            "process_group": "nccl" if device == "cuda" else "gloo"}


def make_train_engine(settings: dict[str, Any], model_dir: str, version: int) -> TrainEngine:
    """The trainer backend named by `backend` (torch here; megatron on GPU clusters)."""
    backend = settings.get("backend", "torch")
    if backend not in ("torch", "megatron"):
        raise ValueError(f"backend: {backend!r} is not available in this build (use 'torch' or 'megatron')")
    require_device(engine_device(settings))
    if backend == "megatron":
        return _make_megatron_engine(settings, model_dir, version)
    algo = settings.get("algo") or {}
    cfg = TrainConfig(lr=float(algo.get("lr", 2e-5)), adam_eps=float(algo.get("adam_eps", 1e-5)),
                      betas=(float(algo.get("adam_beta1", 0.9)), float(algo.get("adam_beta2", 0.999))),
                      grad_clip=float(algo.get("grad_clip", 1.0)), weight_decay=float(algo.get("weight_decay", 0.0)),
                      seed=int(settings.get("seed", 1)), device=engine_device(settings))
    return TorchTrainEngine(model_dir, cfg, version=version)


def make_reference_engine(settings: dict[str, Any]) -> TrainEngine:
    """The KL penalty's reference (`algo.kl_coef` > 0): an engine of the same backend and layout holding the
    run's starting weights (model.path, also when the run resumes from a checkpoint); only its log-probs are
    used, so it never changes."""
    path = (settings.get("model") or {}).get("path")
    if not path:
        raise TrainerConfigError("algo.kl_coef > 0: model.path (the reference model's weights) is not set")
    return make_train_engine(settings, str(path), 0)


def _make_megatron_engine(settings: dict[str, Any], model_dir: str, version: int) -> TrainEngine:
    """`backend: megatron` (actors/engines/megatron.py): the same algo settings plus the trainer group's
    `parallel` from the topology (tp, pp; dp is what the world size leaves). Every trainer rank builds one."""
    from actors.engines.megatron import MegatronConfig, MegatronTrainEngine  # optional dependency
    algo = settings.get("algo") or {}
    parallel = (settings.get("instance") or {}).get("parallel") or {}
    cfg = MegatronConfig(lr=float(algo.get("lr", 2e-5)), adam_eps=float(algo.get("adam_eps", 1e-5)),
                         betas=(float(algo.get("adam_beta1", 0.9)), float(algo.get("adam_beta2", 0.999))),
                         grad_clip=float(algo.get("grad_clip", 1.0)),
                         weight_decay=float(algo.get("weight_decay", 0.0)), seed=int(settings.get("seed", 1)),
                         device=engine_device(settings),
                         tensor_parallel=int(parallel.get("tp", 1)), pipeline_parallel=int(parallel.get("pp", 1)),
                         bf16=trainer_placement(settings)["dtype"] == "bfloat16",
                         sequence_parallel=bool(settings.get("sequence_parallel", False)),
                         recompute=str(settings.get("recompute", "none")),
                         logprob_chunk_tokens=int(settings.get("logprob_chunk_tokens", 0)))
    return MegatronTrainEngine(model_dir, cfg, version=version)


def batch_to_sequences(batch: Batch) -> dict[str, Any]:
    """Flatten a Batch into per-sequence token lists and per-token fields aligned with the tokens.

    loss_mask marks answer tokens; `behav` holds their behaviour log-probs (aligned: position t holds
    log p(x_t | x_<t)); `versions` the weight version that sampled each answer token (-1 on prompts).
    """
    seqs, mask, behav, versions, rewards, correct, group_ids, no_eos, out_lens = [], [], [], [], [], [], [], [], []
    for g_idx, group in enumerate(batch.groups):
        p = list(group.prompt_ids)
        for s in group.samples:
            seqs.append(p + list(s.output_ids))
            mask.append([0.0] * len(p) + [1.0] * len(s.output_ids))
            behav.append([0.0] * len(p) + [float(x) for x in s.logprobs])
            versions.append([-1.0] * len(p) + [float(v) for v in s.versions])
            rewards.append(float(s.reward))
            correct.append(bool(s.correct))
            group_ids.append(g_idx)
            no_eos.append(s.finish_reason != "stop")
            out_lens.append(len(s.output_ids))
    return {"seqs": seqs, "loss_mask": mask, "behav": behav, "versions": versions, "rewards": rewards,
            "correct": correct, "group_ids": group_ids, "no_eos": no_eos, "out_lens": out_lens}


@dataclass
class StepConfig:
    """How one training step uses a batch (from the `algo` settings)."""

    ppo: PPOConfig = field(default_factory=PPOConfig)
    minibatches: int = 1
    max_tokens_per_mb: int = 4096
    temperature: float = 1.0
    decoupled: bool = True    # False: proximal = behaviour log-probs, i.e. standard PPO
    group_std: bool = True
    adv_norm: AdvNorm = "batch"
    kl_coef: float = 0.0      # > 0: a KL penalty to the frozen starting weights, in the token rewards
    kl_estimator: KLEstimator = "k1"

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> "StepConfig":
        algo = settings.get("algo") or {}
        cap = algo.get("behav_imp_weight_cap", 5.0)
        ppo = PPOConfig(eps_low=float(algo.get("eps_clip", 0.2)),
                        eps_high=float(algo["eps_clip_high"]) if algo.get("eps_clip_high") is not None else None,
                        dual_clip=float(algo["dual_clip"]) if algo.get("dual_clip") else None,
                        behav_cap=float(cap) if cap else None)
        return cls(ppo=ppo, minibatches=int(algo.get("ppo_minibatches", 1)),
                   max_tokens_per_mb=int(algo.get("max_tokens_per_mb", 4096)),
                   temperature=float((settings.get("gen") or {}).get("temperature", 1.0)) or 1.0,
                   decoupled=bool(algo.get("decoupled", True)), group_std=bool(algo.get("group_std", True)),
                   adv_norm=algo.get("adv_norm", "batch"), kl_coef=float(algo.get("kl_coef", 0.0)),
                   kl_estimator=algo.get("kl_estimator", "k1"))


# A parameter server restarted in place answers within a few seconds; each attempt is bounded by the link's
# timeout, so this bounds how long a step waits for one that does not come back.
PUBLISH_ATTEMPTS = 10
# A request to the buffer is asked again each time the buffer restarts while it waits (a restarted buffer
# says so with HelloRequest); this bounds how many restarts one request outlives.
BUFFER_ATTEMPTS = 10


class TrainerConfigError(ValueError):
    """The trainer's settings or placement cannot work; the message says why."""


@dataclass
class StageExport:
    """What a pipeline stage's sender (a rank > 0) exported and keeps: rank 0 announces it with its own."""

    stage: int
    specs: list[list[TensorMeta]]
    digests: list[TensorDigest]


class ServerGroupHost:
    """One trainer rank's weights group with the rollouts' servers (SGLang's weight-update group): hosted on
    a free port, joined on a thread while the servers join, broadcast into once every rank is in. Rank 0
    hosts stage 0's; each other pipeline stage's sender hosts its own."""

    def __init__(self, address: str, backend: str, timeout_s: float, bind_addr: str = "") -> None:
        self.address, self.backend, self.timeout_s = address, backend, timeout_s
        self.bind_addr = bind_addr or "0.0.0.0"
        self.generation: int | None = None
        self._sender: Any = None
        self._joined: concurrent.futures.Future | None = None

    def host(self, generation: int, world_size: int, group_name: str) -> int:
        """Start a group of this generation (closing the previous one); returns its port at once."""
        from actors.engines.sglang import WeightGroupSender
        from transport.ports import free_port

        self.close()
        port = free_port(self.bind_addr)
        sender = WeightGroupSender(self.address, port, world_size, group_name=group_name, backend=self.backend,
                                   timeout_s=self.timeout_s)
        joined: concurrent.futures.Future = concurrent.futures.Future()

        def join() -> None:
            try:
                sender.open()
            except BaseException as exc:
                joined.set_exception(exc)
            else:
                joined.set_result(None)

        threading.Thread(target=join, name=f"join-{group_name}", daemon=True).start()
        self._sender, self._joined, self.generation = sender, joined, generation
        return port

    def broadcast(self, packed: list[PackedBucket], link_name: str) -> None:
        """One SGLang-format broadcast per bucket (the servers run /update_weights_from_distributed for
        each), once every server rank has joined; blocking."""
        sender, joined = self._sender, self._joined
        if sender is None or joined is None:
            raise RuntimeError("no weights group is hosted")
        try:
            joined.result(timeout=self.timeout_s + 5)
            for bucket in packed:
                if self.backend == "nccl":   # kept in host memory: up to the GPU, and checked there
                    bucket = PackedBucket(bucket.header, bucket.flat.cuda(non_blocking=True))
                sender.send(unpack_bucket(bucket, link_name))
        except BaseException:
            # Tear the broken group down now: the servers still inside its collective then fail at once
            # instead of waiting out their own timeout, and the next group can form.
            self.close()
            raise

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._sender, self._joined, self.generation = None, None, None


class TrainerActor(Actor):
    placement = staticmethod(trainer_placement)   # what --dry-run prints for the group

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        # The buffer restarted: what was asked of it must be asked again (see _ask_buffer).
        self._buffer_back = asyncio.Event()
        self._buffer_lost = False

    async def on_start(self) -> None:
        s = self.settings
        instance = s.get("instance") or {}
        count = int(instance.get("count", 1))
        world = instance.get("world")
        if count > 1 and not world:
            raise TrainerConfigError(f"the trainer group has {count} instances but no world_port: its instances "
                                     f"would each train on their own. Set world_port on the group (topology)")
        if world and s.get("backend", "torch") != "megatron":
            raise TrainerConfigError(f"a trainer world of {count} ranks needs backend: megatron (the torch backend "
                                     f"trains on one process)")
        pp = int((instance.get("parallel") or {}).get("pp", 1)) if world else 1
        if pp > 1 and "train_to_ps" in (s.get("links") or {}):
            raise TrainerConfigError("parallel.pp > 1 needs direct weights to rollouts whose servers join the "
                                     "weights group (SGLang): every pipeline stage sends its own layers on a group "
                                     "of its own; the relay through the parameter server (train_to_ps) takes one "
                                     "sender (docs/engines-megatron.md)")
        if restarted_in_place(self):
            # The buffer keeps every batch served since the last checkpoint, so a trainer restarted alone
            # resumes from that checkpoint and is served the same batches again. A world cannot take one
            # rank back (the others wait in a collective for it): that needs a relaunch.
            if world:
                raise RuntimeError(f"{self.name} was restarted inside a running launch, but a trainer world "
                                   f"cannot take one rank back: relaunch the run (run.recover: auto resumes "
                                   f"from the last checkpoint)")
            if not recovering(s):
                raise RuntimeError(f"{self.name} was restarted inside a running launch, which resumes from the "
                                   f"last checkpoint, but run.recover is off: relaunch the run")
            self.log.warning("trainer_restarted_in_place")
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        self.step_cfg = StepConfig.from_settings(s)
        self.eta = int((s.get("algo") or {}).get("eta", 4))
        self.total_steps = int((s.get("run") or {}).get("total_steps", 100))
        self.ckpt_every = int((s.get("run") or {}).get("checkpoint_every_steps", 20))
        self.keep_ckpts = int((s.get("run") or {}).get("keep_checkpoints", 2))
        self.version, model_dir = start_weights(s, self.run_dir)
        self.engine = await asyncio.to_thread(make_train_engine, s, model_dir, self.version)
        self.ref_engine = await asyncio.to_thread(make_reference_engine, s) if self.step_cfg.kl_coef > 0 else None
        # A trainer world: rank 0 leads (bus, weights, metrics), the others follow its engine calls.
        self.ranks = await asyncio.to_thread(RankGroup) if world else None
        # Pipeline stages each send their own layers, on a weights channel followed beside the training one.
        self.weight_ranks = await asyncio.to_thread(RankGroup) if pp > 1 else None
        # Rank 0 sends each rank the share of its data-parallel replica: it learns every rank's replica once.
        self.rank_dp = (await asyncio.to_thread(self.ranks.gather, self.engine.data_parallel[0]) or []
                        if self.ranks is not None else [])
        self.kept: dict[int, list[PackedBucket]] = {}    # direct weights: version -> buckets, the last two
        self.server_host: ServerGroupHost | None = None  # direct weights to servers: this rank's group
        if self.version > 0:
            await asyncio.to_thread(self.engine.load, model_dir)
        if self.ranks is not None and not self.ranks.leader:
            if s.get("links"):
                raise TrainerConfigError(f"{self.name} is in links {sorted(s['links'])}: only trainer.0 sends "
                                         f"weights; list trainer.0 in the link, not the whole trainer group")
            self.address = str(instance.get("address") or "")
            if self.weight_ranks is not None and not self.address:
                raise TrainerConfigError(f"{self.name}: settings.instance.address is not set (the topology launcher "
                                         f"sets it): a pipeline stage's sender hosts its weights group there")
            self.log.info("trainer_rank_started", rank=self.ranks.rank, world=self.ranks.size, version=self.version)
            return
        self.bucket_bytes = int(s.get("weight_bucket_mb", 64)) << 20
        self.param_server = ((s.get("groups") or {}).get("param_server") or [None])[0]
        self.link: BulkLink | None = None
        self.direct = False
        links = s.get("links") or {}
        link_cfg = links.get("train_to_ps")
        if link_cfg is None and len(links) == 1 and self.param_server is not None:
            # Direct weights: rank 0 of the rollouts' link. The parameter server forms it (LinkReform) and
            # asks for each broadcast (WeightsBroadcast); the last published versions are kept for that.
            link_cfg = next(iter(links.values()))
            self.direct = True
        self.link_epoch = 0   # relay: the train link's epoch; a failed transfer moves both sides to a new one
        if link_cfg is not None and self.param_server is not None:
            self.link_cfg = LinkConfig.from_dict(link_cfg)
            self.link = self.make_link(self.link_cfg)
            if self.direct and self.link_cfg.rank != 0:
                raise TrainerConfigError(f"links.{self.link_cfg.name}.members: the trainer broadcasts direct "
                                         f"weights as rank 0 and must be listed first, got {self.link_cfg.members}")
        self._link_lock = asyncio.Lock()
        self._broadcasting: tuple[int, asyncio.Future] | None = None   # (generation, task) of a running broadcast
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        except ImportError as e:  # tensorboard is a core dependency; say so rather than fail the run
            self.log.warning("tensorboard_unavailable", error=str(e))
        self.log.info("trainer_started", version=self.version, model=model_dir, total_steps=self.total_steps)

    async def on_ready(self) -> None:
        if self.ranks is not None and not self.ranks.leader:
            self.spawn(self._follow(), name="follow_rank0")
            if self.weight_ranks is not None:
                self.spawn(self._follow_weights(), name="follow_rank0_weights")
        else:
            self.spawn(self._train_loop(), name="train_loop")

    async def on_stop(self) -> None:
        if getattr(self, "tb", None) is not None:
            self.tb.close()
        if getattr(self, "link", None) is not None:
            self.link.close()
        if getattr(self, "server_host", None) is not None:
            self.server_host.close()

    def on_peer_dead(self, peer: str) -> None:
        if peer == "buffer":
            self._buffer_lost = True
        # A torch.distributed world cannot take a rank back: the others would wait in a collective for it.
        ranks = getattr(self, "ranks", None)
        if ranks is not None and peer in ((self.settings.get("groups") or {}).get("trainer") or []):
            self.log.error("trainer_rank_died", peer=peer)
            self.request_stop(f"trainer rank {peer} stopped answering; the trainer world cannot continue without "
                              f"it (relaunch with run.recover: auto to resume from the last checkpoint)", exit_code=1)

    def on_peer_alive(self, peer: str) -> None:
        if peer == "buffer" and self._buffer_lost:
            self._buffer_lost = False
            self._buffer_back.set()

    @handles(HelloRequest)
    def on_hello_request(self, msg: HelloRequest, env: Any) -> None:
        if env.sender == "buffer":
            self._buffer_back.set()

    async def _ask_buffer(self, msg: Any, timeout: float | None) -> Any:
        """A request to the buffer that outlives the buffer's restart: asked again once it is back. (The
        buffer serves a step's batch again if it served it already: nothing is taken twice.)"""
        for attempt in range(1, BUFFER_ATTEMPTS + 1):
            self._buffer_back.clear()
            ask = asyncio.ensure_future(self.bus.request("buffer", msg, timeout=timeout))
            back = asyncio.ensure_future(self._buffer_back.wait())
            try:
                await asyncio.wait({ask, back}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                back.cancel()
            if ask.done():
                return ask.result()
            ask.cancel()
            await asyncio.gather(ask, return_exceptions=True)
            self.counters["buffer_requests_repeated"] += 1
            self.log.warning("buffer_restarted", asking_again=type(msg).KIND, attempt=attempt)
        raise RuntimeError(f"the buffer restarted {BUFFER_ATTEMPTS} times while {type(msg).KIND} waited for it")

    # --- ranks > 0 --------------------------------------------------------------------------------
    async def _follow(self) -> None:
        await in_thread(self._follow_commands)
        self.request_stop("run finished")

    def _follow_commands(self) -> None:
        """Make rank 0's engine calls, in its order, until it says stop."""
        assert self.ranks is not None
        while True:
            command, args = self.ranks.next_command()
            if command == TRAIN:
                (version,) = args
                _, share = decode(self.ranks.recv_frames())
                if not isinstance(share, BatchTensors):
                    raise TypeError(f"trainer rank {self.ranks.rank}: expected a batch share, got {type(share).__name__}")
                self.ranks.gather(train_share(self.engine, share, self.step_cfg, version, self.ref_engine))
            elif command == EXPORT:
                bucket_bytes, version = args
                buckets = list(self.engine.export_weights(bucket_bytes))
                if self.weight_ranks is not None:
                    self.ranks.gather(self._keep_stage(version, buckets))
            elif command == SAVE:
                self.engine.save(*args)
            else:
                self.log.info("trainer_rank_done", rank=self.ranks.rank)
                return

    def _keep_stage(self, version: int, buckets: list[Any]) -> "StageExport | None":
        """A pipeline stage's sender keeps its own buckets of `version` to broadcast them itself, and tells
        rank 0 their names, shapes and digests (for the specs every server receives by, and the hash)."""
        if not buckets:
            return None   # not a stage sender (data- or tensor-parallel rank > 0)
        self._keep(version, buckets)
        # No digests: the servers are checked by the version they report (see _publish).
        return StageExport(self.engine.pp_rank, [bucket_metas(b) for b in buckets], [])

    def _keep(self, version: int, buckets: list[Any]) -> None:
        """Direct weights: this rank's buckets of `version`, packed, kept with the previous version only
        (the parameter server may still be asking for it). In host memory: two copies of the weights on the
        GPU would cost a 7B trainer 30 GB (tools/plan); each bucket goes up again as it is broadcast."""
        self.kept[version] = [p.to_host() for p in pack_buckets(buckets)]
        for old in [v for v in self.kept if v < version - 1]:
            del self.kept[old]

    async def _follow_weights(self) -> None:
        await in_thread(self._follow_weight_commands)

    def _follow_weight_commands(self) -> None:
        """Ranks > 0 of a pipeline-parallel trainer: rank 0's weights commands, on a thread of their own
        (they come while a training step runs). A stage's sender hosts that stage's group and broadcasts
        its kept buckets there; the other ranks only answer."""
        assert self.weight_ranks is not None
        sender = self.engine.is_export_sender and self.engine.pp_rank > 0
        link_name = ""
        while True:
            command, args = self.weight_ranks.next_command()
            if command == HOST:
                generation, world_size, link_name, backend, timeout_s = args
                hosted = None
                if sender:
                    if self.server_host is None:
                        self.server_host = ServerGroupHost(self.address, backend, timeout_s)
                    stage = self.engine.pp_rank
                    port = self.server_host.host(generation, world_size,
                                                 weight_group_name(link_name, generation, stage))
                    hosted = (stage, self.address, port)
                    self.log.info("weights_group_hosted", generation=generation, stage=stage, port=port,
                                  world_size=world_size)
                self.weight_ranks.gather(hosted)
            elif command == BROADCAST:
                version, generation = args
                error = ""
                if sender:
                    t0 = time.monotonic()
                    try:
                        self._broadcast_kept(version, generation, link_name)
                    except Exception as exc:
                        error = f"stage {self.engine.pp_rank} ({self.name}): {exc}"
                    self.log.info("stage_weights_sent", version=version, generation=generation,
                                  stage=self.engine.pp_rank, buckets=len(self.kept.get(version, [])),
                                  seconds=round(time.monotonic() - t0, 4), error=error or None)
                self.weight_ranks.gather(error)
            else:
                if self.server_host is not None:
                    self.server_host.close()
                return

    def _broadcast_kept(self, version: int, generation: int, link_name: str) -> None:
        packed = self.kept.get(version)
        if packed is None:
            raise RuntimeError(f"version {version} is not kept here (kept: {sorted(self.kept)})")
        if self.server_host is None or self.server_host.generation != generation:
            raise RuntimeError(f"no weights group of generation {generation} is hosted here")
        self.server_host.broadcast(packed, link_name)

    @handles(RunFinished)
    def on_run_finished(self, msg: RunFinished) -> None:
        """Sent by rank 0 to every actor; ranks > 0 have already had its stop command."""

    # --- rank 0: every engine call is led, so that the other ranks make it too ----------------------
    def _train_step(self, batch: BatchTensors) -> dict[str, Any]:
        if self.ranks is None:
            return train_on_batch(self.engine, batch, self.step_cfg, self.version, self.ref_engine)
        self.ranks.lead(TRAIN, self.version)
        self.ranks.send_frames(self._shares(batch))
        share = train_share(self.engine, batch, self.step_cfg, self.version, self.ref_engine)
        return step_metrics(batch, self.version, self.ranks.gather(share) or [share])

    def _shares(self, batch: BatchTensors) -> dict[int, list[Any]]:
        """Each other rank's share of `batch`, encoded: the tokens of the sequences its data-parallel
        replica trains on (tensor- and pipeline-parallel ranks of one replica get the same share)."""
        assert self.ranks is not None
        samples = rank_samples(batch, self.step_cfg, self.engine.data_parallel[1])
        replicas = sorted(set(self.rank_dp[1:]))
        shares = batch.shares([samples[dp] for dp in replicas])
        encoded = {dp: encode(share, sender=self.name) for dp, share in zip(replicas, shares)}
        return {r: encoded[dp] for r, dp in enumerate(self.rank_dp) if r > 0}

    def _export(self) -> tuple[list[Any], list["StageExport"]]:
        """This rank's buckets, and with pipeline stages what the other stages' senders keep."""
        if self.ranks is not None:
            self.ranks.lead(EXPORT, self.bucket_bytes, self.version)
        buckets = list(self.engine.export_weights(self.bucket_bytes))
        if self.weight_ranks is None:
            return buckets, []
        stages = [s for s in self.ranks.gather(None) or [] if s is not None]
        return buckets, sorted(stages, key=lambda s: s.stage)

    def _save(self, path: str) -> None:
        if self.ranks is not None:
            self.ranks.lead(SAVE, path)
        self.engine.save(path)

    # --- the loop ---------------------------------------------------------------------------------
    async def _train_loop(self) -> None:
        last_end = time.time()
        while self.version < self.total_steps:
            t_wait = time.time()
            batch = await self._ask_buffer(BatchRequest(step=self.version + 1), timeout=None)
            assert isinstance(batch, BatchTensors)
            t0 = time.time()
            stats = await asyncio.to_thread(self._train_step, batch)
            self.version += 1
            train_seconds = time.time() - t0
            if self.eta == 0:
                # Synchronous: the next batch may only start once every rollout samples with these weights.
                sync_seconds = await self._publish()
                await self._wait_rollouts_at(self.version)
                await self.bus.send("buffer", VersionUpdate(version=self.version))
            else:
                # Asynchronous: open the gate at once; rollouts switch weights while they generate, and
                # the staleness bound (checked again at batch time) covers samples begun on older weights.
                await self.bus.send("buffer", VersionUpdate(version=self.version))
                sync_seconds = await self._publish()
            end = time.time()
            stats.update(step=self.version, version=self.version, wait_seconds=t0 - t_wait,
                         train_seconds=train_seconds, weight_sync_seconds=sync_seconds,
                         step_seconds=end - last_end, time=end, buffer_depth=batch.stats.depth,
                         buffer_running=batch.stats.running, dropped_stale=batch.stats.dropped_stale,
                         dropped_uniform=batch.stats.dropped_uniform, reissued=batch.stats.returned,
                         epoch=batch.stats.epoch, **await self._push_stats())
            if batch.stats.rollout_utilisation >= 0:   # -1: no rollout clocks arrived since the last batch
                stats["rollout_utilisation"] = batch.stats.rollout_utilisation
            stats["effective_throughput"] = stats["n_tokens"] / max(stats["step_seconds"], 1e-9)
            last_end = end
            self._record(stats)
            if self.version % self.ckpt_every == 0 or self.version == self.total_steps:
                await self._checkpoint()
        # Marked before telling anyone: the supervisor must know the run is over when the others exit.
        mark_run_finished(self.run_dir, self.version)
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.lead, STOP)
        if self.weight_ranks is not None:
            async with self._link_lock:
                await asyncio.to_thread(self.weight_ranks.lead, STOP)
        for peer in self.bus.peers:
            try:
                await asyncio.wait_for(self.bus.send(peer, RunFinished(step=self.version)), timeout=5)
            except (asyncio.TimeoutError, Exception) as e:  # a dead peer must not keep the run alive
                self.log.warning("run_finished_not_delivered", peer=peer, error=str(e))
        self.log.info("run_finished", step=self.version)
        self.request_stop("run finished")

    async def _publish(self) -> float:
        """Weights of the new version to the parameter server (or kept for direct broadcast); returns the
        seconds it took."""
        if self.link is None:
            return 0.0
        t0 = time.time()
        buckets, stages = await asyncio.to_thread(self._export)
        digest = ""
        if self.direct and self.server_host is None and self.weight_ranks is None:
            # Only rollouts that receive on the bulk link check a hash against the trainer's. SGLang servers
            # are checked by the version they report, and the relay's parameter server hashes what it
            # received itself, after it answered: hashing 15 GB here would hold every step.
            digests = await asyncio.to_thread(tensor_digests, [kv for b in buckets for kv in b])
            digest = combine_digests(digests + [d for s in stages for d in s.digests])
        if self.direct:
            await asyncio.to_thread(self._keep, self.version, buckets)
            specs = [bucket_metas(b) for b in buckets] + [m for s in stages for m in s.specs]
            stage_buckets = [len(buckets)] + [len(s.specs) for s in stages] if stages else []
            reply = await self.bus.request(self.param_server, WeightsPublished(
                version=self.version, n_buckets=len(specs), weights_hash=digest, specs=specs,
                stage_buckets=stage_buckets), timeout=60.0)
            if not isinstance(reply, WeightsStored) or reply.version != self.version:
                raise RuntimeError(f"param server answered {reply!r} to version {self.version}")
            return time.time() - t0
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                await self._relay(buckets, digest)
                return time.time() - t0
            except (BusError, BulkError, TimeoutError) as exc:
                # The parameter server died or restarted mid-transfer (a restart is in place): meet it on a
                # fresh epoch of the link, which its next WeightsPublished names.
                self.counters["publish_retries"] += 1
                self.log.warning("publish_failed", version=self.version, attempt=attempt, epoch=self.link_epoch,
                                 error=str(exc)[:300])
                self.link_epoch += 1
        raise RuntimeError(f"version {self.version} could not reach the parameter server in {PUBLISH_ATTEMPTS} "
                           f"attempts")

    async def _relay(self, buckets: list[Any], digest: str) -> None:
        """One attempt: announce the version and the link epoch, join that epoch if the link is elsewhere
        (the parameter server joins it on the announcement), send the buckets."""
        assert self.link is not None
        dst, epoch = self.link_cfg.rank_of(self.param_server), self.link_epoch
        reply = asyncio.ensure_future(self.bus.request(self.param_server, WeightsPublished(
            version=self.version, n_buckets=len(buckets), weights_hash=digest, link_epoch=epoch,
            incarnation=self.incarnation),
            timeout=self.link_cfg.timeout_s + 30))

        def send_all() -> None:
            if self.link.generation != epoch:
                self.link.reform(epoch)
            for b in buckets:
                self.link.send(b, dst)

        try:
            await asyncio.to_thread(send_all)
        except BaseException:
            reply.cancel()
            await asyncio.gather(reply, return_exceptions=True)
            raise
        answer = await reply
        if not isinstance(answer, WeightsStored) or answer.version != self.version:
            raise RuntimeError(f"param server answered {answer!r} to version {self.version}")

    @handles(LinkReform)
    async def on_link_reform(self, msg: LinkReform) -> LinkFormed:
        """Direct weights: join the rollouts' group of this generation as its rank 0 (the rendezvous master).
        With ``world_size`` set, the rollouts' servers join themselves: host a fresh group on a free port
        (each pipeline stage's sender one of its own), reply with them at once, and finish joining in the
        background while the servers come."""
        if not self.direct or self.link is None:
            raise RuntimeError(f"{self.name} has no direct weights link to re-form")
        if self._broadcasting is not None and self._broadcasting[0] < msg.generation:
            # The parameter server left that broadcast (a member it waited for was lost): nobody finishes it.
            self._broadcasting[1].cancel()
        async with self._link_lock:
            t0 = time.monotonic()
            if msg.world_size > 0:
                addrs, ports = await self._host_server_groups(msg.generation, msg.world_size)
                return LinkFormed(generation=msg.generation, seconds=time.monotonic() - t0, master_addrs=addrs,
                                  master_ports=ports)
            if self.weight_ranks is not None:   # a placement error no retry can mend: stop the run
                why = ("parallel.pp > 1: every pipeline stage sends its own layers, which needs rollouts whose "
                       "servers join the weights group (SGLang); these rollouts receive on the bulk link")
                self.request_stop(why, exit_code=1)
                raise TrainerConfigError(why)
            await in_thread(self.link.reform, msg.generation, msg.members or None)
        self.log.info("weights_link_formed", generation=msg.generation, members=msg.members,
                      seconds=round(time.monotonic() - t0, 3))
        return LinkFormed(generation=msg.generation, seconds=time.monotonic() - t0)

    async def _host_server_groups(self, generation: int, world_size: int) -> tuple[list[str], list[int]]:
        """Stage 0's group here, the other stages' on their senders; (addresses, ports) in stage order."""
        cfg = self.link_cfg
        if self.server_host is None:
            self.server_host = ServerGroupHost(cfg.master_addr, cfg.backend, cfg.timeout_s, cfg.bind_addr)
        port = self.server_host.host(generation, world_size, weight_group_name(cfg.name, generation, 0))
        addrs, ports = [cfg.master_addr], [port]
        if self.weight_ranks is not None:
            ranks = self.weight_ranks

            def host_stages() -> list[Any]:
                ranks.lead(HOST, generation, world_size, cfg.name, cfg.backend, cfg.timeout_s)
                return ranks.gather(None) or []

            for _, addr, stage_port in sorted(h for h in await in_thread(host_stages) if h is not None):
                addrs.append(addr)
                ports.append(stage_port)
        self.log.info("weights_group_hosted", generation=generation, ports=ports, world_size=world_size)
        return addrs, ports

    @handles(WeightsBroadcast)
    async def on_weights_broadcast(self, msg: WeightsBroadcast) -> WeightsBroadcastDone:
        """Direct weights: broadcast a kept version to the rollouts (they receive after WeightsReady)."""
        if not self.direct or self.link is None:
            raise RuntimeError(f"{self.name} has no direct weights link")
        packed = self.kept.get(msg.version)
        if packed is None:
            raise RuntimeError(f"version {msg.version} is not kept here (kept: {sorted(self.kept)})")
        async with self._link_lock:
            t0 = time.monotonic()
            if self.server_host is not None and self.server_host.generation == msg.generation:
                await in_thread(self._broadcast_to_servers, msg.version, msg.generation)
                return WeightsBroadcastDone(version=msg.version, seconds=time.monotonic() - t0)
            if self.link.generation != msg.generation:
                raise RuntimeError(f"link {self.link.config.name!r} is at generation {self.link.generation}, "
                                   f"not {msg.generation}")
            link = self.link

            async def broadcast() -> None:
                for bucket in packed:
                    await in_thread(link.broadcast_packed, bucket, 0, msg.generation)
            task = asyncio.ensure_future(broadcast())
            self._broadcasting = (msg.generation, task)
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled() or asyncio.current_task().cancelling():
                    raise
                raise RuntimeError(f"broadcast of version {msg.version} on generation {msg.generation} "
                                   f"abandoned: the link is being formed again") from None
            finally:
                self._broadcasting = None
        return WeightsBroadcastDone(version=msg.version, seconds=time.monotonic() - t0)

    def _broadcast_to_servers(self, version: int, generation: int) -> None:
        """Stage 0's buckets on its group; with pipeline stages every other stage's sender broadcasts its
        own at the same time (the servers take the stages in order), and says whether that worked."""
        if self.weight_ranks is None:
            self._broadcast_kept(version, generation, self.link_cfg.name)
            return
        self.weight_ranks.lead(BROADCAST, version, generation)
        failure: Exception | None = None
        try:
            self._broadcast_kept(version, generation, self.link_cfg.name)
        except Exception as exc:   # the other stages still answer: gather before raising
            failure = exc
        errors = [e for e in self.weight_ranks.gather("") or [] if e]
        if failure is not None:
            raise failure
        if errors:
            raise RuntimeError("; ".join(errors))

    async def _push_stats(self) -> dict[str, float]:
        """The parameter server's latest view: how long the last push to every rollout took until acked, and
        how long generation stalled for it (mean over rollouts of their last ack's stall_seconds)."""
        if self.link is None:
            return {}
        try:
            status = await self.bus.request(self.param_server, WeightsStatusRequest(), timeout=10.0)
        except (BusError, TimeoutError) as exc:   # metrics must not stop training
            self.log.warning("weights_status_unavailable", error=str(exc))
            return {}
        stalls = [r.stall_seconds for r in status.rollouts.values()]
        return {"weight_push_seconds": status.last_sync_seconds,
                "gen_stall_seconds": sum(stalls) / len(stalls) if stalls else 0.0}

    async def _wait_rollouts_at(self, version: int) -> None:
        if self.link is None:
            return
        for _ in range(60):  # bounded: a rollout that never catches up stops the run with a clear error
            status = await self.bus.request(self.param_server, WeightsStatusRequest(min_version=version, timeout_s=10.0),
                                            timeout=30.0)
            if isinstance(status, WeightsStatus) and status.reached:
                return
        raise RuntimeError(f"rollouts did not reach version {version} within 10 minutes (synchronous mode)")

    def _record(self, stats: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(stats) + "\n")
        if self.tb is not None:
            for k, v in stats.items():
                if isinstance(v, (int, float)) and k != "time":
                    self.tb.add_scalar(k, v, self.version)
            self.tb.flush()
        self.log.info("step", **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items()
                                 if k in ("step", "task_reward", "accuracy", "n_tokens", "staleness_max",
                                          "step_seconds", "effective_throughput", "logprob_gap_max")})

    async def _checkpoint(self) -> None:
        ckpt = checkpoint_dir(self.run_dir, self.version)
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / COMPLETE).unlink(missing_ok=True)   # written again by a trainer restarted in place
        await asyncio.to_thread(self._save, str(ckpt / "model"))
        reply = await self._ask_buffer(CheckpointRequest(step=self.version), timeout=60)
        if not isinstance(reply, CheckpointDone):
            raise RuntimeError(f"buffer answered {reply!r} to a checkpoint request")
        mark_complete(ckpt, {"step": self.version, "time": time.time()})
        self.log.info("checkpoint_saved", step=self.version, path=str(ckpt))
        done = [path for _, path in complete_checkpoints(self.run_dir)]   # newest first; .corrupt ones stay
        for old in done[self.keep_ckpts:] if self.keep_ckpts > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


@dataclass
class ShareResult:
    """What one trainer rank did with its share of a step; rank 0 merges every rank's into the metrics."""

    ppo: PPOStats                       # empty on ranks whose loss statistics duplicate another's
    logprob_gap: float                  # max |proximal - behaviour| on tokens sampled by these very weights
    updates: list[dict[str, float]]     # engine.train_step reports (already global: summed over replicas)
    kl_reward: float | None = None      # mean over answer tokens of -kl_coef * KL to the reference (kl_coef > 0)


def as_columns(batch: Batch | BatchTensors) -> BatchTensors:
    """The batch in the trainer's working form (what the buffer sends); a list-form Batch is converted."""
    return batch if isinstance(batch, BatchTensors) else BatchTensors.from_batch(batch)


def train_on_batch(engine: TrainEngine, batch: Batch | BatchTensors, cfg: StepConfig, version: int,
                   ref_engine: TrainEngine | None = None) -> dict[str, Any]:
    """One training step on `batch` with a single-rank engine at `version` (steps completed); the metrics."""
    cols = as_columns(batch)
    return step_metrics(cols, version, [train_share(engine, cols, cfg, version, ref_engine)])


def packed_logprobs(engine: TrainEngine, seqs: list[list[int] | None], micro_batches: Any, out: torch.Tensor,
                    starts: list[int], temperature: float) -> None:
    """Log-probs of `seqs` under `engine`, computed micro-batch by micro-batch (lists of sequence indices)
    and written into `out` (the packed layout of every sequence, `starts` their offsets)."""
    for ids in micro_batches:
        mb = PackedBatch.from_sequences([seqs[i] for i in ids])
        lp = engine.compute_logprobs(mb, temperature=temperature).logprobs
        for j, i in enumerate(ids):
            out[starts[i]:starts[i] + len(seqs[i])] = lp[int(mb.cu_seqlens[j]):int(mb.cu_seqlens[j + 1])]


def sequence_lengths(batch: BatchTensors) -> tuple[list[int], list[int]]:
    """Each sequence's (prompt + answer) length and group index, in sample order."""
    group_ids = batch.sample_groups()
    return [batch.prompt_lens[g] + n for g, n in zip(group_ids, batch.output_lens)], group_ids


def minibatch_plan(lengths: list[int], group_ids: list[int], cfg: StepConfig, dp_size: int) -> list[list[list[list[int]]]]:
    """Per data-parallel rank, its micro-batches (sequence indices) of every PPO minibatch. PPO minibatches
    are contiguous slices of whole groups, so a group never straddles two updates; each is split into the
    same number of micro-batches per replica, balanced by tokens (algo.packing). A pure function of the
    lengths: trainer.0 computes it to send each rank its share, and each rank computes it again to train."""
    budget = max(cfg.max_tokens_per_mb, max(lengths))
    groups = sorted(set(group_ids))
    plan: list[list[list[list[int]]]] = [[] for _ in range(dp_size)]
    for m in range(cfg.minibatches):
        gsel = set(groups[m::cfg.minibatches])
        seq_ids = [i for i in range(len(lengths)) if group_ids[i] in gsel]
        if not seq_ids:
            continue
        if len(seq_ids) < dp_size:
            raise TrainerConfigError(f"PPO minibatch {m} has {len(seq_ids)} sequences for {dp_size} data-parallel "
                                     f"ranks: use fewer algo.ppo_minibatches or a larger batch")
        ranks = split_by_rank(allocate_micro_batches([lengths[i] for i in seq_ids], budget, n_groups=dp_size), dp_size)
        for r in range(dp_size):
            plan[r].append([[seq_ids[i] for i in idx] for idx in ranks[r]])
    return plan


def rank_samples(batch: BatchTensors, cfg: StepConfig, dp_size: int) -> list[list[int]]:
    """Per data-parallel rank, the samples whose tokens it needs: those it trains on, or with a KL penalty
    every one (the reference log-probs of the whole batch enter every rank's advantages)."""
    if cfg.kl_coef > 0:
        return [list(range(batch.n_samples))] * dp_size
    lengths, group_ids = sequence_lengths(batch)
    return [sorted(i for mbs in minibatches for ids in mbs for i in ids)
            for minibatches in minibatch_plan(lengths, group_ids, cfg, dp_size)]


@dataclass
class _Layout:
    """The packed layout of every sequence of a batch, with the tokens and per-token fields of the carried
    ones filled in (the others are zero: a rank reads only its own sequences' tokens)."""

    seqs: list[list[int] | None]   # token ids of the carried sequences
    lengths: list[int]
    starts: list[int]
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor        # float32, 1 on answer tokens
    behav: torch.Tensor            # float32 behaviour log-probs on answer tokens
    versions: torch.Tensor         # float32 weight version on answer tokens, -1 on prompts


def _layout(batch: BatchTensors, lengths: list[int], group_ids: list[int]) -> _Layout:
    n = len(lengths)
    lens = torch.tensor(lengths, dtype=torch.int64)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    total = int(cu[-1])
    prompt_of = torch.tensor([batch.prompt_lens[g] for g in group_ids], dtype=torch.int64)
    pos = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(cu[:-1], lens)
    on_answer = pos >= torch.repeat_interleave(prompt_of, lens)
    carried = batch.carried_samples()
    c = torch.tensor(carried, dtype=torch.int64)
    out_lens = torch.tensor([batch.output_lens[i] for i in carried], dtype=torch.int64)
    out_cu = torch.zeros(len(carried) + 1, dtype=torch.int64)
    out_cu[1:] = torch.cumsum(out_lens, 0)
    # Where each carried answer token sits in the layout: its sequence's start + prompt length + offset.
    answer_pos = (torch.repeat_interleave(cu[:-1][c] + prompt_of[c] - out_cu[:-1], out_lens)
                  + torch.arange(int(out_cu[-1]), dtype=torch.int64))
    behav = torch.zeros(total, dtype=torch.float32)
    behav[answer_pos] = batch.flat("logprobs")
    versions = torch.full((total,), -1.0, dtype=torch.float32)
    versions[answer_pos] = batch.flat("versions").to(torch.float32)
    tokens = torch.zeros(total, dtype=torch.int64)
    tokens[answer_pos] = batch.flat("output_ids").to(torch.int64)
    prompts = batch.flat("prompt_ids").to(torch.int64)
    p_cu = [0]
    for plen in batch.prompt_lens:
        p_cu.append(p_cu[-1] + plen)
    starts = cu[:-1].tolist()
    seqs: list[list[int] | None] = [None] * n
    for i in carried:
        g, s = group_ids[i], starts[i]
        tokens[s:s + batch.prompt_lens[g]] = prompts[p_cu[g]:p_cu[g + 1]]
        seqs[i] = tokens[s:s + lengths[i]].tolist()
    return _Layout(seqs, lengths, starts, cu, on_answer.to(torch.float32), behav, versions)


def train_share(engine: TrainEngine, batch: Batch | BatchTensors, cfg: StepConfig, version: int,
                ref_engine: TrainEngine | None = None) -> ShareResult:
    """This rank's part of one training step. Every rank of a multi-rank trainer calls it on the same batch,
    or on its share of it (`BatchTensors.share` of `rank_samples`: the same scalar columns, the tokens of
    its own sequences): each data-parallel replica takes the same number of micro-batches of every PPO
    minibatch (`minibatch_plan`), computes their proximal log-probs and trains on them; the gradients and
    the loss denominator (the minibatch's global token count) are summed across replicas."""
    batch = as_columns(batch)
    dp_rank, dp_size = engine.data_parallel
    lengths, group_ids = sequence_lengths(batch)
    minibatches = minibatch_plan(lengths, group_ids, cfg, dp_size)[dp_rank]
    mine_ids = [i for mbs in minibatches for ids in mbs for i in ids]
    lay = _layout(batch, lengths, group_ids)
    missing = [i for i in (range(len(lengths)) if cfg.kl_coef > 0 else mine_ids) if lay.seqs[i] is None]
    if missing:
        raise ValueError(f"train_share: data-parallel rank {dp_rank} was not sent the tokens of sequences "
                         f"{missing[:8]} (of {len(missing)}) it needs")
    seqs, starts = lay.seqs, lay.starts
    mask = lay.loss_mask.bool()
    behav = lay.behav
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    budget = max(cfg.max_tokens_per_mb, max(lengths))
    kl_reward = None
    ref = None
    if cfg.kl_coef > 0:
        # KL(behaviour || reference) on the sampled tokens, for the whole batch on every rank: the penalty
        # enters the token rewards before the batch-wide advantage normalisation.
        if ref_engine is None:
            raise TrainerConfigError("algo.kl_coef > 0 needs the reference engine (the frozen starting weights)")
        ref = torch.zeros_like(behav)
        packed_logprobs(ref_engine, seqs, allocate_micro_batches(lengths, budget), ref, starts, cfg.temperature)
        kl_reward = -cfg.kl_coef * float(kl_penalty(behav[mask], ref[mask], cfg.kl_estimator).mean())
    adv = compute_advantages(rewards, torch.tensor(group_ids), mask, cu_seqlens=lay.cu_seqlens,
                             group_std=cfg.group_std, adv_norm=cfg.adv_norm, logp=behav, logp_ref=ref,
                             kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator).advantages

    def tokens_of(ids: list[int]) -> torch.Tensor:
        sel = torch.zeros(behav.numel(), dtype=torch.bool)
        for i in ids:
            sel[starts[i]:starts[i] + lengths[i]] = True
        return sel

    # Proximal log-probs: the current weights before this step's updates, for this rank's sequences.
    prox = behav.clone()
    if cfg.decoupled:
        packed_logprobs(engine, seqs, [ids for mbs in minibatches for ids in mbs], prox, starts, cfg.temperature)
    mine = tokens_of(mine_ids)
    current = (lay.versions == float(version)) & mask & mine  # sampled by exactly these weights
    gap = float(((prox - behav).abs() * current).max()) if bool(current.any()) else 0.0

    per_token = {"loss_mask": lay.loss_mask, "behav": behav, "prox": prox, "adv": adv}
    stats_all = PPOStats()
    updates: list[dict[str, float]] = []
    for mbs_ids in minibatches:
        sel = tokens_of([i for ids in mbs_ids for i in ids])
        local = count_loss_tokens(mask[sel], prox[sel], behav[sel], cfg.ppo.behav_cap)
        n_tokens = engine.data_parallel_sum([float(local)])[0]   # the same decision on every rank
        if n_tokens == 0:
            continue
        mbs = [PackedBatch.from_sequences([seqs[i] for i in ids],
                                          {k: [v[starts[i]:starts[i] + lengths[i]].tolist() for i in ids]
                                           for k, v in per_token.items()})
               for ids in mbs_ids]
        collected: list[PPOStats] = []

        def loss_fn(outputs: TokenLogProbs, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
            f = mb.fields
            loss, st = ppo_loss(outputs.logprobs, f["prox"], f["behav"], f["adv"], f["loss_mask"], 1.0,
                                cfg.ppo, entropy=outputs.entropy)
            collected.append(st)
            return loss, {}

        updates.append(engine.train_step(mbs, loss_fn, temperature=cfg.temperature,
                                         loss_denominator=float(n_tokens), with_entropy=True))
        for st in collected:
            stats_all = stats_all.merge(st)
    return ShareResult(ppo=stats_all if engine.reports_stats else PPOStats(), logprob_gap=gap, updates=updates,
                       kl_reward=kl_reward)


def step_metrics(batch: Batch | BatchTensors, version: int, shares: list[ShareResult]) -> dict[str, Any]:
    """The step's metrics from the batch's answers (every sample carried: rank 0's batch) and every rank's
    share (rank 0's first)."""
    batch = as_columns(batch)
    ppo = PPOStats()
    for share in shares:
        ppo = ppo.merge(share.ppo)
    summary = ppo.summary()
    updates = shares[0].updates
    kl_reward = {} if shares[0].kl_reward is None else {"kl_reward": shares[0].kl_reward}
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    if batch.carried is not None and batch.carried != list(range(batch.n_samples)):
        raise ValueError("step_metrics: needs every sample's versions (the whole batch), got a rank's share")
    versions = batch.flat("versions")
    # Each sample's oldest weight version (prompt and unknown tokens are -1 and do not count).
    starts_v, o = [], 0
    for n in batch.output_lens:
        mine = versions[o:o + n]
        mine = mine[mine >= 0]
        starts_v.append(int(mine.min()) if mine.numel() else version)
        o += n
    staleness = sample_staleness(torch.tensor(starts_v), version).float()
    out_lens = torch.tensor(batch.output_lens, dtype=torch.float32)
    return {
        "task_reward": float(rewards.mean()), "accuracy": float(torch.tensor(batch.correct).float().mean()),
        "n_tokens": float(out_lens.sum()), "n_seqs": float(batch.n_samples),   # the loss mask: every answer token
        "avg_seq_len": float(out_lens.mean()),
        "no_eos_ratio": float(torch.tensor([r != "stop" for r in batch.finish_reasons]).float().mean()),
        "importance_weight": summary["importance_weight_mean"],
        "importance_weight_max": summary["importance_weight_max"],
        "actor_clip_ratio": summary["clip_ratio"], "ppo_approx_kl": summary["approx_kl"],
        "behav_masked_frac": summary["behav_masked_frac"], "entropy": summary.get("entropy", 0.0),
        "staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max()),
        "logprob_gap_max": max(share.logprob_gap for share in shares),
        "loss": sum(x["loss"] for x in updates), "grad_norm": max((x["grad_norm"] for x in updates), default=0.0),
        "lr": updates[-1]["lr"] if updates else 0.0,
        "accuracy_by_level": _accuracy_by_level(batch), **kl_reward,
    }


def _accuracy_by_level(batch: BatchTensors) -> dict[str, float]:
    by: dict[str, list[bool]] = {}
    for g, correct in zip(batch.sample_groups(), batch.correct):
        by.setdefault(str(batch.levels[g]), []).append(correct)
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}
