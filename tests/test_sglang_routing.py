"""Routing replay (algo.routing_replay: r3) with SGLang rollouts: the client decodes SGLang 0.5.23's
meta_info.routed_experts (base64 int32 [tokens, num_hidden_layers, top-k]) into the trajectory's
[tokens, sparse layers, top-k] and keeps the last segment's routing of an interrupted sample; the stand-in
returns its model's own routing as that release does; a rollout launched from settings with r3 carries the
routing into a trainer batch, whose replay gives the rollout's log-probs."""
from __future__ import annotations

import asyncio
import base64
import copy
import functools
import sys

import pytest
import torch

from actors.batch import Batch, BatchGroup, as_columns
from actors.engines.base import EngineError, GenerationRequest, SamplingParams
from actors.engines.checkpoint import save_model
from actors.engines.sglang import RoutedExpertsLayout, SGLangEngine, _Sample, _sample_seed
from actors.engines.sglang_routes import SGLangError, SGLangLaunchError
from actors.engines.torch_gen import TorchGenerationEngine
from actors.engines.torch_train import TorchTrainEngine, TrainConfig
from actors.trainer.step import StepConfig, train_on_batch
from launch.inputs import sglang_routing_problem
from testsupport.bounded import run_bounded
from testsupport.sglang_standin import StandinThread, launch_config
from testsupport.tiny_models import near_tie_moe_model, tiny_model
from transport.messages import decode, encode
from transport.protocol import BufferStats, Sample

TIMEOUT = 300.0   # a bound against hangs: a launched stand-in imports torch
run = functools.partial(run_bounded, timeout=TIMEOUT)
PROMPT = (1, 2, 3, 4, 5)
# Three layers, the middle one dense: SGLang's column of layer 1 stays zero and is dropped.
LAYOUT = RoutedExpertsLayout(num_layers=3, sparse_layers=(0, 2), top_k=2, num_experts=8)


def sglang_encoding(ids: torch.Tensor) -> str:
    """What 0.5.23 sends: base64 of the int32 bytes of [rows, num_hidden_layers, top-k]."""
    return base64.b64encode(ids.to(torch.int32).numpy().tobytes()).decode("ascii")


def full_routing(rows: int, seed: int) -> torch.Tensor:
    """A [rows, 3 layers, top-2] routing as SGLang captures it, layer 1 (dense) never written."""
    ids = torch.randint(0, 8, (rows, 3, 2), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    ids[:, 1] = 0
    return ids


def test_the_encoding_decodes_to_the_sparse_layers_per_token():
    ids = full_routing(6, seed=0)
    routes = LAYOUT.decode(sglang_encoding(ids), rows=6)
    assert routes.dtype == torch.uint8 and routes.shape == (6, 2, 2)
    assert torch.equal(routes.long(), ids[:, [0, 2]].long())
    assert RoutedExpertsLayout(3, (0, 2), 2, 300).decode(sglang_encoding(ids), 6).dtype == torch.int16
    with pytest.raises(SGLangError, match=r" 144 bytes, expected 7 tokens x 3 layers x top-2 int32 = 168"):
        LAYOUT.decode(sglang_encoding(ids), rows=7)
    with pytest.raises(SGLangError, match="not base64"):
        LAYOUT.decode("not base64!", rows=6)
    with pytest.raises(SGLangError, match="expected a base64 string, got list"):
        LAYOUT.decode([[0, 1]], rows=6)
    ids[2, 2, 1] = 8
    with pytest.raises(SGLangError, match=r"expert ids in \[0, 8\], the model has 8 experts"):
        LAYOUT.decode(sglang_encoding(ids), rows=6)


def answer(tokens: list[int], reason: str, routing: torch.Tensor | None) -> dict:
    meta = {"finish_reason": {"type": reason}, "weight_version": "0",
            "output_token_logprobs": [[-0.5, t, None] for t in tokens]}
    if routing is not None:
        meta["routed_experts"] = sglang_encoding(routing)
    return {"output_ids": tokens, "meta_info": meta}


def test_an_interrupted_sample_keeps_the_routing_of_its_last_segment_aligned_with_its_tokens():
    engine = SGLangEngine(url="http://127.0.0.1:1", routed_experts=LAYOUT)
    request = GenerationRequest("r", (7, 8, 9, 10))
    sample = _Sample(request.input_ids)
    # Segment 1 (4 prompt tokens sent) is interrupted after 3 tokens: rows for 4 + 3 - 1 tokens fed.
    first = full_routing(6, seed=1)
    assert engine._take_answer(request, sample, answer([20, 21, 22], "abort", first), 0) == "abort"
    assert torch.equal(engine._whole_routes(sample).long(), first[:, [0, 2]].long())
    # Its resubmission was aborted before it ran: no routing, no tokens; the first segment's still covers all.
    engine._take_answer(request, sample, answer([], "abort", None), 0)
    assert engine._whole_routes(sample).shape[0] == 6
    # Segment 2 sends the 7 tokens held and ends after 2 more: its routing (the 7 routed again, under the
    # weights it ran on, and the new one fed) replaces the first's.
    second = full_routing(8, seed=2)
    assert engine._take_answer(request, sample, answer([23, 24], "stop", second), 0) == "stop"
    assert sample.output == [20, 21, 22, 23, 24]
    assert torch.equal(engine._whole_routes(sample).long(), second[:, [0, 2]].long())
    # A segment whose routing does not cover the tokens it sent is refused, and so is an answer without any
    # from a server launched without the flag.
    with pytest.raises(SGLangError, match=r"expected 9 tokens"):
        engine._take_answer(request, sample, answer([25], "length", full_routing(8, seed=3)), 0)
    with pytest.raises(SGLangError, match="the server runs without --enable-return-routed-experts"):
        engine._take_answer(request, _Sample(request.input_ids), answer([25], "length", None), 0)
    # Tokens that came without routing (a retracted request's force-streamed tokens): the sample has none.
    partial = _Sample(request.input_ids)
    engine._take_answer(request, partial, answer([30], "abort", full_routing(4, seed=4)), 0)
    engine._take_answer(request, partial, answer([31], "abort", None), 0)
    assert engine._whole_routes(partial) is None


def generate(engine: SGLangEngine, n: int, tokens: int, seed: int = 1) -> list:
    async def main():
        await engine.start()
        try:
            return await engine.generate(GenerationRequest("g", PROMPT, SamplingParams(max_new_tokens=tokens, seed=seed),
                                                           n=n))
        finally:
            await engine.stop()
    return run(main())


def embedded(model, seed: int, tokens: int):
    """The embedded engine's own answer to what the stand-in was sent for sample 0 (its seed)."""
    async def main():
        engine = TorchGenerationEngine(model=copy.deepcopy(model), record_routing=True)
        await engine.start()
        try:
            [result] = await engine.generate(GenerationRequest("d", PROMPT, SamplingParams(max_new_tokens=tokens,
                                                                                           seed=seed), 1))
            return result
        finally:
            await engine.stop()
    return run(main())


def test_the_standin_returns_the_routing_its_model_routed_and_the_client_aligns_it(tmp_path):
    model = tiny_model(seed=3, family="qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    save_model(model, str(tmp_path / "model"))
    assert RoutedExpertsLayout.of_model(str(tmp_path / "model")) == LAYOUT
    server = StandinThread(TorchGenerationEngine(model=copy.deepcopy(model), record_routing=True),
                           return_routed_experts=True).start()
    try:
        results = generate(SGLangEngine(url=server.url, routed_experts=LAYOUT), n=2, tokens=24)
    finally:
        server.stop()
    for r in results:
        assert r.routed_experts.dtype == torch.uint8
        assert r.routed_experts.shape == (len(PROMPT) + len(r.output_ids) - 1, 2, 2)
    direct = embedded(model, _sample_seed(1, 0), tokens=24)
    assert direct.output_ids == results[0].output_ids
    assert torch.equal(direct.routed_experts, results[0].routed_experts)


def test_without_the_server_flag_the_answer_has_no_routing_and_the_rollout_says_why():
    model = tiny_model(seed=3, family="qwen3_moe")
    server = StandinThread(TorchGenerationEngine(model=copy.deepcopy(model), record_routing=True)).start()
    try:
        with pytest.raises(SGLangError, match=r"has no meta_info.routed_experts: the server runs without "
                                              r"--enable-return-routed-experts \(SGLang 0.5.23 or later has it\)"):
            generate(SGLangEngine(url=server.url, routed_experts=RoutedExpertsLayout(2, (0, 1), 2, 8)), 1, 4)
    finally:
        server.stop()
    with pytest.raises(EngineError, match="SGLang 0.5.6 has no --enable-return-routed-experts"):
        StandinThread(TorchGenerationEngine(model=model), release="0.5.6", return_routed_experts=True).start()


def test_the_oldest_release_refuses_the_flag_and_launch_refuses_r3_with_it(tmp_path):
    save_model(tiny_model(seed=3, family="qwen3_moe"), str(tmp_path / "model"))
    config = launch_config(str(tmp_path / "model"), tmp_path, release="0.5.6", routed_experts=True)

    async def main():
        with pytest.raises(SGLangLaunchError) as info:
            await SGLangEngine(launch=config).start()
        return str(info.value)
    assert "unrecognized arguments: --enable-return-routed-experts" in run(main())
    assert sglang_routing_problem("0.5.6") == (
        "r3 replays the routing the rollouts recorded; SGLang 0.5.6, installed here, returns none "
        "(--enable-return-routed-experts and /generate's return_routed_experts came after it; 0.5.23 has them)")
    assert sglang_routing_problem("0.5.23") is None and sglang_routing_problem(None) is None


def test_an_r3_rollout_on_sglang_carries_the_routing_the_trainer_replays(tmp_path):
    from actors.rollout.actor import make_engine
    from topology.settings import RolloutSettings

    model = near_tie_moe_model()
    save_model(model, str(tmp_path / "model"))
    settings = {"engine": "sglang", "instance": {"group": "rollout", "index": 0},
                "sglang": {"command": [sys.executable, "-m", "testsupport.sglang_standin"],
                           "env": {"OMP_NUM_THREADS": "1"}, "health_timeout_s": 120.0}}
    dense = make_engine(RolloutSettings.model_validate(settings), 0, str(tmp_path / "model"), run_dir=str(tmp_path))
    assert dense.routed_experts is None and "--enable-return-routed-experts" not in dense.server.config.args(1, 0)
    engine = make_engine(RolloutSettings.model_validate({**settings, "algo": {"routing_replay": "r3"}}), 0,
                         str(tmp_path / "model"), run_dir=str(tmp_path))
    assert engine.routed_experts == RoutedExpertsLayout(2, (0, 1), 1, 4)
    assert "--enable-return-routed-experts" in engine.server.config.args(1, 0)

    groups = []

    async def main():
        await engine.start()
        try:
            for g in range(2):
                results = await engine.generate(GenerationRequest(
                    f"r{g}", (1 + g, 2, 3), SamplingParams(max_new_tokens=40, seed=g), n=6))
                groups.append(BatchGroup(prompt_ids=[1 + g, 2, 3], level=g % 2, samples=[
                    Sample(output_ids=r.output_ids, logprobs=r.logprobs, versions=r.versions,
                           finish_reason=r.finish_reason, reward=5.0 if i % 2 else -5.0, correct=bool(i % 2),
                           routed_experts=r.routed_experts) for i, r in enumerate(results)]))
        finally:
            await engine.stop()
    run(main())
    _, batch = decode(encode(as_columns(Batch(step=1, groups=groups, stats=BufferStats()))))  # as the buffer sends it
    assert all(r.dtype == torch.uint8 and r.shape[1:] == (2, 1) for r in batch.routed_experts)
    gaps = {}
    for replay in ("r3", "none"):
        trainer = TorchTrainEngine(model=copy.deepcopy(model), config=TrainConfig(lr=1e-3))
        stats = train_on_batch(trainer, batch, StepConfig.defaults(minibatches=2, routing_replay=replay), version=0)
        gaps[replay] = stats["logprob_gap_max"]
    # The rollout's routing replayed: the trainer computes the server's log-probs; its own routing breaks the
    # near-ties differently.
    assert gaps["r3"] < 1e-5 and gaps["none"] > 1e-3, gaps
