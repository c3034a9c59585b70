"""The embedded generation engine: correctness of tokens and log-probs, continuous batching, sampling,
abort, pause/resume, and interruptible weight updates (versions recorded per token)."""
from __future__ import annotations

import asyncio
import functools
import threading

import pytest
import torch

from actors.engines.base import EngineError, GenerationRequest, PackedBatch, RequestError, SamplingParams
from actors.engines.checkpoint import CheckpointError, hf_state_dict
from actors.engines.torch_gen import TorchGenerationEngine, counter_uniform, sample_tokens
from actors.engines.torch_train import TorchTrainEngine
from testsupport.bounded import run_bounded
from testsupport.tiny_models import greedy_reference, random_sequences, tiny_model

TIMEOUT = 60.0
VOCAB = 97


run = functools.partial(run_bounded, timeout=TIMEOUT)


async def started(model=None, **kwargs) -> TorchGenerationEngine:
    engine = TorchGenerationEngine(model=model if model is not None else tiny_model(seed=0), **kwargs)
    await engine.start()
    return engine


FAMILIES = ["qwen2", "qwen3", "qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_full_forward_and_trainer(family):
    model = tiny_model(seed=0, family=family)
    prompts = random_sequences(6, 3, 25, VOCAB, seed=1)

    async def main():
        engine = await started(model)
        try:
            return await asyncio.gather(*[engine.generate(GenerationRequest(
                f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=12 + i))) for i, p in enumerate(prompts)])
        finally:
            await engine.stop()

    results = run(main())
    trainer = TorchTrainEngine(model=tiny_model(seed=0, family=family))
    for i, (prompt, [result]) in enumerate(zip(prompts, results)):
        assert result.finish_reason == "length" and len(result.output_ids) == 12 + i
        assert result.output_ids == greedy_reference(model, prompt, 12 + i)
        assert result.versions == [0] * len(result.output_ids) and result.prompt_len == len(prompt)
        # Rollout and trainer agree on behaviour log-probs (the design's first invariant).
        batch = PackedBatch.from_sequences([prompt + result.output_ids])
        recomputed = trainer.compute_logprobs(batch).logprobs[len(prompt):]
        torch.testing.assert_close(torch.tensor(result.logprobs), recomputed, atol=1e-5, rtol=0)


def test_sampled_logprobs_are_under_the_temperature_scaled_distribution():
    model = tiny_model(seed=2)
    prompt = random_sequences(1, 8, 8, VOCAB, seed=3)[0]

    async def main():
        engine = await started(model)
        try:
            return await engine.generate(GenerationRequest("t", prompt, SamplingParams(
                temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, seed=11), n=3))
        finally:
            await engine.stop()

    results = run(main())
    trainer = TorchTrainEngine(model=tiny_model(seed=2))
    assert [r.index for r in results] == [0, 1, 2]
    for r in results:
        batch = PackedBatch.from_sequences([prompt + r.output_ids])
        recomputed = trainer.compute_logprobs(batch, temperature=0.7).logprobs[len(prompt):]
        torch.testing.assert_close(torch.tensor(r.logprobs), recomputed, atol=1e-5, rtol=0)


def test_seeded_samples_do_not_depend_on_batch_company_and_n_samples_differ():
    model = tiny_model(seed=4)
    prompt = random_sequences(1, 10, 10, VOCAB, seed=5)[0]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20, seed=123)

    async def main():
        engine = await started(model)
        try:
            alone = await engine.generate(GenerationRequest("a", prompt, sampling, n=4))
            others = [engine.generate(GenerationRequest(f"o{i}", p, SamplingParams(max_new_tokens=30, seed=i)))
                      for i, p in enumerate(random_sequences(8, 2, 30, VOCAB, seed=6))]
            crowd, *_ = await asyncio.gather(engine.generate(GenerationRequest("b", prompt, sampling, n=4)), *others)
            return alone, crowd
        finally:
            await engine.stop()

    alone, crowd = run(main())
    assert [r.output_ids for r in alone] == [r.output_ids for r in crowd]
    assert len({tuple(r.output_ids) for r in alone}) == 4  # independent streams per sample


def test_stop_tokens_and_lengths_end_each_sample_independently():
    model = tiny_model(seed=0)
    prompt = random_sequences(1, 5, 5, VOCAB, seed=1)[0]
    greedy = greedy_reference(model, prompt, 10)
    stop = greedy[3]
    first = greedy.index(stop)

    async def main():
        engine = await started(model)
        try:
            return await engine.generate(GenerationRequest("s", prompt, SamplingParams(
                temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,))))
        finally:
            await engine.stop()

    [result] = run(main())
    assert result.finish_reason == "stop" and result.output_ids == greedy[:first + 1]


def test_sample_tokens_respects_top_k_top_p_and_matches_probabilities():
    torch.manual_seed(0)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    seeds = torch.full((4000,), 7)
    u = counter_uniform(seeds, torch.zeros(4000, dtype=torch.long), torch.arange(4000))
    ones = torch.ones(4000)
    tokens, logp = sample_tokens(logits, ones, ones, torch.full((4000,), 2), u)
    assert set(tokens.tolist()) == {0, 1}
    full = torch.log_softmax(logits[0], -1)
    torch.testing.assert_close(logp, full[tokens])  # the full-vocabulary log-prob, not the truncated one
    tokens, _ = sample_tokens(logits, ones, torch.full((4000,), 0.8), torch.zeros(4000, dtype=torch.long), u)
    assert set(tokens.tolist()) == {0, 1}  # p(0)=0.64, p(0)+p(1)=0.87 >= 0.8
    tokens, _ = sample_tokens(logits, ones, ones, torch.zeros(4000, dtype=torch.long), u)
    freq = torch.bincount(tokens, minlength=5).float() / 4000
    assert (freq - full.exp()).abs().max() < 0.03
    tokens, _ = sample_tokens(logits, torch.zeros(4000), ones, torch.zeros(4000, dtype=torch.long), u)
    assert tokens.eq(0).all()


def test_abort_one_and_all_return_partial_tokens():
    model = tiny_model(seed=0)
    prompts = random_sequences(3, 4, 8, VOCAB, seed=9)
    reached = threading.Event()

    async def main():
        engine = await started(model)
        engine.on_step = lambda step: reached.set() if step >= 3 else None
        try:
            tasks = [asyncio.ensure_future(engine.generate(GenerationRequest(
                f"r{i}", p, SamplingParams(max_new_tokens=200, seed=i, temperature=1.0)))) for i, p in enumerate(prompts)]
            assert await asyncio.to_thread(reached.wait, TIMEOUT)
            assert await engine.abort("r1") == 1
            one = await tasks[1]
            assert await engine.abort() == 2
            rest = await asyncio.gather(tasks[0], tasks[2])
            assert await engine.abort("gone") == 0
            health = await engine.health()
            return one, rest, health
        finally:
            await engine.stop()

    one, rest, health = run(main())
    for [r] in [one, *rest]:
        assert r.finish_reason == "abort" and 3 <= len(r.output_ids) < 200
        assert len(r.logprobs) == len(r.versions) == len(r.output_ids)
    assert health["running"] == 0 and health["waiting"] == 0 and health["ok"]


def test_pause_holds_requests_and_resume_finishes_them():
    model = tiny_model(seed=0)

    async def main():
        engine = await started(model)
        try:
            await engine.pause()
            task = asyncio.ensure_future(engine.generate(GenerationRequest("p", [1, 2, 3], SamplingParams(
                temperature=0.0, max_new_tokens=5))))
            await asyncio.sleep(0)  # let generate() enqueue (scheduling, not timing)
            health = await engine.health()
            assert health["paused"] and health["waiting"] == 1 and not task.done()
            await engine.resume()
            return await task
        finally:
            await engine.stop()

    [result] = run(main())
    assert result.output_ids == greedy_reference(model, [1, 2, 3], 5)


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_update_mid_generation_switches_versions_at_a_step_boundary(family):
    old, new = tiny_model(seed=0, family=family), tiny_model(seed=1, family=family)
    prompts = random_sequences(3, 4, 12, VOCAB, seed=2)
    swap_at = 4
    engine = TorchGenerationEngine(model=tiny_model(seed=0, family=family), record_routing=True)

    reached = threading.Event()

    def hold_until_staged(step: int) -> None:
        # Block the decode thread after step 4 until the new weights are fully staged, so the swap lands
        # exactly at the next boundary: deterministic, and decoding continued while they streamed in.
        if step == swap_at:
            reached.set()
            with engine._cond:
                assert engine._cond.wait_for(lambda: engine._pending_swap is not None, TIMEOUT)

    async def main():
        await engine.start()
        engine.on_step = hold_until_staged
        try:
            await engine.pause()  # so that all three requests join the batch at the same boundary
            tasks = [asyncio.ensure_future(engine.generate(GenerationRequest(
                f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=12)))) for i, p in enumerate(prompts)]
            await asyncio.sleep(0)
            await engine.resume()
            assert await asyncio.to_thread(reached.wait, TIMEOUT)
            buckets = [[(k, v)] for k, v in hf_state_dict(new).items()]
            await engine.update_weights(7, iter(buckets))
            assert engine.version == 7
            return await asyncio.gather(*tasks), engine.swaps[-1]
        finally:
            await engine.stop()

    results, swap = run(main())
    assert swap.rows_rebuilt == 3 and swap.version == 7
    for prompt, [r] in zip(prompts, results):
        switch = r.versions.index(7)
        assert r.versions == [0] * switch + [7] * (12 - switch)
        assert switch == swap_at + 1  # the prefill token plus 4 decode steps under the old weights
        expected_old = greedy_reference(old, prompt, switch)
        assert r.output_ids[:switch] == expected_old
        # After the swap the new weights continue from the tokens so far (rebuilt KV cache).
        assert r.output_ids[switch:] == greedy_reference(new, prompt + expected_old, 12 - switch)
        if family == "qwen3_moe":  # the routing of every token fed, as the rebuilt cache routed it
            assert r.routed_experts.shape == (len(prompt) + 11, 2, 2) and r.routed_experts.dtype == torch.uint8
        else:
            assert r.routed_experts is None


def test_weight_update_while_idle_and_errors():
    async def main():
        engine = await started(tiny_model(seed=0))
        try:
            new = tiny_model(seed=1)

            async def source():
                for name, tensor in hf_state_dict(new).items():
                    yield [(name, tensor)]

            await engine.update_weights(1, source())
            for (name, a), (_, b) in zip(engine.model.named_parameters(), new.named_parameters()):
                assert torch.equal(a, b), name
            with pytest.raises(CheckpointError, match="unexpected tensor 'model.nope'"):
                await engine.update_weights(2, [[("model.nope", torch.zeros(1))]])
            with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \(3,\)"):
                await engine.update_weights(2, [[("model.norm.weight", torch.zeros(3))]])
            assert engine.version == 1
            with pytest.raises(RequestError, match="outside the vocabulary"):
                await engine.generate(GenerationRequest("x", [5000], SamplingParams()))
            with pytest.raises(RequestError, match="max_position_embeddings"):
                await engine.generate(GenerationRequest("x", [1] * 300, SamplingParams()))
        finally:
            await engine.stop()
        with pytest.raises(EngineError, match="not running"):
            await engine.generate(GenerationRequest("x", [1], SamplingParams()))

    run(main())
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(RequestError, match="input_ids is empty"):
        GenerationRequest("x", [])
    with pytest.raises(RequestError, match="n must be"):
        GenerationRequest("x", [1], n=0)


def test_event_loop_keeps_running_while_decoding():
    async def main():
        engine = await started(tiny_model(seed=0))
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick_task = asyncio.ensure_future(ticker())
        try:
            await engine.generate(GenerationRequest("long", [1, 2, 3], SamplingParams(max_new_tokens=150, seed=0), n=8))
        finally:
            tick_task.cancel()
            await engine.stop()
        return ticks

    assert run(main()) > 50


def test_abort_landing_with_admission_at_one_boundary_is_not_missed():
    """An abort and the admission of the request it names can meet at one step boundary (a resume and an
    abort posted together): the request must come back aborted, not run to its full length."""
    async def main() -> None:
        engine = await started(tiny_model(0))
        try:
            await engine.pause()
            task = asyncio.ensure_future(engine.generate(GenerationRequest(
                rid="late", input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=200, seed=1))))
            await asyncio.sleep(0)  # let generate() queue the request (the engine is paused: not admitted)
            assert (await engine.health())["waiting"] == 1
            with engine._cond:  # re-entrant: the decode thread sees both changes at its next boundary
                assert await engine.abort("late") == 1
                await engine.resume()
            (result,) = await asyncio.wait_for(task, timeout=60)
            assert result.finish_reason == "abort" and len(result.output_ids) < 200
        finally:
            await engine.stop()
    run(main())
