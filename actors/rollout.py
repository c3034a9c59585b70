"""RolloutActor: drives a generation engine, turns GenerateGroup into Trajectories, takes new weights live.

Work. ``GenerateGroup`` (from the buffer) becomes one :class:`GenerationRequest` with ``n`` samples; the
handler awaits the engine (which decodes in its own thread or server, so the event loop never blocks) and
sends :class:`Trajectories` to a reward actor, round-robin over ``settings["groups"]["reward"]``. A group
that cannot be finished (the actor is draining, the engine failed, the request is malformed) goes back to
the buffer as :class:`GroupReturned` with a reason, so no work is ever lost silently. Reasons starting with
``invalid:`` mean re-issuing the same group cannot succeed.

Weights. On ready the actor sends :class:`RolloutHello` (its engine version) to the parameter server and
waits for :class:`LinkReform`: it never opens the ``ps_to_rollout`` bulk link on its own, because only the
parameter server knows the generation every member must meet at (a restarted rollout needs a fresh group).
:class:`WeightsReady` is a request: the actor receives ``n_buckets`` broadcasts on the link (in a thread),
feeds them to ``engine.update_weights`` as they arrive while generation continues (``gen.interruptible``,
the default) or pauses, swaps and resumes (``gen.interruptible: false``, the synchronous baseline), and
answers :class:`WeightsAck` with the engine's own weights hash, the receive time and the stall time.

Settings (besides the shared experiment keys ``model.path``, ``model.dtype``, ``gen.interruptible``):
    engine:            "torch" (default); see :func:`make_engine`
    device:            "cpu" or "cuda" for the embedded engine (default: the instance's GPU if it has one)
    max_running:       most sequences the embedded engine decodes at once (default 256)
    link:              name of the weights link (default "ps_to_rollout", or the only link listed)
    weights_timeout_s: bound on waiting for the link to reach a WeightsReady's generation (default: the
                       link's timeout_s)
    weights_via_server: with direct weights (the trainer is the link's rank 0) and an SGLang engine, the
                       server joins the trainer's group and receives itself (default true; false: this
                       process receives on the bulk link and hands the weights to the server through disk)
    stats_every_s:     period of the ``rollout_stats`` log line (default 30; 0 disables it)
"""
from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from actors.base import Actor, ActorSpec, handles
from actors.engines.base import (EngineError, GenerationEngine, GenerationRequest, RequestError, SamplingParams,
                                 WeightBucket, engine_device, require_device)
from actors.recovery import start_weights
from actors.weights import weights_hash
from transport.bulk import BulkError, BulkLink, LinkConfig
from transport.protocol import (Answers, GenerateGroup, GroupReturned, HelloRequest, LinkReform, RolloutHello,
                                RunFinished, Sample, ServerDown, Trajectories, WeightsAck, WeightsReady, WorkerHello)

__all__ = ["RolloutActor", "RolloutConfigError", "WeightSyncError", "make_engine", "verify_engine_weights",
           "in_thread", "link_config", "weight_group_name"]

T = TypeVar("T")


class RolloutConfigError(ValueError):
    """The rollout's settings are unusable; the message names the key."""


class WeightSyncError(RuntimeError):
    """A weight update could not be received or applied; the message names the version and cause."""


def in_thread(fn: Callable[..., T], *args: Any) -> "asyncio.Future[T]":
    """Run a blocking call (a bulk-link collective) in a daemon thread and await its result.

    Not asyncio.to_thread: a collective blocked on a dead peer cannot be cancelled, and the default
    executor is joined at interpreter exit, which would hold a stopping actor until the link timeout.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def body() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine, never swallowed
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, False, exc)
            return
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle, True, result)

    # In the caller's context: what a link sends or receives is logged as caused by the caller's message.
    threading.Thread(target=contextvars.copy_context().run, args=(body,),
                     name=f"blocking-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return fut


def link_config(settings: dict[str, Any], default: str, key: str = "link") -> LinkConfig | None:
    """The LinkConfig named by ``settings[key]`` (default ``default``; the only listed link if just one)."""
    links = settings.get("links") or {}
    name = settings.get(key) or default
    if name not in links:
        if key in settings:
            raise RolloutConfigError(f"{key}: link {name!r} is not in settings.links ({sorted(links)})")
        if len(links) != 1:
            return None
        name = next(iter(links))
    try:
        return LinkConfig.from_dict(dict(links[name]))
    except (BulkError, TypeError) as exc:
        raise RolloutConfigError(f"links.{name}: {exc}") from exc


def weight_group_name(link: str, generation: int, stage: int) -> str:
    """The name of a weights group the servers join: one per link generation and trainer pipeline stage."""
    return f"{link}-g{generation}" + (f"-pp{stage}" if stage else "")


class ServerWeightGroup:
    """Direct weights received by the rollout's server itself (SGLang's /init_weights_update_group and
    /update_weights_from_distributed), in place of a BulkLink: the same generation bookkeeping, but the
    server joins the trainer's groups (as ``ranks`` ranks, one per tensor-parallel rank; one group per
    trainer pipeline stage, each stage sending its own layers) and receives."""

    def __init__(self, engine: Any, config: LinkConfig, ranks: int) -> None:
        self.engine, self.config, self.ranks = engine, config, max(1, ranks)
        self.generation: int | None = None
        self.groups: list[str] = []     # in stage order

    async def join(self, msg: LinkReform) -> None:
        stages = len(msg.master_ports)
        if (msg.world_size <= 0 or msg.rank_offset < 1 or not stages or len(msg.master_addrs) != stages
                or min(msg.master_ports) <= 0):
            raise EngineError(f"link {self.config.name!r}: LinkReform {msg} has no server group to join")
        for name in self.groups:
            try:
                await self.engine.destroy_weights_group(name)
            except EngineError:  # a restarted server no longer has it
                pass
        self.groups, self.generation = [], None
        # One stage at a time, in order: every member joins stage k's group before any joins k + 1.
        for stage, (addr, port) in enumerate(zip(msg.master_addrs, msg.master_ports)):
            name = weight_group_name(self.config.name, msg.generation, stage)
            await self.engine.init_weights_group(addr, port, msg.rank_offset, msg.world_size, group_name=name,
                                                 backend=self.config.backend)
            self.groups.append(name)
        self.generation = msg.generation

    async def receive(self, msg: WeightsReady) -> None:
        if len(msg.specs) != msg.n_buckets:
            raise EngineError(f"version {msg.version}: {msg.n_buckets} buckets but specs for {len(msg.specs)}")
        per_stage = list(msg.stage_buckets) or [msg.n_buckets]
        if sum(per_stage) != msg.n_buckets or len(per_stage) != len(self.groups):
            raise EngineError(f"version {msg.version}: buckets per stage {per_stage} do not fit {msg.n_buckets} "
                              f"buckets on {len(self.groups)} groups")
        groups = [name for name, n in zip(self.groups, per_stage) for _ in range(n)]
        await self.engine.update_weights_from_distributed(msg.version, msg.specs, group_name=groups)

    def close(self) -> None:
        self.groups, self.generation = [], None


def rollout_placement(settings: dict[str, Any]) -> dict[str, str]:
    """Where and how the rollout's engine runs, as --dry-run prints it. An SGLang server always runs on the
    instance's GPUs, in ``sglang.dtype`` or ``model.dtype`` ("auto": SGLang takes the checkpoint's)."""
    kind = str(settings.get("engine", "torch"))
    tp = int(((settings.get("instance") or {}).get("parallel") or {}).get("tp", 1))
    model_dtype = (settings.get("model") or {}).get("dtype")
    if kind == "sglang":
        dtype = (settings.get("sglang") or {}).get("dtype") or model_dtype or "auto"
        return {"engine": "sglang", "device": "cuda", "dtype": str(dtype), "parallel": f"tp={tp}", "memory": "-",
                "process_group": "nccl (weights group)"}
    device = engine_device(settings)
    return {"engine": kind, "device": device, "dtype": str(model_dtype or "float32"), "parallel": f"tp={tp}",
            "memory": "-", "process_group": "nccl" if device == "cuda" else "gloo"}


def make_engine(settings: dict[str, Any], version: int, model_dir: str, run_dir: str | None = None,
                on_server_event: Callable[[str, int], Awaitable[None]] | None = None) -> GenerationEngine:
    """The one place that turns ``settings["engine"]`` into an engine. ``on_server_event(event, restarts)``:
    the engine's server process "died" or was "restarted" (SGLang engines that launch their server)."""
    kind = str(settings.get("engine", "torch"))
    if kind == "torch":
        from actors.engines.torch_gen import TorchGenerationEngine

        model = settings.get("model") or {}
        index = int((settings.get("instance") or {}).get("index", 0))
        device = engine_device(settings)
        require_device(device)
        return TorchGenerationEngine(model_dir, version=version, device=device,
                                     dtype=model.get("dtype"), max_running=int(settings.get("max_running", 256)),
                                     seed=int(settings.get("seed", 0)) * 1000 + index)
    if kind == "sglang":  # an SGLang server, started here or attached by settings["sglang_url"]
        from actors.engines.sglang import SGLangEngine

        return SGLangEngine.from_settings(settings, version, model_dir, run_dir=run_dir,
                                          on_server_event=on_server_event)
    raise RolloutConfigError(f"engine: {kind!r} is not available here (known: 'torch', 'sglang')")


def verify_engine_weights(engine: GenerationEngine, version: int) -> tuple[str, str]:
    """``(weights_hash, "hash")`` of the weights the engine samples with, computed where they live; or, for an
    engine whose server cannot read them back (SGLang), ``("", "version")`` once it reports ``version``."""
    own = getattr(engine, "verify_weights", None)
    if callable(own):
        return own(version)
    from actors.engines.checkpoint import hf_state_dict

    return weights_hash(hf_state_dict(engine.model).items()), "hash"  # type: ignore[attr-defined]


class RolloutActor(Actor):
    placement = staticmethod(rollout_placement)   # what --dry-run prints for the group

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        # Everything a handler may touch exists before the bus starts: messages can arrive during on_start.
        self.engine: GenerationEngine | None = None
        self._engine_ready = asyncio.Event()
        self.link: BulkLink | ServerWeightGroup | None = None
        self._link_target: int | None = None
        self._link_msg: LinkReform | None = None
        self._link_requests = 0          # LinkReform messages seen; each one re-forms, even at an equal number
        self._link_wanted = asyncio.Event()
        self._link_changed = asyncio.Condition()
        self._weights_lock = asyncio.Lock()
        self._receiving: tuple[int, asyncio.Future] | None = None   # (generation, task) of a running receive
        self._incarnation = f"{os.getpid()}-{time.time_ns()}"
        self.rewards: list[str] = []
        self.buffer = "buffer"
        self.param_server: str | None = None
        self.active: dict[str, float] = {}   # group_id -> start time
        self._rr = 0
        self._t0 = time.monotonic()
        self._busy_since: float | None = None
        self._busy_total = 0.0
        self._idle = asyncio.Event()         # set while no group is in the engine
        self._idle.set()
        self._gen_seconds = 0.0
        self._tokens = 0

    # ------------------------------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        groups = self.settings.get("groups") or {}
        self.rewards = list(groups.get("reward") or [])
        if not self.rewards:
            raise RolloutConfigError("groups.reward: no reward actors to send trajectories to")
        self.buffer = (groups.get("buffer") or ["buffer"])[0]
        self.param_server = (groups.get("param_server") or [None])[0]
        config = link_config(self.settings, "ps_to_rollout")
        version, model_dir = start_weights(self.settings, self.run_dir)
        self.engine = make_engine(self.settings, version, model_dir, run_dir=str(self.run_dir),
                                  on_server_event=self._engine_server_event)
        if config is not None:
            # Direct weights (the trainer is rank 0) to an engine whose server can join the group itself
            # (SGLang): the server receives; otherwise this process receives on the bulk link.
            direct = config.members and config.members[0] != self.param_server
            server_side = direct and hasattr(self.engine, "init_weights_group") \
                and bool(self.settings.get("weights_via_server", True))
            tp = int(((self.settings.get("instance") or {}).get("parallel") or {}).get("tp", 1))
            self.link = ServerWeightGroup(self.engine, config, tp) if server_side else self.make_link(config)
        await self.engine.start()
        self._engine_ready.set()
        self.log.info("engine_started", engine=type(self.engine).__name__, version=version, model_dir=model_dir,
                      link=config.name if config else None)

    async def on_ready(self) -> None:
        await self.bus.send(self.buffer, WorkerHello(role="rollout"))
        if self.link is not None:
            self.spawn(self._link_keeper(), name="link_keeper")
            await self._hello()
        every = float(self.settings.get("stats_every_s", 30.0))
        if every > 0:
            self.spawn(self._stats_loop(every), name="stats", critical=False)

    async def on_drain(self) -> None:
        # Handlers see self.draining before they submit; everything already submitted is aborted and its
        # handler sends GroupReturned (partial tokens are dropped: the buffer re-issues the whole group).
        if self.engine is None:
            return
        # Abort until every submitted group has come back. More than one round can be needed: a request
        # admitted at the same step boundary as an abort is missed by it (the embedded engine takes the
        # waiting list and the aborts together, then aborts before admitting), so abort again.
        deadline = time.monotonic() + float(self.settings.get("drain_timeout", 30.0)) / 2
        rounds = 0
        while self.active and time.monotonic() < deadline:
            rounds += 1
            aborted = await self.engine.abort()
            self.log.info("drain_abort", round=rounds, aborted=aborted, active=len(self.active))
            try:
                await asyncio.wait_for(self._idle.wait(), 0.5)
            except TimeoutError:
                continue

    async def on_stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
        if self.link is not None:
            self.link.close()
        self.log.info("rollout_stats", **self.stats())

    def on_peer_alive(self, peer: str) -> None:
        # A parameter server that was declared dead and answers again may be a fresh process: say hello
        # again so it learns our version and re-forms the link with us.
        if peer == self.param_server and self.link is not None and self._engine_ready.is_set():
            self.spawn(self._hello(), name="hello", critical=False)

    async def _engine_server_event(self, event: str, restarts: int) -> None:
        """The engine's server "died": its weights group went with it; tell the parameter server at once, so
        it forms no group that would wait a whole link timeout for the missing ranks. "restarted": it is back
        on its launch weights, outside every group; say hello again, as a restarted rollout does, so the
        group is re-formed with its ranks and the current version pushed (on the engine's watcher task)."""
        version = self.engine.version if self.engine else -1
        if isinstance(self.link, ServerWeightGroup):
            self.link.close()
        if event == "died":
            self.log.warning("engine_server_died", restarts=restarts, version=version)
            if self.link is not None and self.param_server is not None:
                await self.bus.send(self.param_server, ServerDown(restarts=restarts))
            return
        self.log.warning("engine_server_restarted", restarts=restarts, version=version)
        if self.link is not None:
            await self._hello()

    @handles(HelloRequest)
    async def on_hello_request(self, msg: HelloRequest, env: Any) -> None:
        if env.sender == self.buffer:   # a restarted buffer: it has no work of ours and may give some
            await self.bus.send(self.buffer, WorkerHello(role="rollout"))
            return
        await self._engine_ready.wait()
        if self.link is not None:
            await self._hello()

    async def _hello(self) -> None:
        if self.param_server is None or self.engine is None:
            return
        ranks = self.link.ranks if isinstance(self.link, ServerWeightGroup) else 0
        await self.bus.send(self.param_server, RolloutHello(version=self.engine.version, weight_ranks=ranks,
                                                            incarnation=self._incarnation))
        self.log.info("hello_sent", version=self.engine.version, param_server=self.param_server)

    # ----------------------------------------------------------------------------------- generation

    @handles(GenerateGroup)
    async def on_generate(self, msg: GenerateGroup) -> None:
        await self._engine_ready.wait()
        engine = self.engine
        assert engine is not None
        try:
            sampling = SamplingParams(temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
                                      max_new_tokens=msg.max_new_tokens, stop_token_ids=tuple(msg.stop_token_ids),
                                      # seed 0 is "unset" on the wire: let the engine pick a fresh one
                                      seed=msg.seed or None)
            request = GenerationRequest(rid=msg.group_id, input_ids=tuple(msg.prompt_ids), sampling=sampling, n=msg.n)
        except RequestError as exc:
            await self._return(msg.group_id, f"invalid: {exc}")
            return
        # No await between this check and engine.generate registering the request: on_drain's abort
        # either sees the request or this handler sees draining.
        if self.draining:
            await self._return(msg.group_id, "draining")
            return
        start = time.monotonic()
        self._busy_enter(msg.group_id, start)
        try:
            results = await engine.generate(request)
        except RequestError as exc:
            await self._return(msg.group_id, f"invalid: {exc}")
            return
        except EngineError as exc:
            self.log.error("engine_failed", group_id=msg.group_id, error=str(exc))
            await self._return(msg.group_id, f"engine_error: {exc}")
            return
        except asyncio.CancelledError:
            # The drain ran out of time and cancelled this handler (the engine aborts the request on
            # cancellation): the group still goes back to the buffer.
            await self._return(msg.group_id, "cancelled")
            raise
        finally:
            self._busy_exit(msg.group_id)
        seconds = time.monotonic() - start
        if any(r.finish_reason == "abort" for r in results):
            await self._return(msg.group_id, "draining" if self.draining else "aborted")
            return
        samples = [Sample(output_ids=list(r.output_ids), logprobs=list(r.logprobs), versions=list(r.versions),
                          finish_reason=r.finish_reason) for r in results]
        tokens = sum(len(s.output_ids) for s in samples)
        self._gen_seconds += seconds
        self._tokens += tokens
        self.counters["groups_generated"] += 1
        self.counters["tokens_generated"] += tokens
        reward = msg.reward or self.rewards[self._rr % len(self.rewards)]
        self._rr += 1
        await self.bus.send(reward, Trajectories(group_id=msg.group_id, task=msg.task, answers=Answers(
            samples=samples, rollout=self.name, gen_seconds=seconds, **self._clocks())))

    async def _return(self, group_id: str, reason: str) -> None:
        self.counters["groups_returned"] += 1
        self.log.info("group_returned", group_id=group_id, reason=reason[:200])
        await self.bus.send(self.buffer, GroupReturned(group_id=group_id, reason=reason))

    def _busy_enter(self, group_id: str, now: float) -> None:
        if not self.active:
            self._busy_since = now
        self.active[group_id] = now
        self._idle.clear()

    def _busy_exit(self, group_id: str) -> None:
        self.active.pop(group_id, None)
        if not self.active:
            self._idle.set()
            if self._busy_since is not None:
                self._busy_total += time.monotonic() - self._busy_since
                self._busy_since = None

    def _clocks(self) -> dict[str, float]:
        """Seconds with at least one group in hand, and seconds up, since this rollout started."""
        now = time.monotonic()
        busy = self._busy_total + (now - self._busy_since if self._busy_since is not None else 0.0)
        return {"busy_seconds": busy, "up_seconds": now - self._t0}

    def stats(self) -> dict[str, Any]:
        clocks = self._clocks()
        busy, wall = clocks["busy_seconds"], max(clocks["up_seconds"], 1e-9)
        return {"groups": self.counters["groups_generated"], "returned": self.counters["groups_returned"],
                "tokens": self._tokens, "gen_seconds": round(self._gen_seconds, 3),
                "busy_fraction": round(busy / wall, 4), "active": len(self.active),
                "version": self.engine.version if self.engine is not None else None,
                "tokens_per_s": round(self._tokens / wall, 2)}

    async def _stats_loop(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)  # a reporting period, not synchronisation
            self.log.info("rollout_stats", **self.stats())

    # -------------------------------------------------------------------------------------- weights

    @handles(LinkReform)
    def on_link_reform(self, msg: LinkReform) -> None:
        if self.link is None:
            self.log.warning("link_reform_without_link", generation=msg.generation)
            return
        self._link_target = msg.generation
        self._link_msg = msg
        self._link_requests += 1
        self._link_wanted.set()
        if self._receiving is not None and self._receiving[0] < msg.generation:
            # The parameter server left that transfer (a member it waited for was lost): nobody finishes it.
            self._receiving[1].cancel()

    async def _link_keeper(self) -> None:
        """Re-form the link at the newest generation the parameter server asked for, one at a time."""
        assert self.link is not None
        done = 0
        while True:
            await self._link_wanted.wait()
            self._link_wanted.clear()
            if self._link_requests == done:
                continue
            done, generation, msg = self._link_requests, self._link_target, self._link_msg
            t0 = time.monotonic()
            try:
                if not await self._formed_unless_newer(generation, msg):
                    continue
            except (BulkError, EngineError) as exc:
                # The parameter server retries at a newer generation and tells us; wait for that.
                self.counters["link_reform_failures"] += 1
                self.log.error("link_reform_failed", generation=generation, error=str(exc))
                continue
            self.counters["link_reforms"] += 1
            self.log.info("link_formed", generation=generation, seconds=round(time.monotonic() - t0, 3))
            async with self._link_changed:
                self._link_changed.notify_all()

    async def _formed_unless_newer(self, generation: int, msg: LinkReform) -> bool:
        """Form the link at ``generation``, unless a newer LinkReform comes first (a member this one waits for
        was left out of the next): then abandon it (a bulk link's thread ends on its own generation; a
        server's join is cancelled and the next join drops what it left)."""
        assert self.link is not None
        forming = (asyncio.ensure_future(self.link.join(msg)) if isinstance(self.link, ServerWeightGroup)
                   else in_thread(self.link.reform, generation, msg.members or None))
        newer = asyncio.ensure_future(self._link_wanted.wait())
        await asyncio.wait({forming, newer}, return_when=asyncio.FIRST_COMPLETED)
        newer.cancel()
        if forming.done():
            forming.result()
            return True
        forming.cancel()
        forming.add_done_callback(lambda f: f.cancelled() or f.exception())   # its late error is expected
        self.counters["link_formations_abandoned"] += 1
        self.log.warning("link_formation_abandoned", generation=generation, newer=self._link_target)
        return False

    async def _wait_link(self, generation: int, timeout: float) -> "BulkLink | ServerWeightGroup":
        link = self.link
        if link is None:
            raise WeightSyncError(f"{self.name} has no weights link (settings.links has none for it)")
        def stale() -> bool:  # a request for an older group than the one formed (or being formed) now
            known = [g for g in (link.generation, self._link_target) if g is not None]
            return bool(known) and max(known) > generation

        if stale():  # e.g. queued by ZeroMQ while this process was down: nobody will broadcast on it
            raise WeightSyncError(f"link {link.config.name!r}: generation {generation} is stale "
                                  f"(the link is at {link.generation}, re-forming to {self._link_target})")
        try:
            async with asyncio.timeout(timeout):
                async with self._link_changed:
                    await self._link_changed.wait_for(lambda: link.generation == generation or stale())
            if stale():
                raise WeightSyncError(f"link {link.config.name!r}: generation {generation} became stale "
                                      f"while waiting (now {link.generation})")
        except TimeoutError:
            raise WeightSyncError(f"link {link.config.name!r} did not reach generation {generation} within "
                                  f"{timeout:g}s (it is at {link.generation})") from None
        return link

    @handles(WeightsReady)
    async def on_weights_ready(self, msg: WeightsReady) -> WeightsAck:
        await self._engine_ready.wait()
        engine = self.engine
        assert engine is not None
        async with self._weights_lock:
            link_timeout = self.link.config.timeout_s if self.link is not None else 60.0
            link = await self._wait_link(msg.generation, float(self.settings.get("weights_timeout_s", link_timeout)))
            t0 = time.monotonic()
            # The receiver runs on its own so the link is always drained, even if the engine rejects a
            # bucket: leaving the broadcast half-done would stall the parameter server and every peer.
            queue: asyncio.Queue[WeightBucket | BaseException | None] = asyncio.Queue()
            received_at: list[float] = []

            async def receive() -> None:
                try:
                    for _ in range(msg.n_buckets):
                        queue.put_nowait(await in_thread(link.recv, 0, msg.generation) if msg.point_to_point
                                         else await in_thread(link.broadcast, None, 0, msg.generation))
                except BaseException as exc:
                    queue.put_nowait(exc)
                    raise
                finally:
                    received_at.append(time.monotonic())
                    queue.put_nowait(None)

            async def buckets() -> AsyncIterator[WeightBucket]:
                # A broken transfer must fail update_weights before it swaps: a partial source would
                # otherwise be applied as version K with the rest of the weights still at K-1.
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise WeightSyncError(f"version {msg.version}: receiving buckets failed: {item}") from item
                    yield item

            if isinstance(link, ServerWeightGroup):
                update = asyncio.ensure_future(self._update_through_server(msg, link, t0))
                self._receiving = (msg.generation, update)
                try:
                    return await update
                except asyncio.CancelledError:
                    if not update.cancelled() or asyncio.current_task().cancelling():
                        raise
                    self.counters["weight_updates_abandoned"] += 1
                    raise WeightSyncError(f"version {msg.version}: abandoned, the weights group is being formed "
                                          f"again without this transfer") from None
                finally:
                    if self._receiving is not None and self._receiving[1] is update:
                        self._receiving = None
            receiver = asyncio.ensure_future(receive())
            self._receiving = (msg.generation, receiver)
            receiver.add_done_callback(lambda done: self._receiving is not None and self._receiving[1] is done
                                       and setattr(self, "_receiving", None))
            interruptible = bool((self.settings.get("gen") or {}).get("interruptible", True))
            swaps_before = len(getattr(engine, "swaps", []))
            stall = 0.0
            try:
                if interruptible:
                    await engine.update_weights(msg.version, buckets())
                else:
                    paused = time.monotonic()
                    await engine.pause()
                    try:
                        await engine.update_weights(msg.version, buckets())
                    finally:
                        await engine.resume()
                        stall = time.monotonic() - paused
            except Exception as exc:
                await asyncio.gather(receiver, return_exceptions=True)
                self.counters["weight_update_failures"] += 1
                self.log.error("weights_update_failed", version=msg.version, error=repr(exc))
                raise WeightSyncError(f"version {msg.version}: {exc}") from exc
            await receiver  # raises the link error, if any (update_weights then saw a short source)
            receive_s = received_at[0] - t0
            swaps = getattr(engine, "swaps", [])
            if interruptible and len(swaps) > swaps_before:
                stall = swaps[-1].swap_s + swaps[-1].rebuild_s   # the decode loop's pause at the boundary
            digest, how = await self._verified(msg)
            self.log.info("weights_updated", version=msg.version, generation=msg.generation, buckets=msg.n_buckets,
                          receive_s=round(receive_s, 4), stall_s=round(stall, 4),
                          total_s=round(time.monotonic() - t0, 4), interruptible=interruptible,
                          active_groups=len(self.active), verified=how)
            return WeightsAck(version=msg.version, weights_hash=digest, receive_seconds=receive_s,
                              stall_seconds=stall, verified=how)

    async def _verified(self, msg: WeightsReady) -> tuple[str, str]:
        """(hash, how) of the weights the engine now samples with (`verify_engine_weights`); a hash that
        differs from the trainer's is an error in the log and a counter (the parameter server counts it too)."""
        try:
            digest, how = await asyncio.to_thread(verify_engine_weights, self.engine, msg.version)
        except EngineError as exc:
            raise WeightSyncError(f"version {msg.version}: the engine's weights could not be checked: {exc}") from exc
        if how == "hash" and msg.weights_hash and digest != msg.weights_hash:   # "": the trainer announced none
            self.counters["hash_mismatches"] += 1
            self.log.error("weights_hash_mismatch", version=msg.version, expected=msg.weights_hash, got=digest)
        self.counters["weight_updates"] += 1
        self.counters[f"weights_verified_by_{how}"] += 1
        return digest, how

    async def _update_through_server(self, msg: WeightsReady, group: "ServerWeightGroup", t0: float) -> WeightsAck:
        """The server receives the buckets the trainer broadcasts, one /update_weights_from_distributed each,
        inside one pause of its generation (the engine's interruption)."""
        try:
            await group.receive(msg)
        except Exception as exc:
            self.counters["weight_update_failures"] += 1
            self.log.error("weights_update_failed", version=msg.version, error=repr(exc))
            raise WeightSyncError(f"version {msg.version}: {exc}") from exc
        seconds = time.monotonic() - t0
        digest, how = await self._verified(msg)
        self.log.info("weights_updated", version=msg.version, generation=msg.generation, buckets=msg.n_buckets,
                      total_s=round(seconds, 4), through_server=True, active_groups=len(self.active), verified=how)
        # generation pauses for the whole receive (SGLang aborts and resumes around it)
        return WeightsAck(version=msg.version, weights_hash=digest, receive_seconds=seconds, stall_seconds=seconds,
                          verified=how)

    @handles(RunFinished)
    def on_run_finished(self, msg: RunFinished) -> None:
        self.request_stop(f"run finished at step {msg.step}: {msg.reason}")
