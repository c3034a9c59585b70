"""RolloutActor: drives a generation engine, turns GenerateGroup into Trajectories, takes new weights live.

Work. ``GenerateGroup`` (from the buffer) becomes one :class:`GenerationRequest` with ``n`` samples, run as
``n`` episodes (actors/rollout/episode.py) in the environment its task names (``Task.tool``; none: the one-turn case,
exactly that one request), or, with ``settings.agent``, as ``n`` episodes of that agent against this rollout's
OpenAI endpoint (actors/rollout/agent.py; the answers carry the prompt the conversations rendered). The handler awaits the engine (which decodes in its own thread or server, so the
event loop never blocks) and the environment's steps (each bounded by ``gen.env_timeout_s``), and sends
:class:`Trajectories` to a reward actor, round-robin over ``cfg.groups["reward"]``. A group
that cannot be finished (the actor is draining, the engine failed, the request is malformed) goes back to
the buffer as :class:`GroupReturned` with a reason, so no work is ever lost silently. Reasons starting with
``invalid:`` mean re-issuing the same group cannot succeed. The evaluator's held-out prompts
(:class:`EvalGenerate`, ``weights_from: rollouts``) are answered greedily on the same engine, beside the groups.

Weights. On ready the actor sends :class:`RolloutHello` (its engine version) to the parameter server and
waits for :class:`LinkReform`: it never opens the ``ps_to_rollout`` bulk link on its own, because only the
parameter server knows the epoch every member must meet at (a restarted rollout needs a fresh group).
:class:`WeightsReady` is a request, answered by :class:`WeightsAck` once the engine samples with the new
version. How the bytes come is this rollout's :class:`actors.weight_sync.WeightReceiver`, picked once at
start: on the bulk link, fed to ``engine.update_weights`` as they arrive while generation continues
(``gen.interruptible``, the default) or paused around the swap (``gen.interruptible: false``, the
synchronous baseline); or through its SGLang server, which joins the trainer's group itself.

Settings (besides the shared experiment keys ``model.path``, ``model.dtype``, ``gen.interruptible``,
``gen.max_turns``, ``gen.max_context``, ``gen.env_timeout_s``):
    engine:            "torch" (default); see :func:`make_engine`
    device:            "cpu" or "cuda" for the embedded engine (default: the instance's GPU if it has one)
    max_running:       most sequences the embedded engine decodes at once (default 256)
    link:              name of the weights link (default "ps_to_rollout", or the only link listed)
    weights_timeout_s: bound on waiting for the link to reach a WeightsReady's epoch (default: the
                       link's timeout_s)
    weights_via_server: with direct weights (the trainer is the link's rank 0) and an SGLang engine, the
                       server joins the trainer's group and receives itself (default true; false: this
                       process receives on the bulk link and hands the weights to the server through disk)
    stats_every_s:     period of the ``rollout_stats`` log line (default 30; 0 disables it)
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from actors.runtime.base import Actor, ActorSpec, handles
from actors.engines.base import (EngineError, GenerationEngine, GenerationRequest, RequestError, SamplingParams,
                                 require_device)
from actors.engines.tokenizer import LoadedTokenizer, load_tokenizer
from actors.engines.lora import LoraSpec
from actors.reward.sandbox import MiB, SandboxLimits, probe_sandbox
from actors.rollout.agent import (AgentFn, AgentGroupError, AgentRun, AgentSandbox, agent_problems, group_answers,
                                  load_agent, preload_openai, run_agent, shared_http_client)
from actors.rollout.chat import ChatTemplate, template_of
from actors.rollout.envs import ENVIRONMENTS, UnknownTool, environment_for
from actors.rollout.envs.python_tool import CodeRunner, python_tool, timeout_problem
from actors.rollout.episode import EpisodeError, EpisodeLimits, Trajectory, run_episodes, turn_seed
from actors.rollout.openai_server import AgentEndpoint, EndpointLimits
from actors.runtime.recovery import held_start_weights
from actors.weight_sync import WeightReceiver, WeightSyncError, link_config, make_receiver
from actors.weights import weights_hash
from topology.settings import RolloutSettings
from transport.bulk import BulkError
from transport.protocol import (AbortGroup, Answers, EvalGenerate, EvalGenerated, GenerateGroup, GroupAborted,
                                GroupReturned, HelloRequest, LinkReform, RolloutHello, RunFinished, Sample, ServerDown, Trajectories, WeightsAck, WeightsReady,
                                WorkerHello)

__all__ = ["RolloutActor", "RolloutConfigError", "make_engine", "verify_engine_weights"]


class RolloutConfigError(ValueError):
    """The rollout's settings are unusable; the message names the key."""


def rollout_placement(cfg: RolloutSettings) -> dict[str, str]:
    """Where and how the rollout's engine runs, as --dry-run prints it. An SGLang server always runs on the
    instance's GPUs, in ``sglang.dtype`` or ``model.dtype`` ("auto": SGLang takes the checkpoint's)."""
    kind = cfg.engine
    tp = cfg.instance.parallel.get("tp", 1)
    model_dtype = cfg.model.dtype
    if kind == "sglang":
        dtype = cfg.sglang.dtype or model_dtype or "auto"
        return {"engine": "sglang", "device": "cuda", "dtype": str(dtype), "parallel": f"tp={tp}", "memory": "-",
                "process_group": "nccl (weights group)"}
    device = cfg.engine_device
    return {"engine": kind, "device": device, "dtype": str(model_dtype or "float32"), "parallel": f"tp={tp}",
            "memory": "-", "process_group": "nccl" if device == "cuda" else "gloo"}


def rollout_ready_budget(cfg: RolloutSettings) -> tuple[float, str] | None:
    """What a rollout starts beyond its process, as (seconds it may take, the setting that says so): it
    reports ready once its engine is up, and an SGLang server it launches is up only when healthy (weights
    read from shared storage, CUDA graphs captured: minutes at 7B, more at 32B). None: nothing beyond."""
    if cfg.engine != "sglang":
        return None
    if cfg.sglang_url:
        from actors.engines.sglang import SGLangEngine
        return SGLangEngine.ATTACH_TIMEOUT_S, "the attach wait for sglang_url"
    return cfg.sglang.health_timeout_s, "sglang.health_timeout_s"


def make_engine(cfg: RolloutSettings, version: int, model_dir: str, run_dir: str | None = None,
                on_server_event: Callable[[str, int], Awaitable[None]] | None = None) -> GenerationEngine:
    """The one place that turns ``cfg.engine`` into an engine. ``on_server_event(event, restarts)``:
    the engine's server process "died" or was "restarted" (SGLang engines that launch their server)."""
    kind = cfg.engine
    if kind == "torch":
        from actors.engines.torch_gen import TorchGenerationEngine

        device = cfg.engine_device
        require_device(device)
        lora = cfg.model.lora
        return TorchGenerationEngine(model_dir, version=version, device=device,
                                     dtype=cfg.model.dtype, max_running=cfg.max_running,
                                     seed=cfg.seed * 1000 + cfg.instance.index,
                                     record_routing=cfg.algo.routing_replay == "r3",
                                     lora=LoraSpec.from_settings(lora), start_adapter=lora.adapter if lora else None)
    # "sglang" (the settings admit no other engine): an SGLang server, started here or attached by cfg.sglang_url
    from actors.engines.sglang import SGLangEngine

    return SGLangEngine.from_settings(cfg, version, model_dir, run_dir=run_dir, on_server_event=on_server_event)


def agent_task(msg: GenerateGroup, prompt: str) -> dict[str, Any]:
    """The task record an agent is given: the prompt as text and what its answer is checked against."""
    task = msg.task
    return {"prompt": prompt, "answer": task.answer, "answers": task.references, "kind": task.kind,
            "tests": list(task.tests), "mode": task.mode, "group_id": msg.group_id}


async def verify_engine_weights(engine: GenerationEngine, version: int) -> tuple[str, str]:
    """``(weights_hash, "hash")`` of the weights the engine samples with, computed where they live; or, for an
    engine whose server cannot read them back (SGLang), ``("", "version")`` once it reports ``version``."""
    own = getattr(engine, "verify_weights", None)
    if callable(own):
        return await own(version)
    from actors.engines.checkpoint import hf_state_dict

    model = engine.model  # type: ignore[attr-defined]
    return await asyncio.to_thread(lambda: weights_hash(hf_state_dict(model).items())), "hash"


class RolloutActor(Actor):
    Settings = RolloutSettings
    cfg: RolloutSettings
    placement = staticmethod(rollout_placement)   # what --dry-run prints for the group
    ready_budget = staticmethod(rollout_ready_budget)   # what it starts before it is ready (launch/readiness.py)
    # Interchangeable workers: the run starts once enough are ready, the rest join when their servers are up,
    # and one that cannot be kept up is left down (actors/runtime/supervisor.py, late_joiners).
    joins_late = True

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        # Everything a handler may touch exists before the bus starts: messages can arrive during on_start.
        self.engine: GenerationEngine | None = None
        self._engine_ready = asyncio.Event()
        self.receiver: WeightReceiver | None = None   # this rollout's side of the weights path
        self._link_target: int | None = None
        self._link_msg: LinkReform | None = None
        self._link_requests = 0          # LinkReform messages seen; each one re-forms, even at an equal number
        self._link_wanted = asyncio.Event()
        self._link_changed = asyncio.Condition()
        self._weights_lock = asyncio.Lock()
        self._incarnation = f"{os.getpid()}-{time.time_ns()}"
        self.rewards: list[str] = []
        self.buffer = "buffer"
        self.param_server: str | None = None
        self.active: dict[str, float] = {}   # group_id -> start time
        self.held: set[str] = set()          # groups whose handler runs (active, or waiting for the engine)
        self.aborted: set[str] = set()       # groups the buffer had aborted while this rollout held them
        self._group_done: dict[str, asyncio.Event] = {}
        self._episodes: dict[str, asyncio.Future] = {}   # group_id -> its episodes in flight (AbortGroup cancels)
        self._kv_tokens = 0                  # the engine's server's KV pool (0: not known)
        self._rr = 0
        self._t0 = time.monotonic()
        self._busy_since: float | None = None
        self._busy_total = 0.0
        self._idle = asyncio.Event()         # set while no group is in the engine
        self._idle.set()
        self._gen_seconds = 0.0
        self._env_seconds = 0.0              # of it, environment steps (tool calls) of episodes
        self._tokens = 0
        self.codec: LoadedTokenizer | None = None   # what an episode encodes observations and decodes turns with
        self.limits = EpisodeLimits()
        self.environments = dict(ENVIRONMENTS)   # tool name -> factory; the python tool's built from settings
        self.python_runner: CodeRunner | None = None
        self._eval_requests = 0              # the evaluator's prompts taken (their request ids)
        self.agent: AgentFn | list[str] | None = None   # settings.agent: every group runs it (on_start)
        self.endpoint: AgentEndpoint | None = None       # the agents' OpenAI endpoint over this rollout's engine
        self.agent_sandbox: AgentSandbox | None = None   # settings.agent.sandbox: how its programs are isolated
        self.agent_http: Any = None                      # the agent functions' shared HTTP pool (AgentClient)

    # ------------------------------------------------------------------------------------ lifecycle

    @classmethod
    def check_settings(cls, cfg: RolloutSettings) -> list[str]:
        out = []
        if not cfg.groups.get("reward"):
            out.append("groups.reward: no reward actors to send trajectories to")
        if not cfg.model.path:
            out.append("model.path: not set (episodes decode turns with its tokenizer)")
        if problem := timeout_problem(cfg.python_tool, cfg.gen.env_timeout_s):
            out.append(problem)
        return out + agent_problems(cfg.agent)

    async def on_start(self) -> None:
        # Off the event loop: it imports the agent's module, which may take seconds on a loaded machine.
        if problems := await asyncio.to_thread(self.check_settings, self.cfg):
            raise RolloutConfigError("; ".join(problems))
        groups = self.cfg.groups
        self.rewards = list(groups["reward"])
        self.buffer = (groups.get("buffer") or ["buffer"])[0]
        self.param_server = (groups.get("param_server") or [None])[0]
        config = link_config(self.cfg.links, self.cfg.link, "ps_to_rollout")
        gen = self.cfg.gen
        self.limits = EpisodeLimits(max_turns=gen.max_turns, max_tokens=gen.max_context,
                                    env_timeout_s=gen.env_timeout_s)
        try:
            self.python_runner, self.environments["python"] = python_tool(self.cfg.python_tool, gen.env_timeout_s)
        except ValueError as exc:
            raise RolloutConfigError(str(exc)) from None
        self.codec = await asyncio.to_thread(load_tokenizer, self.cfg.model.path)
        # The checkpoint is leased until the engine has loaded it: the trainer's retention goes on meanwhile.
        with held_start_weights(self.cfg, self.run_dir, self.name) as (version, model_dir):
            self.engine = make_engine(self.cfg, version, model_dir, run_dir=str(self.run_dir),
                                      on_server_event=self._engine_server_event)
            if config is not None:
                self.receiver = make_receiver(self.cfg, config, self.engine, self._verified, self.make_link,
                                              self.param_server, self.counters, self.log, lambda: len(self.active))
            await self.engine.start()
        if self.cfg.agent.enabled:
            await self._start_agent_endpoint()
        kv_pool = getattr(self.engine, "kv_pool_tokens", None)
        if callable(kv_pool):
            try:
                self._kv_tokens = await kv_pool()
            except EngineError as exc:
                self.log.warning("kv_pool_unknown", error=str(exc))
        self._engine_ready.set()
        self.log.info("engine_started", engine=type(self.engine).__name__, version=version, model_dir=model_dir,
                      link=config.name if config else None)

    async def _start_agent_endpoint(self) -> None:
        """settings.agent: load the agent, serve the OpenAI endpoint on loopback over the engine."""
        settings, gen = self.cfg.agent, self.cfg.gen
        assert self.codec is not None and self.engine is not None
        try:
            # Imports off the event loop: the `openai` package alone takes seconds to import on a loaded machine,
            # and its first use by an agent would otherwise stall the bus's heartbeats (AgentClient.openai).
            self.agent = (await asyncio.to_thread(load_agent, settings.function) if settings.function
                          else list(settings.command or []))
            if settings.function:
                await asyncio.to_thread(preload_openai)
                self.agent_http = await asyncio.to_thread(shared_http_client)
            if settings.chat_template:
                with open(settings.chat_template, encoding="utf-8") as f:
                    source = f.read()
                template: ChatTemplate | None = ChatTemplate(source, *self._special_texts())
            else:
                template = template_of(self.codec)
        except (ValueError, OSError) as exc:   # ChatError is a ValueError
            raise RolloutConfigError(f"agent: {exc}") from None
        if template is None:
            raise RolloutConfigError("agent: the tokenizer has no chat_template and agent.chat_template is unset")
        eos = self.codec.eos_token_id
        try:
            self.endpoint = AgentEndpoint(self.engine, self.codec, template, EndpointLimits(
                max_new_tokens=gen.max_new_tokens, max_context=gen.max_context,
                stop_token_ids=(eos,) if eos is not None else ()), tool_format=settings.tool_format)
        except ValueError as exc:
            raise RolloutConfigError(f"agent.tool_format: {exc}") from None
        if settings.sandbox:
            self.agent_sandbox = await self._agent_sandbox()
            await self.endpoint.start(unix_path=self.agent_sandbox.socket_path)
            os.chmod(self.agent_sandbox.socket_path, 0o666)   # the sandbox's unprivileged uid connects to it
        else:
            await self.endpoint.start()
        self.log.info("agent_endpoint", base_url=self.endpoint.base_url,
                      agent=settings.function or " ".join(settings.command or []))

    async def _agent_sandbox(self) -> AgentSandbox:
        """settings.agent.sandbox: the program's files, and the endpoint's socket in a folder of its own that
        the sandbox's unprivileged uid may enter but not list."""
        settings = self.cfg.agent
        status = await asyncio.to_thread(probe_sandbox)
        if not status.available:
            raise RolloutConfigError(f"agent.sandbox: no working bubblewrap sandbox ({status.reason})")
        files = {}
        for path in settings.files:
            try:
                with open(path, "rb") as f:
                    files[os.path.basename(path)] = f.read()
            except OSError as exc:
                raise RolloutConfigError(f"agent.files: {exc}") from None
        folder = tempfile.mkdtemp(prefix="agent-endpoint-")
        os.chmod(folder, 0o711)
        return AgentSandbox(os.path.join(folder, "endpoint.sock"), files,
                            SandboxLimits(memory_bytes=settings.memory_mb * MiB))

    def _special_texts(self) -> tuple[str, str]:
        """(eos, bos) as text, what a chat template's variables name."""
        assert self.codec is not None
        text = lambda i: self.codec.decode([i], skip_special_tokens=False) if i is not None else ""  # type: ignore[union-attr]
        return text(self.codec.eos_token_id), text(self.codec.bos_token_id)

    def progress(self) -> dict[str, Any]:
        return {"weights_version": self.engine.version if self.engine is not None else None,
                "groups": len(self.active)}

    async def on_ready(self) -> None:
        await self.bus.send(self.buffer, WorkerHello(role="rollout", kv_tokens=self._kv_tokens))
        if self.receiver is not None:
            self.spawn(self._link_keeper(), name="link_keeper")
            await self._hello()
        every = self.cfg.stats_every_s
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
        if self.endpoint is not None:   # an agent would go on calling: end its episodes
            for running in self._episodes.values():
                running.cancel()
        deadline = time.monotonic() + self.cfg.drain_timeout / 2
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
        if self.endpoint is not None:
            await self.endpoint.stop()
        if self.agent_http is not None:
            await self.agent_http.aclose()
        if self.agent_sandbox is not None:
            shutil.rmtree(os.path.dirname(self.agent_sandbox.socket_path), ignore_errors=True)
        if self.engine is not None:
            await self.engine.stop()
        if self.receiver is not None:
            self.receiver.close()
        self.log.info("rollout_stats", **self.stats())

    def on_peer_alive(self, peer: str) -> None:
        # A parameter server that was declared dead and answers again may be a fresh process: say hello
        # again so it learns our version and re-forms the link with us.
        if peer == self.param_server and self.receiver is not None and self._engine_ready.is_set():
            self.spawn(self._hello(), name="hello", critical=False)

    async def _engine_server_event(self, event: str, restarts: int) -> None:
        """The engine's server "died": its weights group went with it; tell the parameter server at once, so
        it forms no group that would wait a whole link timeout for the missing ranks. "restarted": it is back
        on its launch weights, outside every group; say hello again, as a restarted rollout does, so the
        group is re-formed with its ranks and the current version pushed (on the engine's watcher task)."""
        version = self.engine.version if self.engine else -1
        if self.receiver is not None:
            self.receiver.server_lost()
        if event == "died":
            self.log.warning("engine_server_died", restarts=restarts, version=version)
            if self.receiver is not None and self.param_server is not None:
                await self.bus.send(self.param_server, ServerDown(restarts=restarts))
            return
        self.log.warning("engine_server_restarted", restarts=restarts, version=version)
        if self.receiver is not None:
            await self._hello()

    @handles(HelloRequest)
    async def on_hello_request(self, msg: HelloRequest, env: Any) -> None:
        if env.sender == self.buffer:   # a restarted buffer: it has no work of ours and may give some
            await self.bus.send(self.buffer, WorkerHello(role="rollout", kv_tokens=self._kv_tokens))
            return
        await self._engine_ready.wait()
        if self.receiver is not None:
            await self._hello()

    async def _hello(self) -> None:
        if self.param_server is None or self.engine is None or self.receiver is None:
            return
        await self.bus.send(self.param_server, RolloutHello(version=self.engine.version,
                                                            weight_ranks=self.receiver.ranks,
                                                            incarnation=self._incarnation))
        self.log.info("hello_sent", version=self.engine.version, param_server=self.param_server)

    # ----------------------------------------------------------------------------------- generation

    @handles(GenerateGroup)
    async def on_generate(self, msg: GenerateGroup) -> None:
        # Held from the first instant (before any await): an AbortGroup that follows finds it here.
        self.held.add(msg.group_id)
        self._group_done[msg.group_id] = asyncio.Event()
        try:
            await self._generate(msg)
        finally:
            self.held.discard(msg.group_id)
            self._group_done.pop(msg.group_id).set()

    async def _generate(self, msg: GenerateGroup) -> None:
        await self._engine_ready.wait()
        if msg.group_id in self.aborted:   # aborted before its generation began
            await self._return(msg.group_id, "aborted")
            return
        engine = self.engine
        assert engine is not None
        try:
            sampling = SamplingParams(temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
                                      max_new_tokens=msg.max_new_tokens, stop_token_ids=tuple(msg.stop_token_ids),
                                      # seed 0 is "unset" on the wire: let the engine pick a fresh one
                                      seed=msg.seed or None)
            request = GenerationRequest(rid=msg.group_id, input_ids=tuple(msg.prompt_ids), sampling=sampling, n=msg.n)
            make_env = environment_for({"tool": msg.task.tool or None}, self.environments)
        except (RequestError, UnknownTool) as exc:
            await self._return(msg.group_id, f"invalid: {exc}")
            return
        # No await between this check and engine.generate registering the request: on_drain's abort
        # either sees the request or this handler sees draining.
        if self.draining:
            await self._return(msg.group_id, "draining")
            return
        start = time.monotonic()
        self._busy_enter(msg.group_id, start)
        assert self.codec is not None
        if self.agent is not None:
            await self._generate_by_agent(msg, start)
            return
        running = self._episodes[msg.group_id] = asyncio.ensure_future(
            run_episodes(engine, request, make_env, self.codec, self.limits))
        try:
            episodes = await self._await_group(msg.group_id, running)
        except (RequestError, EpisodeError) as exc:   # EpisodeError: a tool's marker is not one token
            await self._return(msg.group_id, f"invalid: {exc}")
            return
        except EngineError as exc:
            self.log.error("engine_failed", group_id=msg.group_id, error=str(exc))
            await self._return(msg.group_id, f"engine_error: {exc}")
            return
        if episodes is None:
            return
        seconds = time.monotonic() - start
        if any(t.end == "abort" for t in episodes):
            await self._return(msg.group_id, "draining" if self.draining else "aborted")
            return
        self._count_episodes(msg.group_id, episodes)
        samples = [Sample(output_ids=t.output_ids, logprobs=t.logprobs, versions=t.versions,
                          finish_reason=t.answer_finish_reason, routed_experts=t.routed_experts) for t in episodes]
        await self._send_answers(msg, samples, episodes, seconds)

    async def _send_answers(self, msg: GenerateGroup, samples: list[Sample], episodes: list[Trajectory],
                            seconds: float, prompt_ids: list[int] | None = None) -> None:
        tokens = sum(t.generated_tokens for t in episodes)   # an environment's tokens are not generation
        self._gen_seconds += seconds
        self._tokens += tokens
        self.counters["groups_generated"] += 1
        self.counters["tokens_generated"] += tokens
        reward = msg.reward or self.rewards[self._rr % len(self.rewards)]
        self._rr += 1
        await self.bus.send(reward, Trajectories(group_id=msg.group_id, task=msg.task, answers=Answers(
            samples=samples, rollout=self.name, gen_seconds=seconds, prompt_ids=list(prompt_ids or []),
            **self._clocks())))

    async def _await_group(self, group_id: str, running: asyncio.Future) -> Any:
        """What ``running`` (the group's episodes or agent runs) returns; None once a cancelled group has gone
        back to the buffer. Its other errors propagate."""
        try:
            return await running
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not (current is not None and current.cancelling()):
                # AbortGroup or a drain cancelled the episodes (a later turn or an agent's call is a request of
                # its own, which aborting the group's id does not reach); cancelling aborts every one in flight.
                # (Not running.cancelled(): a gather whose children clean up before re-raising, as run_agent
                # closes its episode, ends with a CancelledError exception and reads as not cancelled.)
                await self._return(group_id, "draining" if self.draining else "aborted")
                return None
            # The drain ran out of time and cancelled this handler (the engine aborts the request on
            # cancellation): the group still goes back to the buffer.
            await self._return(group_id, "cancelled")
            raise
        finally:
            self._episodes.pop(group_id, None)
            self._busy_exit(group_id)

    async def _generate_by_agent(self, msg: GenerateGroup, start: float) -> None:
        """The group as ``n`` episodes of the agent (settings.agent), each its own key on the endpoint, run at
        once; the answers continue the prompt the conversations rendered (`group_answers`), which travels in
        `Answers.prompt_ids`. An agent's reward travels in `Sample.agent_reward`."""
        assert self.endpoint is not None and self.agent is not None and self.codec is not None
        task = agent_task(msg, self.codec.decode(msg.prompt_ids))
        seed = msg.seed or None
        running = self._episodes[msg.group_id] = asyncio.ensure_future(asyncio.gather(*(
            run_agent(self.endpoint, self.agent, task, f"{msg.group_id}/s{i}", self.cfg.agent.timeout_s,
                      turn_seed(seed, i, 0), self.agent_sandbox, self.agent_http)
            for i in range(msg.n))))
        runs: list[AgentRun] | None = await self._await_group(msg.group_id, running)
        if runs is None:
            return
        seconds = time.monotonic() - start
        self._count_agent_runs(msg.group_id, runs)
        if any(t.end == "abort" for run in runs for t in run.trajectories):
            await self._return(msg.group_id, "draining" if self.draining else "aborted")
            return
        try:
            prompt, answers = group_answers(runs)
        except AgentGroupError as exc:
            await self._return(msg.group_id, f"invalid: agent: {exc}")
            return
        self._count_episodes(msg.group_id, answers)
        samples = [Sample(output_ids=t.output_ids, logprobs=t.logprobs, versions=t.versions,
                          finish_reason=t.answer_finish_reason, agent_reward=run.reward)
                   for t, run in zip(answers, runs)]
        await self._send_answers(msg, samples, answers, seconds, prompt_ids=prompt)

    def _count_agent_runs(self, group_id: str, runs: list[AgentRun]) -> None:
        """The conversations' counters (drift above all: 0 expected) and the agents' failures, logged with cause."""
        for run in runs:
            for name, value in run.counters.items():
                self.counters[f"agent_{name}"] += value
            self.counters["agent_branches_untrained"] += max(len(run.trajectories) - 1, 0)
            if run.error:
                self.counters["agent_errors"] += 1
                self.log.warning("agent_error", group_id=group_id, error=run.error[:300])
            if run.counters.get("drift") or run.counters.get("rerendered"):
                self.log.warning("agent_drift", group_id=group_id, **run.counters)

    def _count_episodes(self, group_id: str, episodes: list[Trajectory]) -> None:
        """Turns, tool calls and environment time per episode (rollout_stats); an environment's failure is
        part of the episode's outcome (its answer is graded as it stands), logged with its cause."""
        for t in episodes:
            self.counters["episodes"] += 1
            self.counters["turns"] += len(t.turns)
            self.counters["tool_calls"] += t.tool_calls
            self.counters["env_tokens"] += t.env_tokens
            self._env_seconds += t.env_seconds
            self.counters[f"episode_end_{t.end}"] += 1
            if t.end == "env_error":
                self.log.warning("episode_env_error", group_id=group_id, error=t.error[:300])

    @handles(EvalGenerate)
    async def on_eval_generate(self, msg: EvalGenerate) -> EvalGenerated:
        """The evaluator's held-out prompt, answered greedily on this engine beside the groups, by the same path
        (SGLang or the embedded engine; a weight update mid-answer shows in the per-token versions). It is not
        group work: the buffer never sees it and it does not count as busy time. Empty prompt: the version only."""
        await self._engine_ready.wait()
        engine = self.engine
        assert engine is not None
        if not msg.prompt_ids:
            return EvalGenerated(version=engine.version)
        if self.draining:
            return EvalGenerated(version=engine.version, error="draining")
        self._eval_requests += 1
        try:
            greedy = SamplingParams(temperature=0.0, max_new_tokens=msg.max_new_tokens,
                                    stop_token_ids=tuple(msg.stop_token_ids))
            (result,) = await engine.generate(GenerationRequest(
                rid=f"eval-{self._incarnation}-{self._eval_requests}", input_ids=tuple(msg.prompt_ids),
                sampling=greedy, n=1))
        except RequestError as exc:
            return EvalGenerated(version=engine.version, error=f"invalid: {exc}")
        except EngineError as exc:
            return EvalGenerated(version=engine.version, error=f"engine_error: {exc}")
        if result.finish_reason == "abort":   # drained meanwhile
            return EvalGenerated(version=engine.version, error="aborted")
        self.counters["eval_prompts_answered"] += 1
        return EvalGenerated(version=engine.version, output_ids=list(result.output_ids), logprobs=list(result.logprobs),
                             versions=list(result.versions), finish_reason=result.finish_reason)

    @handles(AbortGroup)
    async def on_abort_group(self, msg: AbortGroup) -> GroupAborted:
        """The buffer gives up on a group (its time ran out) and will issue it again: stop generating it,
        and answer once it has stopped, so that no second copy runs beside it."""
        gid = msg.group_id
        held = gid in self.held
        self.log.info("group_abort", group_id=gid, held=held, reason=msg.reason)
        if not held:   # it finished (its answers are on their way) or never came
            return GroupAborted(group_id=gid, held=False, stopped=True)
        self.aborted.add(gid)
        if len(self.aborted) > 100_000:   # bounded: group ids are never issued twice
            self.aborted.clear()
        self.counters["groups_aborted"] += 1
        done = self._group_done[gid]
        if self.engine is not None and gid in self.active:
            await self.engine.abort(gid)
            running = self._episodes.get(gid)
            # An episode's later turns are requests of their own: cancelling aborts them. A one-turn group is
            # not cancelled: its aborted request answers, and `done` is set once the server has let it go
            # (a cancelled wait would answer before the server's copy ended, beside its re-issue).
            if running is not None and (self.limits.max_turns > 1 or self.agent is not None):
                running.cancel()
        try:
            await asyncio.wait_for(done.wait(), self.cfg.drain_timeout / 2)
        except TimeoutError:
            return GroupAborted(group_id=gid, held=True, stopped=False)
        return GroupAborted(group_id=gid, held=True, stopped=True)

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
        episodes = max(self.counters["episodes"], 1)
        return {"groups": self.counters["groups_generated"], "returned": self.counters["groups_returned"],
                "tokens": self._tokens, "gen_seconds": round(self._gen_seconds, 3),
                "env_seconds": round(self._env_seconds, 3),
                "turns_per_episode": round(self.counters["turns"] / episodes, 3),
                "tool_calls_per_episode": round(self.counters["tool_calls"] / episodes, 3),
                "busy_fraction": round(busy / wall, 4), "active": len(self.active),
                "version": self.engine.version if self.engine is not None else None,
                "tokens_per_s": round(self._tokens / wall, 2),
                # the python tool's runs, calls abandoned at its timeout, runs refused (no sandbox) or failed
                **({"python_tool": dict(self.python_runner.counters)}
                   if self.python_runner is not None and self.python_runner.counters["runs"] else {}),
                # the agents' endpoint: calls, errors, its own time per call (HTTP, matching, rendering, parsing)
                **({"agent_endpoint": self.endpoint.stats()} if self.endpoint is not None else {})}

    async def _stats_loop(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)  # a reporting period, not synchronisation
            self.log.info("rollout_stats", **self.stats())

    # -------------------------------------------------------------------------------------- weights

    @handles(LinkReform)
    def on_link_reform(self, msg: LinkReform) -> None:
        if self.receiver is None:
            self.log.warning("link_reform_without_link", epoch=msg.epoch)
            return
        self._link_target = msg.epoch
        self._link_msg = msg
        self._link_requests += 1
        self._link_wanted.set()
        self.receiver.abandon_before(msg.epoch)

    async def _link_keeper(self) -> None:
        """Re-form the link at the newest epoch the parameter server asked for, one at a time."""
        assert self.receiver is not None
        done = 0
        while True:
            await self._link_wanted.wait()
            self._link_wanted.clear()
            if self._link_requests == done:
                continue
            done, epoch, msg = self._link_requests, self._link_target, self._link_msg
            t0 = time.monotonic()
            try:
                if not await self._formed_unless_newer(epoch, msg):
                    continue
            except (BulkError, EngineError) as exc:
                # The parameter server retries at a newer epoch and tells us; wait for that.
                self.counters["link_reform_failures"] += 1
                self.log.error("link_reform_failed", epoch=epoch, error=str(exc))
                continue
            self.counters["link_reforms"] += 1
            self.log.info("link_formed", epoch=epoch, seconds=round(time.monotonic() - t0, 3))
            async with self._link_changed:
                self._link_changed.notify_all()

    async def _formed_unless_newer(self, epoch: int, msg: LinkReform) -> bool:
        """Form the link at ``epoch``, unless a newer LinkReform comes first (a member this one waits for
        was left out of the next): then abandon it (a bulk link's thread ends on its own epoch; a
        server's join is cancelled and the next join drops what it left)."""
        assert self.receiver is not None
        forming = asyncio.ensure_future(self.receiver.form(msg))
        newer = asyncio.ensure_future(self._link_wanted.wait())
        await asyncio.wait({forming, newer}, return_when=asyncio.FIRST_COMPLETED)
        newer.cancel()
        if forming.done():
            forming.result()
            return True
        forming.cancel()
        forming.add_done_callback(lambda f: f.cancelled() or f.exception())   # its late error is expected
        self.counters["link_formations_abandoned"] += 1
        self.log.warning("link_formation_abandoned", epoch=epoch, newer=self._link_target)
        return False

    async def _wait_link(self, epoch: int, timeout: float) -> None:
        link = self.receiver
        if link is None:
            raise WeightSyncError(f"{self.name} has no weights link (settings.links has none for it)")
        def stale() -> bool:  # a request for an older group than the one formed (or being formed) now
            known = [e for e in (link.epoch, self._link_target) if e is not None]
            return bool(known) and max(known) > epoch

        if stale():  # e.g. queued by ZeroMQ while this process was down: nobody will broadcast on it
            raise WeightSyncError(f"link {link.config.name!r}: epoch {epoch} is stale "
                                  f"(the link is at {link.epoch}, re-forming to {self._link_target})")
        try:
            async with asyncio.timeout(timeout):
                async with self._link_changed:
                    await self._link_changed.wait_for(lambda: link.epoch == epoch or stale())
            if stale():
                raise WeightSyncError(f"link {link.config.name!r}: epoch {epoch} became stale "
                                      f"while waiting (now {link.epoch})")
        except TimeoutError:
            raise WeightSyncError(f"link {link.config.name!r} did not reach epoch {epoch} within "
                                  f"{timeout:g}s (it is at {link.epoch})") from None

    @handles(WeightsReady)
    async def on_weights_ready(self, msg: WeightsReady) -> WeightsAck:
        await self._engine_ready.wait()
        async with self._weights_lock:
            link_timeout = self.receiver.config.timeout_s if self.receiver is not None else 60.0
            await self._wait_link(msg.epoch, self.cfg.weights_timeout_s or link_timeout)
            assert self.receiver is not None
            return await self.receiver.receive(msg)

    async def _verified(self, msg: WeightsReady) -> tuple[str, str]:
        """(hash, how) of the weights the engine now samples with (`verify_engine_weights`); a hash that
        differs from the trainer's is an error in the log and a counter (the parameter server counts it too)."""
        try:
            digest, how = await verify_engine_weights(self.engine, msg.version)
        except EngineError as exc:
            raise WeightSyncError(f"version {msg.version}: the engine's weights could not be checked: {exc}") from exc
        if how == "hash" and msg.weights_hash and digest != msg.weights_hash:   # "": the trainer announced none
            self.counters["hash_mismatches"] += 1
            self.log.error("weights_hash_mismatch", version=msg.version, expected=msg.weights_hash, got=digest)
        self.counters["weight_updates"] += 1
        self.counters[f"weights_verified_by_{how}"] += 1
        return digest, how

    @handles(RunFinished)
    def on_run_finished(self, msg: RunFinished) -> None:
        self.request_stop(f"run finished at step {msg.step}: {msg.reason}")
