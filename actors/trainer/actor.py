"""The trainer actor: takes a batch, recomputes proximal log-probs, trains decoupled PPO, publishes weights.

One training step (version v -> v + 1):

    BatchTensors (B groups x n answers, token columns as tensor frames) from the buffer; in a trainer
    world, trainer.0 sends each other rank only the tokens of its data-parallel replica's sequences
    -> pack prompt+answer sequences (padding-free), loss mask on answer tokens
    -> proximal log-probs under the current weights (before this step's updates)
    -> group-normalised advantages (algo.advantages), then `algo.ppo_minibatches` optimizer updates,
       each on micro-batches under a token budget (algo.packing), loss = the one `algo.loss` names
       (algo.losses; decoupled PPO by default) on the corrected behaviour weights (algo.corrections),
       aggregated over the minibatch's global tokens or answers (`algo.loss_agg_mode`)
    -> VersionUpdate(v + 1) to the buffer (opens the staleness gate)
    -> weights on their way to the rollouts (actors/weight_sync: the relay through the parameter server,
       or direct weights kept here and broadcast when the parameter server asks)
    -> metrics (metrics.jsonl + TensorBoard), and a checkpoint every `run.checkpoint_every_steps` (and, with
       `run.checkpoint_every_s`, after a step ending that long after the last one: `recovery.checkpoint_due`)

Publishing runs beside training (eta > 0): the publisher (actors/trainer/publisher.py), an object with a task
of its own, exports the newest version whenever the last one has reached the parameter server. A step waits
for its own version's publish as long as publishing keeps up (at most `VersionPublisher.wait_s`: 5 times the
longest publish so far, at least `PUBLISH_WAIT_MIN_S`), which keeps
a healthy run's messages in one order (tools.replay replays it); when a publish takes longer, an older one
is still under way, or the parameter server stops answering the bus's heartbeats (silent for the bus's
heartbeat_timeout: frozen, or its machine gone), the step goes on without it. A parameter server that is
frozen therefore holds up training for a heartbeat timeout, a slow one for that first wait at most: training
goes on with the rollouts' weights as they are, for as long as their
samples stay within eta versions (the buffer's staleness bound is the limit, as for any slow push), and the
newest version is published once the server answers again; versions made meanwhile are skipped, not queued.
(A replacement parameter server was the other way: it would need the supervisor to kill a process that may
yet come back, and the rollouts to re-form their link with a new one, for a gain the staleness bound already
gives.) The engine is used by one of them at a time (``_engine_lock``): an export sees whole steps. With
eta = 0 (synchronous) each step waits for its version to be published and reach every rollout.

The parts: the step's math in actors/trainer/step.py, its metrics in actors/trainer/metrics.py, the other
ranks' loop in actors/trainer/followers.py (their channel: actors/runtime/rank_group.py), the weights path in actors/weight_sync/.

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
import time
from typing import Any

from actors.runtime.base import Actor, ActorSpec, handles
from actors.batch import shares as batch_shares
from actors.engines.base import TrainEngine, require_device
from actors.engines.torch_train import TorchTrainEngine, TrainConfig
from actors.engines.lora import LoraSpec
from actors.runtime.rank_group import EXPORT, SAVE, STOP, TRAIN, RankGroup
from actors.trainer.followers import follow_rank0
from actors.runtime.recovery import (COMPLETE, checkpoint_dir, checkpoint_due, held_start_weights, mark_complete,
                             mark_run_finished, prune_checkpoints, recovering, restarted_in_place)
from actors.runtime.threads import in_thread
from actors.runtime.spans import SpanLog
from actors.trainer.metrics import LOSS_SHARES, MetricsWriter, mismatch_warning, step_metrics
from actors.trainer.publisher import VersionPublisher
from actors.trainer.trackers import Trackers
# StepConfig, TrainerConfigError, train_on_batch, rank_samples: the step's math, imported here by its users too
from actors.trainer.step import StepConfig, TrainerConfigError, rank_samples, train_on_batch, train_share
from actors.weight_sync import StageExport, WeightSender, WeightSyncConfigError, make_sender, make_stage_sender
from topology.settings import TrainerSettings
from transport.bus import RemoteError
from transport.messages import encode
from transport.protocol import (BatchRequest, BatchTensors, CheckpointDone, CheckpointRequest, HelloRequest, LinkFormed,
                                LinkReform, RunFinished, VersionUpdate, WeightsBroadcast, WeightsBroadcastDone)


def trainer_placement(cfg: TrainerSettings) -> dict[str, str]:
    """Where and how the trainer's engine runs, as the engine will be built and as --dry-run prints it: the
    device (the instance's GPU by default), the parameter dtype (Megatron: bf16 by default on a GPU; the
    torch backend keeps float32 weights and autocasts to bf16 on a GPU), the parallel layout and the
    process-group backend of its world."""
    backend = cfg.backend
    device = cfg.engine_device
    parallel = cfg.instance.parallel
    if backend == "megatron":
        dtype = "bfloat16" if (cfg.bf16 if cfg.bf16 is not None else device == "cuda") else "float32"
    else:
        dtype = "float32 (bf16 autocast)" if device == "cuda" else "float32"
    layout = " ".join(f"{k}={parallel[k]}" for k in ("dp", "tp", "pp", "ep", "etp") if k in parallel) or "dp=1"
    if backend == "megatron":
        memory = (("sp " if cfg.sequence_parallel and parallel.get("tp", 1) > 1 else "")
                  + f"recompute={cfg.recompute} "
                  + f"logprob_chunk={cfg.logprob_chunk_tokens or 'off'}")
    else:
        memory = "-"
    return {"engine": backend, "device": device, "dtype": dtype, "parallel": layout, "memory": memory,
            "process_group": "nccl" if device == "cuda" else "gloo"}


def make_train_engine(cfg: TrainerSettings, model_dir: str, version: int, lora: bool = True) -> TrainEngine:
    """The trainer backend named by `backend` (torch here; megatron on GPU clusters); with ``model.lora`` (and
    ``lora``) it trains adapters on the frozen model."""
    require_device(cfg.engine_device)
    spec = LoraSpec.from_settings(cfg.model.lora) if lora else None
    start_adapter = cfg.model.lora.adapter if spec is not None else None
    if cfg.backend == "megatron":
        return _make_megatron_engine(cfg, model_dir, version, spec, start_adapter)
    a = cfg.algo
    config = TrainConfig(lr=a.lr, adam_eps=a.adam_eps, betas=(a.adam_beta1, a.adam_beta2), grad_clip=a.grad_clip,
                         weight_decay=a.weight_decay, seed=cfg.seed, device=cfg.engine_device,
                         moe_aux_loss_coef=a.moe_aux_loss_coef)
    return TorchTrainEngine(model_dir, config, version=version, lora=spec, start_adapter=start_adapter)


def make_reference_engine(cfg: TrainerSettings) -> TrainEngine:
    """The KL penalty's reference (`algo.kl_coef` > 0): an engine of the same backend and layout holding the
    run's starting weights (model.path, also when the run resumes from a checkpoint); only its log-probs are
    used, so it never changes."""
    return make_train_engine(cfg, cfg.model.path, 0, lora=False)   # set: TrainerActor.check_settings refuses it unset


def _make_megatron_engine(cfg: TrainerSettings, model_dir: str, version: int, lora: LoraSpec | None,
                          start_adapter: str | None) -> TrainEngine:
    """`backend: megatron` (actors/engines/megatron.py): the same algo settings plus the trainer group's
    `parallel` from the topology (tp, pp, ep, etp; dp is what the world size leaves). Every trainer rank builds one."""
    from actors.engines.megatron import MegatronConfig, MegatronTrainEngine  # optional dependency
    a = cfg.algo
    parallel = cfg.instance.parallel
    config = MegatronConfig(lr=a.lr, adam_eps=a.adam_eps, betas=(a.adam_beta1, a.adam_beta2), grad_clip=a.grad_clip,
                            weight_decay=a.weight_decay, seed=cfg.seed, device=cfg.engine_device,
                            tensor_parallel=parallel.get("tp", 1), pipeline_parallel=parallel.get("pp", 1),
                            expert_parallel=parallel.get("ep", 1), expert_tensor_parallel=parallel.get("etp"),
                            moe_aux_loss_coef=a.moe_aux_loss_coef, bf16=trainer_placement(cfg)["dtype"] == "bfloat16",
                            sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute,
                            logprob_chunk_tokens=cfg.logprob_chunk_tokens)
    return MegatronTrainEngine(model_dir, config, version=version, lora=lora, start_adapter=start_adapter)


# A request to the buffer is asked again each time the buffer restarts while it waits (a restarted buffer
# says so with HelloRequest); this bounds how many restarts one request outlives.
BUFFER_ATTEMPTS = 10
DRAINING_RETRY_S = 1.0   # between asks of a buffer that answers "draining" (it is stopping: bounded by its stop budget)
FINAL_PUBLISH_S = 120.0   # how long the run's end waits for its last version to be published


class TrainerActor(Actor):
    Settings = TrainerSettings
    cfg: TrainerSettings
    placement = staticmethod(trainer_placement)   # what --dry-run prints for the group

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        # The buffer restarted: what was asked of it must be asked again (see _ask_buffer).
        self._buffer_back = asyncio.Event()
        self._buffer_lost = False
        # Set while the parameter server is silent (heartbeats): a step does not wait for its publish then.
        self._param_server_silent = asyncio.Event()

    @classmethod
    def check_settings(cls, cfg: TrainerSettings) -> list[str]:
        instance = cfg.instance
        group, count, world = instance.group or "trainer", instance.count, instance.world
        out = []
        if count > 1 and not world:
            out.append(f"actors.{group}.world_port: the group has {count} instances but no world_port: they would "
                       f"each train on their own (set it: a port, or 0 for a free one at launch)")
        if world and cfg.backend != "megatron":
            out.append(f"actors.{group}.settings.backend: a trainer world of {count} ranks needs backend: megatron "
                       f"(the torch backend trains on one process)")
        if world and instance.parallel.get("pp", 1) > 1 and "train_to_ps" in cfg.links:
            out.append(f"actors.{group}.parallel.pp: > 1 needs direct weights to rollouts whose servers join the "
                       "weights group (SGLang): every pipeline stage sends its own layers on a group of its own; "
                       "the relay through the parameter server (train_to_ps) takes one sender "
                       "(docs/engines-megatron.md)")
        if world and world.rank > 0 and cfg.links:
            out.append(f"links: {group}.{instance.index} is in links {sorted(cfg.links)}: only rank 0 sends weights; "
                       f"list {group}.0 in the link, not the whole {group} group")
        if instance.parallel.get("ep", 1) > 1 and cfg.backend != "megatron":
            out.append(f"actors.{group}.parallel.ep: expert parallelism needs backend: megatron (the torch backend "
                       f"trains on one process)")
        if cfg.algo.kl_coef > 0 and not cfg.model.path:
            out.append("model.path: algo.kl_coef > 0 needs the starting weights as the KL reference, and "
                       "model.path is not set")
        return out

    async def on_start(self) -> None:
        cfg = self.cfg
        if problems := self.check_settings(cfg):
            raise TrainerConfigError("; ".join(problems))
        instance = cfg.instance
        world = instance.world
        pp = instance.parallel.get("pp", 1) if world else 1
        if restarted_in_place(self):
            # The buffer keeps every batch served since the last checkpoint, so a trainer restarted alone
            # resumes from that checkpoint and is served the same batches again. A world cannot take one
            # rank back (the others wait in a collective for it): that needs a relaunch.
            if world:
                raise RuntimeError(f"{self.name} was restarted inside a running launch, but a trainer world "
                                   f"cannot take one rank back: relaunch the run (run.recover: auto resumes "
                                   f"from the last checkpoint)")
            if not recovering(cfg):
                raise RuntimeError(f"{self.name} was restarted inside a running launch, which resumes from the "
                                   f"last checkpoint, but run.recover is off: relaunch the run")
            self.log.warning("trainer_restarted_in_place")
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        self.step_cfg = StepConfig.from_settings(cfg)
        self.eta = cfg.algo.eta
        self.total_steps = cfg.run.total_steps
        self.ckpt_every = cfg.run.checkpoint_every_steps
        self.ckpt_every_s = cfg.run.checkpoint_every_s
        self.last_ckpt = time.monotonic()
        self.keep_ckpts = cfg.run.keep_checkpoints
        self.trace = SpanLog(self.run_dir, self.name) if cfg.run.trace else None
        self.ckpt_lease_s = cfg.run.checkpoint_lease_s
        with held_start_weights(cfg, self.run_dir, self.name) as (self.version, model_dir):
            self.engine = await asyncio.to_thread(make_train_engine, cfg, model_dir, self.version)
            self.ref_engine = await asyncio.to_thread(make_reference_engine, cfg) if self.step_cfg.kl_coef > 0 else None
            # A trainer world: rank 0 leads (bus, weights, metrics), the others follow its engine calls.
            self.ranks = await in_thread(RankGroup) if world else None
            # Pipeline stages each send their own layers, on a weights channel followed beside the training one.
            self.weight_ranks = await in_thread(RankGroup) if pp > 1 else None
            # Rank 0 sends each rank the share of its data-parallel replica: it learns every rank's replica once.
            self.rank_dp = (await in_thread(self.ranks.gather, self.engine.data_parallel[0]) or []
                            if self.ranks is not None else [])
            if self.version > 0:
                await asyncio.to_thread(self.engine.load, model_dir)
        if self.ranks is not None and not self.ranks.leader:
            address = instance.address
            if self.weight_ranks is not None and not address:
                raise TrainerConfigError(f"{self.name}: settings.instance.address is not set (the topology launcher "
                                         f"sets it): a pipeline stage's sender hosts its weights group there")
            # A pipeline stage's sender (a stage > 0) keeps and broadcasts its own layers.
            self.stage_sender = (make_stage_sender(cfg, self.engine.pp_rank, self.engine.is_export_sender
                                                   and self.engine.pp_rank > 0, address, self.log)
                                 if self.weight_ranks is not None else None)
            self.log.info("trainer_rank_started", rank=self.ranks.rank, world=self.ranks.size, version=self.version)
            return
        self.bucket_bytes = cfg.weight_bucket_mb << 20
        self.param_server = (cfg.groups.get("param_server") or [None])[0]
        self._engine_lock = asyncio.Lock()       # a step, an export or a save at a time
        self._phase = ("starting", time.time())  # what the loop does now, for the status file
        self._link_lock = asyncio.Lock()   # the weights channel of a pipeline-parallel trainer, one lead at a time
        try:
            self.weights: WeightSender | None = make_sender(cfg, self.make_link, self.bus, self.incarnation,
                                                            self.counters, self.log, self.weight_ranks, self._link_lock)
        except WeightSyncConfigError as exc:
            raise TrainerConfigError(str(exc)) from None
        run = cfg.run
        self.metrics = MetricsWriter(self.run_dir, self.log, Trackers(
            list(run.trackers), self.run_dir, run.tracker_project, run.tracker_mode,
            {"algo": cfg.algo.model_dump(), "gen": cfg.gen.model_dump(), "model": cfg.model.path}, self.log))
        # Each new version on its way to the parameter server, beside training (actors/trainer/publisher.py).
        self.publisher = VersionPublisher(self.weights, self._export, self._engine_lock, self.bus, self.param_server,
                                          self.version, self.counters, self.log, self.trace)
        self.log.info("trainer_started", version=self.version, model=model_dir, total_steps=self.total_steps)

    async def on_ready(self) -> None:
        if self.ranks is not None and not self.ranks.leader:
            self.spawn(self._follow(), name="follow_rank0")
        else:
            self._publisher_task = self.spawn(self.publisher.run(), name="publisher")
            self.spawn(self._train_loop(), name="train_loop")

    def progress(self) -> dict[str, Any]:
        if not hasattr(self, "_phase"):   # ranks > 0 follow rank 0
            return {"rank": self.ranks.rank if getattr(self, "ranks", None) is not None else 0}
        what, since = self._phase
        return {"version": self.version, "total_steps": self.total_steps, "phase": what,
                "phase_for_s": round(time.time() - since, 1), "published": self.publisher.published,
                "step_seconds_max": round(getattr(self, "_step_seconds_max", 0.0), 3)}

    def _enter(self, phase: str) -> None:
        self._phase = (phase, time.time())

    async def on_stop(self) -> None:
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        if getattr(self, "weights", None) is not None:
            self.weights.close()

    def on_peer_dead(self, peer: str) -> None:
        if peer == "buffer":
            self._buffer_lost = True
        if peer == getattr(self, "param_server", None):
            self._param_server_silent.set()
        # A torch.distributed world cannot take a rank back: the others would wait in a collective for it.
        ranks = getattr(self, "ranks", None)
        if ranks is not None and peer in (self.cfg.groups.get("trainer") or []):
            self.log.error("trainer_rank_died", peer=peer)
            self.request_stop(f"trainer rank {peer} stopped answering; the trainer world cannot continue without "
                              f"it (relaunch with run.recover: auto to resume from the last checkpoint)", exit_code=1)

    def on_peer_restarted(self, peer: str) -> None:
        # A rank restarted faster than the heartbeat timeout was never declared dead, and its old process is
        # gone from the world all the same.
        ranks = getattr(self, "ranks", None)
        if ranks is not None and peer in (self.cfg.groups.get("trainer") or []):
            self.log.error("trainer_rank_restarted", peer=peer)
            self.request_stop(f"trainer rank {peer} restarted; the trainer world cannot take its new process in "
                              f"(relaunch with run.recover: auto to resume from the last checkpoint)", exit_code=1)

    def on_peer_alive(self, peer: str) -> None:
        if peer == getattr(self, "param_server", None):
            self._param_server_silent.clear()
        if peer == "buffer" and self._buffer_lost:
            self._buffer_lost = False
            self._buffer_back.set()

    @handles(HelloRequest)
    def on_hello_request(self, msg: HelloRequest, env: Any) -> None:
        if env.sender == "buffer":
            self._buffer_back.set()

    async def _ask_buffer(self, msg: Any, timeout: float | None) -> Any:
        """A request to the buffer that outlives the buffer's restart: asked again once it is back. (The
        buffer serves a step's batch again if it served it already: nothing is taken twice.) A buffer that is
        stopping hands the request back ("draining"): it is asked again once a second, until a process that is
        not stopping takes it (the stopping one's drain is bounded by its stop budget)."""
        restarts, draining = 0, False
        while True:
            self._buffer_back.clear()
            ask = asyncio.ensure_future(self.bus.request("buffer", msg, timeout=timeout))
            back = asyncio.ensure_future(self._buffer_back.wait())
            try:
                await asyncio.wait({ask, back}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                back.cancel()
            if ask.done():
                try:
                    return ask.result()
                except RemoteError as exc:
                    if exc.code != "draining":
                        raise
                if not draining:
                    self.log.warning("buffer_draining", asking_again=type(msg).KIND)
                draining = True
                await asyncio.sleep(DRAINING_RETRY_S)
                continue
            ask.cancel()
            await asyncio.gather(ask, return_exceptions=True)
            restarts += 1
            self.counters["buffer_requests_repeated"] += 1
            self.log.warning("buffer_restarted", asking_again=type(msg).KIND, attempt=restarts)
            if restarts >= BUFFER_ATTEMPTS:
                raise RuntimeError(f"the buffer restarted {BUFFER_ATTEMPTS} times while {type(msg).KIND} waited for it")

    # --- ranks > 0 --------------------------------------------------------------------------------
    async def _follow(self) -> None:
        """Rank 0's engine calls and weights commands, until it has stopped both (then the run is over)."""
        assert self.ranks is not None
        await in_thread(follow_rank0, self.ranks, self.weight_ranks, self.engine, self.step_cfg, self.ref_engine,
                        self.stage_sender, self.log, self.name)
        self.request_stop("run finished")

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
        shares = batch_shares(batch, [samples[dp] for dp in replicas])
        encoded = {dp: encode(share, sender=self.name) for dp, share in zip(replicas, shares)}
        return {r: encoded[dp] for r, dp in enumerate(self.rank_dp) if r > 0}

    def _export(self) -> tuple[list[Any], list[StageExport]]:
        """This rank's buckets, packed into host memory by the sender as they are exported, and with pipeline
        stages what the other stages' senders keep."""
        assert self.weights is not None
        if self.ranks is not None:
            self.ranks.lead(EXPORT, self.bucket_bytes, self.version)
        buckets = self.weights.take(self.version, self.engine.export_weights(self.bucket_bytes))
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
        self._step_seconds_max = 0.0
        while self.version < self.total_steps:
            t_wait = time.time()
            self._enter(f"waiting for the batch of step {self.version + 1} from the buffer")
            batch = await self._ask_buffer(BatchRequest(step=self.version + 1), timeout=None)
            assert isinstance(batch, BatchTensors)
            self._enter(f"training step {self.version + 1}")
            async with self._engine_lock:
                t0 = time.time()
                stats = await in_thread(self._train_step, batch)   # leads the other ranks: a collective
                self.version += 1
            train_seconds = time.time() - t0
            publisher = self.publisher
            publisher.made(self.version)
            if self.eta == 0:
                # Synchronous: the next batch may only start once every rollout samples with these weights.
                self._enter(f"publishing version {self.version} (synchronous: every rollout must have it)")
                await publisher.published_at(self.version, timeout=None)
                sync_seconds = publisher.publish_seconds
                await publisher.rollouts_at(self.version)
                await self.bus.send("buffer", VersionUpdate(version=self.version))
            else:
                # Asynchronous: open the gate at once; rollouts switch weights while they generate, and
                # the staleness bound (checked again at batch time) covers samples begun on older weights.
                # The publisher sends the version on its way; the step waits for it while publishing keeps up.
                publisher_idle = publisher.published == self.version - 1
                await self.bus.send("buffer", VersionUpdate(version=self.version))
                if publisher_idle:
                    t_publish = time.monotonic()
                    waited = await publisher.published_at(self.version, timeout=publisher.wait_s(),
                                                          unless=self._param_server_silent)
                    if waited != "published":
                        self.log.warning("step_goes_on_without_its_publish", version=self.version,
                                         published=publisher.published,
                                         waited_s=round(time.monotonic() - t_publish, 1),
                                         why="the parameter server is silent (heartbeats)" if waited == "unless"
                                         else f"no publish within {publisher.wait_s():.0f} s")
                sync_seconds = publisher.publish_seconds   # the newest publish that completed
            end = time.time()
            loss_shares = stats.pop(LOSS_SHARES, None)
            if self.trace is not None:
                self.trace.write("step", step=self.version, wait=[t_wait, t0], train=[t0, t0 + train_seconds],
                                 end=end, logprobs_s=stats.get("logprobs_seconds"),
                                 forward_backward_s=stats.get("forward_backward_seconds"),
                                 optimizer_s=stats.get("optimizer_seconds"), loss_shares=loss_shares)
            stats.update(step=self.version, version=self.version, wait_seconds=t0 - t_wait,
                         train_seconds=train_seconds, weight_sync_seconds=sync_seconds,
                         step_seconds=end - last_end, time=end, buffer_depth=batch.stats.depth,
                         buffer_running=batch.stats.running, dropped_stale=batch.stats.dropped_stale,
                         dropped_uniform=batch.stats.dropped_uniform, reissued=batch.stats.returned,
                         data_pass=batch.stats.data_pass, **publisher.push_stats)
            self._step_seconds_max = max(self._step_seconds_max, end - last_end)
            if batch.stats.rollout_utilisation >= 0:   # -1: no rollout clocks arrived since the last batch
                stats["rollout_utilisation"] = batch.stats.rollout_utilisation
            stats["effective_throughput"] = stats["n_tokens"] / max(stats["step_seconds"], 1e-9)
            last_end = end
            self._record(stats)
            if checkpoint_due(self.version, self.total_steps, self.ckpt_every, self.ckpt_every_s,
                              time.monotonic() - self.last_ckpt):
                self._enter(f"checkpointing step {self.version}")
                await self._checkpoint()
        self._enter(f"publishing the last version, {self.version}")
        if await self.publisher.published_at(self.version, timeout=FINAL_PUBLISH_S) != "published":
            self.log.warning("last_version_not_published", version=self.version, published=self.publisher.published,
                             waited_s=FINAL_PUBLISH_S)
        async with self._engine_lock:   # not in the middle of an export, whose ranks > 0 follow it
            self._publisher_task.cancel()
        await self.publisher.last_version_pushed()
        # Marked before telling anyone: the supervisor must know the run is over when the others exit.
        mark_run_finished(self.run_dir, self.version)
        self._enter("finishing the run")
        try:
            await self._stop_ranks()
        finally:   # the run is over whatever the other ranks did: every actor must hear it (a failure is raised)
            for peer in self.bus.peers:
                try:
                    await asyncio.wait_for(self.bus.send(peer, RunFinished(step=self.version)), timeout=5)
                except (asyncio.TimeoutError, Exception) as e:  # a dead peer must not keep the run alive
                    self.log.warning("run_finished_not_delivered", peer=peer, error=str(e))
        self.log.info("run_finished", step=self.version)
        self.request_stop("run finished")

    async def _stop_ranks(self) -> None:
        """The other ranks' engine calls end, then their weights channel, once no broadcast is led on it (the
        parameter server may still ask for the last version's): they leave when both have ended."""
        if self.ranks is not None:
            async with self._engine_lock:
                await in_thread(self.ranks.lead, STOP)
        if self.weight_ranks is not None:
            async with self._link_lock:
                await in_thread(self.weight_ranks.lead, STOP)

    @handles(LinkReform)
    async def on_link_reform(self, msg: LinkReform) -> LinkFormed:
        """Direct weights: the parameter server forms the rollouts' group of an epoch (see
        actors/weight_sync/direct.py)."""
        if self.weights is None:
            raise RuntimeError(f"{self.name} has no direct weights link to re-form")
        try:
            return await self.weights.form(msg)
        except WeightSyncConfigError as exc:   # a placement error no retry can mend: stop the run
            self.request_stop(str(exc), exit_code=1)
            raise

    @handles(WeightsBroadcast)
    async def on_weights_broadcast(self, msg: WeightsBroadcast) -> WeightsBroadcastDone:
        """Direct weights: broadcast a kept version to the rollouts (they receive after WeightsReady)."""
        if self.weights is None:
            raise RuntimeError(f"{self.name} has no direct weights link")
        return await self.weights.broadcast(msg)

    def _record(self, stats: dict[str, Any]) -> None:
        warning = mismatch_warning(stats, self.cfg.algo.mismatch_warn_kl)
        if warning:
            # trainer and engine disagree on the very weights they share: the usual forerunner of a collapse
            stats["mismatch_warning"] = warning
            self.log.warning("trainer_engine_mismatch", step=stats.get("step"), warning=warning)
        self.metrics.write(stats, self.version)
        self.log.info("step", **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items()
                                 if k in ("step", "task_reward", "accuracy", "n_tokens", "staleness_max",
                                          "step_seconds", "effective_throughput", "logprob_gap_max")})

    async def _checkpoint(self) -> None:
        ckpt = checkpoint_dir(self.run_dir, self.version)
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / COMPLETE).unlink(missing_ok=True)   # written again by a trainer restarted in place
        async with self._engine_lock:
            await asyncio.to_thread(self._save, str(ckpt / "model"))
        reply = await self._ask_buffer(CheckpointRequest(step=self.version), timeout=60)
        if not isinstance(reply, CheckpointDone):
            raise RuntimeError(f"buffer answered {reply!r} to a checkpoint request")
        mark_complete(ckpt, {"step": self.version, "time": time.time()})
        self.last_ckpt = time.monotonic()
        self.log.info("checkpoint_saved", step=self.version, path=str(ckpt))
        await asyncio.to_thread(prune_checkpoints, self.run_dir, self.keep_ckpts, self.ckpt_lease_s)
