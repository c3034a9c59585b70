"""The stand-in SGLang server is as strict as each supported SGLang release, 0.5.6 and 0.5.23 (each behaviour
cited in testsupport/sglang_standin.py and docs/engines-sglang.md), and the SGLang client copes with each:
idle keep-alive, /health that generates a token, queued aborts that carry tokens, cache flushes that kill a
server with a running batch (0.5.6) or fail the update (0.5.23), a weights group joined by every
tensor-parallel rank, pauses that answer before they apply, no decode step during a broadcast, int32 seeds
(0.5.6) and int64 ones (0.5.23), and connections reset under a call."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from typing import AsyncIterator

import pytest

from actors.engines.base import GenerationRequest, SamplingParams
from actors.engines.checkpoint import hf_state_dict, save_model
from actors.engines.sglang import LaunchConfig, SGLangEngine, sglang_rid
from actors.engines.sglang_group import WeightGroupSender
from actors.engines.sglang_routes import (CLIENT_KEEP_ALIVE_S, SEED_RANGE, SGLANG_VERSIONS, SGLangConnectionReset,
                                          SGLangError)
from actors.engines.torch_gen import TorchGenerationEngine
from actors.weights import weights_hash
from testsupport.bounded import run_bounded, until
from testsupport.sglang_standin import FORCE_STREAM_INTERVAL, TIMEOUT_KEEP_ALIVE_S, StandinThread, launch_config
from testsupport.tiny_models import greedy_reference, tiny_model
from transport.bulk import bucket_metas
from transport.ports import free_port

TIMEOUT = 90.0
run = functools.partial(run_bounded, timeout=TIMEOUT)
OLDEST, NEWEST = SGLANG_VERSIONS[0], SGLANG_VERSIONS[-1]
each_release = pytest.mark.parametrize("standin", SGLANG_VERSIONS, indirect=True)


def post(url: str, route: str, body: dict, timeout: float = TIMEOUT) -> tuple[int, dict]:
    req = urllib.request.Request(url + route, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def get_status(url: str, route: str, timeout: float = TIMEOUT) -> int:
    try:
        with urllib.request.urlopen(url + route, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def hold_at(engine: TorchGenerationEngine, step: int) -> tuple[threading.Event, threading.Event]:
    """Hold the decode thread after `step` until `release` is set (a step that takes long on a busy GPU);
    `reached` says it got there."""
    reached, release = threading.Event(), threading.Event()

    def hook(at: int) -> None:
        if at == step:
            reached.set()
            release.wait(60)
    engine.on_step = hook
    return reached, release


def test_idle_connections_close_after_sglangs_keep_alive_and_the_client_drops_them_sooner(standin):
    # uvicorn closes a connection idle for timeout_keep_alive=5 s (entrypoints/http_server.py:3059, environ.py:
    # 337; 0.5.6: http_server.py:1433); a client keeping it longer (aiohttp's default is 15 s) sends, now and
    # then, on a connection being closed.
    conn = http.client.HTTPConnection("127.0.0.1", standin.port, timeout=30)
    conn.request("GET", "/model_info")
    assert conn.getresponse().read()
    opened = time.monotonic()
    conn.sock.settimeout(TIMEOUT_KEEP_ALIVE_S + 10)
    assert conn.sock.recv(1) == b""   # the server closed it (a timeout here raises)
    assert time.monotonic() - opened >= TIMEOUT_KEEP_ALIVE_S - 0.5
    conn.close()

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            await engine.abort("nothing-to-abort")   # no request in flight: no HTTP call
            await engine._post("/abort_request", {"rid": "a", "abort_all": False})
            await asyncio.sleep(CLIENT_KEEP_ALIVE_S + 0.5)   # idle longer than the client keeps a connection
            await engine._post("/abort_request", {"rid": "b", "abort_all": False})
        finally:
            await engine.stop()

    run(main())
    calls = [name.split() for _, event, name in standin.server.request_log if event == "call"]
    assert CLIENT_KEEP_ALIVE_S < TIMEOUT_KEEP_ALIVE_S
    (route_a, port_a), (route_b, port_b) = calls[-2:]
    assert route_a == route_b == "/abort_request" and port_a != port_b   # the idle connection was dropped


def test_health_generates_a_token_and_a_busy_server_is_healthy_to_the_client(standin, monkeypatch):
    # /health queues a one-token request behind the running batch and checks once a second
    # (entrypoints/http_server.py:409-484): under a long step it answers after seconds, and 503 after
    # SGLANG_HEALTH_CHECK_TIMEOUT. The client waits for the server's own limit, not 2 or 5 s.
    standin.engine.max_running = 1
    reached, release = hold_at(standin.engine, 2)
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "8")

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            t0 = time.monotonic()
            idle = await engine.health()
            idle_s = time.monotonic() - t0
            busy = asyncio.ensure_future(engine.generate(GenerationRequest(
                "busy", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=20))))
            assert await asyncio.to_thread(reached.wait, 30)
            # A step that takes 6 s: longer than the old 5 s probe, shorter than the server's limit.
            threading.Timer(6.0, release.set).start()
            t1 = time.monotonic()
            held = await engine.health()
            held_s = time.monotonic() - t1
            await busy
            return idle, idle_s, held, held_s
        finally:
            release.set()
            await engine.stop()

    idle, idle_s, held, held_s = run(main())
    assert idle["ok"] and idle_s >= 1.0          # it generates a token and checks once a second
    assert held["ok"] and held_s >= 5.0


def test_health_answers_503_when_nothing_comes_back_in_time(standin, monkeypatch):
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "2")
    standin.engine.max_running = 1
    reached, release = hold_at(standin.engine, 2)
    done: list[int] = []
    worker = threading.Thread(target=lambda: done.append(post(standin.url, "/generate", {
        "input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 10}})[0]))
    worker.start()
    try:
        assert reached.wait(30)
        assert get_status(standin.url, "/health") == 503    # the engine is stuck: no token in 2 s
    finally:
        release.set()
        worker.join(60)
    assert done == [200] and get_status(standin.url, "/health") == 200


@each_release
def test_a_request_aborted_in_the_queue_answers_its_force_streamed_tokens(standin):
    # A request retracted to the waiting queue keeps its output; aborted there, it is answered through
    # TokenizerManager._handle_abort_req with what reached the tokenizer manager: its tokens up to the last
    # multiple of 50 (managers/scheduler_components/output_streamer.py:475-477; 0.5.6:
    # managers/scheduler_output_processor_mixin.py:822-826), and the server's weight_version in 0.5.23 only
    # (managers/tokenizer_manager.py:3606).
    reached, release = hold_at(standin.engine, 120)
    answers: list[dict] = []
    worker = threading.Thread(target=lambda: answers.append(post(standin.url, "/generate", {
        "rid": "r", "input_ids": [5, 6, 7], "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 200}})[1]))
    worker.start()
    try:
        assert reached.wait(60)
        assert post(standin.url, "/pause_generation", {"mode": "retract"})[0] == 200
        release.set()
        for _ in range(600):   # bounded: the retraction reaches the request at its next step
            if standin.server.states.get("r") is not None and standin.server.states["r"].queued:
                break
            time.sleep(0.05)
        assert post(standin.url, "/abort_request", {"rid": "r"})[0] == 200
    finally:
        release.set()
        worker.join(60)
    [answer] = answers
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in meta
    assert meta.get("weight_version") == (None if standin.server.release.version == OLDEST else "0")
    streamed = 120 // FORCE_STREAM_INTERVAL * FORCE_STREAM_INTERVAL
    assert meta["completion_tokens"] == streamed == len(answer["output_ids"]) == len(meta["output_token_logprobs"])
    assert answer["output_ids"] == greedy_reference(tiny_model(seed=0), [5, 6, 7], streamed)
    post(standin.url, "/continue_generation", {})


@each_release
def test_the_client_resumes_a_queued_abort_from_its_tokens(standin):
    # The same answer reaching the client: its tokens are labelled with the version the request went out
    # under, and the sample resumes from them after the pause.
    reached, release = hold_at(standin.engine, 120)

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            task = asyncio.ensure_future(engine.generate(GenerationRequest(
                "q", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=160))))
            assert await asyncio.to_thread(reached.wait, 60)
            await asyncio.to_thread(post, standin.url, "/pause_generation", {"mode": "retract"})
            release.set()
            await until(lambda: any(s.queued for s in standin.server.states.values()), 30, "the retraction")
            await engine.pause()      # abort mode: the queued request comes back with 100 tokens
            await engine.resume()
            [result] = await task
            return result, engine.resubmits
        finally:
            release.set()
            await engine.stop()

    result, resubmits = run(main())
    assert resubmits >= 1 and result.finish_reason == "length"
    assert result.output_ids == greedy_reference(tiny_model(seed=0), [5, 6, 7], 160)
    assert result.versions == [0] * 160


@pytest.mark.parametrize("standin", [OLDEST], indirect=True)
def test_a_cache_flush_with_a_running_batch_kills_an_oldest_release_server(standin, tmp_path):
    # 0.5.6: every weight update asserts that its cache flush succeeded
    # (managers/scheduler_update_weights_mixin.py:50-52), and the flush refuses while the running batch holds a
    # request (managers/scheduler.py:2205-2255): an in_place pause keeps the batch, so the update kills the
    # scheduler, and the server with it.
    save_model(tiny_model(seed=4), str(tmp_path / "v1"))
    reached, release = hold_at(standin.engine, 3)
    outcome: list[object] = []

    def generate() -> None:   # its server dies under it
        try:
            outcome.append(post(standin.url, "/generate", {
                "input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 100}}, 30))
        except (OSError, http.client.HTTPException) as exc:
            outcome.append(exc)
    worker = threading.Thread(target=generate)
    worker.start()
    try:
        assert reached.wait(30)
        assert post(standin.url, "/pause_generation", {"mode": "in_place"})[0] == 200
        release.set()
        with pytest.raises((ConnectionError, http.client.HTTPException, urllib.error.URLError)):
            post(standin.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "v1"), "flush_cache": True})
    finally:
        release.set()
        worker.join(60)
    assert "Cache flush failed" in (standin.server.crashed or "")
    assert len(outcome) == 1 and isinstance(outcome[0], Exception)   # nothing answered it
    with pytest.raises((ConnectionError, urllib.error.URLError)):
        get_status(standin.url, "/model_info", timeout=5)


@pytest.mark.parametrize("standin", [NEWEST], indirect=True)
def test_a_cache_flush_with_a_running_batch_fails_a_newest_release_update(standin, tmp_path):
    # 0.5.23: the flush still refuses while the running batch holds a request (managers/scheduler.py:5518-5547),
    # but the update answers it with success False, HTTP 400, its weights already changed and the server's
    # version not relabelled (managers/scheduler_components/weight_updater.py:120-133).
    save_model(tiny_model(seed=4), str(tmp_path / "v1"))
    reached, release = hold_at(standin.engine, 3)
    outcome: list[tuple[int, dict]] = []
    worker = threading.Thread(target=lambda: outcome.append(post(standin.url, "/generate", {
        "input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 10}})))
    worker.start()
    try:
        assert reached.wait(30)
        assert post(standin.url, "/pause_generation", {"mode": "in_place"})[0] == 200
        release.set()
        status, _ = post(standin.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "v1"),
                                                                     "flush_cache": True, "weight_version": "1"})
        assert status == 400
        assert post(standin.url, "/continue_generation", {})[0] == 200
    finally:
        release.set()
        worker.join(60)
    assert standin.server.crashed is None and outcome[0][0] == 200
    assert weights_hash(hf_state_dict(standin.engine.model).items()) == weights_hash(hf_state_dict(tiny_model(seed=4)).items())
    with urllib.request.urlopen(standin.url + "/model_info", timeout=TIMEOUT) as r:
        assert json.loads(r.read())["weight_version"] == "0"


def test_the_clients_update_flushes_after_an_abort_pause_and_the_server_lives(standin, tmp_path):
    save_model(tiny_model(seed=4), str(tmp_path / "v1"))
    reached, release = hold_at(standin.engine, 3)

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            task = asyncio.ensure_future(engine.generate(GenerationRequest(
                "u", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=30))))
            assert await asyncio.to_thread(reached.wait, 30)
            release.set()
            await engine.update_weights_from_disk(1, str(tmp_path / "v1"))
            [result] = await task
            return result
        finally:
            release.set()
            await engine.stop()

    result = run(main())
    assert standin.server.crashed is None and len(result.output_ids) == 30 and result.versions[-1] == 1


def test_abort_mode_pause_checks_once_a_second_and_in_place_answers_before_it_applies(standin):
    # managers/tokenizer_manager.py:1264-1277: abort mode aborts, then checks once a second until nothing holds
    # the model-update lock; in_place and retract are sent to the scheduler, which applies them after the
    # step it runs, and the route answers at once.
    reached, release = hold_at(standin.engine, 3)
    worker = threading.Thread(target=post, args=(standin.url, "/generate", {
        "input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 100}}))
    worker.start()
    try:
        assert reached.wait(30)
        # the step stays held until `release`: an answer now is one given before the pause was applied
        assert post(standin.url, "/pause_generation", {"mode": "in_place"}, timeout=60)[0] == 200
        assert reached.is_set() and not release.is_set()
        assert post(standin.url, "/continue_generation", {})[0] == 200
        t1 = time.monotonic()
        release.set()
        assert post(standin.url, "/pause_generation", {"mode": "abort"})[0] == 200
        assert time.monotonic() - t1 >= 1.0    # the running request was aborted, then checked a second later
    finally:
        release.set()
        worker.join(60)
    post(standin.url, "/continue_generation", {})


def _launch(model_dir: str, tmp_path, *extra_args: str, **kw) -> LaunchConfig:
    return launch_config(model_dir, tmp_path, *extra_args, health_timeout_s=90.0, **kw)


def test_every_tensor_parallel_rank_joins_the_weights_group(tmp_path):
    # model_executor/model_runner.py:1113: each TP rank joins as rank_offset + tp_rank, so a server of tp 2 is
    # two ranks of the trainer's group (world 1 + 2); a server that joined once would leave the group
    # unformed. The scheduler handles the update between batches (managers/scheduler.py:967-989).
    model_dir = str(tmp_path / "start")
    save_model(tiny_model(seed=0), model_dir)
    named = list(hf_state_dict(tiny_model(seed=7)).items())
    buckets = [named[:5], named[5:]]

    async def main():
        engine = SGLangEngine(launch=_launch(model_dir, tmp_path, tp=2))
        await engine.start()
        sender = WeightGroupSender("127.0.0.1", free_port(), world_size=3, backend="gloo", timeout_s=60,
                                 group_name="g-tp")
        try:
            await asyncio.gather(engine.init_weights_group("127.0.0.1", sender.master_port, 1, 3, backend="gloo",
                                                           group_name="g-tp"),
                                 asyncio.to_thread(sender.open))

            def send_all() -> None:
                for b in buckets:
                    sender.send(b)
            await asyncio.gather(engine.update_weights_from_distributed(1, [bucket_metas(b) for b in buckets],
                                                                 group_name="g-tp"),
                                 asyncio.to_thread(send_all))
            [after] = await engine.generate(GenerationRequest("a", [1, 2], SamplingParams(temperature=0.0,
                                                                                          max_new_tokens=5)))
            digest = await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(
                engine.url + "/standin/weights_hash", timeout=60).read())["weights_hash"])
            return after, digest
        finally:
            sender.close()
            await engine.stop()

    after, digest = run(main())
    assert digest == weights_hash(named) and after.versions == [1] * 5
    assert after.output_ids == greedy_reference(tiny_model(seed=7), [1, 2], 5)


def standin_log(url: str) -> dict:
    """A launched stand-in's request log and decode-step times (its GET /standin/log, not an SGLang route)."""
    with urllib.request.urlopen(url + "/standin/log", timeout=60) as r:
        return json.loads(r.read())


def _group_body(named: list, version: int, group: str) -> dict:
    return {"names": [n for n, _ in named], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": group, "flush_cache": True,
            "abort_all_requests": False, "load_format": "flattened_bucket", "weight_version": str(version)}


@pytest.mark.parametrize("release", SGLANG_VERSIONS)
def test_no_decode_step_runs_while_a_bucket_is_received(tmp_path, release):
    # Outside a pause, SGLang's update first takes the model-update lock's writer side (running requests
    # finish), then its scheduler receives the bucket between batches (managers/tokenizer_control_mixin.py:
    # 515-524, managers/scheduler.py:2026-2040; 0.5.6: tokenizer_communicator_mixin.py:418-430, scheduler.py:
    # 967-989): no token is generated meanwhile. 0.5.23 receives it inside a weight-update session, whose
    # opening waits for the running requests the same way (tokenizer_control_mixin.py:471-483).
    model_dir = str(tmp_path / "start")
    save_model(tiny_model(seed=0), model_dir)
    named = list(hf_state_dict(tiny_model(seed=9)).items())

    async def main():
        engine = SGLangEngine(launch=_launch(model_dir, tmp_path, release=release))
        await engine.start()
        sender = WeightGroupSender("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=60,
                                 group_name="g-nostep")
        session = release != OLDEST
        try:
            await asyncio.gather(engine.init_weights_group("127.0.0.1", sender.master_port, 1, 2, backend="gloo",
                                                           group_name="g-nostep"),
                                 asyncio.to_thread(sender.open))
            long = asyncio.ensure_future(engine.generate(GenerationRequest(
                "long", [3, 4], SamplingParams(temperature=0.0, max_new_tokens=200))))
            await until(lambda: len(standin_log(engine.url)["steps"]) > 5, 60, "generation to run")
            # the route straight, without the client's pause: the server itself must keep them apart
            if session:
                await engine._post("/begin_weight_update", {})
            update = asyncio.ensure_future(engine._post("/update_weights_from_distributed",
                                                        _group_body(named, 1, "g-nostep")))
            await asyncio.to_thread(sender.send, named)
            await update
            if session:
                await engine._post("/end_weight_update", {})
            [result] = await long
            return result, standin_log(engine.url)
        finally:
            sender.close()
            await engine.stop()

    result, log = run(main())
    start = next(t for t, e, _ in log["events"] if e == "receive_start")
    end = next(t for t, e, _ in log["events"] if e == "receive_end")
    assert not [t for t in log["steps"] if start <= t <= end]
    assert result.versions == [0] * 200


def test_a_weight_bucket_is_never_sent_twice_after_a_reset(tmp_path):
    # The server may be receiving the bucket: a second call would wait for a bucket the trainer sends once, or
    # take the next one (mixed weights). The reset fails the update instead.
    model_dir = str(tmp_path / "start")
    save_model(tiny_model(seed=0), model_dir)
    named = list(hf_state_dict(tiny_model(seed=9)).items())
    launch = _launch(model_dir, tmp_path, "--standin-drop-connection", "/update_weights_from_distributed:after")

    async def main():
        engine = SGLangEngine(launch=launch)
        await engine.start()
        sender = WeightGroupSender("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=60,
                                 group_name="g-reset")
        try:
            await asyncio.gather(engine.init_weights_group("127.0.0.1", sender.master_port, 1, 2, backend="gloo",
                                                           group_name="g-reset"),
                                 asyncio.to_thread(sender.open))
            update = asyncio.ensure_future(engine.update_weights_from_distributed(1, [bucket_metas(named)],
                                                                                 group_name="g-reset"))
            await asyncio.to_thread(sender.send, named)
            with pytest.raises(SGLangError, match="not idempotent"):
                await update
            return engine.resets_retried, standin_log(engine.url)
        finally:
            sender.close()
            await engine.stop()

    retried, log = run(main())
    calls = [n for _, e, n in log["events"] if e == "call" and n.startswith("/update_weights_from_distributed")]
    assert retried == 0 and len(calls) == 1


@each_release
def test_a_seed_outside_int32_kills_an_oldest_release_server_and_the_client_sends_none(standin):
    # 0.5.6 sampling/sampling_batch_info.py:90-97: the seeds become an int32 tensor in the scheduler, where one
    # outside int32 raises and the server dies; 0.5.23 makes them int64 (sampling_batch_info.py:167) and
    # refuses one outside int64 with HTTP 400 (sampling/sampling_params.py:308-312).
    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            return await engine.generate(GenerationRequest("s", [5, 6], SamplingParams(
                temperature=1.0, max_new_tokens=4, seed=(1 << 62) + 12345), n=4))
        finally:
            await engine.stop()

    results = run(main())   # the stand-in checks every seed it is sent: none left int32
    assert [len(r.output_ids) for r in results] == [4] * 4 and standin.server.crashed is None
    assert SEED_RANGE == 1 << 31
    beyond_int32 = {"input_ids": [5], "sampling_params": {"sampling_seed": 1 << 40, "max_new_tokens": 2}}
    if standin.server.release.version == OLDEST:
        with pytest.raises((ConnectionError, http.client.HTTPException, urllib.error.URLError)):
            post(standin.url, "/generate", beyond_int32)
        assert "int32" in (standin.server.crashed or "")
        return
    assert post(standin.url, "/generate", beyond_int32)[0] == 200
    beyond_int64 = {"input_ids": [5], "sampling_params": {"sampling_seed": 1 << 63, "max_new_tokens": 2}}
    assert post(standin.url, "/generate", beyond_int64)[0] == 400 and standin.server.crashed is None


def test_idempotent_calls_are_sent_again_after_a_reset(standin, tmp_path):
    save_model(tiny_model(seed=4), str(tmp_path / "v1"))
    for route in ("/pause_generation", "/update_weights_from_disk", "/update_weight_version", "/continue_generation"):
        standin.server.drop_next[route] = ["before"]

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            await engine.update_weights_from_disk(1, str(tmp_path / "v1"))
            [after] = await engine.generate(GenerationRequest("a", [1, 2], SamplingParams(temperature=0.0,
                                                                                          max_new_tokens=4)))
            return after, engine.resets_retried
        finally:
            await engine.stop()

    after, retried = run(main())
    assert retried == 4 and after.versions == [1] * 4
    assert after.output_ids == greedy_reference(tiny_model(seed=4), [1, 2], 4)


def test_a_reset_generate_is_aborted_before_it_is_sent_again(standin):
    # The server got the request and runs it; its connection is gone. The client aborts that rid, then sends
    # the sample again as a new segment: the two copies never run at once.
    standin.server.drop_next["/generate"] = ["after"]

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            return await engine.generate(GenerationRequest("g", [5, 6, 7], SamplingParams(
                temperature=0.0, max_new_tokens=150)))
        finally:
            await engine.stop()

    [result] = run(main())
    assert result.output_ids == greedy_reference(tiny_model(seed=0), [5, 6, 7], 150)
    log = standin.server.request_log
    first = next(t for t, e, rid in log if e == "start" and rid == "g/0/0/")
    abort = next(t for t, e, rid in log if e == "abort" and rid == "g/0/0/")
    second = next(t for t, e, rid in log if e == "start" and rid == "g/0/1/")
    # SGLang takes messages in order: the abort reaches the scheduler before the new copy, which it stops at
    # its next step (managers/scheduler.py:2416-2424)
    assert first < abort < second


@contextlib.asynccontextmanager
async def attached(standin: StandinThread, release: threading.Event, **options) -> AsyncIterator[SGLangEngine]:
    """An engine attached to the stand-in; on the way out the held decode step is let go before it stops."""
    engine = SGLangEngine(url=standin.url, **options)
    await engine.start()
    try:
        yield engine
    finally:
        release.set()
        await engine.stop()


def test_a_sample_that_fails_stops_its_siblings_and_every_copy_on_the_server(standin):
    # Sample 0's connection is reset after the server took it, and the client may not send it again: the request
    # fails. Sample 1 still runs (the decode step is held). Before generate raises, both copies are aborted on
    # the server (a failed call keeps its rid for that) and sample 1's call is stopped in the client, so nothing
    # of the request goes on generating, or resubmits itself after a pause.
    standin.server.drop_next["/generate"] = ["after"]
    reached, release = hold_at(standin.engine, 2)

    async def main():
        async with attached(standin, release) as engine:
            engine.MAX_RESETS = 0
            with pytest.raises(SGLangConnectionReset):
                await engine.generate(GenerationRequest("g", [5, 6, 7], SamplingParams(
                    temperature=0.0, max_new_tokens=50), n=2))
            return engine._http_inflight, {rid for _, e, rid in standin.server.request_log if e == "abort"}

    inflight, aborted = run(main())
    assert inflight == 0
    assert {"g/0/0/", "g/1/0/"} <= aborted


def test_a_generate_that_times_out_is_aborted_on_the_server(standin):
    # A /generate past its request timeout: the client gives up on the call, and stops the copy the server is
    # still generating rather than leave it to run on beside a re-issue.
    reached, release = hold_at(standin.engine, 2)

    async def main():
        async with attached(standin, release, request_timeout_s=1.0) as engine:
            with pytest.raises(SGLangError, match="TimeoutError"):
                await engine.generate(GenerationRequest("t", [5, 6, 7], SamplingParams(
                    temperature=0.0, max_new_tokens=50)))
            return {rid for _, e, rid in standin.server.request_log if e == "abort"}

    assert "t/0/0/" in run(main())


def test_aborting_one_request_never_stops_another_whose_rid_it_prefixes(standin):
    # SGLang aborts by rid prefix (below). Request "a"'s sample 1 and request "a/1"'s sample 0 must not share a
    # prefix on the server, nor a sample's segment 1 and its segment 10: aborting "a" leaves "a/1" running.
    reached, release = hold_at(standin.engine, 2)

    async def main():
        async with attached(standin, release) as engine:
            sampling = SamplingParams(temperature=0.0, max_new_tokens=20)
            a = asyncio.ensure_future(engine.generate(GenerationRequest("a", [5, 6, 7], sampling, n=2)))
            other = asyncio.ensure_future(engine.generate(GenerationRequest("a/1", [5, 6, 7], sampling)))
            assert await asyncio.to_thread(reached.wait, 30)
            await until(lambda: len(standin.server.states) == 3, 30, "all three samples to reach the server")
            await engine.abort("a")
            release.set()
            return [r.finish_reason for r in await a], [r.finish_reason for r in await other]

    assert run(main()) == (["abort", "abort"], ["length"])
    ids = {sglang_rid(rid, i, seg) for rid in ("a", "a/1", "a/", "%2F") for i in (0, 1, 10) for seg in (0, 1, 10)}
    assert not any(x != y and y.startswith(x) for x in ids for y in ids)


def test_abort_matches_by_rid_prefix(standin):
    # TokenizerManager.abort_request forwards a rid it knows; Scheduler.abort_request aborts every request
    # whose rid starts with it (managers/scheduler.py:2348, :2418).
    reached, release = hold_at(standin.engine, 2)
    answers: dict[str, dict] = {}
    workers = [threading.Thread(target=lambda r=rid: answers.__setitem__(r, post(standin.url, "/generate", {
        "rid": r, "input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 50}})[1]))
        for rid in ("x", "xy")]
    for w in workers:
        w.start()
    try:
        assert reached.wait(30)
        for _ in range(600):
            if len(standin.server.states) == 2:
                break
            time.sleep(0.05)
        assert post(standin.url, "/abort_request", {"rid": "x"})[0] == 200
        release.set()
    finally:
        release.set()
        for w in workers:
            w.join(60)
    assert {r: a["meta_info"]["finish_reason"]["type"] for r, a in answers.items()} == {"x": "abort", "xy": "abort"}
    assert post(standin.url, "/abort_request", {"rid": "nobody"})[0] == 200   # unknown rid: nothing happens
