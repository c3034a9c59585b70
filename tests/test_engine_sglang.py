"""The SGLang engine against the stand-in SGLang server (a real HTTP server over the embedded engine).

In-process (the server on its own event loop in a thread): samples equal the embedded engine's, abort returns
partial tokens, pause/resume, interruption by a weight update from disk (old tokens are the old model's greedy
continuation, later ones the new model's, each tagged with its version), typed errors. As a subprocess
through the same launch path the real server takes: health wait, weights over a process group (gloo) in
both of SGLang's layouts while generation runs, restart after the server is killed, a launch that fails."""
from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from actors.engines.base import EngineError, GenerationRequest, RequestError, SamplingParams
from actors.engines.checkpoint import hf_state_dict, save_model
from actors.engines.sglang import (LaunchConfig, SGLangEngine, SGLangError, SGLangLaunchError, WeightsIncompleteError,
                                   _sample_seed)
from actors.engines.sglang_group import WeightGroupSender
from actors.engines.sglang_routes import SGLANG_VERSIONS
from actors.engines.torch_gen import TorchGenerationEngine
from actors.weights import weights_hash
from testsupport.bounded import run_bounded, until
from testsupport.sglang_standin import StandinThread, launch_config
from testsupport.tiny_models import greedy_reference, random_sequences, tiny_model
from transport.bulk import bucket_metas
from transport.ports import free_port

# A bound against hangs, not a speed check: tests here launch stand-in servers (a torch import each) and
# restart them, which took over 60 s on a 2-core machine at load 80.
TIMEOUT = 300.0
VOCAB = 97


def standin_weights_hash(url: str) -> str:
    """The stand-in's own fingerprint of the weights it serves (its GET /standin/weights_hash): how a test
    proves the bytes a server received. The engine never asks for it: real SGLang has no such route."""
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/standin/weights_hash", timeout=60.0) as r:
        return str(json.loads(r.read())["weights_hash"])


run = functools.partial(run_bounded, timeout=TIMEOUT)
# The client's weight updates against each supported release (the stand-in serves as either).
each_release = pytest.mark.parametrize("standin", SGLANG_VERSIONS, indirect=True)


def test_samples_equal_the_embedded_engine_and_logprobs_come_back(standin):
    prompt = random_sequences(1, 5, 12, VOCAB, seed=3)[0]
    sampling = SamplingParams(temperature=1.0, top_k=30, max_new_tokens=24, seed=11)

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            results = await engine.generate(GenerationRequest("g1", prompt, sampling, n=3))
            health = await engine.health()
        finally:
            await engine.stop()
        reference = TorchGenerationEngine(model=tiny_model(seed=0))
        await reference.start()
        try:
            expected = [(await reference.generate(GenerationRequest(
                f"r{i}", prompt, SamplingParams(temperature=1.0, top_k=30, max_new_tokens=24,
                                                seed=_sample_seed(11, i)))))[0] for i in range(3)]
        finally:
            await reference.stop()
        return results, expected, health

    results, expected, health = run(main())
    assert [r.index for r in results] == [0, 1, 2]
    for got, want in zip(results, expected):
        assert got.output_ids == want.output_ids and got.finish_reason == want.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
        assert got.versions == [0] * 24 and got.prompt_len == len(prompt)
    assert len({tuple(r.output_ids) for r in results}) > 1  # the samples differ
    assert health["ok"] and health["version"] == 0


def hold_decoding_at(engine_core: TorchGenerationEngine, step: int) -> threading.Event:
    """Once, in the decode thread: hold decoding at `step` until an abort is queued, so the point where a
    pause or abort cuts in is exact whatever the machine's speed. The event says the step was reached."""
    reached = threading.Event()

    def hook(at: int) -> None:
        if reached.is_set() or at < step:
            return
        reached.set()
        with engine_core._cond:
            engine_core._cond.wait_for(lambda: engine_core._aborts, timeout=30)

    engine_core.on_step = hook
    return reached


def test_a_request_held_at_the_pause_gate_does_not_block_an_update(standin, tmp_path):
    # SGLang holds a /generate that arrives during a pause at its gate until /continue_generation. A pause
    # that waited for every open /generate to return would stall the update on a request sent just before
    # the pause and held there, until the drain timeout (a rollout would then block every later weight
    # group). Here another client pauses the server before the request is sent.
    new_model = tiny_model(seed=5)
    save_model(new_model, str(tmp_path / "v1"))
    prompt = random_sequences(1, 4, 8, VOCAB, seed=6)[0]

    async def main():
        engine, other = SGLangEngine(url=standin.url, drain_timeout_s=5.0), SGLangEngine(url=standin.url)
        await engine.start()
        await other.start()
        try:
            await other.pause()
            task = asyncio.ensure_future(engine.generate(GenerationRequest(
                "held", prompt, SamplingParams(temperature=0.0, max_new_tokens=10))))
            while engine._http_inflight == 0:   # sent; the server holds it at the gate
                await asyncio.sleep(0.01)
            await engine.update_weights_from_disk(1, str(tmp_path / "v1"))   # continues the server too
            [result] = await task
            return result
        finally:
            await other.stop()
            await engine.stop()

    result = run(main())
    assert result.versions == [1] * 10   # nothing ran before the update
    assert result.output_ids == greedy_reference(new_model, prompt, 10)


@each_release
def test_weight_update_from_disk_interrupts_and_resumes_with_new_version(standin, tmp_path):
    new_model = tiny_model(seed=5)
    save_model(new_model, str(tmp_path / "v1"))
    prompt = random_sequences(1, 4, 8, VOCAB, seed=4)[0]
    cut = 6  # decode steps under the old weights before the update's abort lands
    reached = hold_decoding_at(standin.engine, cut)

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            task = asyncio.ensure_future(engine.generate(GenerationRequest(
                "long", prompt, SamplingParams(temperature=0.0, max_new_tokens=40))))
            assert await asyncio.to_thread(reached.wait, 30)
            await engine.update_weights_from_disk(1, str(tmp_path / "v1"))
            [result] = await task
            digest = await asyncio.to_thread(standin_weights_hash, engine.url)
            return result, digest, engine.resubmits, engine.version
        finally:
            await engine.stop()

    result, digest, resubmits, version = run(main())
    old = cut + 1  # the prefill's token plus one per decode step
    assert result.finish_reason == "length" and len(result.output_ids) == 40
    assert result.versions == [0] * old + [1] * (40 - old)
    assert result.output_ids[:old] == greedy_reference(tiny_model(seed=0), prompt, old)
    assert result.output_ids[old:] == greedy_reference(new_model, prompt + result.output_ids[:old], 40 - old)
    assert resubmits == 1 and version == 1
    assert digest == weights_hash(hf_state_dict(new_model).items())


def test_update_weights_from_buckets_goes_through_disk(standin, tmp_path):
    new_model = tiny_model(seed=7)
    named = list(hf_state_dict(new_model).items())
    buckets = [named[:5], named[5:]]

    async def main():
        engine = SGLangEngine(url=standin.url, weights_dir=str(tmp_path / "w"))
        await engine.start()
        try:
            await engine.update_weights(3, iter(buckets))
            [r] = await engine.generate(GenerationRequest("a", [1, 2, 3], SamplingParams(temperature=0.0,
                                                                                        max_new_tokens=5)))
            return r, await asyncio.to_thread(standin_weights_hash, engine.url)
        finally:
            await engine.stop()

    r, digest = run(main())
    assert r.versions == [3] * 5 and r.output_ids == greedy_reference(new_model, [1, 2, 3], 5)
    assert digest == weights_hash(named)
    assert (tmp_path / "w" / "v3" / "model.safetensors").exists()


def test_abort_returns_partial_tokens_and_pause_holds_requests(standin):
    started = hold_decoding_at(standin.engine, 3)

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            task = asyncio.ensure_future(engine.generate(GenerationRequest(
                "x", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=100), n=1)))
            assert await asyncio.to_thread(started.wait, 30)
            assert await engine.abort("x") == 1
            [aborted] = await task
            assert await engine.abort("nothing") == 0
            # Paused: a request waits (no HTTP call is made) and runs after resume.
            await engine.pause()
            waiting = asyncio.ensure_future(engine.generate(GenerationRequest(
                "y", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=4))))
            await asyncio.sleep(0)  # let it reach the gate
            health = await engine.health()
            await engine.resume()
            [done] = await waiting
            return aborted, health, done
        finally:
            await engine.stop()

    aborted, health, done = run(main())
    assert aborted.finish_reason == "abort" and 4 <= len(aborted.output_ids) < 100
    assert aborted.output_ids == greedy_reference(tiny_model(seed=0), [5, 6, 7], len(aborted.output_ids))
    assert health["paused"] and health["waiting"] == 1 and health["running"] == 0
    assert done.finish_reason == "length" and done.output_ids == greedy_reference(tiny_model(seed=0), [5, 6, 7], 4)


def test_a_request_aborted_while_queued_resumes_after_the_pause(standin):
    # SGLang 0.5.6 answers a request still in its waiting queue at /pause_generation {"mode": "abort"}
    # without weight_version or prompt_tokens (TokenizerManager._handle_abort_req). Failing the whole
    # request on it would make the rollout drop the group's partial answers.
    standin.engine.max_running = 1    # b waits in the queue while a runs
    started = hold_decoding_at(standin.engine, 2)
    prompt_a, prompt_b = [5, 6, 7], [8, 9, 10, 11]

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            running = asyncio.ensure_future(engine.generate(GenerationRequest(
                "a", prompt_a, SamplingParams(temperature=0.0, max_new_tokens=12))))
            assert await asyncio.to_thread(started.wait, 30)
            queued = asyncio.ensure_future(engine.generate(GenerationRequest(
                "b", prompt_b, SamplingParams(temperature=0.0, max_new_tokens=6))))
            for _ in range(3000):   # bounded: b reaches the embedded engine's waiting list
                if len(standin.engine._in_flight) == 2:
                    break
                await asyncio.sleep(0.01)
            assert len(standin.engine._in_flight) == 2
            await engine.pause()
            await engine.resume()
            return await running, await queued
        finally:
            await engine.stop()

    [a], [b] = run(main())
    assert standin.server.counters["aborted"] == 2
    model = tiny_model(seed=0)
    assert a.finish_reason == "length" and a.output_ids == greedy_reference(model, prompt_a, 12)
    assert b.finish_reason == "length" and b.output_ids == greedy_reference(model, prompt_b, 6)
    assert b.versions == [0] * 6


def _post_generate(url: str, ids: list[int], **sampling) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request
    body = json.dumps({"input_ids": ids, "sampling_params": sampling}).encode()
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_standin_refuses_what_sglang_refuses(standin):
    # SGLang 0.5.6: SamplingParams.__init__/verify and TokenizerManager._validate_one_request, HTTP 400.
    context = standin.engine.model.config.max_position_embeddings
    cases = [({"top_k": 0, "temperature": 1.0}, "top_k must be -1 (disable) or at least 1, got 0."),
             ({"top_k": -2, "temperature": 1.0}, "top_k must be -1 (disable) or at least 1, got -2."),
             ({"temperature": -0.5}, "temperature must be non-negative"),
             ({"max_new_tokens": context - 3}, "exceeds the model's maximum context length"),]
    for sampling, message in cases:
        status, answer = _post_generate(standin.url, [1, 2, 3], **sampling)
        assert status == 400 and message in answer["error"]["message"], (sampling, answer)
    status, answer = _post_generate(standin.url, list(range(1, 10)) * (context // 9 + 1), max_new_tokens=1)
    assert status == 400 and "longer than the model's context length" in answer["error"]["message"]
    # Greedy sampling turns top_k into 1 before the check, so top_k 0 passes there.
    status, _ = _post_generate(standin.url, [1, 2, 3], top_k=0, temperature=0.0, max_new_tokens=2)
    assert status == 200
    status, _ = _post_generate(standin.url, [1, 2, 3], max_new_tokens=context - 4)
    assert status == 200


def test_top_k_off_is_sent_as_sglangs_minus_one(standin):
    prompt = [5, 6, 7]

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            return await engine.generate(GenerationRequest(
                "k", prompt, SamplingParams(temperature=1.0, top_k=0, max_new_tokens=4, seed=1)))
        finally:
            await engine.stop()

    [result] = run(main())
    assert len(result.output_ids) == 4


def test_a_paused_server_is_not_reported_down(standin, monkeypatch):
    # SGLang's /health generates one token, held at the pause gate: 503 after SGLANG_HEALTH_CHECK_TIMEOUT.
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    import urllib.error
    import urllib.request

    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            await engine.pause()
            with pytest.raises(urllib.error.HTTPError) as refused:
                await asyncio.to_thread(urllib.request.urlopen, standin.url + "/health", timeout=30)
            paused = await engine.health()
            await engine.resume()
            resumed = await engine.health()
            return refused.value.code, paused, resumed
        finally:
            await engine.stop()

    code, paused, resumed = run(main())
    assert code == 503
    assert paused["ok"] and paused["paused"]
    assert resumed["ok"] and not resumed["paused"]


def test_typed_errors(standin):
    async def main():
        engine = SGLangEngine(url=standin.url)
        await engine.start()
        try:
            with pytest.raises(RequestError, match="refused"):
                await engine.generate(GenerationRequest("bad", [VOCAB + 5], SamplingParams(max_new_tokens=3)))
            with pytest.raises(EngineError, match="not initialised"):
                await engine.update_weights_from_distributed(1, [[]])
        finally:
            await engine.stop()
        dead = SGLangEngine(url=f"http://127.0.0.1:{free_port()}", attach_timeout_s=1.0)
        dead_start = dead.start()
        with pytest.raises(SGLangLaunchError, match="not healthy"):
            await asyncio.wait_for(dead_start, 40)

    run(main())
    with pytest.raises(EngineError, match="exactly one"):
        SGLangEngine()


@pytest.mark.parametrize("release", SGLANG_VERSIONS)
def test_launched_server_distributed_weights_and_restart(tmp_path, release):
    model_dir = str(tmp_path / "start")
    save_model(tiny_model(seed=0), model_dir)
    new = [tiny_model(seed=21), tiny_model(seed=22)]
    events: list[tuple[str, int]] = []

    async def on_server_event(event: str, restarts: int) -> None:
        events.append((event, restarts))

    async def push(engine: SGLangEngine, sender: WeightGroupSender, version: int, model, flattened: bool):
        named = list(hf_state_dict(model).items())
        buckets = [named[:4], named[4:9], named[9:]]
        sender.flattened = flattened

        def send_all() -> None:
            for b in buckets:
                sender.send(b)

        await asyncio.gather(engine.update_weights_from_distributed(version, [bucket_metas(b) for b in buckets],
                                                                    flattened=flattened),
                             asyncio.to_thread(send_all))
        return weights_hash(named)

    async def main():
        engine = SGLangEngine(launch=launch_config(model_dir, tmp_path, release=release),
                              on_server_event=on_server_event)
        await engine.start()
        sender = WeightGroupSender("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=30)
        try:
            long = asyncio.ensure_future(engine.generate(GenerationRequest(
                "long", [3, 4, 5], SamplingParams(temperature=0.0, max_new_tokens=200), n=2)))
            await asyncio.gather(engine.init_weights_group("127.0.0.1", sender.master_port, 1, 2, backend="gloo"),
                                 asyncio.to_thread(sender.open))
            h1 = await push(engine, sender, 1, new[0], flattened=True)
            got1 = await asyncio.to_thread(standin_weights_hash, engine.url)
            h2 = await push(engine, sender, 2, new[1], flattened=False)
            got2 = await asyncio.to_thread(standin_weights_hash, engine.url)
            results = await long
            [after] = await engine.generate(GenerationRequest("a", [1, 2], SamplingParams(temperature=0.0,
                                                                                          max_new_tokens=6)))
            # Kill the server: the engine says it died, restarts it (start weights, version 0) and says so.
            os.killpg(engine.server.proc.pid, signal.SIGKILL)
            [again] = await engine.generate(GenerationRequest("b", [1, 2], SamplingParams(temperature=0.0,
                                                                                          max_new_tokens=6)))
            health = await engine.health()
            return h1, got1, h2, got2, results, after, again, health
        finally:
            sender.close()
            await engine.stop()

    h1, got1, h2, got2, results, after, again, health = run(main())
    assert got1 == h1 and got2 == h2
    for r in results:  # the long answers span the updates; versions never go back
        assert len(r.output_ids) == 200 and r.versions == sorted(r.versions) and r.versions[0] == 0
    assert after.versions == [2] * 6 and after.output_ids == greedy_reference(new[1], [1, 2], 6)
    assert events == [("died", 0), ("restarted", 1)] and health["restarts"] == 1 and health["ok"]
    assert again.versions == [0] * 6 and again.output_ids == greedy_reference(tiny_model(seed=0), [1, 2], 6)


def _server_info(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/server_info", timeout=60.0) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("release", SGLANG_VERSIONS)
def test_an_update_broken_off_between_buckets_keeps_the_server_paused_until_a_whole_version_loads(tmp_path, release):
    # The stand-in fails to load the second bucket of version 1 (SGLang's answer to a failed load: the first
    # bucket stays loaded). The server then holds weights of no single version: the engine keeps it paused,
    # even when asked to resume, and a request waits at its gate until version 2 has loaded whole; that
    # request's tokens are all version 2's. On 0.5.23 the broken session is closed, so version 2 opens its own.
    model_dir = str(tmp_path / "start")
    save_model(tiny_model(seed=0), model_dir)
    new = [tiny_model(seed=21), tiny_model(seed=22)]

    async def push(engine: SGLangEngine, sender: WeightGroupSender, version: int, model) -> list:
        named = list(hf_state_dict(model).items())
        buckets = [named[:5], named[5:]]

        def send_all() -> None:
            for b in buckets:
                sender.send(b)

        return await asyncio.gather(engine.update_weights_from_distributed(version, [bucket_metas(b) for b in buckets]),
                                    asyncio.to_thread(send_all), return_exceptions=True)

    async def main():
        engine = SGLangEngine(launch=launch_config(model_dir, tmp_path, "--fail-load-at", "2", release=release))
        await engine.start()
        sender = WeightGroupSender("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=30)
        try:
            await asyncio.gather(engine.init_weights_group("127.0.0.1", sender.master_port, 1, 2, backend="gloo"),
                                 asyncio.to_thread(sender.open))
            failed, sent = await push(engine, sender, 1, new[0])
            partial = await asyncio.to_thread(standin_weights_hash, engine.url)
            held = asyncio.ensure_future(engine.generate(GenerationRequest(
                "held", [1, 2], SamplingParams(temperature=0.0, max_new_tokens=6))))
            await until(lambda: "held" in engine._requests, TIMEOUT, "the request to reach the engine")
            await engine.resume()   # what a receiver's clean-up would ask: refused while the weights are mixed
            state = (await engine.health(), engine.incomplete_version, engine.version,
                     await asyncio.to_thread(_server_info, engine.url))
            ok, _ = await push(engine, sender, 2, new[1])
            [result] = await held
            return failed, sent, partial, state, ok, result, engine.incomplete_version
        finally:
            sender.close()
            await engine.stop()

    failed, sent, partial, state, ok, result, incomplete_after = run(main())
    assert isinstance(failed, WeightsIncompleteError) and "version 1" in str(failed), failed
    assert "partially updated" in str(failed.__cause__), failed.__cause__
    assert sent is None and ok is None
    # the server really held a mix: the first bucket of version 1 over version 0's rest
    assert partial not in (weights_hash(hf_state_dict(tiny_model(seed=0)).items()),
                           weights_hash(hf_state_dict(new[0]).items()))
    health, incomplete, version, info = state
    assert health["paused"] and incomplete == 1 and version == 0
    assert info["paused"] and info["counters"]["generate"] == 0   # nothing was generated on the mix
    assert result.versions == [2] * 6 and result.output_ids == greedy_reference(new[1], [1, 2], 6)
    assert incomplete_after is None and info["version"] == release


def test_a_server_that_dies_while_paused_comes_back_unpaused(tmp_path):
    # Killed during a weight update (paused; /continue_generation then fails), the server was restarted
    # but the engine stayed paused, so every later request waited at the pause gate for good.
    model_dir = str(tmp_path / "start")
    save_model(tiny_model(seed=0), model_dir)
    events: list[tuple[str, int]] = []

    async def on_server_event(event: str, restarts: int) -> None:
        events.append((event, restarts))

    async def main():
        engine = SGLangEngine(launch=launch_config(model_dir, tmp_path), on_server_event=on_server_event)
        await engine.start()
        try:
            await engine.pause()
            os.killpg(engine.server.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineError):
                await engine.resume()            # the server is gone
            request = GenerationRequest("after", [1, 2], SamplingParams(temperature=0.0, max_new_tokens=4))
            [answer] = await asyncio.wait_for(engine.generate(request), 120)
            return answer, await engine.health()
        finally:
            await engine.stop()

    answer, health = run(main())
    assert ("restarted", 1) in events and not health["paused"]
    assert answer.output_ids == greedy_reference(tiny_model(seed=0), [1, 2], 4)


def test_a_server_dies_with_the_process_that_started_it(tmp_path):
    # A rollout actor killed by SIGKILL cannot stop its server; the kernel sends the server SIGTERM then.
    model_dir = str(tmp_path / "start")
    save_model(tiny_model(seed=0), model_dir)
    script = (f"import asyncio, sys\n"
              f"from actors.engines.sglang import LaunchConfig, SGLangEngine\n"
              f"async def main():\n"
              f"    e = SGLangEngine(launch=LaunchConfig(model_path={model_dir!r}, command=[sys.executable, '-m', "
              f"'testsupport.sglang_standin'], health_timeout_s=60.0, env={{'OMP_NUM_THREADS': '1'}}))\n"
              f"    await e.start()\n"
              f"    print(e.server.proc.pid, flush=True)\n"
              f"    await asyncio.sleep(600)\n"
              f"asyncio.run(main())\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=str(Path(__file__).resolve().parents[1]))
    try:
        server_pid = int(parent.stdout.readline())
        os.kill(server_pid, 0)                       # the server is up
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                break
            if Path(f"/proc/{server_pid}/stat").read_text().split()[2] == "Z":
                break                                 # exited, not yet reaped
            time.sleep(0.1)
        else:
            os.kill(server_pid, signal.SIGKILL)
            pytest.fail("the server outlived the process that started it")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_launch_that_fails_names_the_exit_and_log(tmp_path):
    config = LaunchConfig(model_path=str(tmp_path / "missing"),
                          command=[sys.executable, "-m", "testsupport.sglang_standin"],
                          log_path=str(tmp_path / "server.log"), health_timeout_s=30.0)

    async def main():
        engine = SGLangEngine(launch=config)
        with pytest.raises(SGLangLaunchError, match="exited with code") as info:
            await engine.start()
        return str(info.value)

    message = run(main())
    assert "missing" in message  # the log tail names the missing model directory


def test_a_launched_server_never_healthy_is_killed_and_named(tmp_path, random_model_dir):
    # A server that stays 'starting' (/health 503) past health_timeout_s: the start fails naming the wait, and
    # the process is killed, not left loading beside its replacement.
    (tmp_path / "gate").mkdir()   # no file for its seed: it never comes up
    config = launch_config(str(random_model_dir), tmp_path, "--standin-starting-until-dir", str(tmp_path / "gate"),
                           health_timeout_s=3.0)

    async def main():
        engine = SGLangEngine(launch=config)
        with pytest.raises(SGLangLaunchError, match="was not healthy within 3 s") as info:
            await engine.start()
        return str(info.value), engine.server.proc

    message, proc = run(main())
    assert proc is not None and proc.wait(timeout=30) is not None, message


def test_a_server_told_to_fail_at_start_exits_and_is_named(tmp_path, random_model_dir):
    # The stand-in's DIR/<seed>.fail: a server that cannot load its model (tests/test_late_rollouts.py's rollout.2)
    (tmp_path / "gate").mkdir()
    (tmp_path / "gate" / "0.fail").write_text("")
    config = launch_config(str(random_model_dir), tmp_path, "--standin-starting-until-dir", str(tmp_path / "gate"))

    async def main():
        with pytest.raises(SGLangLaunchError, match="exited with code 1") as info:
            await SGLangEngine(launch=config).start()
        return str(info.value)

    assert "told to fail at start" in run(main())


def test_make_engine_builds_the_sglang_engine(tmp_path):
    from actors.rollout.actor import RolloutActor, make_engine
    from topology.settings import RolloutSettings, SettingsError, read_settings

    engine = make_engine(RolloutSettings.model_validate({"engine": "sglang", "sglang_url": "http://127.0.0.1:1"}), 4,
                         str(tmp_path), run_dir=str(tmp_path))
    assert isinstance(engine, SGLangEngine) and engine.version == 4 and engine.url == "http://127.0.0.1:1"
    async def on_server_event(event: str, restarts: int) -> None:  # the rollout's: ServerDown, hello again
        pass

    launched = make_engine(RolloutSettings.model_validate(
        {"engine": "sglang", "instance": {"group": "rollout", "index": 2, "parallel": {"tp": 2}},
         "sglang": {"command": ["python", "-m", "testsupport.sglang_standin"], "mem_fraction_static": 0.8}}),
        0, "/models/m", run_dir=str(tmp_path), on_server_event=on_server_event)
    assert launched.user_on_server_event is on_server_event
    args = launched.server.config.args(30001, 0)
    assert args[:3] == ["python", "-m", "testsupport.sglang_standin"]
    assert args[args.index("--tp-size") + 1] == "2" and args[args.index("--mem-fraction-static") + 1] == "0.8"
    assert args[args.index("--model-path") + 1] == "/models/m" and "--skip-tokenizer-init" in args
    # The settings model refuses an unknown server key, and one put beside sglang instead of under it.
    with pytest.raises(SettingsError, match=r"rollout.2: settings.sglang.bogus: unknown key"):
        read_settings(RolloutActor, {"engine": "sglang", "sglang": {"bogus": 1}}, "rollout.2")
    with pytest.raises(SettingsError, match=r"settings.mem_fraction_static: unknown key \(did you mean "
                                            r"'sglang.mem_fraction_static'\?\)"):
        read_settings(RolloutActor, {"engine": "sglang", "mem_fraction_static": 0.8}, "rollout.2")


@pytest.mark.parametrize("topology", sorted(p.name for p in (Path(__file__).parent.parent / "topology").glob("*.yaml")))
def test_shipped_sglang_rollouts_build_their_launch_command(topology, tmp_path):
    # Every setting a shipped topology gives an SGLang rollout reaches the server's command line.
    from actors.rollout.actor import make_engine
    from topology import load
    from topology.settings import RolloutSettings

    plan = load(Path(__file__).parent.parent / "topology" / topology, check_imports=False)
    for spec in plan.specs(tmp_path):
        settings = spec["settings"]
        if settings.get("engine") != "sglang":
            continue
        engine = make_engine(RolloutSettings.model_validate(settings), 0, "/models/m", run_dir=str(tmp_path))
        args = engine.server.config.args(30001, 0)
        for key, value in (settings.get("sglang") or {}).items():
            if key == "mem_fraction_static":
                assert args[args.index("--mem-fraction-static") + 1] == str(value)


@pytest.mark.parametrize("hash_route", [True, False])
def test_weights_are_verified_by_the_version_the_server_reports(hash_route, tmp_path):
    # Real SGLang (0.5.6) has no route that reads Qwen2 weights back: the rollout checks the version the
    # server reports after the update. The client asks only real routes, so a stand-in that offers its own
    # hash route is checked the same way (the route's hash still proves the bytes, for the test).
    server = StandinThread(TorchGenerationEngine(model=tiny_model(seed=0)), weights_hash_route=hash_route).start()
    named = list(hf_state_dict(tiny_model(seed=1)).items())

    async def main():
        engine = SGLangEngine(url=server.url, weights_dir=str(tmp_path / "w"))
        await engine.start()
        try:
            await engine.update_weights(3, [named])
            assert await engine.verify_weights(3) == ("", "version")
            with pytest.raises(SGLangError, match="reports weight version '3' after the update to 4"):
                await engine.verify_weights(4)
            if hash_route:
                assert await asyncio.to_thread(standin_weights_hash, engine.url) == weights_hash(named)
        finally:
            await engine.stop()

    try:
        run(main())
    finally:
        server.stop()
