"""Qwen3-MoE weights into SGLang: the names and shapes a server loads (the stand-in's ``WeightRules``, as
SGLang's Qwen3 / Qwen3-MoE ``load_weights`` and FusedMoE do, with the server's own tensor and expert
parallelism), a whole trainer version pushed in buckets through the engine client, and buckets of mixed dtypes
laid out so that SGLang 0.5.23's flattened receive takes them."""
from __future__ import annotations

import asyncio
import functools
import json
import re
import urllib.request

import pytest
import torch

from actors.engines.base import RequestError
from actors.engines.checkpoint import hf_state_dict, save_model
from actors.engines.sglang import SGLangEngine, WeightsIncompleteError
from actors.engines.sglang_group import WeightGroupSender
from actors.engines.torch_train import TorchTrainEngine
from actors.weight_sync.direct import KeptVersions
from actors.weights import weights_hash
from testsupport.bounded import run_bounded
from testsupport.sglang_standin import WeightRules, launch_config
from testsupport.tiny_models import tiny_model
from transport.bulk import FLAT_ALIGN, BulkError, bucket_views, flat_misaligned, flat_order, pack_bucket
from transport.ports import free_port

TIMEOUT = 300.0   # a bound against hangs: a launched stand-in and its tp worker each import torch
run = functools.partial(run_bounded, timeout=TIMEOUT)
EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def moe_model(seed: int):
    return tiny_model(seed=seed, family="qwen3_moe", num_experts=4, num_experts_per_tok=2)


def test_each_expert_is_loaded_by_the_ranks_of_its_expert_parallel_rank_only():
    model = moe_model(0)
    rules = WeightRules(model, tp_size=4, ep_size=2)   # 2 experts per EP rank, each expert split over 2 ranks
    shapes = {n: tuple(t.shape) for n, t in hf_state_dict(model).items()}
    assert any(".q_norm." in n for n in shapes) and any(".mlp.gate." in n for n in shapes)
    for name, shape in shapes.items():
        expert = EXPERT.search(name)
        expected = list(range(4)) if expert is None else [0, 1] if int(expert.group(1)) < 2 else [2, 3]
        assert rules.ranks(name, shape) == expected, name
    # EP = TP: one rank per expert
    rules = WeightRules(model, tp_size=2, ep_size=2)
    assert rules.ranks("model.layers.1.mlp.experts.3.down_proj.weight",
                       shapes["model.layers.1.mlp.experts.3.down_proj.weight"]) == [1]


def test_names_sglang_would_not_load_and_wrong_shapes_are_refused():
    model = moe_model(0)
    rules = WeightRules(model, tp_size=2, ep_size=2)
    down = tuple(model.model.layers[0].mlp.experts[0].down_proj.weight.shape)
    with pytest.raises(ValueError, match=r"expert 4 of a model with 4 experts.*never load it"):
        rules.ranks("model.layers.0.mlp.experts.4.down_proj.weight", down)
    with pytest.raises(ValueError, match=r"no parameter of Qwen3MoeForCausalLM"):
        rules.ranks("model.layers.0.mlp.shared_expert.down_proj.weight", down)
    with pytest.raises(ValueError, match=r"no parameter of"):
        rules.ranks("model.layers.9.self_attn.q_norm.weight", (16,))
    with pytest.raises(ValueError, match=r"Attempted to load weight \(torch.Size\(\[1, 2\]\)\) into parameter"):
        rules.ranks("model.layers.0.mlp.experts.1.down_proj.weight", (1, 2))
    with pytest.raises(ValueError, match="must divide the model's 4 experts"):
        WeightRules(model, tp_size=3, ep_size=3)
    with pytest.raises(ValueError, match="must divide --tp-size"):
        WeightRules(model, tp_size=2, ep_size=4)
    tied = tiny_model(seed=0, family="qwen3", tie_word_embeddings=True)
    assert WeightRules(tied).ranks("lm_head.weight", (97, 64)) == []   # SGLang skips a tied head


def _rank_loads(url: str) -> list[dict[str, int]]:
    with urllib.request.urlopen(url + "/standin/log", timeout=60.0) as r:
        return json.loads(r.read())["rank_loads"]


def _hash(url: str) -> str:
    with urllib.request.urlopen(url + "/standin/weights_hash", timeout=60.0) as r:
        return str(json.loads(r.read())["weights_hash"])


async def _push(engine: SGLangEngine, sender: WeightGroupSender, version: int, packed: list) -> list:
    """One version from the trainer's kept buckets: the client receives each while the trainer broadcasts it."""
    def send_all() -> None:
        for p in packed:
            sender.send(bucket_views(p))
    return await asyncio.gather(engine.update_weights_from_distributed(version, [p.metas() for p in packed]),
                                asyncio.to_thread(send_all), return_exceptions=True)


def test_a_trainer_version_of_a_moe_model_reaches_a_server_with_its_own_tp_and_ep(tmp_path):
    # The embedded trainer's Hugging Face-named buckets, kept as the direct weight path keeps them, go to a
    # stand-in launched with --tp-size 2 --ep-size 2 (SGLang 0.5.23): afterwards it serves exactly the
    # trainer's weights, every expert was loaded by one rank once (the rank holding it), everything else by
    # both. A version whose last bucket names an expert the model lacks is refused: no tensor of that bucket
    # is loaded, the server stays paused and reports the last whole version, and the next whole version loads.
    model_dir = str(tmp_path / "start")
    save_model(moe_model(0), model_dir)
    trainer = TorchTrainEngine(model=moe_model(7))
    kept = KeptVersions()
    packed = kept.keep(1, trainer.export_weights(bucket_bytes=48 << 10))
    names = [m.name for p in packed for m in p.metas()]
    assert len(packed) > 3 and sorted(names) == sorted(hf_state_dict(trainer.model))

    # version 2: another trainer's buckets up to the last one holding an expert, whose first expert is renamed
    # to expert 4 (the model has 0..3)
    bad_buckets = [list(b) for b in TorchTrainEngine(model=moe_model(8)).export_weights(bucket_bytes=48 << 10)]
    end = max(i for i, b in enumerate(bad_buckets) if any(EXPERT.search(n) for n, _ in b))
    bad_buckets, last = bad_buckets[:end + 1], bad_buckets[end]
    victim = next(i for i, (n, _) in enumerate(last) if EXPERT.search(n))
    last[victim] = (EXPERT.sub(".mlp.experts.4.", last[victim][0]), last[victim][1])
    bad = [pack_bucket(b, i) for i, b in enumerate(flat_order(b) for b in bad_buckets)]
    good = kept.keep(3, TorchTrainEngine(model=moe_model(9)).export_weights(bucket_bytes=48 << 10))

    async def main():
        engine = SGLangEngine(launch=launch_config(model_dir, tmp_path, tp=2, ep=2))
        await engine.start()
        sender = WeightGroupSender("127.0.0.1", free_port(), world_size=3, backend="gloo", timeout_s=60)
        try:
            await asyncio.gather(engine.init_weights_group("127.0.0.1", sender.master_port, 1, 3, backend="gloo"),
                                 asyncio.to_thread(sender.open))
            first = await _push(engine, sender, 1, packed)
            after_first = await asyncio.to_thread(_hash, engine.url), await asyncio.to_thread(_rank_loads, engine.url)
            refused = await _push(engine, sender, 2, bad)
            after_bad = (await asyncio.to_thread(_rank_loads, engine.url), engine.incomplete_version,
                         await engine.reported_version(), (await engine.health())["paused"])
            last_ok = await _push(engine, sender, 3, good)
            return first, after_first, refused, after_bad, last_ok, await asyncio.to_thread(_hash, engine.url)
        finally:
            sender.close()
            await engine.stop()

    first, (hash1, loads1), refused, after_bad, last_ok, hash3 = run(main())
    assert first == [None, None] and last_ok == [None, None]
    assert hash1 == weights_hash(hf_state_dict(trainer.model).items())
    for name in names:
        expert = EXPERT.search(name)
        if expert is None:
            assert [loads1[r].get(name) for r in (0, 1)] == [1, 1], name
        else:
            holder = int(expert.group(1)) // 2
            assert loads1[holder].get(name) == 1 and name not in loads1[1 - holder], name

    failed, _ = refused
    assert isinstance(failed, WeightsIncompleteError) and "version 2" in str(failed), failed
    assert "expert 4 of a model with 4 experts" in str(failed.__cause__), failed.__cause__
    loads2, incomplete, reported, paused = after_bad
    bad_last = {m.name for m in bad[-1].metas()}
    assert all(loads2[r].get(n, 0) == loads1[r].get(n, 0) for r in (0, 1) for n in bad_last)   # none of it loaded
    assert incomplete == 2 and reported == "1" and paused
    good_model = TorchTrainEngine(model=moe_model(9)).model
    assert hash3 == weights_hash(hf_state_dict(good_model).items())


def _mixed_bucket(model) -> list[tuple[str, torch.Tensor]]:
    """The model's weights as a trainer with fp32 norms and bf16 matrices exports them, a matrix of an odd
    element count first: back to back, the fp32 norm after it would start at a byte offset of 2 mod 4."""
    named = hf_state_dict(model)
    order = ["model.embed_tokens.weight", "model.norm.weight"] + [n for n in named if n not in
                                                                  ("model.embed_tokens.weight", "model.norm.weight")]
    return [(n, named[n].to(torch.float32 if "norm" in n else torch.bfloat16).clone()) for n in order]


def test_a_bucket_of_fp32_norms_and_bf16_matrices_goes_through(tmp_path):
    # hidden 33: the embedding (97 x 33 bf16) is 6,402 bytes, so in the trainer's order the fp32 final norm would
    # start at byte 6,402. SGLang 0.5.23 refuses that bucket before receiving it; the client never sends it,
    # and the trainer's kept buckets are ordered so that it goes through whole.
    trained = tiny_model(seed=3, family="qwen3", hidden_size=33)
    bucket = _mixed_bucket(trained)
    metas = pack_bucket(bucket, align=16).metas()
    misaligned = flat_misaligned(metas)
    assert misaligned is not None and misaligned[0].name == "model.norm.weight" and misaligned[1] == 6402
    with pytest.raises(BulkError, match="would start at byte 6402"):
        pack_bucket(bucket, align=FLAT_ALIGN, checksum=False)

    model_dir = str(tmp_path / "start")
    save_model(tiny_model(seed=0, family="qwen3", hidden_size=33), model_dir)

    async def main():
        engine = SGLangEngine(launch=launch_config(model_dir, tmp_path))
        await engine.start()
        sender = WeightGroupSender("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=60)
        try:
            await asyncio.gather(engine.init_weights_group("127.0.0.1", sender.master_port, 1, 2, backend="gloo"),
                                 asyncio.to_thread(sender.open))
            with pytest.raises(RequestError, match=r"'model.norm.weight' \(float32\) at byte 6402"):
                await engine.update_weights_from_distributed(1, [metas])
            calls = (await asyncio.to_thread(_server_info, engine.url))["counters"]
            # What SGLang 0.5.23 answers to the bucket as it stands (the stand-in as that release), asked directly.
            await engine._post("/begin_weight_update", {})
            answer = await _raw_update(engine, metas)
            await engine._post("/end_weight_update", {})
            outcome = await _push(engine, sender, 1, KeptVersions().keep(1, [bucket]))
            return calls, answer, outcome, await engine.reported_version(), await asyncio.to_thread(_hash, engine.url)
        finally:
            sender.close()
            await engine.stop()

    calls, answer, outcome, reported, served = run(main())
    assert calls["distributed_calls"] == 0 and calls["updates"] == 0   # refused before anything was sent
    assert answer == (400, "Failed to receive weights: Unaligned received tensor model.norm.weight: byte offset "
                           "6402, dtype torch.float32")
    assert outcome == [None, None] and reported == "1"
    expected = dict(bucket)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            param.copy_(expected[name].float())
    assert served == weights_hash(hf_state_dict(trained).items())


def _server_info(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=60.0) as r:
        return json.loads(r.read())


async def _raw_update(engine: SGLangEngine, metas) -> tuple[int, str]:
    import aiohttp
    body = {"names": [m.name for m in metas], "dtypes": [m.dtype for m in metas],
            "shapes": [list(m.shape) for m in metas], "group_name": "weight_update_group",
            "load_format": "flattened_bucket", "flush_cache": True, "abort_all_requests": False}
    async with aiohttp.ClientSession() as session:
        async with session.post(engine.url + "/update_weights_from_distributed", json=body) as r:
            return r.status, (await r.json())["message"]


def test_a_rollouts_sglang_ep_size_launches_the_server_with_expert_parallelism(tmp_path):
    from actors.engines.base import EngineError
    from actors.rollout.actor import make_engine
    from topology.settings import RolloutSettings

    def settings(ep_size: int) -> RolloutSettings:
        return RolloutSettings.model_validate(
            {"engine": "sglang", "instance": {"group": "rollout", "index": 0, "parallel": {"tp": 4}},
             "sglang": {"command": ["python", "-m", "testsupport.sglang_standin"], "ep_size": ep_size}})

    args = make_engine(settings(2), 0, "/models/m", run_dir=str(tmp_path)).server.config.args(30001, 0)
    assert args[args.index("--tp-size") + 1] == "4" and args[args.index("--ep-size") + 1] == "2"
    assert "--ep-size" not in make_engine(settings(1), 0, "/models/m", run_dir=str(tmp_path)).server.config.args(1, 0)
    with pytest.raises(EngineError, match=r"rollout.0: settings.sglang.ep_size 3 does not divide parallel.tp 4"):
        make_engine(settings(3), 0, "/models/m", run_dir=str(tmp_path))
