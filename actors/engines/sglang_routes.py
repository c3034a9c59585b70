"""The SGLang HTTP API this code speaks, declared once: routes and the fields sent to each, sampling fields,
what is read from an answer, and the errors a client raises.

Everything the client (actors/engines/sglang.py) sends is declared in :data:`ROUTES` (route -> SGLang
request class and the fields we send) and :data:`SAMPLING_FIELDS`; ``tests/test_engine_sglang_fields.py``
checks them against SGLang's own ``sglang.srt.managers.io_struct`` dataclasses of :data:`SGLANG_VERSION`
(the version pinned in pyproject's ``gpu`` extra). See docs/engines-sglang.md.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .base import EngineError

__all__ = ["SGLANG_VERSION", "ROUTES", "SAMPLING_FIELDS", "META_INFO_KEYS", "GET_ROUTES", "IDEMPOTENT_ROUTES",
           "SERVER_INFO_KEYS", "DEFAULT_GROUP", "SERVER_KEEP_ALIVE_S", "CLIENT_KEEP_ALIVE_S", "HEALTH_CHECK_TIMEOUT_S",
           "SEED_RANGE", "ServerEvents", "SGLangError", "SGLangHTTPError", "SGLangLaunchError",
           "SGLangConnectionReset", "payload", "sampling_payload", "health_probe_s"]

# The SGLang release whose HTTP API this module speaks (pinned in pyproject.toml's `gpu` extra). 0.5.6 is
# the first release whose /pause_generation takes a mode (abort / in_place / retract).
SGLANG_VERSION = "0.5.6"

# route -> (SGLang request dataclass in sglang.srt.managers.io_struct, the fields this module sends).
ROUTES: dict[str, tuple[str, frozenset[str]]] = {
    "/generate": ("GenerateReqInput", frozenset({"rid", "input_ids", "sampling_params", "return_logprob",
                                                 "lora_path"})),
    "/abort_request": ("AbortReq", frozenset({"rid", "abort_all"})),
    "/pause_generation": ("PauseGenerationReqInput", frozenset({"mode"})),
    "/continue_generation": ("ContinueGenerationReqInput", frozenset()),
    "/update_weights_from_disk": ("UpdateWeightFromDiskReqInput",
                                  frozenset({"model_path", "abort_all_requests", "weight_version", "flush_cache"})),
    "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput",
                                   frozenset({"master_address", "master_port", "rank_offset", "world_size",
                                              "group_name", "backend"})),
    "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput",
                                         frozenset({"names", "dtypes", "shapes", "group_name", "flush_cache",
                                                    "abort_all_requests", "weight_version", "load_format"})),
    "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", frozenset({"group_name"})),
    "/update_weight_version": ("UpdateWeightVersionReqInput", frozenset({"new_version", "abort_all_requests"})),
    # LoRA (model.lora): an adapter directory in PEFT's layout is loaded under a name, which /generate's
    # lora_path names (entrypoints/http_server.py:983-1013; managers/tokenizer_communicator_mixin.py:545-647).
    "/load_lora_adapter": ("LoadLoRAAdapterReqInput", frozenset({"lora_name", "lora_path"})),
    "/unload_lora_adapter": ("UnloadLoRAAdapterReqInput", frozenset({"lora_name"})),
}
# Keys of /generate's sampling_params (arguments of sglang.srt.sampling.sampling_params.SamplingParams).
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed"})
# What this module reads from a /generate answer's meta_info (set in SGLang's tokenizer_manager).
META_INFO_KEYS = frozenset({"finish_reason", "output_token_logprobs", "weight_version", "completion_tokens",
                            "prompt_tokens"})
GET_ROUTES = frozenset({"/health", "/health_generate", "/model_info", "/server_info", "/weight_version"})
# What this module reads from GET /server_info (the scheduler's info: managers/scheduler.py:2662-2668).
SERVER_INFO_KEYS = frozenset({"max_total_num_tokens"})

# Routes a client may send again after the connection was reset (the server may or may not have seen the
# first one): sending them twice leaves the server as sending them once. Not here: /generate (a second copy
# would generate twice; the engine aborts the rid and resubmits what it holds), /init_weights_update_group (a
# second join of the same rank), /update_weights_from_distributed (a second receive would wait for a bucket
# the trainer sends once, or take the next one: mixed weights) and /destroy_weights_update_group.
IDEMPOTENT_ROUTES = GET_ROUTES | frozenset({"/abort_request", "/pause_generation", "/continue_generation",
                                            "/update_weight_version", "/update_weights_from_disk"})

# SGLang's HTTP server closes a connection idle for this long (entrypoints/http_server.py:1433:
# uvicorn.run(..., timeout_keep_alive=5)). A client that keeps idle connections longer sends, now and then,
# on one the server is closing: the request fails with a reset. The client keeps them for less.
SERVER_KEEP_ALIVE_S = 5.0
CLIENT_KEEP_ALIVE_S = 4.0

# /health sends a one-token request and answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT seconds without output
# (entrypoints/http_server.py:136, :464-483); it takes at least a second (it checks once a second).
HEALTH_CHECK_TIMEOUT_S = 20.0

# sampling_seed becomes an int32 tensor under --enable-deterministic-inference
# (sampling/sampling_batch_info.py:90-97); a seed outside int32 raises in the scheduler and takes the server
# down. The engine sends seeds in [0, 2**31).
SEED_RANGE = 1 << 31

# The process group SGLang's model runner joins for update_weights_from_distributed (its default name).
DEFAULT_GROUP = "weight_update_group"

# A launched server's life events: ("died", restarts so far) as soon as its process is gone, then
# ("restarted", restarts) once it is healthy again.
ServerEvents = Callable[[str, int], Awaitable[None]]


class SGLangError(EngineError):
    """Talking to the SGLang server failed; the message names the server, the route and the cause."""


class SGLangHTTPError(SGLangError):
    """The server answered a route with an error status."""

    def __init__(self, url: str, route: str, status: int, body: str) -> None:
        super().__init__(f"SGLang server {url}: {route} answered HTTP {status}: {body[:500]}")
        self.url, self.route, self.status, self.body = url, route, status, body


class SGLangConnectionReset(SGLangError):
    """The connection dropped before an answer came (reset, or closed by the server); the server may or may
    not have received the request."""


class SGLangLaunchError(SGLangError):
    """The server process could not be started, or did not become healthy in time."""


def payload(route: str, **fields: Any) -> dict[str, Any]:
    """The JSON body for ``route``; only the fields declared in :data:`ROUTES` may be sent."""
    if route not in ROUTES:
        raise SGLangError(f"{route}: not a route this engine knows ({sorted(ROUTES)})")
    unknown = set(fields) - ROUTES[route][1]
    if unknown:
        raise SGLangError(f"{route}: field(s) {sorted(unknown)} are not declared in ROUTES[{route!r}]")
    return fields


def health_probe_s(env: dict[str, str] | None = None) -> float:
    """How long a client waits for GET /health: the server's own limit, SGLANG_HEALTH_CHECK_TIMEOUT (its
    launch environment's, else ours, else SGLang's 20 s), and 5 s more. A shorter wait gives up on a healthy
    server whose one-token check is queued behind a long step, which takes seconds under load."""
    import os
    value = (env or {}).get("SGLANG_HEALTH_CHECK_TIMEOUT") or os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT")
    return (float(value) if value else HEALTH_CHECK_TIMEOUT_S) + 5.0


def sampling_payload(**fields: Any) -> dict[str, Any]:
    unknown = set(fields) - SAMPLING_FIELDS
    if unknown:
        raise SGLangError(f"sampling_params: field(s) {sorted(unknown)} are not declared in SAMPLING_FIELDS")
    return fields
