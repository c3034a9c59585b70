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

__all__ = ["SGLANG_VERSION", "ROUTES", "SAMPLING_FIELDS", "META_INFO_KEYS", "GET_ROUTES", "DEFAULT_GROUP",
           "ServerEvents", "SGLangError", "SGLangHTTPError", "SGLangLaunchError", "payload", "sampling_payload"]

# The SGLang release whose HTTP API this module speaks (pinned in pyproject.toml's `gpu` extra). 0.5.6 is
# the first release whose /pause_generation takes a mode (abort / in_place / retract).
SGLANG_VERSION = "0.5.6"

# route -> (SGLang request dataclass in sglang.srt.managers.io_struct, the fields this module sends).
ROUTES: dict[str, tuple[str, frozenset[str]]] = {
    "/generate": ("GenerateReqInput", frozenset({"rid", "input_ids", "sampling_params", "return_logprob"})),
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
}
# Keys of /generate's sampling_params (arguments of sglang.srt.sampling.sampling_params.SamplingParams).
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed"})
# What this module reads from a /generate answer's meta_info (set in SGLang's tokenizer_manager).
META_INFO_KEYS = frozenset({"finish_reason", "output_token_logprobs", "weight_version", "completion_tokens",
                            "prompt_tokens"})
GET_ROUTES = frozenset({"/health", "/health_generate", "/model_info", "/server_info", "/weight_version"})

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


def sampling_payload(**fields: Any) -> dict[str, Any]:
    unknown = set(fields) - SAMPLING_FIELDS
    if unknown:
        raise SGLangError(f"sampling_params: field(s) {sorted(unknown)} are not declared in SAMPLING_FIELDS")
    return fields
