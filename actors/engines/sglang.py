"""SGLang rollout engine: a `GenerationEngine` that drives an SGLang server over its HTTP API.

The server is either started by this engine (``python -m sglang.launch_server ...``, restarted with backoff
when it dies) or attached to by URL. Everything crosses HTTP as token ids: ``/generate`` with
``input_ids``, ``sampling_params``, ``return_logprob`` and a request id ``rid``; the answer's
``meta_info.output_token_logprobs`` gives every generated token with its log-prob.

Group answers. A request with ``n`` samples becomes ``n`` concurrent ``/generate`` calls on the same prompt:
SGLang's radix cache shares the prompt's prefill between them, and each sample can be aborted and resumed
on its own.

Interruption (AReaL's scheme). A weight update is::

    /pause_generation {"mode": "abort"}   -> every running request comes back with its partial tokens
                                             (finish_reason "abort"); SGLang returns once none is running
    the update (/update_weights_from_disk, or /update_weights_from_distributed per bucket while the
    trainer broadcasts), then /update_weight_version
    /continue_generation                  -> the engine re-submits every interrupted sample as
                                             prompt + tokens so far with the remaining token budget

so the KV cache of in-flight sequences is rebuilt under the new weights and later tokens carry the new
version. With ``model.lora`` a version is an adapter: written as a PEFT-layout directory and loaded with
``/load_lora_adapter`` under the name ``v<version>`` inside the same pause, after which every ``/generate``
(the interrupted samples' resubmissions too) names it in ``lora_path``; the previous adapter is unloaded once
the server runs again (SGLang unloads an adapter when no request uses it: tokenizer_communicator_mixin.py:540). Because no ``/generate`` call can span an update in abort mode (SGLang's pause waits until no
request holds the model lock), each response was sampled by one weight version: the server's
``meta_info.weight_version``, which the engine keeps equal to our integer version.

Routing replay (``algo.routing_replay: r3`` on a mixture-of-experts model). The server is launched with
``--enable-return-routed-experts`` and every /generate asks ``return_routed_experts``; each answer's
``meta_info.routed_experts`` covers the whole sequence sent plus the new tokens (all but the last), so the
answer of a sample's last segment replaces what earlier segments returned: after an interruption the
resubmitted prefix is routed again under the new weights, as the embedded engine rebuilds its cache
(:class:`RoutedExpertsLayout` decodes it). SGLang 0.5.23 has the option; 0.5.6 has none.

The parts beside it: ``sglang_routes.py`` (every route and field this client sends, checked against
SGLang's own request classes), ``sglang_server.py`` (the launched server process and its restarts),
``sglang_group.py`` (the weight-update process group the trainer and the servers join) and
``sglang_disk.py`` (the checkpoint a server loads buckets from). The client speaks the routes of the SGLang
releases in :data:`SGLANG_VERSIONS` (the oldest and newest of the supported range), over one aiohttp
session; where they differ it uses what both accept, or asks the server (weight-update sessions).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from algo.serving import DecodePace
from topology.settings import RolloutSettings
from transport.bulk import TensorMeta, flat_misaligned

from .base import (EngineError, GenerationEngine, GenerationRequest, GenerationResult, RequestError,
                   WeightBucket, WeightSource)
from .checkpoint import load_config
from .lora import LoraSpec, is_adapter_name, read_adapter, resolve_start, write_adapter
from .moe import compact_routes
from .sglang_disk import write_checkpoint
from .sglang_routes import (CLIENT_KEEP_ALIVE_S, DEFAULT_GROUP, IDEMPOTENT_ROUTES, ROUTED_EXPERTS_FLAG,
                            ROUTED_EXPERTS_KEY, ROUTED_EXPERTS_SINCE, SEED_RANGE, SGLANG_VERSION, SGLANG_VERSIONS, ServerEvents, SGLangConnectionReset, SGLangError, SGLangHTTPError,
                            SGLangLaunchError, health_probe_s, payload, sampling_payload)
from .sglang_server import LaunchConfig, SGLangServer

__all__ = ["SGLANG_VERSION", "SGLANG_VERSIONS", "SGLangError", "SGLangHTTPError", "SGLangLaunchError", "LaunchConfig",
           "RoutedExpertsLayout", "SGLangEngine", "WeightsIncompleteError"]


class WeightsIncompleteError(SGLangError):
    """An update broke off after the server may have loaded part of the version; the server stays paused
    until a whole version has loaded (the message names the version and the cause)."""


@dataclasses.dataclass
class _Sample:
    prompt: tuple[int, ...]
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    sglang_rid: str | None = None
    segments: int = 0
    # Routing replay: the routing of the last answer that carried it, [rows, sparse layers, top-k].
    routes: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class RoutedExpertsLayout:
    """How SGLang returns one request's routing, and the part of it a trajectory keeps.

    ``meta_info.routed_experts`` is the base64 of the little-endian int32 bytes of a [rows, num_hidden_layers,
    top-k] array (0.5.23: managers/detokenizer_manager.py:466 encodes what state_capturer/base.py:63-75 keeps,
    int32 with num_hidden_layers x num_experts_per_tok per token, state_capturer/routed_experts.py:72-73). Its
    rows are the tokens the model was fed, positions 0 to the sequence's last but one: prompt and output but
    the last output token (managers/io_struct.py:265-268, managers/scheduler_components/
    batch_result_processor.py:154-160) -- GenerationResult.routed_experts' rows exactly. Column = the layer's
    global index (the capture's layer_id, layers/moe/topk.py:2541-2545); a dense layer's column is never
    written (zeros). The trajectory keeps the sparse layers' columns, in moe.compact_routes' dtype."""

    num_layers: int
    sparse_layers: tuple[int, ...]
    top_k: int
    num_experts: int

    @classmethod
    def of_model(cls, model_dir: str) -> RoutedExpertsLayout | None:
        """The layout of the model in ``model_dir``; None for a dense model (nothing is routed)."""
        config = load_config(model_dir)
        if not config.sparse_layers:
            return None
        return cls(config.num_hidden_layers, tuple(config.sparse_layers), config.num_experts_per_tok,
                   config.num_experts)

    def decode(self, encoded: Any, rows: int) -> torch.Tensor:
        """meta_info.routed_experts of an answer whose sequence fed ``rows`` tokens to the model, as
        [rows, sparse layers, top-k]; anything else is refused with the reason."""
        if not isinstance(encoded, str):
            raise SGLangError(f"meta_info.{ROUTED_EXPERTS_KEY}: expected a base64 string, got "
                              f"{type(encoded).__name__}")
        try:
            raw = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise SGLangError(f"meta_info.{ROUTED_EXPERTS_KEY}: not base64 ({exc})") from None
        per_row = self.num_layers * self.top_k
        if len(raw) != rows * per_row * 4:
            raise SGLangError(f"meta_info.{ROUTED_EXPERTS_KEY}: {len(raw)} bytes, expected {rows} tokens x "
                              f"{self.num_layers} layers x top-{self.top_k} int32 = {rows * per_row * 4}")
        ids = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(rows, self.num_layers, self.top_k)
        sparse = ids[:, list(self.sparse_layers)]
        if sparse.numel() and (int(sparse.min()) < 0 or int(sparse.max()) >= self.num_experts):
            raise SGLangError(f"meta_info.{ROUTED_EXPERTS_KEY}: expert ids in [{int(sparse.min())}, "
                              f"{int(sparse.max())}], the model has {self.num_experts} experts")
        return compact_routes(sparse, self.num_experts)


class SGLangEngine(GenerationEngine):
    """`GenerationEngine` over an SGLang server (started here, or attached to by ``url``).

    Beyond the interface: :meth:`update_weights_from_disk`, and the direct path
    :meth:`init_weights_group` + :meth:`update_weights_from_distributed` (bucket metadata in, while the trainer
    broadcasts the bucket bytes with :class:`WeightGroupSender`). ``update_weights(version, source)`` takes
    buckets that passed through this process: they are written as a checkpoint under ``weights_dir`` and
    loaded with ``/update_weights_from_disk``.
    """

    # Connection resets in a row one sample's /generate survives (each: abort the rid, resubmit what it holds).
    MAX_RESETS = 3
    # How long start() waits for an attached server (by url) to answer /health.
    ATTACH_TIMEOUT_S = 30.0
    # Sends of an idempotent route after a reset.
    MAX_RETRIES = 2

    def __init__(self, *, url: str | None = None, launch: LaunchConfig | None = None, version: int | None = 0,
                 weights_dir: str | None = None, request_timeout_s: float | None = None,
                 control_timeout_s: float = 600.0, drain_timeout_s: float = 120.0,
                 attach_timeout_s: float = ATTACH_TIMEOUT_S,
                 pace: DecodePace | None = None, on_server_event: ServerEvents | None = None,
                 lora: LoraSpec | None = None, lora_name: str | None = None,
                 routed_experts: RoutedExpertsLayout | None = None) -> None:
        """``request_timeout_s``: bound on one /generate call; None derives it from the tokens it may still
        generate and the pace measured on this server's answers (``pace``: algo.serving.DecodePace).
        ``lora``: versions may be adapters (the module docstring); ``lora_name``: the adapter the server was
        launched with (``LaunchConfig.lora_paths``), which requests name until the next. ``routed_experts``:
        every answer returns its routing in this layout (GenerationResult.routed_experts; the server must run
        with ``--enable-return-routed-experts``)."""
        if (url is None) == (launch is None):
            raise EngineError("SGLangEngine needs exactly one of url (attach) or launch (start a server)")
        self._attach_url = url.rstrip("/") if url else None
        self.server = SGLangServer(launch, self._get_ok, self._server_event) if launch is not None else None
        if version is None and launch is not None:
            raise EngineError("SGLangEngine: version None (take the server's) is for attaching to a server by url")
        # None: a client that only reads (tools.eval) takes the attached server's version instead of
        # relabelling it, so a server in a run keeps the label its rollout gave it.
        self._adopt_version = version is None
        self._version = version or 0
        self.weights_dir = weights_dir
        self.lora, self._lora_name = lora, lora_name
        self.routed_experts = routed_experts
        self.request_timeout_s, self.control_timeout_s = request_timeout_s, control_timeout_s
        self.pace = pace or DecodePace()
        self.health_probe_s = health_probe_s(launch.env if launch is not None else None)
        self.drain_timeout_s, self.attach_timeout_s = drain_timeout_s, attach_timeout_s
        self.user_on_server_event = on_server_event
        self._session: Any = None
        self._open = asyncio.Event()       # cleared while paused / updating: samples wait before (re)sending
        self._open.set()
        self._epoch = 0                    # bumped by every pause: an abort seen across it is an interruption
        self._paused = False
        self._incomplete: int | None = None   # a version the server loaded only part of: it stays paused
        self._control = asyncio.Lock()     # pause/resume/updates one at a time
        self._requests: dict[str, list[_Sample]] = {}
        self._user_aborted: set[str] = set()
        self._http_inflight = 0
        self._http_idle = asyncio.Event()
        self._http_idle.set()
        self._stopping = False
        self._abort_events: dict[str, asyncio.Event] = {}
        self.groups: dict[str, Any] = {}   # weight group name -> its init arguments
        # Whether the server brackets /update_weights_from_distributed in a weight-update session (None: not
        # asked yet; asked again after a restart, which may have brought another release).
        self._weight_session: bool | None = None
        self.swaps: list[dict[str, Any]] = []
        self.tokens_generated = 0
        self.resubmits = 0
        self.resets_retried = 0            # idempotent calls sent again after a reset

    # --- construction from rollout settings -----------------------------------------------------------
    @classmethod
    def from_settings(cls, cfg: RolloutSettings, version: int, model_dir: str, run_dir: str | None = None,
                      on_server_event: ServerEvents | None = None) -> SGLangEngine:
        """Settings: ``sglang_url`` (attach) or ``sglang: {command, host, port, mem_fraction_static, dtype,
        extra_args, env, health_timeout_s, max_restarts, backoff_s, request_timeout_s}``; tp from
        ``instance.parallel.tp``; the model from ``model_dir`` (the rollout's start weights). ``on_server_event``
        hears when a server this engine launched died and when it came back (:data:`ServerEvents`)."""
        sg = cfg.sglang
        instance = cfg.instance
        name = f"{instance.group or 'rollout'}.{instance.index}"
        base = Path(run_dir or ".")
        weights_dir = sg.weights_dir or str(base / "sglang_weights" / name)
        gen = cfg.gen
        common = dict(version=version, weights_dir=weights_dir, request_timeout_s=sg.request_timeout_s,
                      control_timeout_s=sg.control_timeout_s,
                      pace=DecodePace(gen.assumed_tokens_per_s, gen.timeout_slack, gen.timeout_floor_s))
        lora = LoraSpec.from_settings(cfg.model.lora)
        lora_paths: dict[str, str] = {}
        if lora is not None:   # the server serves the base; the adapter a run resumes with is loaded at launch
            model_dir, adapter_dir = resolve_start(model_dir, lora.adapter)
            if adapter_dir is not None:
                _, tensors, _ = read_adapter(adapter_dir)
                path = Path(weights_dir) / f"lora-v{version}"
                write_adapter(str(path), tensors, lora, model_dir, load_config(model_dir))
                lora_paths[f"v{version}"] = str(path)
            common.update(lora=lora, lora_name=next(iter(lora_paths), None))
        # r3 replays the rollout's routing: a mixture-of-experts model's answers carry it (a dense one routes nothing).
        routed = RoutedExpertsLayout.of_model(model_dir) if cfg.algo.routing_replay == "r3" else None
        common["routed_experts"] = routed
        if cfg.sglang_url:
            if lora_paths:
                raise EngineError("model.lora: a server attached by sglang_url cannot start from an adapter; "
                                  "launch it here (sglang.command) or start the run without model.lora.adapter")
            return cls(url=cfg.sglang_url, **common)
        tp = instance.parallel.get("tp", 1)
        if tp % sg.ep_size:   # SGLang splits the tp ranks into ep_size groups of experts
            raise EngineError(f"{name}: settings.sglang.ep_size {sg.ep_size} does not divide parallel.tp {tp}")
        command = sg.command or [sys.executable, "-m", "sglang.launch_server"]
        if isinstance(command, str):
            command = command.split()
        launch = LaunchConfig(
            model_path=model_dir, command=list(command), host=sg.host,
            port=sg.port, tp=tp, ep=sg.ep_size,
            mem_fraction_static=sg.mem_fraction_static, dtype=sg.dtype or cfg.model.dtype,
            seed=cfg.seed * 1000 + instance.index,
            extra_args=list(sg.extra_args), env={k: str(v) for k, v in sg.env.items()},
            log_path=sg.log_path or str(base / "logs" / f"{name}.sglang.log"),
            health_timeout_s=sg.health_timeout_s, max_restarts=sg.max_restarts,
            backoff_s=sg.backoff_s, backoff_max_s=sg.backoff_max_s,
            lora_rank=lora.rank if lora else 0, lora_targets=tuple(lora.target_modules) if lora else (),
            lora_paths=lora_paths, routed_experts=routed is not None)
        return cls(launch=launch, on_server_event=on_server_event, **common)

    # --- lifecycle ------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.server.url if self.server is not None else str(self._attach_url)

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        import aiohttp

        if self._session is not None:
            return
        # Idle connections are dropped before SGLang closes them (CLIENT_KEEP_ALIVE_S < SERVER_KEEP_ALIVE_S).
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEP_ALIVE_S),
            timeout=aiohttp.ClientTimeout(total=None))
        try:
            if self.server is not None:
                await self.server.start(self._version)
            else:
                deadline = time.monotonic() + self.attach_timeout_s
                while not await self._get_ok(self.url + "/health", self.health_probe_s):
                    if time.monotonic() > deadline:
                        raise SGLangLaunchError(f"SGLang server at {self.url} is not healthy (GET /health failed "
                                                f"for {self.attach_timeout_s:g} s)")
                    await asyncio.sleep(0.2)  # polling a server we cannot be notified by
                reported = await self.reported_version() if self._adopt_version else ""
                if reported.isdigit():
                    self._version = int(reported)
                else:
                    # An attached server labels its answers with our version from now on (a server that
                    # nobody labelled yet says "default": answers must carry an integer version).
                    await self._post("/update_weight_version",
                                     payload("/update_weight_version", new_version=str(self._version),
                                             abort_all_requests=False))
        except BaseException:
            await self._session.close()
            self._session = None
            raise

    async def stop(self) -> None:
        if self._session is None:
            return
        self._stopping = True
        self._open.set()
        for event in self._abort_events.values():
            event.set()
        if self._requests:
            try:
                await self._post("/abort_request", payload("/abort_request", rid="", abort_all=True), timeout=10.0)
            except SGLangError:
                pass
            try:
                await asyncio.wait_for(self._http_idle.wait(), self.drain_timeout_s)
            except TimeoutError:
                pass
        if self.server is not None:
            await self.server.stop()
        await self._session.close()
        self._session = None

    async def _server_event(self, event: str, restarts: int) -> None:
        """The launched server "died" (its weight groups went with it) or was "restarted": it runs the weights
        it was launched with (the last checkpoint loaded from disk, or the start weights), so weights that
        came over a process group must be sent again."""
        self.groups.clear()
        self._weight_session = None
        if event == "restarted" and self.server is not None:
            self._version = self.server.weight_version
            # A fresh server is not paused: a pause whose /continue_generation died with the old one must not
            # hold every request at the gate for good. It runs whole weights again (its launch weights).
            self._paused = False
            self._incomplete = None
            self._open.set()
        if self.user_on_server_event is not None:
            await self.user_on_server_event(event, restarts)

    async def health(self) -> dict[str, Any]:
        if self._paused:
            # SGLang's /health generates a token, which waits at the pause gate and answers 503 after
            # SGLANG_HEALTH_CHECK_TIMEOUT: a server we paused is judged by its process, not by that route.
            ok = self._session is not None and (self.server is None or self.server.healthy.is_set())
        else:
            ok = self._session is not None and await self._get_ok(self.url + "/health", self.health_probe_s)
        running = sum(1 for samples in self._requests.values() for s in samples if s.sglang_rid is not None)
        total = sum(len(samples) for samples in self._requests.values())
        return {"ok": bool(ok), "version": self._version, "running": running, "waiting": total - running,
                "paused": self._paused, "url": self.url, "tokens_generated": self.tokens_generated,
                "restarts": self.server.restarts if self.server is not None else 0, "resubmits": self.resubmits,
                "error": repr(self.server.failed) if self.server is not None and self.server.failed else None}

    # --- HTTP -----------------------------------------------------------------------------------------
    async def _post(self, route: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        return await self._request("POST", route, body, timeout or self.control_timeout_s)

    async def _get(self, route: str, timeout: float) -> Any:
        """GET a JSON route (one of GET_ROUTES)."""
        return await self._request("GET", route, None, timeout)

    async def _request(self, method: str, route: str, body: dict[str, Any] | None, timeout: float) -> Any:
        """One call; an idempotent one (IDEMPOTENT_ROUTES) is sent again when its connection was reset. A
        reset of any other raises SGLangConnectionReset: whether the server got it is unknown."""
        import aiohttp

        if self._session is None:
            raise SGLangError("SGLang engine is not started (call start())")
        url, what = self.url, route if method == "POST" else f"{method} {route}"
        for attempt in range(self.MAX_RETRIES + 1):
            try:
                async with self._session.request(method, url + route, json=body,
                                                 timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    text = await r.text()
                    if r.status != 200:
                        raise SGLangHTTPError(url, route, r.status, text)
                break
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):   # nothing was sent: the server is not there
                    raise SGLangError(f"SGLang server {url}: {what} failed: {type(exc).__name__}: {exc}") from exc
                if route not in IDEMPOTENT_ROUTES or attempt == self.MAX_RETRIES:
                    raise SGLangConnectionReset(
                        f"SGLang server {url}: {what}: the connection was reset ({type(exc).__name__}: {exc})"
                        + ("" if route in IDEMPOTENT_ROUTES else "; not sent again: the route is not idempotent")
                    ) from exc
                self.resets_retried += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise SGLangError(f"SGLang server {url}: {what} failed: {type(exc).__name__}: {exc}") from exc
        try:
            return json.loads(text) if text else None
        except ValueError as exc:
            raise SGLangError(f"SGLang server {url}: {what} answered non-JSON: {text[:200]!r}") from exc

    async def _get_ok(self, url: str, timeout: float) -> bool:
        """Whether ``url`` answers HTTP 200 within ``timeout`` (health probes: any failure is a no)."""
        import aiohttp

        if self._session is None:
            return False
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _wait_server(self, starts: int) -> None:
        """Wait until the server started after start number `starts` is healthy; raises if it could not be."""
        assert self.server is not None
        server = self.server
        try:
            async with asyncio.timeout(server.config.health_timeout_s + server.config.backoff_max_s + 10.0):
                async with server.changed:
                    await server.changed.wait_for(lambda: server.failed is not None
                                                  or (server.starts > starts and server.healthy.is_set()))
        except TimeoutError:
            raise SGLangError(f"SGLang server at {self.url} did not come back in time") from None
        if server.failed is not None:
            raise SGLangError(f"SGLang server is gone: {server.failed}") from server.failed

    # --- generation -----------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        if self._session is None or self._stopping:
            raise EngineError("SGLang engine is not running (call start())")
        if request.rid in self._requests:
            raise RequestError(f"request {request.rid!r}: rid is already in flight")
        samples = [_Sample(request.input_ids) for _ in range(request.n)]
        self._requests[request.rid] = samples
        base_seed = request.sampling.seed
        if base_seed is None:
            base_seed = int.from_bytes(os.urandom(7), "little")
        runs = [asyncio.ensure_future(self._run_sample(request, i, s, _sample_seed(base_seed, i)))
                for i, s in enumerate(samples)]
        try:
            reasons = await asyncio.gather(*runs)
        except BaseException:
            # One sample failed (or the caller cancelled): stop its siblings here, then every copy still on the
            # server (a sample keeps its rid while its /generate may be running there), so no orphan keeps
            # generating or resubmits after a pause.
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            await self._abort_samples(samples)
            raise
        finally:
            self._requests.pop(request.rid, None)
            self._user_aborted.discard(request.rid)
            self._abort_events.pop(request.rid, None)
        return [GenerationResult(request.rid, i, s.output, s.logprobs, s.versions, reason, len(request.input_ids),
                                 self._whole_routes(s))
                for i, (s, reason) in enumerate(zip(samples, reasons))]

    @staticmethod
    def _whole_routes(sample: _Sample) -> torch.Tensor | None:
        """The sample's routing when its last answer covered every token it holds; else (an answer aborted
        before it ran carries none) None, and the trainer routes that sample by its own router."""
        if sample.routes is None or sample.routes.shape[0] != len(sample.prompt) + len(sample.output) - 1:
            return None
        return sample.routes

    async def _run_sample(self, request: GenerationRequest, index: int, sample: _Sample, seed: int) -> str:
        sp = request.sampling
        resets = 0
        while True:
            if request.rid in self._user_aborted or self._stopping:
                return "abort"
            if not self._open.is_set():
                await self._wait_open(request.rid)
            if request.rid in self._user_aborted or self._stopping:
                return "abort"
            remaining = sp.max_new_tokens - len(sample.output)
            if remaining <= 0:   # the interruption came after its last token
                return "length"
            # Our top_k <= 0 means "no filter"; SGLang refuses any value below 1 but -1 (HTTP 400).
            sampling = sampling_payload(temperature=sp.temperature, top_p=sp.top_p,
                                        top_k=sp.top_k if sp.top_k > 0 else -1,
                                        max_new_tokens=remaining, stop_token_ids=list(sp.stop_token_ids),
                                        sampling_seed=(seed + len(sample.output)) % SEED_RANGE)
            sample.sglang_rid = sglang_rid(request.rid, index, sample.segments)
            sample.segments += 1
            body = payload("/generate", rid=sample.sglang_rid, input_ids=[*sample.prompt, *sample.output],
                           sampling_params=sampling, return_logprob=True,
                           **({"return_routed_experts": True} if self.routed_experts is not None else {}))
            if self._lora_name is not None:
                body["lora_path"] = self._lora_name   # SGLang looks adapters up by the name they were loaded as
            epoch, sent_version, sent_rid = self._epoch, self._version, sample.sglang_rid
            starts = self.server.starts if self.server is not None else 0
            self._http_enter()
            sent_at = time.monotonic()
            try:
                answer = await self._post("/generate", body,
                                          timeout=self.request_timeout_s or self.pace.timeout(remaining))
            except SGLangHTTPError as exc:
                if exc.status == 400:
                    raise RequestError(f"request {request.rid!r}: the SGLang server refused it: {exc.body[:300]}") from exc
                raise
            except SGLangError as exc:
                # A reset connection: the server may be generating it. Stop that copy (an abort of a rid it never
                # got does nothing), then send what we hold again as a new segment. A server that cannot take
                # the abort may be dying: handled as any failed call.
                if isinstance(exc, SGLangConnectionReset):
                    resets += 1
                    if resets <= self.MAX_RESETS and not self._stopping and await self._abort_rid(sent_rid):
                        sample.sglang_rid = None
                        self.resubmits += 1
                        continue
                if self.server is None or self._stopping or not await self.server.died(starts):
                    raise
                # The server died mid-request: wait for the restart, then resume from the tokens we hold.
                await self._wait_server(starts)
                sample.sglang_rid = None
                self.resubmits += 1
                continue
            finally:
                # A call that failed (timed out, cancelled) keeps its rid: generate() aborts that copy.
                self._http_exit()
            sample.sglang_rid = None
            reason = self._take_answer(request, sample, answer, sent_version)
            self.pace.observe(time.monotonic() - sent_at, len(answer["output_ids"]) if "output_ids" in answer
                              else len(answer["meta_info"]["output_token_logprobs"]))
            resets = 0
            if reason != "abort":
                return reason
            if request.rid in self._user_aborted or self._stopping:
                return "abort"
            if epoch != self._epoch or not self._open.is_set():
                self.resubmits += 1  # interrupted by a pause / weight update: resume with what we have
                continue
            finish = (answer.get("meta_info") or {}).get("finish_reason") or {}
            raise EngineError(f"request {request.rid!r} sample {index}: aborted by the server: "
                              f"{finish.get('message') or finish}")

    def _take_answer(self, request: GenerationRequest, sample: _Sample, answer: Any, sent_version: int) -> str:
        """Appends one /generate answer's tokens to `sample`; returns its finish type.

        SGLang answers a request aborted before it ran (or retracted for memory) through
        ``TokenizerManager._handle_abort_req``, whose meta_info has no ``prompt_tokens`` and, in 0.5.6, no
        ``weight_version`` (0.5.6 managers/tokenizer_manager.py:2036-2071; 0.5.23 labels it with the version
        the server has when the abort arrives, tokenizer_manager.py:3603-3608): its tokens, if any, ran on the
        weights the server had when the request was sent, because weights change only while we hold the
        server paused."""
        if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
            raise SGLangError(f"SGLang server {self.url}: /generate answer has no meta_info: {str(answer)[:200]}")
        meta = answer["meta_info"]
        pairs = meta.get("output_token_logprobs")
        if not isinstance(pairs, list):
            raise SGLangError(f"SGLang server {self.url}: /generate answer lacks meta_info.output_token_logprobs "
                              f"(return_logprob was sent)")
        finish = meta.get("finish_reason") or {}
        reason = finish.get("type") if isinstance(finish, dict) else None
        if reason not in ("stop", "length", "abort"):
            raise SGLangError(f"SGLang server {self.url}: /generate finish_reason {finish!r} not understood")
        label = meta.get("weight_version")
        if label is None and reason == "abort":
            label = sent_version
        try:
            version = int(label)
        except (TypeError, ValueError):
            raise SGLangError(f"SGLang server {self.url}: meta_info.weight_version {meta.get('weight_version')!r} "
                              f"is not an integer version (another client relabelled the server?)") from None
        ids = [int(p[1]) for p in pairs]
        if "output_ids" in answer and list(answer["output_ids"]) != ids:
            raise SGLangError(f"SGLang server {self.url}: output_ids and output_token_logprobs disagree")
        if self.routed_experts is not None:
            self._take_routes(sample, meta, len(sample.prompt) + len(sample.output) + len(ids) - 1, reason)
        sample.output.extend(ids)
        sample.logprobs.extend(float(p[0]) for p in pairs)
        sample.versions.extend([version] * len(ids))
        self.tokens_generated += len(ids)
        return reason

    def _take_routes(self, sample: _Sample, meta: dict[str, Any], rows: int, reason: str) -> None:
        """An answer's routing replaces the sample's: it covers the whole sequence sent (the earlier segments'
        tokens routed again) and the new tokens. An answer without it is one SGLang's tokenizer manager gave
        for a request aborted before it ran (managers/tokenizer_manager.py:3577-3642 builds that meta_info),
        or one from a server launched without the flag, which ignores the request's ask (0.5.23:
        state_capturer/routed_experts.py:50-51, managers/tokenizer_manager.py:2602-2609)."""
        encoded = meta.get(ROUTED_EXPERTS_KEY)
        if encoded is not None:
            sample.routes = self.routed_experts.decode(encoded, rows)
        elif reason != "abort":
            raise SGLangError(f"SGLang server {self.url}: /generate asked for return_routed_experts (algo."
                              f"routing_replay r3) and the answer has no meta_info.{ROUTED_EXPERTS_KEY}: the server "
                              f"runs without {ROUTED_EXPERTS_FLAG} (SGLang {ROUTED_EXPERTS_SINCE} or later has it)")

    async def _wait_open(self, rid: str) -> None:
        """Wait until the engine is resumed, or this request is aborted (a drain must not hang on a pause)."""
        aborted = self._abort_events.setdefault(rid, asyncio.Event())
        waits = [asyncio.ensure_future(self._open.wait()), asyncio.ensure_future(aborted.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _http_enter(self) -> None:
        self._http_inflight += 1
        self._http_idle.clear()

    def _http_exit(self) -> None:
        self._http_inflight -= 1
        if self._http_inflight == 0:
            self._http_idle.set()

    async def _abort_rid(self, rid: str | None) -> bool:
        """/abort_request for one SGLang request id; whether the server took it."""
        if rid is None:
            return False
        try:
            await self._post("/abort_request", payload("/abort_request", rid=rid, abort_all=False))
        except SGLangError:
            return False
        return True

    async def _abort_samples(self, samples: list[_Sample]) -> int:
        count = 0
        for s in samples:
            if s.sglang_rid is not None:
                count += 1
                try:
                    await self._post("/abort_request", payload("/abort_request", rid=s.sglang_rid, abort_all=False))
                except SGLangError:
                    pass
        return count

    async def abort(self, rid: str | None = None) -> int:
        targets = list(self._requests) if rid is None else [rid] if rid in self._requests else []
        for r in targets:
            self._user_aborted.add(r)
            self._abort_events.setdefault(r, asyncio.Event()).set()
            await self._abort_samples(self._requests.get(r, []))
        return len(targets)

    # --- pause / resume / weights ---------------------------------------------------------------------
    async def pause(self) -> None:
        """Abort-mode pause: running requests come back with their tokens and wait here until resume()."""
        async with self._control:
            await self._pause()

    async def resume(self) -> None:
        async with self._control:
            await self._resume()

    async def _pause(self) -> None:
        if self._paused:
            return
        self._open.clear()
        self._epoch += 1
        self._paused = True
        # SGLang returns once no request holds its model lock: every request that ran has its answer
        # (labelled with the version it ran on) on the way back to us. /generate calls still open are held
        # at the server's pause gate and run on the new weights after /continue_generation, so waiting
        # here for them to return would wait for ever.
        await self._post("/pause_generation", payload("/pause_generation", mode="abort"))

    async def _resume(self) -> None:
        if not self._paused:
            return
        if self._incomplete is not None:
            # The server holds part of a version: no token may be sampled on it. It resumes when a complete
            # version has loaded (or a restarted server comes back on its launch weights).
            return
        await self._post("/continue_generation", payload("/continue_generation"))
        self._paused = False
        self._open.set()

    @property
    def incomplete_version(self) -> int | None:
        """The version whose update broke off after the server had loaded part of it (None: the server's
        weights are one whole version). The server stays paused meanwhile."""
        return self._incomplete

    async def _interrupted(self, version: int, update: Callable[[], Awaitable[None]]) -> None:
        """pause(abort) -> update -> label the server with `version` -> continue (unless already paused).

        An update that fails or is abandoned may leave the server with part of the version: SGLang loads each
        bucket of ``update_weights_from_distributed`` as it comes and answers a failure with "The full weights
        of the ModelRunner are partially updated. Please discard the whole weights." (0.5.23:
        model_executor/model_runner_components/weight_updater.py:324-341; 0.5.6: model_runner.py:1147-1236),
        and its ``update_weights_from_disk`` repoints the model at the new checkpoint before loading and
        reloads from there on failure (0.5.23: weight_updater.py:193, :229-238; 0.5.6: model_runner.py:938,
        968-979). 0.5.23 also fails an update whose cache flush finds a request still running
        (managers/scheduler_components/weight_updater.py:120-133) after the weights changed.
        So the server then stays paused, whatever else asks it to resume, until an update of a whole version
        succeeds (or a restarted server comes back on its launch weights): generation would otherwise go on
        with weights of no single version, labelled as the old one."""
        async with self._control:
            was_paused = self._paused and self._incomplete is None
            t0 = time.monotonic()
            await self._pause()
            t1 = time.monotonic()
            try:
                await update()
                await self._post("/update_weight_version",
                                 payload("/update_weight_version", new_version=str(version), abort_all_requests=False))
            except BaseException as exc:
                self._incomplete = version
                if not isinstance(exc, Exception):   # cancelled: the caller learns it as cancelled
                    raise
                raise WeightsIncompleteError(
                    f"SGLang server {self.url}: the update to version {version} broke off and part of it may have "
                    f"loaded ({type(exc).__name__}: {str(exc)[:300]}); the server stays paused until a whole "
                    f"version has loaded") from exc
            self._version = version
            self._incomplete = None
            if not was_paused:
                await self._resume()
            t2 = time.monotonic()
            self.swaps.append({"version": version, "pause_s": t1 - t0, "update_s": t2 - t1, "stall_s": t2 - t0})

    async def update_weights_from_disk(self, version: int, model_path: str) -> None:
        """Load a Hugging Face checkpoint directory (on the server's file system) as ``version``."""
        async def update() -> None:
            await self._post("/update_weights_from_disk",
                             payload("/update_weights_from_disk", model_path=str(model_path), abort_all_requests=False,
                                     flush_cache=True))
        await self._interrupted(version, update)
        if self.server is not None:  # a restart comes back on these weights
            self.server.model_path, self.server.weight_version = str(model_path), version

    async def update_weights(self, version: int, source: WeightSource) -> None:
        """Buckets that passed through this process: written as a checkpoint, then /update_weights_from_disk."""
        if not self.weights_dir:
            raise EngineError("SGLangEngine.update_weights needs weights_dir (where the server can read a checkpoint)")
        path = Path(self.weights_dir) / f"v{version}"
        buckets: list[WeightBucket] = []
        if isinstance(source, AsyncIterable):
            async for bucket in source:
                buckets.append([(n, t.detach().to("cpu", copy=True)) for n, t in bucket])
        else:
            iterator = iter(source)
            done = object()
            while (bucket := await asyncio.to_thread(next, iterator, done)) is not done:
                buckets.append([(n, t.detach().to("cpu", copy=True)) for n, t in bucket])
        if self.lora is not None and any(is_adapter_name(n) for bucket in buckets for n, _ in bucket):
            await self.load_adapter(version, {n: t for bucket in buckets for n, t in bucket})
            return
        await asyncio.to_thread(write_checkpoint, path, buckets, self.server.config.model_path
                                if self.server is not None else None)
        await self.update_weights_from_disk(version, str(path))
        # Keep the newest checkpoint and the one before it (a restart may still be loading it).
        for old in sorted(Path(self.weights_dir).glob("v*"), key=lambda p: p.stat().st_mtime)[:-2]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)

    async def load_adapter(self, version: int, tensors: dict[str, Any]) -> None:
        """A LoRA version: written as a PEFT-layout directory, loaded under the name ``v<version>`` inside one
        pause (every later /generate names it), then the previous adapter is unloaded."""
        if self.lora is None or not self.weights_dir:
            raise EngineError("SGLangEngine.load_adapter needs model.lora and weights_dir")
        if not all(is_adapter_name(n) for n in tensors):
            raise EngineError(f"version {version}: both adapter and base tensors; a version is one or the other")
        base = self.server.config.model_path if self.server is not None else None
        path = Path(self.weights_dir) / f"lora-v{version}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        await asyncio.to_thread(write_adapter, str(tmp), tensors, self.lora, base or "", load_config(base) if base else None)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)   # a server never loads half an adapter
        name, previous = f"v{version}", self._lora_name

        async def update() -> None:
            await self._post("/load_lora_adapter", payload("/load_lora_adapter", lora_name=name, lora_path=str(path)))
            self._lora_name = name   # before the resume: resubmitted samples go to the new adapter
        await self._interrupted(version, update)
        if self.server is not None:   # a restart comes back with this adapter
            self.server.lora_paths, self.server.weight_version = {name: str(path)}, version
        if previous is not None and previous != name:
            await self._post("/unload_lora_adapter", payload("/unload_lora_adapter", lora_name=previous))
        for old in sorted(Path(self.weights_dir).glob("lora-v*"), key=lambda p: p.stat().st_mtime)[:-2]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)

    async def init_weights_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> None:
        """Have the server join the trainer's weight group (the trainer joins as rank 0 at the same time)."""
        body = payload("/init_weights_update_group", master_address=master_address, master_port=int(master_port),
                       rank_offset=int(rank_offset), world_size=int(world_size), group_name=group_name,
                       backend=backend)
        await self._post("/init_weights_update_group", body)
        self.groups[group_name] = body

    async def destroy_weights_group(self, group_name: str = DEFAULT_GROUP) -> None:
        await self._post("/destroy_weights_update_group", payload("/destroy_weights_update_group",
                                                                  group_name=group_name))
        self.groups.pop(group_name, None)

    async def update_weights_from_distributed(self, version: int, buckets: Iterable[Sequence[TensorMeta]], *,
                                              group_name: str | Sequence[str] = DEFAULT_GROUP,
                                              flattened: bool = True) -> None:
        """Receive ``version`` over the weight group, one /update_weights_from_distributed call per bucket
        while the trainer broadcasts that bucket (:class:`WeightGroupSender`), inside one interruption.
        ``group_name``: the group of every bucket, or one per bucket (a pipeline-parallel trainer's stages
        each broadcast their own buckets on their own group)."""
        specs_list = [list(b) for b in buckets]
        names = [group_name] * len(specs_list) if isinstance(group_name, str) else list(group_name)
        if len(names) != len(specs_list):
            raise EngineError(f"{len(specs_list)} buckets but {len(names)} group names")
        missing = sorted(set(names) - set(self.groups))
        if missing:
            raise EngineError(f"weight group(s) {missing} not initialised on {self.url} "
                              f"(call init_weights_group first; a restarted server needs it again)")
        for i, specs in enumerate(specs_list if flattened else []):
            # SGLang 0.5.23 refuses such a bucket before receiving it (weight_sync/tensor_bucket.py:98-101), while
            # the trainer broadcasts it: refused here, nothing is sent (the trainer orders buckets with flat_order).
            misaligned = flat_misaligned(specs)
            if misaligned is not None:
                meta, offset = misaligned
                raise RequestError(f"weights v{version}: bucket {i} would put {meta.name!r} ({meta.dtype}) at byte "
                                   f"{offset} of the flattened bucket, not a multiple of its element size (SGLang "
                                   f"refuses it); order the bucket's tensors widest dtype first "
                                   f"(transport.bulk.flat_order)")

        async def update() -> None:
            session = await self._begin_weight_update()
            try:
                for i, (specs, name) in enumerate(zip(specs_list, names)):
                    last = i == len(specs_list) - 1
                    body = payload("/update_weights_from_distributed", names=[s.name for s in specs],
                                   dtypes=[s.dtype for s in specs], shapes=[list(s.shape) for s in specs],
                                   group_name=name, flush_cache=last, abort_all_requests=False,
                                   **({"load_format": "flattened_bucket"} if flattened else {}))
                    await self._post("/update_weights_from_distributed", body)
            except BaseException:
                if session:   # closed either way, or the next update's begin is refused; the bucket's error is
                    with contextlib.suppress(SGLangError):   # the one to report
                        await self._post("/end_weight_update", payload("/end_weight_update"))
                raise
            if session:
                await self._post("/end_weight_update", payload("/end_weight_update"))
        await self._interrupted(version, update)

    async def _begin_weight_update(self) -> bool:
        """Open a weight-update session where the server has them (0.5.23 receives buckets only inside one:
        managers/scheduler_components/weight_updater.py:192-197); whether one was opened. A server without the
        route (0.5.6) answers HTTP 404, and is not asked again until it restarts."""
        if self._weight_session is False:
            return False
        try:
            await self._post("/begin_weight_update", payload("/begin_weight_update"))
        except SGLangHTTPError as exc:
            if exc.status != 404:
                raise
            self._weight_session = False
            return False
        self._weight_session = True
        return True

    async def verify_weights(self, version: int) -> tuple[str, str]:
        """How the rollout checks the weights it acknowledges: ``("", "version")`` once GET /model_info
        reports ``version``.

        SGLang 0.5.6 has no route that reads Qwen2 weights back (`/get_weights_by_name` is implemented for
        Llama models only), so a server is checked by the version it reports: it records the
        ``weight_version`` of an update only after every tensor-parallel rank loaded it."""
        reported = await self.reported_version()
        if reported != str(version):
            raise SGLangError(f"SGLang server {self.url} reports weight version {reported!r} after the update to "
                              f"{version}")
        return "", "version"

    async def kv_pool_tokens(self) -> int:
        """Tokens the server's KV pool holds (GET /server_info's max_total_num_tokens, which SGLang's
        scheduler sizes from the memory left after the weights); 0 when the server does not say."""
        answer = await self._get("/server_info", 60.0)
        try:
            return max(0, int(answer["max_total_num_tokens"]))
        except (KeyError, TypeError, ValueError):
            return 0

    async def reported_version(self) -> str:
        """The weight version the server reports (GET /model_info's weight_version, as it spells it: both
        releases report it there, and 0.5.23 has no GET /weight_version)."""
        answer = await self._get("/model_info", 60.0)
        try:
            return str(answer["weight_version"])
        except (KeyError, TypeError) as exc:
            raise SGLangError(f"SGLang server {self.url}: GET /model_info answered {str(answer)[:200]!r}") from exc


def sglang_rid(rid: str, index: int, segment: int) -> str:
    """The SGLang request id of one segment of sample ``index`` of request ``rid``. SGLang aborts every request
    whose rid starts with the one named (0.5.23 managers/scheduler.py:5688, :5800; 0.5.6 :2348, :2418), so no id may be a prefix of another:
    the request's rid has its '/' escaped and every part ends in '/' ("g/1/1/" is not a prefix of "g/1/10/", nor
    request "a"'s sample 1 of request "a/1"'s)."""
    escaped = rid.replace("%", "%25").replace("/", "%2F")
    return f"{escaped}/{index}/{segment}/"


def _sample_seed(base: int, index: int) -> int:
    """Sample ``index``'s seed of a request seeded ``base``: in [0, SEED_RANGE), SGLang's int32 seeds."""
    digest = hashlib.blake2b(f"{base}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_RANGE
