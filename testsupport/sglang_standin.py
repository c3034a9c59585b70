"""A stand-in SGLang server over the embedded engine, for running and testing the SGLang path without a GPU.

    python -m testsupport.sglang_standin --model-path DIR [--host 127.0.0.1] [--port 30000]
                                            [--weight-version 0] [--random-seed S] [--tp-size 1] ...

It serves the routes and request/response fields of SGLang's HTTP server (the release pinned in
actors.engines.sglang_routes.SGLANG_VERSION) that the SGLang engine uses, over a `TorchGenerationEngine`:

    GET  /health /health_generate /model_info /server_info /weight_version
    POST /generate                 input_ids, sampling_params, return_logprob, rid -> output_ids, meta_info
                                   (finish_reason, prompt_tokens, completion_tokens, cached_tokens,
                                   weight_version, output_token_logprobs = [[logprob, token_id, null], ...])
    POST /abort_request            rid | abort_all
    POST /pause_generation         mode: abort (running requests come back with their partial tokens,
                                   finish_reason abort; returns once none is running) | in_place | retract
                                   (requests stay, decoding stops); new /generate calls wait until continue
    POST /continue_generation
    POST /update_weights_from_disk model_path (a Hugging Face checkpoint directory), weight_version, ...
    POST /init_weights_update_group, /destroy_weights_update_group
    POST /update_weights_from_distributed   names, dtypes, shapes, group_name, load_format (per tensor or
                                   "flattened_bucket"): receives the bucket over the group (gloo on CPU)
    POST /update_weight_version    new_version, abort_all_requests

Semantics follow SGLang's: a weight update outside a pause waits until running requests finish; inside a
pause it is applied at once and (as in SGLang) does not relabel weight_version, which /update_weight_version
does. One extension that SGLang lacks: GET /standin/weights_hash (actors.weights.weights_hash of the
weights in use) so tests can prove which weights the server samples with; ``--no-weights-hash`` leaves it
out, to serve exactly as SGLang does (rollouts then check the version the server reports). Fields SGLang has but the
stand-in does not implement are refused with HTTP 400 naming them, rather than silently ignored.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

from actors.engines.base import EngineError, GenerationRequest, RequestError, SamplingParams, WeightBucket
from actors.engines.sglang_group import drop_weight_group, join_weight_group
from actors.engines.sglang_routes import SGLANG_VERSION
from actors.engines.torch_gen import TorchGenerationEngine
from transport.bulk import TensorMeta, unpack_flat

__all__ = ["StandinServer", "main"]

log = logging.getLogger("sglang_standin")

# Fields of SGLang's request classes that the stand-in implements, per route.
_IMPLEMENTED: dict[str, set[str]] = {
    "/generate": {"rid", "input_ids", "sampling_params", "return_logprob", "stream", "log_metrics"},
    "/abort_request": {"rid", "abort_all"},
    "/pause_generation": {"mode"},
    "/continue_generation": set(),
    "/update_weights_from_disk": {"model_path", "load_format", "abort_all_requests", "weight_version",
                                  "flush_cache", "rid"},
    "/init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size", "group_name",
                                   "backend"},
    "/destroy_weights_update_group": {"group_name"},
    "/update_weights_from_distributed": {"names", "dtypes", "shapes", "group_name", "flush_cache",
                                         "abort_all_requests", "weight_version", "load_format"},
    "/update_weight_version": {"new_version", "abort_all_requests"},
}
_SAMPLING = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed", "n"}


def receive_bucket(pg: Any, specs: Sequence[TensorMeta], flattened: bool, device: str = "cpu") -> WeightBucket:
    """The server's half of a weights-group broadcast: what SGLang's model runner does on each rank."""
    import torch.distributed as dist

    if flattened:
        flat = torch.empty(sum(s.nbytes() for s in specs), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=pg)
        return unpack_flat(flat, specs, "weights group")
    out = [(s.name, torch.empty(s.shape, dtype=s.torch_dtype(), device=device)) for s in specs]
    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in out]
    for h in handles:
        h.wait()
    return out


class _BadRequest(Exception):
    pass


def _as_int_version(text: Any, current: int) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        return current


class StandinServer:
    """The aiohttp application; `engine` is the embedded engine it serves."""

    def __init__(self, engine: TorchGenerationEngine, model_path: str, weight_version: str = "0",
                 device: str = "cpu", weights_hash_route: bool = True, fail_load_at: Sequence[int] = ()) -> None:
        self.engine = engine
        # Fault injection (tests): these /update_weights_from_distributed calls, numbered from 1 over the
        # server's life, receive their bucket and then fail to load it.
        self.fail_load_at = set(fail_load_at)
        self.weights_hash_route = weights_hash_route
        self.model_path = model_path
        self.weight_version = weight_version
        self.device = device
        self.paused = False           # new /generate calls wait
        self.in_place = False         # the embedded engine itself is paused
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.running: dict[str, int] = {}   # rid -> open /generate handlers (the "reader lock")
        self._idle = asyncio.Event()
        self._idle.set()
        self._writer = asyncio.Lock()
        self._writer_waiting = 0
        self.groups: dict[str, Any] = {}
        self.counters = {"generate": 0, "aborted": 0, "updates": 0, "distributed_calls": 0}

    # --- app ----------------------------------------------------------------------------------------
    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=1 << 30)
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self.health)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/weight_version", self.get_weight_version)
        if self.weights_hash_route:
            app.router.add_get("/standin/weights_hash", self.weights_hash)
        routes = {"/generate": self.generate, "/abort_request": self.abort_request,
                  "/pause_generation": self.pause_generation, "/continue_generation": self.continue_generation,
                  "/update_weights_from_disk": self.update_weights_from_disk,
                  "/init_weights_update_group": self.init_weights_update_group,
                  "/destroy_weights_update_group": self.destroy_weights_update_group,
                  "/update_weights_from_distributed": self.update_weights_from_distributed,
                  "/update_weight_version": self.update_weight_version}
        for path, handler in routes.items():
            app.router.add_post(path, self._wrap(path, handler))
        return app

    def _wrap(self, path: str, handler: Any) -> Any:
        from aiohttp import web

        async def run(request: Any) -> Any:
            try:
                body = await request.json() if request.can_read_body else {}
            except ValueError as exc:
                return web.json_response({"error": {"message": f"{path}: body is not JSON: {exc}"}}, status=400)
            if not isinstance(body, dict):
                return web.json_response({"error": {"message": f"{path}: body must be a JSON object"}}, status=400)
            unknown = sorted(set(body) - _IMPLEMENTED[path])
            if unknown:
                return web.json_response({"error": {"message": f"{path}: field(s) {unknown} are not implemented "
                                                               f"by the stand-in server"}}, status=400)
            try:
                status, content = await handler(body)
            except (_BadRequest, RequestError, EngineError, ValueError, TypeError, KeyError) as exc:
                return web.json_response({"error": {"message": f"{type(exc).__name__}: {exc}"}}, status=400)
            return web.json_response(content, status=status)
        return run

    # --- info ---------------------------------------------------------------------------------------
    async def health(self, request: Any) -> Any:
        # SGLang 0.5.6 (http_server.health_generate) answers /health by generating one token; while the
        # server is paused that request waits at the pause gate, and after HEALTH_CHECK_TIMEOUT seconds
        # (SGLANG_HEALTH_CHECK_TIMEOUT, default 20) the route answers 503.
        from aiohttp import web
        if self.paused:
            timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
            try:
                await asyncio.wait_for(self._resumed.wait(), timeout)
            except TimeoutError:
                return web.Response(status=503)
        state = await self.engine.health()
        return web.Response(status=200 if state["ok"] else 503)

    async def model_info(self, request: Any) -> Any:
        from aiohttp import web
        return web.json_response({"model_path": self.model_path, "is_generation": True,
                                  "weight_version": self.weight_version})

    async def server_info(self, request: Any) -> Any:
        from aiohttp import web
        state = await self.engine.health()
        return web.json_response({"model_path": self.model_path, "version": f"standin-{SGLANG_VERSION}",
                                  "weight_version": self.weight_version, "paused": self.paused,
                                  "internal_states": [state], "counters": self.counters})

    async def get_weight_version(self, request: Any) -> Any:
        from aiohttp import web
        return web.json_response({"weight_version": self.weight_version})

    async def weights_hash(self, request: Any) -> Any:
        from aiohttp import web
        from actors.engines.checkpoint import hf_state_dict
        from actors.weights import weights_hash
        digest = await asyncio.to_thread(lambda: weights_hash(hf_state_dict(self.engine.model).items()))
        return web.json_response({"weights_hash": digest, "weight_version": self.weight_version})

    # --- generation ---------------------------------------------------------------------------------
    async def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("stream"):
            raise _BadRequest("stream: streaming answers are not implemented by the stand-in server")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise _BadRequest("input_ids: a non-empty list of token ids is required (text input is not "
                              "implemented by the stand-in server)")
        sp = dict(body.get("sampling_params") or {})
        unknown = sorted(set(sp) - _SAMPLING)
        if unknown:
            raise _BadRequest(f"sampling_params: key(s) {unknown} are not implemented by the stand-in server")
        if int(sp.get("n", 1)) != 1:
            raise _BadRequest("sampling_params.n: only n = 1 is implemented by the stand-in server")
        check_sampling(sp, len(ids), self.engine.model.config.max_position_embeddings)
        sampling = SamplingParams(temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
                                  top_k=int(sp.get("top_k", -1)), max_new_tokens=int(sp.get("max_new_tokens", 128)),
                                  stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                                  seed=int(sp.get("sampling_seed", 42)))
        rid = str(body.get("rid") or f"standin-{self.counters['generate']}")
        # Like SGLang: wait while paused, then hold the "reader lock" (no update runs meanwhile).
        while self.paused or self._writer_waiting:
            await self._resumed.wait()
            if self._writer_waiting:
                async with self._writer:
                    pass
        self.counters["generate"] += 1
        self.running[rid] = self.running.get(rid, 0) + 1
        self._idle.clear()
        try:
            [result] = await self.engine.generate(GenerationRequest(rid, tuple(ids), sampling, 1))
            version = self.weight_version
        finally:
            self.running[rid] -= 1
            if not self.running[rid]:
                del self.running[rid]
            if not self.running:
                self._idle.set()
        if result.finish_reason == "abort" and not result.output_ids:
            # SGLang 0.5.6 drops a request still in the waiting queue in Scheduler.abort_request and answers
            # through TokenizerManager._handle_abort_req: meta_info is only id, finish_reason, the logprob
            # lists (when asked for) and completion_tokens; no weight_version and no prompt_tokens.
            self.counters["aborted"] += 1
            meta = {"id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}
            if body.get("return_logprob"):
                meta["input_token_logprobs"], meta["output_token_logprobs"] = [], []
            meta["completion_tokens"] = 0
            return 200, {"text": "", "output_ids": [], "meta_info": meta}
        if result.finish_reason == "abort":
            self.counters["aborted"] += 1
            finish: dict[str, Any] = {"type": "abort", "message": "Abort", "status_code": None, "err_type": None}
        elif result.finish_reason == "stop":
            finish = {"type": "stop", "matched": result.output_ids[-1]}
        else:
            finish = {"type": "length", "length": len(result.output_ids)}
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "weight_version": version,
                "completion_tokens": len(result.output_ids), "cached_tokens": 0,
                # Not an SGLang field: the embedded engine's own version of every token, for tests.
                "standin_token_versions": list(result.versions)}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, result.output_ids)]
        return 200, {"output_ids": list(result.output_ids), "meta_info": meta}

    async def abort_request(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("abort_all"):
            await self.engine.abort(None)
        elif body.get("rid"):
            await self.engine.abort(str(body["rid"]))
        return 200, {}

    async def pause_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise _BadRequest(f"mode: {mode!r} is not one of abort, in_place, retract")
        self.paused = True
        self._resumed.clear()
        if mode == "abort":
            # Abort until no /generate handler is open (a request admitted at the same step boundary as an
            # abort can miss it; the bounded wait then aborts again).
            for _ in range(600):
                if not self.running:
                    break
                await self.engine.abort(None)
                try:
                    await asyncio.wait_for(self._idle.wait(), 0.5)
                except TimeoutError:
                    continue
            else:
                raise EngineError(f"pause_generation: {len(self.running)} requests still running after 300 s")
        elif not self.in_place:
            await self.engine.pause()
            self.in_place = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.in_place:
            await self.engine.resume()
            self.in_place = False
        self.paused = False
        self._resumed.set()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    # --- weights ------------------------------------------------------------------------------------
    async def _apply(self, version_text: Any, buckets: Sequence[list[tuple[str, torch.Tensor]]],
                     abort_all: bool) -> None:
        """Apply buckets: at once when paused, else after the running requests finished (SGLang's writer lock)."""
        version = _as_int_version(version_text, self.engine.version)
        if abort_all:
            await self.engine.abort(None)
        if self.paused:
            await self.engine.update_weights(self.engine.version if version_text is None else version, list(buckets))
        else:
            self._writer_waiting += 1
            try:
                async with self._writer:
                    await self._idle.wait()
                    await self.engine.update_weights(version, list(buckets))
                    if version_text is not None:
                        self.weight_version = str(version_text)
            finally:
                self._writer_waiting -= 1
        self.counters["updates"] += 1

    async def update_weights_from_disk(self, body: dict[str, Any]) -> tuple[int, Any]:
        from actors.engines.checkpoint import CheckpointError, iter_checkpoint_tensors
        path = str(body["model_path"])
        try:
            named = await asyncio.to_thread(lambda: [(n, t) for n, t in iter_checkpoint_tensors(path)
                                                     if not n.endswith("rotary_emb.inv_freq")])
            if not named:
                raise CheckpointError(f"{path}: no safetensors weights found")
            await self._apply(body.get("weight_version"), [named], bool(body.get("abort_all_requests")))
        except (CheckpointError, OSError, EngineError) as exc:
            return 400, {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
        self.model_path = path
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    async def init_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = str(body.get("group_name", "weight_update_group"))
        backend = str(body.get("backend", "nccl"))
        if backend == "nccl" and not torch.cuda.is_available():
            backend = "gloo"  # the stand-in runs on CPU; the rank layout and rendezvous are SGLang's
        rank = int(body["rank_offset"])  # + tp rank 0: the stand-in is one rank
        try:
            pg = await asyncio.to_thread(join_weight_group, str(body["master_address"]), int(body["master_port"]),
                                         rank, int(body["world_size"]), name, backend)
        except EngineError as exc:
            return 400, {"success": False, "message": f"Failed to initialize custom process group: {exc}."}
        self.groups[name] = pg
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    async def destroy_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = str(body.get("group_name", "weight_update_group"))
        pg = self.groups.pop(name, None)
        if pg is None:
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        drop_weight_group(pg)  # in the background: a broken group's teardown must not stall this server
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    async def update_weights_from_distributed(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = str(body.get("group_name", "weight_update_group"))
        pg = self.groups.get(name)
        if pg is None:
            raise _BadRequest(f"Group {name} not in {list(self.groups)}. Please call `init_weights_update_group` "
                              f"first.")
        names, dtypes, shapes = list(body["names"]), list(body["dtypes"]), list(body["shapes"])
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise _BadRequest("names, dtypes and shapes must be non-empty lists of one length")
        specs = [TensorMeta(n, d, [int(x) for x in s]) for n, d, s in zip(names, dtypes, shapes)]
        flattened = body.get("load_format") == "flattened_bucket"
        self.counters["distributed_calls"] += 1
        call = self.counters["distributed_calls"]
        try:
            bucket = await asyncio.to_thread(receive_bucket, pg, specs, flattened, self.device)
            if call in self.fail_load_at:
                raise RuntimeError(f"injected load failure of /update_weights_from_distributed call {call}")
            await self._apply(body.get("weight_version"), [bucket], bool(body.get("abort_all_requests")))
        except Exception as exc:
            # SGLang 0.5.6's words (model_executor/model_runner.py:1147-1236): the buckets loaded before this
            # one stay loaded; the route answers HTTP 400 (entrypoints/http_server.py:862-876).
            return 400, {"success": False, "message": f"Failed to update parameter online: {exc}. The full weights "
                                                      f"of the ModelRunner are partially updated. Please discard "
                                                      f"the whole weights."}
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    async def update_weight_version(self, body: dict[str, Any]) -> tuple[int, Any]:
        new = str(body["new_version"])
        if body.get("abort_all_requests", True):
            await self.engine.abort(None)
        self.weight_version = new
        # Label the embedded engine's tokens the same way (an empty update swaps nothing but the version).
        await self.engine.update_weights(_as_int_version(new, self.engine.version), [])
        return 200, {"success": True, "message": f"Weight version updated to {new}", "new_version": new}


# --------------------------------------------------------------------------------------------------------
# Running it: in a thread (tests) or as a process (python -m testsupport.sglang_standin)
# --------------------------------------------------------------------------------------------------------

def check_sampling(sp: dict[str, Any], input_tokens: int, context_len: int) -> None:
    """Refuses what SGLang 0.5.6 refuses with HTTP 400, in its words: ``SamplingParams.__init__`` (greedy
    temperature turns top_k into 1 first) and ``.verify`` (sampling/sampling_params.py), then
    ``TokenizerManager._validate_one_request`` (context length; ``--allow-auto-truncate`` is off by default)."""
    temperature, top_p = float(sp.get("temperature", 1.0)), float(sp.get("top_p", 1.0))
    top_k, max_new_tokens = int(sp.get("top_k", -1)), sp.get("max_new_tokens", 128)
    if 0 <= temperature < 1e-6:
        top_k = 1
    if temperature < 0.0:
        raise _BadRequest(f"temperature must be non-negative, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise _BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    if top_k != -1 and top_k < 1:
        raise _BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if max_new_tokens is not None and int(max_new_tokens) < 0:
        raise _BadRequest(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    if input_tokens >= context_len:
        raise _BadRequest(f"The input ({input_tokens} tokens) is longer than the model's context length "
                          f"({context_len} tokens).")
    if max_new_tokens is not None and int(max_new_tokens) + input_tokens >= context_len:
        raise _BadRequest(f"Requested token count exceeds the model's maximum context length of {context_len} "
                          f"tokens. You requested a total of {int(max_new_tokens) + input_tokens} tokens: "
                          f"{input_tokens} tokens from the input messages and {max_new_tokens} tokens for the "
                          f"completion. Please reduce the number of tokens in the input messages or the "
                          f"completion to fit within the limit.")


class StandinThread:
    """The stand-in server on its own event loop in a daemon thread (for in-process tests)."""

    def __init__(self, engine: TorchGenerationEngine, model_path: str = "<in-memory>", host: str = "127.0.0.1",
                 port: int = 0, weight_version: str = "0", weights_hash_route: bool = True) -> None:
        self.engine, self.model_path, self.host, self.port = engine, model_path, host, port
        self.weights_hash_route = weights_hash_route
        self.weight_version = weight_version
        self.server: StandinServer | None = None
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sglang-standin", daemon=True)
        self._runner: Any = None
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> StandinThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise EngineError(f"stand-in server did not start within {timeout} s")
        if self._error is not None:
            raise EngineError(f"stand-in server failed to start: {self._error!r}")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        from aiohttp import web
        try:
            await self.engine.start()
            self.server = StandinServer(self.engine, self.model_path, self.weight_version,
                                        weights_hash_route=self.weights_hash_route)
            self._runner = web.AppRunner(self.server.app())
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self._stop = asyncio.Event()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._stop.wait()
        await self._runner.cleanup()
        await self.engine.stop()

    def stop(self, timeout: float = 30.0) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testsupport.sglang_standin",
                                 description="SGLang-compatible HTTP server over the embedded CPU engine")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", type=int, default=1, help="accepted for compatibility; the stand-in is one rank")
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--mem-fraction-static", type=float, default=None, help="accepted for compatibility")
    ap.add_argument("--skip-tokenizer-init", action="store_true", help="accepted; answers carry token ids only")
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--no-weights-hash", action="store_true",
                    help="no GET /standin/weights_hash: serve as SGLang does, with no route reading weights back")
    ap.add_argument("--fail-load-at", default="", metavar="N[,M...]",
                    help="fault injection for tests: these /update_weights_from_distributed calls (numbered from 1) "
                         "receive their bucket, then fail to load it as SGLang answers a failed load")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dtype = None if args.dtype in (None, "auto") else args.dtype
    version = _as_int_version(args.weight_version, 0)
    engine = TorchGenerationEngine(args.model_path, version=version, device=args.device, dtype=dtype,
                                   max_running=args.max_running_requests, seed=args.random_seed)
    from aiohttp import web

    async def serve() -> None:
        await engine.start()
        server = StandinServer(engine, args.model_path, args.weight_version, device=args.device,
                               weights_hash_route=not args.no_weights_hash,
                               fail_load_at=[int(n) for n in args.fail_load_at.split(",") if n.strip()])
        runner = web.AppRunner(server.app())
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        log.info("stand-in SGLang server (API of %s) on http://%s:%d, model %s", SGLANG_VERSION, args.host,
                 args.port, args.model_path)
        await asyncio.Event().wait()  # serve until killed

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
