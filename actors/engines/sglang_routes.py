"""The SGLang HTTP API this code speaks, declared once: routes and the fields sent to each, sampling fields,
what is read from an answer, and the errors a client raises.

Everything the client (actors/engines/sglang.py) sends is declared in :data:`ROUTES` (route -> SGLang
request class and the fields we send) and :data:`SAMPLING_FIELDS`; ``tests/test_engine_sglang_fields.py``
checks them against SGLang's own ``sglang.srt.managers.io_struct`` request classes of both ends of
:data:`SGLANG_VERSIONS` (the range in pyproject's ``gpu`` extra). See docs/engines-sglang.md.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .base import EngineError

__all__ = ["SGLANG_VERSION", "SGLANG_VERSIONS", "ROUTES", "WEIGHT_SESSION_ROUTES", "SAMPLING_FIELDS",
           "META_INFO_KEYS", "GET_ROUTES", "IDEMPOTENT_ROUTES", "SERVER_INFO_KEYS", "DEFAULT_GROUP",
           "ROUTED_EXPERTS_FIELDS", "ROUTED_EXPERTS_FLAG", "ROUTED_EXPERTS_KEY",
           "ROUTED_EXPERTS_SINCE", "SERVER_KEEP_ALIVE_S", "CLIENT_KEEP_ALIVE_S", "HEALTH_CHECK_TIMEOUT_S", "SEED_RANGE", "ServerEvents",
           "SGLangError", "SGLangHTTPError", "SGLangLaunchError", "SGLangConnectionReset", "payload", "sampling_payload", "health_probe_s"]

# The SGLang releases whose HTTP API this module speaks: the oldest and the newest of the range in
# pyproject.toml's `gpu` extra, both tested (tests/test_engine_sglang_fields.py reads each one's source; the
# stand-in serves either, testsupport/sglang_standin.py). 0.5.6 is the first release whose /pause_generation
# takes a mode (abort / in_place / retract). Releases between the two are not read here.
SGLANG_VERSIONS = ("0.5.6", "0.5.23")
SGLANG_VERSION = SGLANG_VERSIONS[-1]   # the newest: what the stand-in serves unless told otherwise

# route -> (SGLang request dataclass in sglang.srt.managers.io_struct, the fields this module sends).
ROUTES: dict[str, tuple[str, frozenset[str]]] = {
    "/generate": ("GenerateReqInput", frozenset({"rid", "input_ids", "sampling_params", "return_logprob",
                                                 "lora_path"})),
    "/abort_request": ("AbortReq", frozenset({"rid", "abort_all"})),
    "/pause_generation": ("PauseGenerationReqInput", frozenset({"mode"})),
    "/continue_generation": ("ContinueGenerationReqInput", frozenset()),
    # No weight_version with an update: inside a pause 0.5.6 ignores it and 0.5.23 relabels the server after
    # each successful call (managers/tokenizer_control_mixin.py:529-531), so after the first bucket of a
    # version that may still break off. /update_weight_version labels a whole version, in both.
    "/update_weights_from_disk": ("UpdateWeightFromDiskReqInput",
                                  frozenset({"model_path", "abort_all_requests", "flush_cache"})),
    "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput",
                                   frozenset({"master_address", "master_port", "rank_offset", "world_size",
                                              "group_name", "backend"})),
    "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput",
                                         frozenset({"names", "dtypes", "shapes", "group_name", "flush_cache",
                                                    "abort_all_requests", "load_format"})),
    # 0.5.23 receives buckets only inside a weight-update session (managers/scheduler_components/
    # weight_updater.py:192-197); 0.5.6 has neither route (WEIGHT_SESSION_ROUTES).
    "/begin_weight_update": ("BeginWeightUpdateReqInput", frozenset()),
    "/end_weight_update": ("EndWeightUpdateReqInput", frozenset()),
    "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", frozenset({"group_name"})),
    "/update_weight_version": ("UpdateWeightVersionReqInput", frozenset({"new_version", "abort_all_requests"})),
    # LoRA (model.lora): an adapter directory in PEFT's layout is loaded under a name, which /generate's
    # lora_path names (0.5.23: entrypoints/http_server.py:1652-1686, managers/tokenizer_control_mixin.py:
    # 633-744 and 831-; 0.5.6: entrypoints/http_server.py:983-1013, managers/tokenizer_communicator_mixin.py:
    # 545-647).
    "/load_lora_adapter": ("LoadLoRAAdapterReqInput", frozenset({"lora_name", "lora_path"})),
    "/unload_lora_adapter": ("UnloadLoRAAdapterReqInput", frozenset({"lora_name"})),
}
# Routing replay (algo.routing_replay: r3): /generate's ``return_routed_experts`` asks for the experts every
# layer routed each token to, on a server launched with ROUTED_EXPERTS_FLAG (0.5.23: managers/io_struct.py:264,
# arg_groups/fields/exec_.py:158). 0.5.6 has neither (no capture at all), and the releases between the two ends
# are not read here, so routing replay with SGLang needs ROUTED_EXPERTS_SINCE or later. Sent only then, apart
# from ROUTES: the HTTP contract of 0.5.23 (api/v1/api_types.py:236-237) does not declare the field and ignores
# keys it does not declare, while FastAPI fills it into GenerateReqInput (entrypoints/http_server.py:933).
ROUTED_EXPERTS_FIELDS = frozenset({"return_routed_experts"})
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
ROUTED_EXPERTS_SINCE = "0.5.23"
# Routes of the releases with weight-update sessions only. The release that added them lies between the two
# tested ends (sgl-project/sglang pull request 28001), so the client asks the server: an older one answers
# /begin_weight_update with HTTP 404, FastAPI's answer to a route it does not have.
WEIGHT_SESSION_ROUTES = frozenset({"/begin_weight_update", "/end_weight_update"})
# Keys of /generate's sampling_params (fields of sglang.srt.sampling.sampling_params.SamplingParams, and in
# 0.5.23 of the HTTP contract's sglang.api.v1.api_types.SamplingParams, which refuses any other key).
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed"})
# What this module reads from a /generate answer's meta_info (set in SGLang's tokenizer_manager).
META_INFO_KEYS = frozenset({"finish_reason", "output_token_logprobs", "weight_version", "completion_tokens",
                            "prompt_tokens"})
# ... and, with return_routed_experts, this one (0.5.23 managers/tokenizer_manager.py:2602-2609).
ROUTED_EXPERTS_KEY = "routed_experts"
# The weight version is read from GET /model_info, which reports it in both releases (0.5.6:
# entrypoints/http_server.py:505; 0.5.23: http_server.py:824-826); 0.5.23 has no GET /weight_version.
GET_ROUTES = frozenset({"/health", "/health_generate", "/model_info", "/server_info"})
# What this module reads from GET /server_info (the scheduler's info: 0.5.23 managers/scheduler.py:1944-1946,
# 0.5.6 managers/scheduler.py:2662-2668).
SERVER_INFO_KEYS = frozenset({"max_total_num_tokens"})

# Routes a client may send again after the connection was reset (the server may or may not have seen the
# first one): sending them twice leaves the server as sending them once. Not here: /generate (a second copy
# would generate twice; the engine aborts the rid and resubmits what it holds), /init_weights_update_group (a
# second join of the same rank), /update_weights_from_distributed (a second receive would wait for a bucket
# the trainer sends once, or take the next one: mixed weights) and /destroy_weights_update_group.
# (/begin_weight_update and /end_weight_update neither: a second begin is refused while the session is open,
# a second end when it is closed.)
IDEMPOTENT_ROUTES = GET_ROUTES | frozenset({"/abort_request", "/pause_generation", "/continue_generation",
                                            "/update_weight_version", "/update_weights_from_disk"})

# SGLang's HTTP server closes a connection idle for this long (0.5.23: timeout_keep_alive=
# envs.SGLANG_TIMEOUT_KEEP_ALIVE, 5 by default: entrypoints/http_server.py:3059, environ.py:337; 0.5.6:
# uvicorn.run(..., timeout_keep_alive=5), entrypoints/http_server.py:1433). A client that keeps idle
# connections longer sends, now and then, on one the server is closing: the request fails with a reset. The
# client keeps them for less.
SERVER_KEEP_ALIVE_S = 5.0
CLIENT_KEEP_ALIVE_S = 4.0

# /health sends a one-token request and answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT seconds without output
# (0.5.23: entrypoints/http_server.py:218, :778-799; 0.5.6: :136, :464-483); it takes at least a second (it
# checks once a second).
HEALTH_CHECK_TIMEOUT_S = 20.0

# sampling_seed becomes an int32 tensor under --enable-deterministic-inference in 0.5.6
# (sampling/sampling_batch_info.py:90-97), where a seed outside int32 raises in the scheduler and takes the
# server down; 0.5.23 makes it int64 (sampling_batch_info.py:167) and refuses one outside int64 with HTTP 400
# (sampling/sampling_params.py:308-312). The engine sends seeds in [0, 2**31), which both take.
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
    unknown = set(fields) - ROUTES[route][1] - (ROUTED_EXPERTS_FIELDS if route == "/generate" else frozenset())
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
