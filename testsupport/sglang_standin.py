"""A stand-in SGLang server over the embedded engine, for running and testing the SGLang path without a GPU.

    python -m testsupport.sglang_standin --model-path DIR [--host 127.0.0.1] [--port 30000]
                                            [--weight-version 0] [--random-seed S] [--tp-size 1]
                                            [--standin-sglang-release 0.5.23] ...

It serves the routes and request/response fields of SGLang's HTTP server that the SGLang engine uses, as
one of the releases the engine speaks to (actors.engines.sglang_routes.SGLANG_VERSIONS: the oldest and the
newest of the supported range; the newest unless ``--standin-sglang-release`` names another), over a
`TorchGenerationEngine`:

    GET  /health /health_generate /model_info /server_info, and /weight_version in 0.5.6
    POST /generate                 input_ids, sampling_params, return_logprob, rid -> output_ids, meta_info
                                   (finish_reason, prompt_tokens, completion_tokens, cached_tokens,
                                   weight_version, output_token_logprobs = [[logprob, token_id, null], ...]);
                                   return_routed_experts (0.5.23, with --enable-return-routed-experts) ->
                                   meta_info.routed_experts, the embedded model's own routing)
    POST /abort_request            rid | abort_all
    POST /pause_generation         mode: abort (running requests come back with their partial tokens,
                                   finish_reason abort; returns once none is running) | in_place | retract
                                   (requests stay, decoding stops); new /generate calls wait until continue
    POST /continue_generation
    POST /update_weights_from_disk model_path (a Hugging Face checkpoint directory), weight_version, ...
    POST /init_weights_update_group, /destroy_weights_update_group
    POST /begin_weight_update, /end_weight_update (0.5.23): the session every bucket is received in
    POST /update_weights_from_distributed   names, dtypes, shapes, group_name, load_format (per tensor or
                                   "flattened_bucket"): receives the bucket over the group (gloo on CPU)
    POST /update_weight_version    new_version, abort_all_requests
    POST /load_lora_adapter        lora_name, lora_path (a PEFT-layout adapter directory), with --enable-lora
    POST /unload_lora_adapter      lora_name; answers once no running request uses it
                                   (/generate's lora_path names a loaded adapter; one adapter runs at a time)

Semantics follow SGLang's: a weight update outside a pause waits until running requests finish; inside a
pause it is applied at once, and relabels weight_version in 0.5.23 but not in 0.5.6 (/update_weight_version
does in both). Where SGLang is strict the stand-in is too, each behaviour read from the release's source (the
constants below cite file and line under python/sglang/srt/ at each release's tag; ``CITATIONS`` holds the
lines, docs/engines-sglang.md lists them): idle keep-alive connections close after 5 s; /health generates a
token and polls once a second; a request aborted in the waiting queue answers with the tokens force-streamed
so far (every 50); a cache flush with a request in the running batch fails the update (0.5.23) or the
scheduler's assertion, and the server dies (0.5.6), as a 0.5.6 server does for a sampling_seed outside int32
(0.5.23 refuses one outside int64); buckets are received only inside a weight-update session (0.5.23); the
weights group is joined as tp_size ranks (a worker process per extra rank); a non-abort pause answers before
the scheduler applies it; no generation step runs while a bucket is received; /abort_request matches by rid
prefix; a disconnected client's request is aborted within 4 s. One extension that SGLang lacks: GET
/standin/weights_hash (actors.weights.weights_hash of the weights in use) so tests can prove which weights
the server samples with; ``--no-weights-hash`` leaves it out, to serve exactly as SGLang does (rollouts then
check the version the server reports). Fields SGLang has but the stand-in does not implement are refused with
HTTP 400 naming them, rather than silently ignored.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextvars
import dataclasses
import json
import logging
import multiprocessing
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from actors.engines.base import EngineError, GenerationRequest, RequestError, SamplingParams, WeightBucket
from actors.engines.sglang_group import drop_weight_group, join_weight_group
from actors.engines.sglang_routes import ROUTED_EXPERTS_FIELDS, SGLANG_VERSION, SGLANG_VERSIONS
from actors.engines.sglang_server import LaunchConfig
from actors.engines.torch_gen import TorchGenerationEngine
from transport.bulk import TensorMeta, flat_misaligned, unpack_flat

__all__ = ["StandinServer", "main"]

log = logging.getLogger("sglang_standin")

# SGLang's values, each where its source sets it (paths under python/sglang/srt/ of the release's tag; the
# newest release's lines first, the oldest's after "0.5.6"). Where the two releases differ the stand-in
# serves as the one it is told (:class:`Release`), the newest by default.
# entrypoints/http_server.py:3059 (environ.py:337, SGLANG_TIMEOUT_KEEP_ALIVE = 5; 0.5.6: http_server.py:1433
# uvicorn.run(..., timeout_keep_alive=5)) closes a connection idle this long; a client must not keep idle
# connections longer, or it sends on one the server is closing.
TIMEOUT_KEEP_ALIVE_S = 5.0
# entrypoints/http_server.py:218 (0.5.6: :136): HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT",
# 20)); the /health route (health_generate, :721-799; 0.5.6: :409-484) sends a one-token request and checks once
# a second (:779-780; 0.5.6: :464-470) whether anything came back since it started, answering 503 after
# HEALTH_CHECK_TIMEOUT.
HEALTH_CHECK_TIMEOUT_S = 20.0
HEALTH_POLL_S = 1.0
# managers/scheduler_components/output_streamer.py:49, :475-477 (environ.py:688; 0.5.6:
# managers/scheduler_output_processor_mixin.py:36, :822-826): a non-streamed request's output reaches the
# tokenizer manager every DEFAULT_FORCE_STREAM_INTERVAL tokens; a request aborted in the waiting queue is
# answered from what arrived (managers/tokenizer_manager.py:3577-3642, _handle_abort_req; 0.5.6: :2036-2071).
FORCE_STREAM_INTERVAL = 50
# managers/tokenizer_manager.py:2267-2280 (0.5.6: :1264-1277): an abort-mode pause aborts everything, then
# checks once a second until no request holds the model-update lock.
PAUSE_POLL_S = 1.0
# managers/tokenizer_manager.py:1958-1973 (environ.py:1679, SGLANG_REQUEST_STATE_WAIT_TIMEOUT = 4; 0.5.6:
# :1048-1062): a non-streamed request whose client disconnected is aborted at the next 4 s check.
DISCONNECT_CHECK_S = 4.0
# A sampling_seed's bounds: 0.5.6 makes the seeds an int32 tensor in the scheduler under deterministic
# inference (sampling/sampling_batch_info.py:90-97), where one outside int32 raises and a scheduler exception
# takes the whole server down; 0.5.23 makes them int64 (sampling_batch_info.py:167) and refuses one outside
# int64 with HTTP 400 (sampling/sampling_params.py:308-312).
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclasses.dataclass(frozen=True)
class Release:
    """What differs between the SGLang releases the stand-in serves as (each cited in ``CITATIONS``)."""

    version: str
    # GET /weight_version (0.5.6 entrypoints/http_server.py:522; gone in 0.5.23, which reports the version
    # in GET /model_info only, http_server.py:824).
    weight_version_route: bool
    # /begin_weight_update and /end_weight_update (0.5.23 entrypoints/http_server.py:1458, :1473), and no
    # /update_weights_from_distributed outside the session they bracket
    # (managers/scheduler_components/weight_updater.py:192-197, :312-335).
    weight_sessions: bool
    # An update inside a pause relabels weight_version when it succeeds (0.5.23
    # managers/tokenizer_control_mixin.py:529-531, managers/tokenizer_manager.py:2318-2319); 0.5.6 applies it
    # and returns before relabelling (managers/tokenizer_communicator_mixin.py:418-424,
    # managers/tokenizer_manager.py:1301-1303).
    relabels_when_paused: bool
    # A cache flush refused after an update (a request in the running batch): 0.5.6 asserts and the scheduler
    # dies (managers/scheduler_update_weights_mixin.py:50-52); 0.5.23 answers the update with success False,
    # HTTP 400, its weights already changed (managers/scheduler_components/weight_updater.py:120-133).
    flush_failure_kills: bool
    # The sampling_seed bounds (INT32/INT64 above): outside int32 kills a 0.5.6 server, outside int64 is refused.
    seed_bits: int
    # A queued abort's meta_info carries weight_version (0.5.23 managers/tokenizer_manager.py:3606; not 0.5.6).
    queued_abort_labelled: bool
    # /generate with lora_path on a server without --enable-lora: refused with HTTP 400 (0.5.23
    # managers/tokenizer_manager.py:3729-3740); 0.5.6 skips lora_path silently (tokenizer_manager.py:474).
    lora_path_needs_lora: bool
    # A flattened bucket whose tensor would start at a byte offset that is not a multiple of its element size:
    # 0.5.23 refuses it before the broadcast is received (weight_sync/tensor_bucket.py:98-101, answered as
    # "Failed to receive weights: ..." by managers/scheduler_components/weight_updater.py:210); 0.5.6 receives it
    # and then fails viewing the bytes as the dtype (weight_sync/tensor_bucket.py:101, `.view(meta.dtype)`), a
    # failed load that leaves the weights partially updated (model_executor/model_runner.py:1224-1236).
    unaligned_refused_before_receive: bool
    # Routing replay: --enable-return-routed-experts and /generate's return_routed_experts (0.5.23
    # arg_groups/fields/exec_.py:158, managers/io_struct.py:264); 0.5.6 has neither flag nor field.
    routed_experts: bool


RELEASES: dict[str, Release] = {
    "0.5.6": Release("0.5.6", weight_version_route=True, weight_sessions=False, relabels_when_paused=False,
                     flush_failure_kills=True, seed_bits=32, queued_abort_labelled=False,
                     lora_path_needs_lora=False, unaligned_refused_before_receive=False, routed_experts=False),
    "0.5.23": Release("0.5.23", weight_version_route=False, weight_sessions=True, relabels_when_paused=True,
                      flush_failure_kills=False, seed_bits=64, queued_abort_labelled=True,
                      lora_path_needs_lora=True, unaligned_refused_before_receive=True, routed_experts=True),
}
assert tuple(RELEASES) == SGLANG_VERSIONS, "the stand-in serves as each release the client speaks to"

# Every line of each release the stand-in's strictness rests on: (path under sglang/srt/ in the release's
# wheel, i.e. python/sglang/srt/ at its tag; line; text the line holds). tests/test_engine_sglang_fields.py
# reads each one in the wheel of its release, so a citation that drifts from the source fails there.
CITATIONS: dict[str, tuple[tuple[str, int, str], ...]] = {
    "0.5.6": (
        ("entrypoints/http_server.py", 1433, "timeout_keep_alive=5"),
        ("entrypoints/http_server.py", 136, 'HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))'),
        ("entrypoints/http_server.py", 432, 'sampling_params = {"max_new_tokens": 1, "temperature": 0.0}'),
        ("entrypoints/http_server.py", 464, "while time.time() < tic + HEALTH_CHECK_TIMEOUT:"),
        ("entrypoints/http_server.py", 465, "await asyncio.sleep(1)"),
        ("entrypoints/http_server.py", 484, "return Response(status_code=503)"),
        ("entrypoints/http_server.py", 423, "if _global_state.tokenizer_manager.server_status == ServerStatus.Starting:"),
        ("entrypoints/http_server.py", 522, '@app.get("/weight_version")'),
        ("environ.py", 335, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)"),
        ("managers/scheduler_output_processor_mixin.py", 36, "DEFAULT_FORCE_STREAM_INTERVAL = 50"),
        ("managers/scheduler_output_processor_mixin.py", 825, "len(req.output_ids) % DEFAULT_FORCE_STREAM_INTERVAL == 0"),
        ("managers/tokenizer_manager.py", 2042, 'abort_message = recv_obj.abort_message or "Abort in waiting queue"'),
        ("managers/tokenizer_manager.py", 2061, "output_ids = state.output_ids"),
        ("managers/tokenizer_manager.py", 1267, 'if obj.mode != "abort":'),
        ("managers/tokenizer_manager.py", 1277, "await asyncio.sleep(1.0)"),
        ("managers/tokenizer_manager.py", 1254, "if not abort_all and rid not in self.rid_to_state:"),
        ("managers/tokenizer_manager.py", 1050, "await asyncio.wait_for(state.event.wait(), timeout=4)"),
        ("managers/tokenizer_manager.py", 1058, "self.abort_request(obj.rid)"),
        ("managers/tokenizer_manager.py", 471, "await self.is_pause_cond.wait_for(lambda: not self.is_pause)"),
        ("managers/tokenizer_manager.py", 1302, "if self.is_pause:"),
        ("managers/tokenizer_manager.py", 1303, "return await self._wait_for_model_update_from_disk(obj)"),
        ("managers/tokenizer_manager.py", 2495, "kill_process_tree(os.getpid())"),
        ("managers/scheduler.py", 2348, "if recv_req.abort_all or req.rid.startswith(recv_req.rid):"),
        ("managers/scheduler.py", 2418, "recv_req.abort_all or req.rid.startswith(recv_req.rid)"),
        ("managers/scheduler.py", 2207, "self.running_batch.is_empty()"),
        ("managers/scheduler.py", 2227, "if self._is_no_request():"),
        ("managers/scheduler.py", 2697, 'logger.error(f"Scheduler hit an exception: {traceback}")'),
        ("managers/scheduler.py", 2698, "parent_process.send_signal(signal.SIGQUIT)"),
        ("managers/scheduler.py", 971, "self.process_input_requests(recv_reqs)"),
        ("managers/scheduler.py", 973, "if self._engine_paused:"),
        ("managers/scheduler.py", 2665, '"max_total_num_tokens": scheduler.max_total_num_tokens,'),
        ("managers/scheduler_update_weights_mixin.py", 52,
         'assert flush_cache_success, "Cache flush failed after updating weights"'),
        ("managers/tokenizer_communicator_mixin.py", 420, "if self.is_pause:"),
        ("managers/tokenizer_communicator_mixin.py", 424, "return result.success, result.message"),
        ("managers/tokenizer_communicator_mixin.py", 428, "async with self.model_update_lock.writer_lock:"),
        ("sampling/sampling_batch_info.py", 93, "dtype=torch.int32,"),
        ("sampling/sampling_params.py", 61, "sampling_seed: int = 42,"),
        ("model_executor/model_runner.py", 1113, "rank = rank_offset + self.tp_rank"),
        # LoRA: the routes, the checks of a load (enabled, a new name, a rank and targets the adapter memory
        # pool holds), of an unload (a loaded name; it waits for the requests using it) and of /generate's
        # lora_path.
        ("entrypoints/http_server.py", 983, '@app.api_route("/load_lora_adapter", methods=["POST"])'),
        ("entrypoints/http_server.py", 1000, '@app.api_route("/unload_lora_adapter", methods=["POST"])'),
        ("managers/tokenizer_communicator_mixin.py", 553, "if not self.server_args.enable_lora:"),
        ("managers/tokenizer_communicator_mixin.py", 555, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."),
        ("managers/tokenizer_communicator_mixin.py", 540, "await self.lora_registry.wait_for_unload(lora_id)"),
        ("lora/lora_manager.py", 161, "because it is already loaded"),
        ("lora/mem_pool.py", 101, "if config.r > self.max_lora_rank:"),
        ("lora/mem_pool.py", 104, "return target_module_names.issubset(self.target_modules)"),
        ("lora/utils.py", 93, '"q_proj": "qkv_proj",'),
        ("lora/lora_registry.py", 109, "does not exist. Loaded LoRAs:"),
        ("managers/tokenizer_manager.py", 474, "if self.server_args.enable_lora and obj.lora_path:"),
        ("managers/tokenizer_manager.py", 499, "Got LoRA adapter that has never been loaded:"),
        # Weight names and shapes (WeightRules): the experts' names, an expert not on this EP rank skipped, a
        # name that is no parameter skipped, a shape that is not the parameter's refused; an unaligned flattened
        # bucket fails where its bytes are viewed as the tensor's dtype.
        ("models/qwen3_moe.py", 859, "num_experts=self.config.num_experts,"),
        ("layers/moe/fused_moe_triton/layer.py", 935, 'f"experts.{expert_id}.{weight_name}.",'),
        ("models/qwen3_moe.py", 917, "# Expert weight not on this rank, will be skipped below"),
        ("layers/moe/fused_moe_triton/layer.py", 498,
         "def _map_global_expert_id_to_local_expert_id(self, expert_id: int) -> int:"),
        ("layers/moe/fused_moe_triton/layer.py", 503, "start_idx = self.moe_ep_rank * num_local_routed_experts"),
        ("layers/moe/fused_moe_triton/layer.py", 543, "if expert_id == -1:"),
        ("layers/moe/fused_moe_triton/layer.py", 182,
         "assert (num_experts - num_fused_shared_experts) % self.moe_ep_size == 0"),
        ("models/qwen3_moe.py", 938, "if name not in params_dict:"),
        ("models/qwen3.py", 533, 'if self.config.tie_word_embeddings and "lm_head.weight" in name:'),
        ("models/qwen3.py", 572, 'logger.warning(f"Parameter {name} not found in params_dict")'),
        ("model_loader/weight_utils.py", 845, "assert param.size() == loaded_weight.size(), ("),
        ("distributed/parallel_state.py", 1653, "ranks = list(range(st, en, moe_tp_size))"),
        ("weight_sync/tensor_bucket.py", 101, ".view(meta.dtype)"),
    ),
    "0.5.23": (
        ("entrypoints/http_server.py", 3059, '"timeout_keep_alive": envs.SGLANG_TIMEOUT_KEEP_ALIVE.get(),'),
        ("environ.py", 337, "SGLANG_TIMEOUT_KEEP_ALIVE = EnvInt(5)"),
        ("entrypoints/http_server.py", 218, 'HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))'),
        ("entrypoints/http_server.py", 751, 'sampling_params = {"max_new_tokens": 1, "temperature": 0.0}'),
        ("entrypoints/http_server.py", 779, "while time.time() < tic + HEALTH_CHECK_TIMEOUT:"),
        ("entrypoints/http_server.py", 780, "await asyncio.sleep(1)"),
        ("entrypoints/http_server.py", 799, "return Response(status_code=503)"),
        ("entrypoints/http_server.py", 735, "if _global_state.tokenizer_manager.server_status == ServerStatus.Starting:"),
        ("entrypoints/http_server.py", 824, '"weight_version": _global_state.tokenizer_manager.config_value('),
        ("environ.py", 344, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)"),
        ("environ.py", 688, "SGLANG_FORCE_STREAM_INTERVAL = EnvInt(50)"),
        ("managers/scheduler_components/output_streamer.py", 49,
         "DEFAULT_FORCE_STREAM_INTERVAL = envs.SGLANG_FORCE_STREAM_INTERVAL.get()"),
        ("managers/scheduler_components/output_streamer.py", 476,
         "len(req.output_ids) % self.default_force_stream_interval == 0"),
        ("managers/tokenizer_manager.py", 3596, 'abort_message = recv_obj.abort_message or "Abort in waiting queue"'),
        ("managers/tokenizer_manager.py", 3606, '"weight_version": self.config_value("weight_version"),'),
        ("managers/tokenizer_manager.py", 3627, "output_ids = state.output_ids"),
        ("managers/tokenizer_manager.py", 2270, 'if obj.mode != "abort":'),
        ("managers/tokenizer_manager.py", 2280, "await asyncio.sleep(1.0)"),
        ("managers/tokenizer_manager.py", 2252, "elif get_serving().tokenizer_worker_num == 1:"),
        ("environ.py", 1679, "SGLANG_REQUEST_STATE_WAIT_TIMEOUT = EnvInt(4)"),
        ("managers/tokenizer_manager.py", 1961, "state.event.wait(), timeout=_REQUEST_STATE_WAIT_TIMEOUT"),
        ("managers/tokenizer_manager.py", 1970, "self.abort_request(obj.rid)"),
        ("managers/tokenizer_manager.py", 939, "await self.is_pause_cond.wait_for(lambda: not self.is_pause)"),
        ("managers/tokenizer_manager.py", 2319, "self._update_weight_version_if_provided(obj.weight_version)"),
        ("managers/tokenizer_manager.py", 4081, "kill_process_tree(os.getpid())"),
        ("managers/scheduler.py", 5688, "if recv_req.abort_all or req.rid.startswith(recv_req.rid):"),
        ("managers/scheduler.py", 5800, "recv_req.abort_all or req.rid.startswith(recv_req.rid)"),
        ("managers/scheduler.py", 5520, "if self.is_fully_idle(ignore_waiting=self._engine_paused):"),
        ("managers/scheduler.py", 6372, 'logger.error(f"Scheduler hit an exception: {traceback}")'),
        ("managers/scheduler.py", 6373, "parent_process.send_signal(signal.SIGQUIT)"),
        ("managers/scheduler.py", 2033, "self.ingest_requests()"),
        ("managers/scheduler.py", 2034, "if self._engine_paused:"),
        ("managers/scheduler.py", 1945, '"max_total_num_tokens": self.max_total_num_tokens,'),
        ("managers/scheduler_components/weight_updater.py", 125, "if recv_req.flush_cache and not self.flush_cache("),
        ("managers/scheduler_components/weight_updater.py", 129,
         '"Weights were updated, but the cache was not flushed because "'),
        ("managers/scheduler_components/weight_updater.py", 195,
         'message="update_weights_from_distributed must run between "'),
        ("managers/scheduler_components/weight_updater.py", 314, 'message="a weight-update session is already open; "'),
        ("managers/scheduler_components/weight_updater.py", 328,
         'message="no weight-update session is open; call begin_weight_update() first",'),
        ("managers/tokenizer_control_mixin.py", 523, "async with self.model_update_lock.writer_lock:"),
        ("managers/tokenizer_control_mixin.py", 530, "self._update_weight_version_if_provided(obj.weight_version)"),
        ("entrypoints/http_server.py", 1458, '@app.post("/begin_weight_update")'),
        ("entrypoints/http_server.py", 1473, '@app.post("/end_weight_update")'),
        ("sampling/sampling_batch_info.py", 163, "else 42"),
        ("sampling/sampling_batch_info.py", 167, "dtype=torch.int64,"),
        ("sampling/sampling_params.py", 308, "if not -(2**63) <= self.sampling_seed <= 2**63 - 1:"),
        ("model_executor/model_runner_components/weight_updater.py", 124, "rank = rank_offset + self.tp_rank"),
        ("entrypoints/http_server.py", 1652, '@app.api_route("/load_lora_adapter", methods=["POST"])'),
        ("entrypoints/http_server.py", 1676, '@app.api_route("/unload_lora_adapter", methods=["POST"])'),
        ("managers/tokenizer_control_mixin.py", 667, "if not get_lora().enable_lora:"),
        ("managers/tokenizer_control_mixin.py", 669, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."),
        ("managers/tokenizer_control_mixin.py", 651, "await self.lora_registry.wait_for_unload(lora_id)"),
        ("lora/lora_manager.py", 358, "because it is already loaded"),
        ("lora/mem_pool.py", 247, "if config.r > self.max_lora_rank:"),
        ("lora/mem_pool.py", 254, "return target_module_names.issubset(self.target_modules)"),
        ("lora/utils.py", 299, '"q_proj": "qkv_proj",'),
        ("lora/lora_registry.py", 120, "does not exist. Loaded LoRAs:"),
        ("arg_groups/lora_hook.py", 153, "When no initial --lora-paths is provided"),
        ("managers/tokenizer_manager.py", 3729, "if not self.enable_lora:"),
        ("managers/tokenizer_manager.py", 3737, "was requested, but LoRA is not enabled. "),
        ("managers/tokenizer_manager.py", 3769, "Got LoRA adapter that has never been loaded:"),
        ("models/qwen3_moe.py", 1173, "num_experts=self.config.num_experts,"),
        ("layers/moe/fused_moe_triton/layer.py", 1812, 'f"experts.{expert_id}.{weight_name}.",'),
        ("models/qwen3_moe.py", 1245, "# Expert weight not on this rank, will be skipped below"),
        ("layers/moe/fused_moe_triton/layer.py", 1153,
         "def _map_global_expert_id_to_local_expert_id(self, expert_id: int) -> int:"),
        ("layers/moe/fused_moe_triton/layer.py", 1154, "start_idx = self._expert_storage_rank * self._num_local_routed"),
        ("layers/moe/fused_moe_triton/layer.py", 1194, "if expert_id == -1:"),
        ("layers/moe/fused_moe_triton/layer.py", 414, "assert self._num_global_routed % storage_ep_size == 0"),
        ("distributed/parallel_state.py", 2907, "ranks = list(range(st, en, moe_tp_size))"),
        ("models/qwen3_moe.py", 1266, "if name not in params_dict:"),
        ("models/qwen3.py", 760, 'logger.warning(f"Parameter {name} not found in params_dict")'),
        ("model_loader/weight_utils.py", 1582, "assert param.size() == loaded_weight.size(), ("),
        ("weight_sync/tensor_bucket.py", 98, "if offset % dtype.itemsize:"),
        ("weight_sync/tensor_bucket.py", 100, 'f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}"'),
        ("managers/scheduler_components/weight_updater.py", 210, 'success, message = False, f"Failed to receive weights: {e}"'),
        # Routing replay: the flag and the request field; no capturer without the flag, and then no
        # meta_info.routed_experts (the request's ask is ignored); the capture, int32 [tokens, num_hidden_layers,
        # num_experts_per_tok] with a dense layer's column left zero, column = the layer's index; the rows returned,
        # [start, seqlen - 1); base64 of the bytes into meta_info.
        ("arg_groups/fields/exec_.py", 158, "enable_return_routed_experts: A["),
        ("managers/io_struct.py", 264, "return_routed_experts: bool = False"),
        ("state_capturer/routed_experts.py", 50, "if not get_exec().features.enable_return_routed_experts:"),
        ("managers/scheduler_components/batch_result_processor.py", 152, "if capturer is None:"),
        ("state_capturer/routed_experts.py", 72, "topk_size = model_config.hf_text_config.num_experts_per_tok"),
        ("state_capturer/routed_experts.py", 73, "num_layers = model_config.hf_text_config.num_hidden_layers"),
        ("state_capturer/base.py", 70, "dtype=torch.int32,"),
        ("state_capturer/base.py", 75, "self.buffer.zero_()"),
        ("layers/moe/topk.py", 2543, "layer_id=layer_id,"),
        ("state_capturer/base.py", 184, "req_to_token_pool.req_to_token[req_pool_idx][start_len : seqlen - 1]"),
        ("managers/detokenizer_manager.py", 443, 'pybase64.b64encode(item.numpy().tobytes()).decode("utf-8")'),
        ("managers/tokenizer_manager.py", 2609, 'meta_info["routed_experts"] = val'),
    ),
}

# lora/utils.py:298-304 (0.5.6: :92-98): the names SGLang's adapter memory pool stacks (a target is checked
# in this form).
_LORA_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                 "up_proj": "gate_up_proj"}


def lora_module_kinds(targets: Sequence[str]) -> set[str]:
    return {_LORA_STACKED.get(t.split(".")[-1], t.split(".")[-1]) for t in targets}


class StandinLora:
    """The LoRA side of a stand-in launched with --enable-lora: the adapters loaded by name and the one merged
    into the engine's weights now (the stand-in runs one adapter at a time; SGLang batches several)."""

    def __init__(self, max_rank: int, targets: Sequence[str]) -> None:
        self.max_rank, self.kinds = max_rank, lora_module_kinds(targets)
        self.loaded: dict[str, tuple[str, Any, dict[str, torch.Tensor]]] = {}   # name -> (path, spec, tensors)
        self.active: str | None = None      # merged into the engine now (None: the base)
        self.running: collections.Counter[str | None] = collections.Counter()
        self.base: dict[str, torch.Tensor] = {}   # the base weights of every layer an adapter may target
        self.changed = asyncio.Condition()
        self.switch = asyncio.Lock()

# model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight: the Hugging Face names FusedMoE's
# make_expert_params_mapping matches (layers/moe/fused_moe_triton/layer.py:1797-1822; 0.5.6: :920-945).
_EXPERT_NAME = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.(?:gate|up|down)_proj\.weight$")


class WeightRules:
    """Which tensor-parallel ranks of a server launched with ``--tp-size`` and ``--ep-size`` load each Hugging
    Face-named tensor of an update, as SGLang's Qwen2 / Qwen3 / Qwen3-MoE ``load_weights`` do (paths under
    python/sglang/srt/, 0.5.23's lines; ``CITATIONS`` has 0.5.6's too). The server is sent full tensors and
    shards them itself, so a tensor's shape is the config's whole shape on every rank.

    - an expert's three matrices are loaded by the ranks of the expert-parallel rank that holds it: experts
      are split in contiguous ranges of num_experts / ep_size (layers/moe/fused_moe_triton/layer.py:1153-1161),
      EP rank = (tp_rank // (tp_size / ep_size)) % ep_size (distributed/parallel_state.py:2898-2907); the
      other ranks skip it (``if expert_id == -1: return``, :1194-1195; models/qwen3_moe.py:1244-1246);
    - every other parameter is loaded by every rank; a tied ``lm_head.weight`` (no parameter of its own: 0.5.23
      warns, models/qwen3.py:760; 0.5.6 skips it, :533-541) and ``rotary_emb.inv_freq`` are skipped by all;
    - a name that is no parameter of the model (an expert index >= num_experts, a layer it lacks) is refused.
      SGLang skips it, silently or with a warning (models/qwen3_moe.py:1266-1267, models/qwen3.py:760): the
      weight never arrives and nothing says so. The stand-in is stricter so that the client never relies on it;
    - a shape other than the parameter's is refused, in SGLang's words (model_loader/weight_utils.py:1582-1584).
    """

    def __init__(self, model: torch.nn.Module, tp_size: int = 1, ep_size: int = 1) -> None:
        config = model.config
        self.architecture = config.ARCHITECTURE
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.tied = bool(config.tie_word_embeddings)
        self.num_experts = int(getattr(config, "num_experts", 0)) if config.sparse_layers else 0
        if ep_size < 1 or tp_size % ep_size:
            raise ValueError(f"--ep-size {ep_size} must divide --tp-size {tp_size}")
        if self.num_experts % ep_size:   # layers/moe/fused_moe_triton/layer.py:414
            raise ValueError(f"--ep-size {ep_size} must divide the model's {self.num_experts} experts")
        self.tp_size, self.ep_size = tp_size, ep_size
        self.moe_tp_size = tp_size // ep_size
        self.local_experts = self.num_experts // ep_size

    def ep_rank(self, tp_rank: int) -> int:
        return (tp_rank // self.moe_tp_size) % self.ep_size

    def ranks(self, name: str, shape: Sequence[int]) -> list[int]:
        """The tensor-parallel ranks that load ``name``; ValueError for a tensor SGLang would not load."""
        if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight"):
            return []
        expected = self.shapes.get(name)
        expert = _EXPERT_NAME.match(name)
        if expected is None:
            what = (f"expert {expert.group(1)} of a model with {self.num_experts} experts per sparse layer"
                    if expert and self.num_experts else f"no parameter of {self.architecture}")
            raise ValueError(f"{name!r} is {what}: SGLang would skip it and never load it")
        if tuple(shape) != expected:
            raise ValueError(f"Attempted to load weight ({torch.Size(shape)}) into parameter "
                             f"({torch.Size(expected)}): {name!r}")
        if expert is None:
            return list(range(self.tp_size))
        holder = int(expert.group(1)) // self.local_experts
        return [r for r in range(self.tp_size) if self.ep_rank(r) == holder]


# Fields of SGLang's request classes that the stand-in implements, per route.
_IMPLEMENTED: dict[str, set[str]] = {
    "/generate": {"rid", "input_ids", "sampling_params", "return_logprob", "stream", "log_metrics", "lora_path"},
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
    "/begin_weight_update": set(),
    "/end_weight_update": set(),
    "/load_lora_adapter": {"lora_name", "lora_path"},
    "/unload_lora_adapter": {"lora_name"},
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


class _Crashed(Exception):
    """The scheduler hit an exception: SGLang then takes the whole server down (nothing is answered)."""


class _Disconnected(Exception):
    """The client went away; SGLang aborts the request and answers nothing."""


class _FlushRefused(Exception):
    """0.5.23: an update's cache flush found a request in the running batch; the update answers HTTP 400 with
    this message, its weights changed (managers/scheduler_components/weight_updater.py:120-133)."""


def _as_int_version(text: Any, current: int) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        return current


def _env_bool(name: str, default: bool) -> bool:
    """An environment switch read as SGLang's EnvBool reads it (environ.py:143-148; 0.5.6: :98-105)."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.lower() in ("true", "1", "yes", "y")


# What the HTTP handler is serving (for the disconnect check): aiohttp's request of the current task.
_HTTP_REQUEST: contextvars.ContextVar[Any] = contextvars.ContextVar("standin_http_request", default=None)


class _ReqState:
    """A /generate past the pause gate: what SGLang's tokenizer manager keeps in rid_to_state."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.engine_rid: str | None = None    # the embedded engine's request while it runs there
        self.abort_requested = False          # an abort reached it in the running batch
        self.retracting = False               # a retract-mode pause took it out of the running batch
        self.queued = False                   # back in the waiting queue (retracted), until continue
        self.queue_aborted = asyncio.Event()  # aborted while in the waiting queue


def _tp_worker_main(conn: Any, tp_rank: int) -> None:
    """One extra tensor-parallel rank of a stand-in launched with --tp-size > 1: its own process, as each of
    SGLang's TP workers is, joining the weights group as rank_offset + tp_rank (model_executor/model_runner_components/
    weight_updater.py:124; 0.5.6: model_runner.py:1113) and receiving every bucket the trainer broadcasts
    (weight_updater.py:260-310; 0.5.6: model_runner.py:1147-1204)."""
    from actors.runtime.run import die_with_parent

    die_with_parent()
    groups: dict[str, Any] = {}
    while True:
        try:
            command, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if command == "join":
                address, port, rank_offset, world_size, name, backend = args
                groups[name] = join_weight_group(address, port, rank_offset + tp_rank, world_size, name, backend)
            elif command == "receive":
                name, specs, flattened = args
                receive_bucket(groups[name], [TensorMeta(n, d, s) for n, d, s in specs], flattened)
            elif command == "destroy":
                pg = groups.pop(args[0], None)
                if pg is not None:
                    drop_weight_group(pg)
            conn.send(("ok", None))
        except Exception as exc:  # reported to rank 0, which answers the route
            conn.send(("error", f"tp rank {tp_rank}: {type(exc).__name__}: {exc}"))


class TPWorkers:
    """The ranks 1..tp_size-1 of a stand-in server, each a process of its own; rank 0 is the server itself."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._workers: list[tuple[Any, Any, asyncio.Lock]] = []

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        for tp_rank in range(1, self.tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_tp_worker_main, args=(child, tp_rank), daemon=True,
                               name=f"standin-tp{tp_rank}")
            proc.start()
            child.close()
            self._workers.append((proc, parent, asyncio.Lock()))

    async def run(self, command: str, *args: Any) -> list[str]:
        """Run ``command`` on every extra rank at once; the errors they report (empty: all succeeded)."""
        async def one(proc: Any, conn: Any, lock: asyncio.Lock) -> str | None:
            async with lock:
                if not proc.is_alive():
                    return f"tp rank process {proc.name} is dead"
                conn.send((command, args))
                status, message = await asyncio.to_thread(conn.recv)
                return message if status == "error" else None
        found = await asyncio.gather(*(one(*w) for w in self._workers))
        return [e for e in found if e]

    def stop(self) -> None:
        for proc, conn, _ in self._workers:
            conn.close()
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        self._workers = []


class StandinServer:
    """The aiohttp application; `engine` is the embedded engine it serves.

    ``tp_size`` ranks join every weights group (``tp_workers`` holds ranks 1..tp_size-1); ``on_crash(reason)``
    is what a scheduler exception does to the server (the process exits; in a thread the server stops);
    ``step_time_s`` makes every decode step take at least that long (a GPU's step time, scaled for tests)."""

    def __init__(self, engine: TorchGenerationEngine, model_path: str, weight_version: str = "0",
                 device: str = "cpu", weights_hash_route: bool = True, tp_size: int = 1,
                 tp_workers: TPWorkers | None = None, on_crash: Callable[[str], None] | None = None,
                 max_total_tokens: int | None = None, step_time_s: float = 0.0, log_path: str | None = None,
                 starting_until: str | None = None, fail_load_at: Sequence[int] = (),
                 lora: StandinLora | None = None, release: str = SGLANG_VERSION, ep_size: int = 1,
                 return_routed_experts: bool = False) -> None:
        if release not in RELEASES:
            raise ValueError(f"release {release!r}: the stand-in serves as SGLang {' or '.join(RELEASES)}")
        self.release = RELEASES[release]
        if return_routed_experts and not self.release.routed_experts:
            raise ValueError(f"SGLang {release} has no --enable-return-routed-experts")
        # --enable-return-routed-experts: answers that ask carry the routing (the engine must record it).
        self.return_routed_experts = return_routed_experts
        self.weight_session = False   # 0.5.23: between /begin_weight_update and /end_weight_update
        self.engine = engine
        self.lora = lora
        # Fault injection (tests): these /update_weights_from_distributed calls, numbered from 1 over the
        # server's life, receive their bucket and then fail to load it.
        self.fail_load_at = set(fail_load_at)
        self.weights_hash_route = weights_hash_route
        self.model_path = model_path
        self.weight_version = weight_version
        self.device = device
        self.tp_size = tp_size
        self.tp_workers = tp_workers
        if tp_size > 1 and (tp_workers is None or tp_workers.tp_size != tp_size):
            raise ValueError(f"tp_size {tp_size}: the server needs TPWorkers for ranks 1..{tp_size - 1}")
        # SGLang's loading rules, where the engine serves a model (tools.rehearse serves a cost model); what
        # each rank loaded, by name, over the server's life (tests read it: each expert on its EP rank once).
        model = getattr(engine, "model", None)
        self.weight_rules = WeightRules(model, tp_size, ep_size) if isinstance(model, torch.nn.Module) else None
        self.rank_loads: list[collections.Counter[str]] = [collections.Counter() for _ in range(tp_size)]
        self.on_crash = on_crash
        self.crashed: str | None = None
        # While this file is missing the server is still starting (loading weights, capturing CUDA graphs):
        # /health answers 503 as SGLang's does then (entrypoints/http_server.py:735-736; 0.5.6: :423-424). Tests decide when.
        self.starting_until = starting_until
        # The KV pool /server_info reports as max_total_num_tokens (SGLang sizes it from the memory left after
        # the weights; the stand-in from its row limit, or --max-total-tokens).
        self.max_total_tokens = max_total_tokens or engine.max_running * self._context_len()
        self.paused = False           # tokenizer manager's is_pause: new /generate calls wait
        self.in_place = False         # the embedded engine itself is paused (in_place / retract)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.running: dict[str, int] = {}   # rid -> open /generate handlers (the "reader lock")
        self.states: dict[str, _ReqState] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._writer = asyncio.Lock()
        self._writer_waiting = 0
        self._last_receive = 0.0     # the tokenizer manager's last_receive_tstamp (monotonic)
        self.groups: dict[str, Any] = {}
        self.counters = {"generate": 0, "aborted": 0, "updates": 0, "distributed_calls": 0}
        # Fault injection for the client's tests: the next requests to a route lose their connection,
        # "before" the handler sees them or "after" it started them (what a reset connection does).
        self.drop_next: dict[str, list[str]] = {}
        # (monotonic time, event, name) for tests: "start"/"end" of every engine run a /generate makes (the
        # rid), "receive_start"/"receive_end" of every bucket received (the group), "call" of every POST
        # route (the route and the client's port: which connection it came on), "abort" of every /abort_request
        # (its rid). Also appended to `log_path` as JSON lines when given (a launched server's log outlives it).
        self.request_log: list[tuple[float, str, str]] = []
        self._log_file = open(log_path, "a", buffering=1) if log_path else None
        # When each decode step ended (monotonic), for tests; every step takes step_time_s at least.
        self.step_times: collections.deque[float] = collections.deque(maxlen=100_000)
        self._step_time_s, self._last_step = step_time_s, time.monotonic()
        engine.on_step = self._on_step

    def _context_len(self) -> int:
        # An engine without a model (a cost model standing in for one) states its context length itself.
        own = getattr(self.engine, "context_len", None)
        return int(own) if own is not None else int(self.engine.model.config.max_position_embeddings)

    def _log(self, entry: tuple[str, str]) -> None:
        record = (time.monotonic(), *entry)
        self.request_log.append(record)
        if self._log_file is not None:
            self._log_file.write(json.dumps(record) + "\n")

    def _on_step(self, _step: int) -> None:
        """In the decode thread, after each step (tests that hold decoding put their own hook here)."""
        left = self._step_time_s - (time.monotonic() - self._last_step)
        if left > 0:
            time.sleep(left)      # the step's own time on a GPU, scaled: the decode thread is that GPU
        self._last_step = time.monotonic()
        self.step_times.append(self._last_step)

    # --- app ----------------------------------------------------------------------------------------
    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=1 << 30)
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self.health)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/server_info", self.server_info)
        if self.release.weight_version_route:
            app.router.add_get("/weight_version", self.get_weight_version)
        if self.weights_hash_route:
            app.router.add_get("/standin/weights_hash", self.weights_hash)
            app.router.add_get("/standin/log", self.test_log)
        routes = {"/generate": self.generate, "/abort_request": self.abort_request,
                  "/pause_generation": self.pause_generation, "/continue_generation": self.continue_generation,
                  "/update_weights_from_disk": self.update_weights_from_disk,
                  "/init_weights_update_group": self.init_weights_update_group,
                  "/destroy_weights_update_group": self.destroy_weights_update_group,
                  "/update_weights_from_distributed": self.update_weights_from_distributed,
                  "/update_weight_version": self.update_weight_version,
                  "/load_lora_adapter": self.load_lora_adapter, "/unload_lora_adapter": self.unload_lora_adapter}
        if self.release.weight_sessions:
            routes.update({"/begin_weight_update": self.begin_weight_update,
                           "/end_weight_update": self.end_weight_update})
        for path, handler in routes.items():
            app.router.add_post(path, self._wrap(path, handler))
        return app

    def _wrap(self, path: str, handler: Any) -> Any:
        from aiohttp import web

        async def run(request: Any) -> Any:
            peer = request.transport.get_extra_info("peername") if request.transport is not None else None
            self._log(("call", f"{path} {peer[1] if peer else '?'}"))
            drops = self.drop_next.get(path)
            drop = drops.pop(0) if drops else None
            if drop == "before":   # the connection went before the request was read: nothing happens
                request.transport.close()
                return web.Response(status=500)
            try:
                body = await request.json() if request.can_read_body else {}
            except ValueError as exc:
                return web.json_response({"error": {"message": f"{path}: body is not JSON: {exc}"}}, status=400)
            if not isinstance(body, dict):
                return web.json_response({"error": {"message": f"{path}: body must be a JSON object"}}, status=400)
            implemented = _IMPLEMENTED[path] | (ROUTED_EXPERTS_FIELDS if path == "/generate" and
                                                self.release.routed_experts else set())
            unknown = sorted(set(body) - implemented)
            if unknown:
                return web.json_response({"error": {"message": f"{path}: field(s) {unknown} are not implemented "
                                                               f"by the stand-in server"}}, status=400)
            _HTTP_REQUEST.set(request)
            work = asyncio.ensure_future(handler(body))
            if drop == "after":    # the request runs on; its client is gone (SGLang notices within 4 s)
                await asyncio.sleep(0)
                request.transport.close()
            try:
                status, content = await work
            except (_Crashed, _Disconnected):
                status, content = 500, None
            except (_BadRequest, RequestError, EngineError, ValueError, TypeError, KeyError) as exc:
                status, content = 400, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
            if content is None or self.crashed:   # a dead server answers nothing
                if request.transport is not None:
                    request.transport.close()
                return web.Response(status=500)
            return web.json_response(content, status=status)
        return run

    def _crash(self, reason: str) -> None:
        """An exception in SGLang's scheduler: it logs it and SIGQUITs the server, which kills its process tree
        (managers/scheduler.py:6370-6373, the running_phase_sigquit_handler in managers/tokenizer_manager.py:
        4072-4081; 0.5.6: scheduler.py:2695-2698, tokenizer_manager.py:2490-2495). Nothing is answered."""
        log.error("Scheduler hit an exception: %s", reason)
        self.crashed = reason
        if self.on_crash is not None:
            self.on_crash(reason)
        raise _Crashed(reason)

    # --- info ---------------------------------------------------------------------------------------
    async def health(self, request: Any) -> Any:
        """SGLang's health_generate (entrypoints/http_server.py:721-799; 0.5.6: :409-484): one token is generated (after
        the pause gate, in the queue behind the running batch), and once a second the route checks whether
        anything came back since it started; 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s). So it takes at
        least a second, and longer under load. SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false (environ.py:344; 0.5.6: :335)
        makes /health (not /health_generate) answer at once."""
        from aiohttp import web
        if self.starting_until is not None and not os.path.exists(self.starting_until):
            return web.Response(status=503)   # ServerStatus.Starting
        if request.path == "/health" and not _env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True):
            return web.Response(status=200)
        timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", HEALTH_CHECK_TIMEOUT_S))
        tic = time.monotonic()
        rid = f"HEALTH_CHECK_{time.time()}"
        probe = asyncio.ensure_future(self._health_token(rid))
        try:
            while time.monotonic() < tic + timeout:
                await asyncio.sleep(HEALTH_POLL_S)
                if self._last_receive > tic:
                    return web.Response(status=200)
            return web.Response(status=503)
        finally:
            probe.cancel()

    async def _health_token(self, rid: str) -> None:
        await self._pause_gate()
        request = GenerationRequest(rid, (0,), SamplingParams(temperature=0.0, max_new_tokens=1), 1)
        await self.engine.generate(request)   # cancelled with the route: the engine aborts it
        self._last_receive = time.monotonic()

    async def model_info(self, request: Any) -> Any:
        from aiohttp import web
        return web.json_response({"model_path": self.model_path, "is_generation": True,
                                  "weight_version": self.weight_version})

    async def server_info(self, request: Any) -> Any:
        """Like SGLang's (entrypoints/http_server.py:863-893; 0.5.6: :540-557): the server arguments, the scheduler's info
        (max_total_num_tokens: the KV pool in tokens, managers/scheduler.py:1938-1950; 0.5.6: :2662-2668) and internal states."""
        from aiohttp import web
        state = await self.engine.health()
        return web.json_response({"model_path": self.model_path, "tp_size": self.tp_size,
                                  "max_running_requests": self.engine.max_running,
                                  "max_total_num_tokens": self.max_total_tokens,
                                  "max_req_input_len": self._context_len() - 1,
                                  "version": self.release.version,
                                  "weight_version": self.weight_version, "paused": self.paused,
                                  "internal_states": [state], "counters": self.counters})

    async def get_weight_version(self, request: Any) -> Any:
        from aiohttp import web
        return web.json_response({"weight_version": self.weight_version})

    async def test_log(self, request: Any) -> Any:
        """Not an SGLang route: request_log, step_times and what each tensor-parallel rank loaded (name -> times),
        for tests of a stand-in in another process."""
        from aiohttp import web
        return web.json_response({"events": self.request_log, "steps": list(self.step_times),
                                  "rank_loads": [dict(c) for c in self.rank_loads]})

    async def weights_hash(self, request: Any) -> Any:
        from aiohttp import web
        from actors.engines.checkpoint import hf_state_dict
        from actors.weights import weights_hash
        digest = await asyncio.to_thread(lambda: weights_hash(hf_state_dict(self.engine.model).items()))
        return web.json_response({"weights_hash": digest, "weight_version": self.weight_version})

    # --- generation ---------------------------------------------------------------------------------
    async def _pause_gate(self) -> None:
        """Like SGLang: wait while paused (managers/tokenizer_manager.py:938-939; 0.5.6: :470-471), and while an update waits
        for the running requests to finish (the model-update lock's writer has priority)."""
        while self.paused or self._writer_waiting:
            await self._resumed.wait()
            if self._writer_waiting:
                async with self._writer:
                    pass

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
        check_sampling(sp, len(ids), self._context_len())
        max_new = int(sp.get("max_new_tokens", 128))
        seed = sp.get("sampling_seed")
        seed = 42 if seed is None else int(seed)   # 0.5.6: SamplingParams' default; 0.5.23: the batch's
        if self.release.seed_bits == 64 and not INT64_MIN <= seed <= INT64_MAX:   # (sampling_batch_info.py:163)
            raise _BadRequest(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
        rid = str(body.get("rid") or f"standin-{self.counters['generate']}")
        await self._pause_gate()
        adapter = await self._use_adapter(body.get("lora_path"))
        try:
            return await self._generate(body, ids, sp, max_new, seed, rid)
        finally:
            if self.lora is not None:
                async with self.lora.changed:
                    self.lora.running[adapter] -= 1
                    self.lora.changed.notify_all()

    async def _generate(self, body: dict[str, Any], ids: list[int], sp: dict[str, Any], max_new: int, seed: int,
                        rid: str) -> tuple[int, Any]:
        if self.release.seed_bits == 32 and not INT32_MIN <= seed <= INT32_MAX:   # as deterministic inference does
            self._crash(f"RuntimeError: value cannot be converted to type int32 without overflow "
                        f"(sampling_seed {seed} of request {rid!r}, sampling/sampling_batch_info.py:90-97)")
        self.counters["generate"] += 1
        self.running[rid] = self.running.get(rid, 0) + 1
        self._idle.clear()
        state = self.states[rid] = _ReqState(rid)
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        try:
            while True:
                sampling = SamplingParams(temperature=float(sp.get("temperature", 1.0)),
                                          top_p=float(sp.get("top_p", 1.0)), top_k=int(sp.get("top_k", -1)),
                                          max_new_tokens=max_new - len(out),
                                          stop_token_ids=tuple(sp.get("stop_token_ids") or ()), seed=seed)
                result = await self._run_engine(state, GenerationRequest(rid, tuple(ids + out), sampling, 1))
                out += result.output_ids
                logprobs += result.logprobs
                versions += result.versions
                if result.finish_reason == "abort" and state.retracting:
                    state.retracting, state.queued = False, True   # back in the waiting queue
                    if await self._requeued(state):
                        continue
                    return 200, self._queued_abort_answer(rid, out, logprobs, body)
                if result.finish_reason == "abort" and not result.output_ids:   # never left the queue
                    return 200, self._queued_abort_answer(rid, out, logprobs, body)
                break
            version = self.weight_version
        finally:
            self.states.pop(rid, None)
            self.running[rid] -= 1
            if not self.running[rid]:
                del self.running[rid]
            if not self.running:
                self._idle.set()
            self._last_receive = time.monotonic()
        reason = result.finish_reason
        if reason == "abort":
            self.counters["aborted"] += 1
            finish: dict[str, Any] = {"type": "abort", "message": "Abort", "status_code": None, "err_type": None}
        elif reason == "stop":
            finish = {"type": "stop", "matched": out[-1]}
        else:
            finish = {"type": "length", "length": len(out)}
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "weight_version": version,
                "completion_tokens": len(out), "cached_tokens": 0,
                # Not an SGLang field: the embedded engine's own version of every token, for tests.
                "standin_token_versions": list(versions)}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, out)]
        if body.get("return_routed_experts") and self.return_routed_experts and result.routed_experts is not None:
            meta["routed_experts"] = self._encode_routes(result.routed_experts)
        return 200, {"output_ids": list(out), "meta_info": meta}

    def _encode_routes(self, routes: torch.Tensor) -> str:
        """The embedded engine's routing of the last run, which fed the whole sequence (prompt, earlier runs'
        tokens and its own but the last: SGLang's rows [0, seqlen - 1)), as SGLang sends it: base64 of int32
        [rows, num_hidden_layers, top-k], a dense layer's column zero, a sparse one at its layer's index."""
        config = self.engine.model.config
        full = torch.zeros(routes.shape[0], config.num_hidden_layers, routes.shape[2], dtype=torch.int32)
        full[:, config.sparse_layers] = routes.to(torch.int32)
        return base64.b64encode(full.numpy().tobytes()).decode("ascii")

    def _queued_abort_answer(self, rid: str, out: list[int], logprobs: list[float],
                             body: dict[str, Any]) -> dict[str, Any]:
        """SGLang drops a request still in the waiting queue in Scheduler.abort_request
        (managers/scheduler.py:5675-5700; 0.5.6: :2344-2368) and answers through
        TokenizerManager._handle_abort_req (managers/tokenizer_manager.py:3577-3642; 0.5.6: :2036-2071):
        meta_info is only id, finish_reason, the logprob lists (when asked for) and completion_tokens, and in
        0.5.23 the weight_version the server has now, with no prompt_tokens; its tokens are what had reached
        the tokenizer manager: a retracted request's output up to its last multiple of FORCE_STREAM_INTERVAL
        (a non-streamed request's output is sent every 50 tokens)."""
        self.counters["aborted"] += 1
        streamed = len(out) // FORCE_STREAM_INTERVAL * FORCE_STREAM_INTERVAL
        meta: dict[str, Any] = {"id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}
        if self.release.queued_abort_labelled:
            meta["weight_version"] = self.weight_version
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs[:streamed], out[:streamed])]
        meta["completion_tokens"] = streamed
        return {"text": "", "output_ids": out[:streamed], "meta_info": meta}

    async def _run_engine(self, state: _ReqState, request: GenerationRequest) -> Any:
        """The request in the embedded engine; a client that disconnected has it aborted at the next 4 s
        check (managers/tokenizer_manager.py:1958-1973; 0.5.6: :1048-1062), and nothing is answered."""
        state.abort_requested, state.engine_rid = False, request.rid
        self._log(("start", request.rid))
        work = asyncio.ensure_future(self.engine.generate(request))
        await asyncio.sleep(0)   # the task's first step registers the request with the engine
        if state.abort_requested:   # an abort that came while it was on its way there
            await self.engine.abort(request.rid)
        try:
            while True:
                done, _ = await asyncio.wait({work}, timeout=DISCONNECT_CHECK_S)
                if done:
                    return work.result()[0]
                http = _HTTP_REQUEST.get()
                if http is not None and (http.transport is None or http.transport.is_closing()):
                    await self.engine.abort(request.rid)
                    await work
                    raise _Disconnected(request.rid)
        finally:
            state.engine_rid = None
            self._log(("end", request.rid))

    async def _requeued(self, state: _ReqState) -> bool:
        """A retracted request waits in the queue until generation continues (True) or it is aborted there."""
        resumed = asyncio.ensure_future(self._resumed.wait())
        aborted = asyncio.ensure_future(state.queue_aborted.wait())
        try:
            await asyncio.wait({resumed, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            resumed.cancel()
            aborted.cancel()
        state.queued = False
        return not state.queue_aborted.is_set()

    async def _abort(self, rid: str | None) -> None:
        """Scheduler.abort_request (managers/scheduler.py:5675-5815; 0.5.6: :2344-2424): every request whose rid starts with
        ``rid`` (all with None), in the waiting queue or the running batch."""
        for state in list(self.states.values()):
            if rid is not None and not state.rid.startswith(rid):
                continue
            if state.queued:
                state.queue_aborted.set()
            else:
                await self._stop_running(state)

    async def _stop_running(self, state: _ReqState) -> None:
        state.abort_requested = True
        if state.engine_rid is not None:
            await self.engine.abort(state.engine_rid)

    async def abort_request(self, body: dict[str, Any]) -> tuple[int, Any]:
        # TokenizerManager.abort_request (managers/tokenizer_manager.py:2241-2253; 0.5.6: :1253-1257) forwards only a rid it
        # knows; the scheduler then matches by prefix.
        self._log(("abort", "" if body.get("abort_all") else str(body.get("rid"))))
        if body.get("abort_all"):
            await self._abort(None)
        elif body.get("rid") and str(body["rid"]) in self.states:
            await self._abort(str(body["rid"]))
        return 200, {}

    async def pause_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        """TokenizerManager.pause_generation (managers/tokenizer_manager.py:2267-2280; 0.5.6:
        :1264-1277): abort mode aborts every
        request and checks once a second until none holds the model-update lock; in_place and retract are
        sent to the scheduler without waiting, which applies them after the step it is running."""
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise _BadRequest(f"mode: {mode!r} is not one of abort, in_place, retract")
        self.paused = True
        self._resumed.clear()
        if mode == "abort":
            for _ in range(600):   # bounded: 10 minutes of checks
                await self._abort(None)
                if not self.running:
                    break
                await asyncio.sleep(PAUSE_POLL_S)
            else:
                raise EngineError(f"pause_generation: {len(self.running)} requests still running after 600 checks")
        elif not self.in_place:
            self.in_place = True
            asyncio.ensure_future(self._scheduler_pause(retract=mode == "retract"))
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    async def _scheduler_pause(self, retract: bool) -> None:
        """Scheduler.pause_generation (managers/scheduler.py:5817-5932; 0.5.6: :2428-2445): retract moves the running batch back
        to the waiting queue, keeping each request's output; in_place keeps it where it is."""
        if retract:
            for state in list(self.states.values()):
                if not state.queued:
                    state.retracting = True
                    await self._stop_running(state)
        await self.engine.pause()

    async def continue_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        # managers/tokenizer_manager.py:2282-2286 (0.5.6: :1279-1283): sent to the scheduler, which resumes at its next loop.
        if self.in_place:
            self.in_place = False
            asyncio.ensure_future(self.engine.resume())
        self.paused = False
        self._resumed.set()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    # --- weights ------------------------------------------------------------------------------------
    async def _flush_cache(self) -> None:
        """Scheduler.flush_cache (managers/scheduler.py:5518-5547; 0.5.6: :2205-2255) refuses while a request
        is in the running batch. 0.5.6 asserts after every weight update that its flush succeeded
        (managers/scheduler_update_weights_mixin.py:50-52, :74-76): the assertion kills the scheduler. 0.5.23
        fails the update instead, its weights already changed
        (managers/scheduler_components/weight_updater.py:120-133)."""
        running = (await self.engine.health())["running"]   # admitted and not finished: the running batch
        if not running:
            return
        if self.release.flush_failure_kills:
            self._crash(f"AssertionError: Cache flush failed after updating weights ({running} request(s) in "
                        f"the running batch)")
        raise _FlushRefused("Weights were updated, but the cache was not flushed because requests are still "
                            "running or queued. Retract or finish them, then call /flush_cache.")

    async def _scheduler_turn(self) -> Any:
        """What SGLang's scheduler does while it handles a weight request: nothing else. Its loop
        (managers/scheduler.py:2026-2040; 0.5.6: :967-989) processes requests between batches, so no decode step runs while a
        bucket is received or loaded; outside a pause the request first takes the model-update lock's writer
        side, which waits until every running request has finished
        (managers/tokenizer_control_mixin.py:515-524, managers/tokenizer_manager.py:2300-2314; 0.5.6:
        tokenizer_communicator_mixin.py:418-430, tokenizer_manager.py:1300-1311)."""
        server = self

        class Turn:
            async def __aenter__(self) -> None:
                self.writer = not server.paused
                if self.writer:
                    server._writer_waiting += 1
                    await server._writer.acquire()
                    await server._idle.wait()
                self.stepping = not server.in_place
                if self.stepping:
                    await server.engine.pause()

            async def __aexit__(self, *exc: Any) -> None:
                if self.stepping:
                    await server.engine.resume()
                if self.writer:
                    server._writer.release()
                    server._writer_waiting -= 1
        return Turn()

    async def _apply(self, version_text: Any, buckets: Sequence[list[tuple[str, torch.Tensor]]],
                     abort_all: bool, flush_cache: bool) -> None:
        """Load buckets (inside a scheduler turn): at once when paused, else after the running requests
        finished; relabel weight_version on success, in 0.5.6 only outside a pause (its paused branch returns
        before it does: Release.relabels_when_paused). Every tensor is checked against SGLang's loading rules
        (:class:`WeightRules`) before any is loaded."""
        plan = [(name, self.weight_rules.ranks(name, tuple(t.shape))) for bucket in buckets for name, t in bucket] \
            if self.weight_rules is not None else []
        await self.engine.update_weights(_as_int_version(version_text, self.engine.version), list(buckets))
        for name, ranks in plan:
            for rank in ranks:
                self.rank_loads[rank][name] += 1
        if flush_cache:
            await self._flush_cache()
        if (not self.paused or self.release.relabels_when_paused) and version_text is not None:
            self.weight_version = str(version_text)
        self.counters["updates"] += 1

    async def update_weights_from_disk(self, body: dict[str, Any]) -> tuple[int, Any]:
        from actors.engines.checkpoint import CheckpointError, iter_checkpoint_tensors
        path = str(body["model_path"])
        if body.get("abort_all_requests"):
            await self._abort(None)
        try:
            named = await asyncio.to_thread(lambda: [(n, t) for n, t in iter_checkpoint_tensors(path)
                                                     if not n.endswith("rotary_emb.inv_freq")])
            if not named:
                raise CheckpointError(f"{path}: no safetensors weights found")
            async with await self._scheduler_turn():
                await self._apply(body.get("weight_version"), [named], False, bool(body.get("flush_cache", True)))
        except (CheckpointError, OSError, EngineError, ValueError) as exc:
            return 400, {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
        except _FlushRefused as exc:
            self.model_path = path
            return 400, {"success": False, "message": str(exc), "num_paused_requests": 0}
        self.model_path = path
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    async def init_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = str(body.get("group_name", "weight_update_group"))
        backend = str(body.get("backend", "nccl"))
        if backend == "nccl" and not torch.cuda.is_available():
            backend = "gloo"  # the stand-in runs on CPU; the rank layout and rendezvous are SGLang's
        address, port = str(body["master_address"]), int(body["master_port"])
        offset, world = int(body["rank_offset"]), int(body["world_size"])
        # Every tensor-parallel rank joins as rank_offset + tp_rank (model_runner_components/weight_updater.py:124;
        # 0.5.6: model_executor/model_runner.py:1113).
        own = asyncio.to_thread(join_weight_group, address, port, offset, world, name, backend)
        extra = (self.tp_workers.run("join", address, port, offset, world, name, backend)
                 if self.tp_workers is not None else asyncio.sleep(0, []))
        own, errors = await asyncio.gather(own, extra, return_exceptions=True)
        errors = [str(errors)] if isinstance(errors, BaseException) else list(errors)
        if isinstance(own, BaseException):
            errors.insert(0, str(own))
        if errors:
            if not isinstance(own, BaseException):
                drop_weight_group(own)
            if self.tp_workers is not None:
                await self.tp_workers.run("destroy", name)
            return 400, {"success": False, "message": f"Failed to initialize custom process group: "
                                                      f"{'; '.join(errors)}."}
        self.groups[name] = own
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    async def destroy_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = str(body.get("group_name", "weight_update_group"))
        pg = self.groups.pop(name, None)
        if pg is None:
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        drop_weight_group(pg)  # in the background: a broken group's teardown must not stall this server
        if self.tp_workers is not None:
            await self.tp_workers.run("destroy", name)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    async def _receive(self, pg: Any, name: str, specs: list[TensorMeta], flattened: bool) -> WeightBucket:
        """One bucket on every tensor-parallel rank at once (each receives the whole broadcast)."""
        parts = [asyncio.to_thread(receive_bucket, pg, specs, flattened, self.device)]
        if self.tp_workers is not None:
            parts.append(self.tp_workers.run("receive", name, [(s.name, s.dtype, list(s.shape)) for s in specs],
                                             flattened))
        self._log(("receive_start", name))
        try:
            bucket, *others = await asyncio.gather(*parts)
        finally:
            self._log(("receive_end", name))
        if others and others[0]:
            raise EngineError("; ".join(others[0]))
        return bucket

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
        if self.release.weight_sessions and not self.weight_session:   # weight_updater.py:192-197
            return 400, {"success": False, "message": "update_weights_from_distributed must run between "
                                                      "begin_weight_update() and end_weight_update()"}
        misaligned = flat_misaligned(specs) if flattened else None
        if misaligned is not None and self.release.unaligned_refused_before_receive:   # tensor_bucket.py:98-101
            meta, offset = misaligned
            return 400, {"success": False, "message": f"Failed to receive weights: Unaligned received tensor "
                                                      f"{meta.name}: byte offset {offset}, dtype torch.{meta.dtype}"}
        if body.get("abort_all_requests"):
            await self._abort(None)
        self.counters["distributed_calls"] += 1
        call = self.counters["distributed_calls"]
        try:
            async with await self._scheduler_turn():
                bucket = await self._receive(pg, name, specs, flattened)
                if call in self.fail_load_at:
                    raise RuntimeError(f"injected load failure of /update_weights_from_distributed call {call}")
                await self._apply(body.get("weight_version"), [bucket], False, bool(body.get("flush_cache", True)))
        except _FlushRefused as exc:
            return 400, {"success": False, "message": str(exc)}
        except Exception as exc:
            if isinstance(exc, _Crashed):
                raise
            # SGLang's words (model_executor/model_runner_components/weight_updater.py:324-341; 0.5.6:
            # model_runner.py:1147-1236): the buckets loaded before this one stay loaded; the route answers
            # HTTP 400 (entrypoints/http_server.py:1488-1505; 0.5.6: :862-876).
            return 400, {"success": False, "message": f"Failed to update parameter online: {exc}. The full weights "
                                                      f"of the ModelRunner are partially updated. Please discard "
                                                      f"the whole weights."}
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    async def begin_weight_update(self, body: dict[str, Any]) -> tuple[int, Any]:
        """0.5.23: open the session /update_weights_from_distributed runs in; one at a time
        (managers/scheduler_components/weight_updater.py:309-321; the route answers 400 on failure,
        entrypoints/http_server.py:1458-1470). Like the updates it waits for running requests outside a pause
        (managers/tokenizer_control_mixin.py:471-483)."""
        async with await self._scheduler_turn():
            if self.weight_session:
                return 400, {"success": False, "message": "a weight-update session is already open; call "
                                                          "end_weight_update() first"}
            self.weight_session = True
        return 200, {"success": True, "message": "Success"}

    async def end_weight_update(self, body: dict[str, Any]) -> tuple[int, Any]:
        """0.5.23: close the session (weight_updater.py:323-335)."""
        async with await self._scheduler_turn():
            if not self.weight_session:
                return 400, {"success": False, "message": "no weight-update session is open; call "
                                                          "begin_weight_update() first"}
            self.weight_session = False
        return 200, {"success": True, "message": "Success"}

    # --- LoRA ---------------------------------------------------------------------------------------
    def _lora_enabled(self) -> StandinLora:
        if self.lora is None:   # managers/tokenizer_control_mixin.py:667-670 (0.5.6: tokenizer_communicator_mixin.py:553-556)
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        return self.lora

    async def load_lora_adapter(self, body: dict[str, Any]) -> tuple[int, Any]:
        from actors.engines.checkpoint import CheckpointError
        from actors.engines.lora import read_adapter

        try:
            lora = self._lora_enabled()
            name, path = str(body["lora_name"]), str(body["lora_path"])
            if name in lora.loaded:   # lora/lora_manager.py:355-359 (0.5.6: :158-162)
                raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
            try:
                spec, tensors, _ = await asyncio.to_thread(read_adapter, path)
            except (CheckpointError, OSError) as exc:
                raise ValueError(f"Failed to load LoRA adapter {name}: {exc}") from None
            if spec.rank > lora.max_rank or not lora_module_kinds(spec.target_modules) <= lora.kinds:
                # lora/lora_manager.py:368-375 (mem_pool.py:247-254: rank and stacked target names; 0.5.6:
                # lora_manager.py:170-178, mem_pool.py:101-104)
                raise ValueError(f"LoRA adapter {name} with rank {spec.rank} is incompatible with the current LoRA "
                                 f"memory pool configuration. Please ensure that the LoRA adapter's rank is within "
                                 f"the configured `--max-lora-rank` and that the target modules are included in "
                                 f"`--lora-target-modules`.")
        except ValueError as exc:   # LoadLoRAAdapterReqOutput(success=False): HTTP 400 (http_server.py:983-997)
            return 400, {"success": False, "error_message": str(exc), "loaded_adapters": None}
        lora.loaded[name] = (path, spec, tensors)
        return 200, {"success": True, "error_message": None,
                     "loaded_adapters": {n: {"lora_name": n, "lora_path": p} for n, (p, _, _) in lora.loaded.items()}}

    async def unload_lora_adapter(self, body: dict[str, Any]) -> tuple[int, Any]:
        try:
            lora = self._lora_enabled()
            name = str(body["lora_name"])
            if name not in lora.loaded:   # lora/lora_registry.py:117-121 (0.5.6: :106-110)
                raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(lora.loaded)}")
        except ValueError as exc:
            return 400, {"success": False, "error_message": str(exc), "loaded_adapters": None}
        del lora.loaded[name]   # new requests naming it are refused from now on; running ones finish with it
        async with lora.changed:   # managers/tokenizer_control_mixin.py:651 (0.5.6: communicator_mixin.py:540)
            await lora.changed.wait_for(lambda: not lora.running[name])
        return 200, {"success": True, "error_message": None,
                     "loaded_adapters": {n: {"lora_name": n, "lora_path": p} for n, (p, _, _) in lora.loaded.items()}}

    async def _use_adapter(self, name: Any) -> str | None:
        """The adapter a /generate runs with (None: the base), merged into the engine if it is not already;
        counted as running until the request ends."""
        if self.lora is None:
            if name is not None and self.release.lora_path_needs_lora:   # tokenizer_manager.py:3729-3740
                raise _BadRequest(f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch "
                                  f"the server with --enable-lora flag and preload adapters using --lora-paths or "
                                  f"/load_lora_adapter endpoint.")
            if name is not None:   # 0.5.6 skips lora_path without --enable-lora (tokenizer_manager.py:474)
                raise _BadRequest("lora_path: this server was not launched with --enable-lora; SGLang 0.5.6 would "
                                  "silently answer from the base model, the stand-in refuses")
            return None
        lora = self.lora
        if name is not None and not isinstance(name, str):
            raise _BadRequest("lora_path: one adapter name per request is implemented by the stand-in server")
        if name is not None and name not in lora.loaded:   # managers/tokenizer_manager.py:3766-3771 (0.5.6: :497-501)
            raise _BadRequest(f"Got LoRA adapter that has never been loaded: {name}\n"
                              f"All loaded adapters: {list(lora.loaded)}.")
        async with lora.switch:
            if lora.active != name:
                busy = [n for n, count in lora.running.items() if count and n != name]
                if busy:
                    raise _BadRequest(f"lora_path {name!r}: the stand-in runs one adapter at a time and requests "
                                      f"with {busy} are running")
                await self._merge_adapter(name)
            async with lora.changed:
                lora.running[name] += 1
        return name

    async def _merge_adapter(self, name: str | None) -> None:
        """Merge adapter ``name`` into the engine's weights (None: back to the base), from a kept copy of the base."""
        from torch import nn

        from actors.engines.lora import merged_weights, module_of

        lora = self.lora
        assert lora is not None
        if not lora.base:
            lora.base = {n + ".weight": m.weight.detach().clone() for n, m in self.engine.model.named_modules()
                         if isinstance(m, nn.Linear) and lora_module_kinds([n]) & lora.kinds}
        merged: dict[str, torch.Tensor] = {}
        if name is not None:
            _, spec, tensors = lora.loaded[name]
            modules = {module_of(n) + ".weight" for n in tensors}
            merged = await asyncio.to_thread(merged_weights, {n: lora.base[n] for n in modules}, tensors,
                                             spec.scaling)
        named = [(n, merged.get(n, t)) for n, t in lora.base.items()]   # layers this adapter leaves: the base
        await self.engine.update_weights(self.engine.version, [named])
        lora.active = name

    async def update_weight_version(self, body: dict[str, Any]) -> tuple[int, Any]:
        new = str(body["new_version"])
        if body.get("abort_all_requests", True):
            await self._abort(None)
        self.weight_version = new
        # Label the embedded engine's tokens the same way (an empty update swaps nothing but the version).
        await self.engine.update_weights(_as_int_version(new, self.engine.version), [])
        return 200, {"success": True, "message": f"Weight version updated to {new}", "new_version": new}


# --------------------------------------------------------------------------------------------------------
# Running it: in a thread (tests) or as a process (python -m testsupport.sglang_standin)
# --------------------------------------------------------------------------------------------------------

def check_sampling(sp: dict[str, Any], input_tokens: int, context_len: int) -> None:
    """Refuses what both releases refuse with HTTP 400, in 0.5.6's words: ``SamplingParams.__init__`` (greedy
    temperature turns top_k into 1 first; 0.5.23: ``__post_init__``, sampling/sampling_params.py:245-250) and
    ``.verify`` (sampling/sampling_params.py:252-266, which in 0.5.23 also refuses a temperature that is not
    finite), then ``TokenizerManager._validate_one_request`` (context length; ``--allow-auto-truncate`` is off
    by default)."""
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
    """The stand-in server on its own event loop in a daemon thread (for in-process tests). A scheduler
    exception (``StandinServer._crash``) stops it, as it kills a real server; ``server.crashed`` says why.
    ``server_options``: further StandinServer arguments (step_time_s, max_total_tokens)."""

    def __init__(self, engine: TorchGenerationEngine, model_path: str = "<in-memory>", host: str = "127.0.0.1",
                 port: int = 0, weight_version: str = "0", weights_hash_route: bool = True,
                 **server_options: Any) -> None:
        self.engine, self.model_path, self.host, self.port = engine, model_path, host, port
        self.weights_hash_route = weights_hash_route
        self.weight_version = weight_version
        self.server_options = server_options
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
                                        weights_hash_route=self.weights_hash_route, on_crash=self._crashed,
                                        **self.server_options)
            self._runner = web.AppRunner(self.server.app(), keepalive_timeout=TIMEOUT_KEEP_ALIVE_S)
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
        if self.server.crashed:   # a killed server's port closes at once; every request dies with it, unanswered
            for site in list(self._runner.sites):
                await site.stop()
            await self.engine.stop()
        await self._runner.cleanup()
        await self.engine.stop()

    def _crashed(self, reason: str) -> None:
        if self._stop is not None:
            self._stop.set()

    def stop(self, timeout: float = 30.0) -> None:
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)


def launch_config(model_dir: str, log_dir: Path, *extra_args: str, health_timeout_s: float = 60.0,
                  release: str = SGLANG_VERSION, **kw: Any) -> LaunchConfig:
    """How tests launch the stand-in through the engine's own launch path (actors/engines/sglang_server.py),
    serving as SGLang ``release``."""
    return LaunchConfig(model_path=model_dir, command=[sys.executable, "-m", "testsupport.sglang_standin"],
                        log_path=str(Path(log_dir) / "server.log"), health_timeout_s=health_timeout_s,
                        backoff_s=0.2, env={"OMP_NUM_THREADS": "1"},
                        extra_args=["--standin-sglang-release", release, *extra_args], **kw)


def main(argv: list[str] | None = None, make_engine: Callable[[argparse.Namespace], Any] | None = None) -> int:
    """``make_engine(args)``: the engine to serve in place of the embedded one (tools/rehearse serves a cost
    model of a GPU's steps behind the same routes)."""
    ap = argparse.ArgumentParser(prog="python -m testsupport.sglang_standin",
                                 description="SGLang-compatible HTTP server over the embedded CPU engine")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", type=int, default=1,
                    help="tensor-parallel ranks: each joins the weights group (ranks 1.. are worker processes)")
    ap.add_argument("--ep-size", "--expert-parallel-size", type=int, default=1,
                    help="expert-parallel ranks among the tensor-parallel ones: each loads its range of experts")
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--mem-fraction-static", type=float, default=None, help="accepted for compatibility")
    ap.add_argument("--skip-tokenizer-init", action="store_true", help="accepted; answers carry token ids only")
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="the KV pool /server_info reports (default: max-running-requests x the context length)")
    ap.add_argument("--standin-drop-connection", action="append", default=[], metavar="ROUTE:WHEN",
                    help="not an SGLang flag (fault injection for tests): the next call of ROUTE loses its "
                         "connection, 'before' the server reads it or 'after' it started; repeatable")
    ap.add_argument("--standin-log-dir", default=None,
                    help="not an SGLang flag: append the request log (/standin/log's events) to "
                         "DIR/standin-<pid>.jsonl, for tests that read it after the server is gone")
    ap.add_argument("--standin-starting-until-dir", default=None, metavar="DIR",
                    help="not an SGLang flag: the server stays 'starting' (/health 503) until DIR/<random-seed> "
                         "exists, as a server loading weights does, for as long as a test wants; if "
                         "DIR/<random-seed>.fail exists at start, it exits 1 at once, as a server that cannot load "
                         "its model does")
    ap.add_argument("--standin-sglang-release", default=SGLANG_VERSION, choices=list(RELEASES),
                    help="not an SGLang flag: the SGLang release to serve as (default: the newest supported)")
    ap.add_argument("--standin-step-time-s", type=float, default=0.0,
                    help="not an SGLang flag: every decode step takes at least this long (a GPU's step time, "
                         "scaled for tests)")
    ap.add_argument("--enable-lora", action="store_true")
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="answers that ask for it carry each token's routed experts (SGLang 0.5.23 and later)")
    ap.add_argument("--max-lora-rank", type=int, default=None)
    ap.add_argument("--lora-target-modules", nargs="*", default=None)
    ap.add_argument("--lora-paths", nargs="*", default=[], metavar="NAME=PATH")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--no-weights-hash", action="store_true",
                    help="no GET /standin/weights_hash: serve as SGLang does, with no route reading weights back")
    ap.add_argument("--fail-load-at", default="", metavar="N[,M...]",
                    help="fault injection for tests: these /update_weights_from_distributed calls (numbered from 1) "
                         "receive their bucket, then fail to load it as SGLang answers a failed load")
    args = ap.parse_args(argv)
    if args.enable_return_routed_experts and not RELEASES[args.standin_sglang_release].routed_experts:
        ap.error("unrecognized arguments: --enable-return-routed-experts")   # as that release's parser answers
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.standin_starting_until_dir and (Path(args.standin_starting_until_dir) / f"{args.random_seed}.fail").exists():
        log.error("stand-in SGLang server (seed %d): told to fail at start", args.random_seed)
        return 1
    dtype = None if args.dtype in (None, "auto") else args.dtype
    version = _as_int_version(args.weight_version, 0)
    engine = make_engine(args) if make_engine is not None else TorchGenerationEngine(
        args.model_path, version=version, device=args.device, dtype=dtype, max_running=args.max_running_requests,
        seed=args.random_seed, record_routing=args.enable_return_routed_experts)
    from aiohttp import web

    def crash(reason: str) -> None:   # a scheduler exception takes the process tree down (no clean exit)
        logging.shutdown()
        os._exit(1)

    workers = TPWorkers(args.tp_size) if args.tp_size > 1 else None
    if workers is not None:
        workers.start()

    async def serve() -> None:
        await engine.start()
        lora = None
        if args.enable_lora:   # server_args.py:4200-4203: rank and targets, or adapters to infer them from
            if not (args.lora_paths or (args.max_lora_rank and args.lora_target_modules)):
                raise SystemExit("When no initial --lora-paths is provided, you need to specify both --max-lora-rank "
                                 "and --lora-target-modules for LoRA initialization.")
            lora = StandinLora(args.max_lora_rank or 0, args.lora_target_modules or [])
        try:
            server = StandinServer(engine, args.model_path, args.weight_version, device=args.device,
                                   weights_hash_route=not args.no_weights_hash, tp_size=args.tp_size,
                                   tp_workers=workers, on_crash=crash, max_total_tokens=args.max_total_tokens,
                                   step_time_s=args.standin_step_time_s,
                                   log_path=str(Path(args.standin_log_dir) / f"standin-{os.getpid()}.jsonl")
                                   if args.standin_log_dir else None,
                                   starting_until=str(Path(args.standin_starting_until_dir) / str(args.random_seed))
                                   if args.standin_starting_until_dir else None,
                                   fail_load_at=[int(n) for n in args.fail_load_at.split(",") if n.strip()], lora=lora,
                                   release=args.standin_sglang_release, ep_size=args.ep_size,
                                   return_routed_experts=args.enable_return_routed_experts)
        except ValueError as exc:   # --ep-size the model or --tp-size does not allow
            raise SystemExit(f"stand-in SGLang server: {exc}") from None
        for spec in args.lora_paths:   # loaded at launch as /load_lora_adapter loads them
            name, _, path = spec.partition("=")
            status, answer = await server.load_lora_adapter({"lora_name": name, "lora_path": path or name})
            if status != 200:
                raise SystemExit(f"--lora-paths {spec}: {answer['error_message']}")
        for drop in args.standin_drop_connection:
            route, _, when = drop.rpartition(":")
            server.drop_next.setdefault(route, []).append(when)
        runner = web.AppRunner(server.app(), keepalive_timeout=TIMEOUT_KEEP_ALIVE_S)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        log.info("stand-in SGLang server (API of %s) on http://%s:%d, model %s", args.standin_sglang_release,
                 args.host, args.port, args.model_path)
        await asyncio.Event().wait()  # serve until killed

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    finally:
        if workers is not None:
            workers.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
