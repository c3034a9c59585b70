"""Sparse upcycling (launch/prepare/upcycle.py) and the warm-start recipe that starts from it (launch/prepare/stage.py)."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from actors.engines.checkpoint import load_model
from actors.engines.moe import RoutingTrace
from launch.prepare.stage import PrepareError, prepare
from launch.prepare.upcycle import UpcycleError, upcycle
from testsupport.tiny_models import ARITH_TOKENIZER_DIR, ARITH_VOCAB, tiny_config, tiny_model_dir

SHAPE = dict(vocab_size=ARITH_VOCAB, max_position_embeddings=4096, head_dim=16)


def moe_dir(path: Path, **overrides) -> Path:
    """A Qwen3-MoE model directory without weights: config.json (the tiny dense model's shape, each expert a
    half of its 128-unit MLP) and the arith tokenizer."""
    path.mkdir(parents=True)
    config = tiny_config("qwen3_moe", **{**SHAPE, "moe_intermediate_size": 64, **overrides})
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(ARITH_TOKENIZER_DIR / name, path / name)
    return path


def test_each_expert_is_a_part_of_the_dense_mlp_and_one_of_each_part_computes_it(tmp_path: Path) -> None:
    dense_dir = tiny_model_dir(tmp_path / "dense", seed=3)
    done = upcycle(str(dense_dir), str(moe_dir(tmp_path / "moe")), str(tmp_path / "out"))
    dense, moe = load_model(str(dense_dir)), load_model(str(tmp_path / "out"))
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (ARITH_TOKENIZER_DIR / "tokenizer.json").read_bytes()
    layers = range(dense.config.num_hidden_layers)
    assert done["parts"] == 2
    assert done["left_out"] == sorted(f"model.layers.{i}.self_attn.{p}_proj.bias" for i in layers for p in "qkv")
    assert done["initialised"] == sorted([f"model.layers.{i}.mlp.gate.weight" for i in layers]
                                         + [f"model.layers.{i}.self_attn.{n}.weight" for i in layers
                                            for n in ("k_norm", "q_norm")])
    assert torch.equal(moe.model.embed_tokens.weight, dense.model.embed_tokens.weight)
    assert torch.equal(moe.lm_head.weight, dense.lm_head.weight)
    for d, m in zip(dense.model.layers, moe.model.layers):
        assert torch.equal(m.self_attn.o_proj.weight, d.self_attn.o_proj.weight)
        assert torch.equal(m.post_attention_layernorm.weight, d.post_attention_layernorm.weight)
        assert torch.equal(m.mlp.experts[5].up_proj.weight, d.mlp.up_proj.weight[64:])
        assert torch.equal(m.mlp.experts[2].down_proj.weight, 2 * d.mlp.down_proj.weight[:, :64])

    # A token routed to one expert of each part, with equal weights (a zero router), gets the dense MLP's output;
    # to two experts of the same part, it does not.
    layer = moe.model.layers[0].mlp
    with torch.no_grad():
        layer.gate.weight.zero_()
        x = torch.randn(6, dense.config.hidden_size, generator=torch.Generator().manual_seed(0))
        want = dense.model.layers[0].mlp(x)

        def routed(a: int, b: int) -> torch.Tensor:
            return layer(x, RoutingTrace(replay=torch.tensor([[[a, b]]] * len(x))))
        torch.testing.assert_close(routed(4, 1), want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(routed(4, 2), want, atol=1e-3)


@pytest.mark.parametrize("overrides, words", [
    ({"hidden_size": 32}, "key 'hidden_size' is 64"),
    ({"num_hidden_layers": 3}, "key 'num_hidden_layers' is 2"),
    ({"moe_intermediate_size": 48}, "intermediate_size 128 is not a multiple of moe_intermediate_size 48"),
])
def test_a_dense_model_of_another_shape_is_refused_naming_the_key(tmp_path: Path, overrides: dict, words: str) -> None:
    dense_dir = tiny_model_dir(tmp_path / "dense")
    with pytest.raises(UpcycleError, match="upcycle: ") as err:
        upcycle(str(dense_dir), str(moe_dir(tmp_path / "moe", **overrides)), str(tmp_path / "out"))
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_only_a_dense_source_and_a_mixture_of_experts_target_are_taken(tmp_path: Path) -> None:
    dense_dir = tiny_model_dir(tmp_path / "dense")
    with pytest.raises(UpcycleError, match="not a mixture of experts"):
        upcycle(str(dense_dir), str(dense_dir), str(tmp_path / "out"))
    moe = moe_dir(tmp_path / "moe")
    shutil.copy(tiny_model_dir(tmp_path / "m", family="qwen3_moe") / "model.safetensors", tmp_path / "moe")
    with pytest.raises(UpcycleError, match="a mixture of experts already"):
        upcycle(str(moe), str(moe), str(tmp_path / "out"))


def test_an_upcycled_recipe_ships_and_its_fingerprint_follows_the_dense_weights(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    from launch.prepare.stage import SHIPPED_MANIFEST
    from tools.prepare import main

    dense_dir = tiny_model_dir(tmp_path / "dense", seed=3)
    data, shipped = tmp_path / "d", tmp_path / "shipped"
    exp = {
        "model": {"path": str(moe_dir(tmp_path / "moe"))},
        "data": {"train": str(data / "train.jsonl"), "test": str(data / "test.jsonl")},
        "prepare": {
            "data": [{"out": str(data), "args": {"train_per_level": 20, "test_per_level": 4, "max_operand": 9}}],
            "warm_start": {"out": str(tmp_path / "ws"), "upcycle": str(dense_dir), "shipped": str(shipped),
                           "stages": [{"data": str(data), "args": {"steps": 2, "batch_size": 8, "seed": 0}}]},
        },
    }
    # the rebuild command, as a user runs it: upcycles, trains the stage and writes the shipped copy
    overrides = [f"experiment.{key}={json.dumps(exp[key])}" for key in ("model", "data", "prepare")]
    assert main(["topology/local_moe.yaml", *overrides, "--ship"]) == 0
    out = capsys.readouterr().out
    assert "upcycling the dense" in out and "initialised" not in out and "loaded" in out, out
    manifest = json.loads((shipped / SHIPPED_MANIFEST).read_text())
    assert manifest["upcycled_from"] == str(dense_dir) and [s["steps"] for s in manifest["stages"]] == [2]

    def fresh_clone() -> list[str]:   # the cache is gone; the shipped copy is all there is
        shutil.rmtree(tmp_path / "ws", ignore_errors=True)
        lines: list[str] = []
        prepared = prepare(copy.deepcopy(exp), log=lines.append)
        return [*lines, f"model.path {prepared['model']['path']}"]

    lines = fresh_clone()
    assert lines[-1] == f"model.path {shipped}" and any("using the shipped warm start" in x for x in lines), lines

    # other dense weights make another recipe: the shipped copy is refused and the warm start made again
    shutil.copy(tiny_model_dir(tmp_path / "other", seed=4) / "model.safetensors", dense_dir / "model.safetensors")
    lines = fresh_clone()
    assert any("not using the shipped warm start" in x and "made by another recipe" in x for x in lines), lines
    assert any("upcycling the dense" in x for x in lines) and lines[-1] == f"model.path {tmp_path / 'ws' / 'stage1'}"

    (dense_dir / "model.safetensors").unlink()
    with pytest.raises(PrepareError, match="prepare.warm_start.upcycle: .*no weights to upcycle"):
        fresh_clone()


def test_the_shipped_moe_warm_start_is_the_one_its_recipe_makes(tmp_path: Path) -> None:
    # configs/models/arith-tiny-moe-warm stands for configs/local_moe.yaml's recipe only while its manifest names
    # that recipe's fingerprint (the dense warm start it upcycles included): a changed recipe must be re-shipped.
    import yaml

    from launch.prepare.stage import _fingerprint, cli_args, shipped_problem
    from launch.prepare.task import make_task
    from topology.experiment import WarmStartStage

    root = Path(__file__).resolve().parents[1]
    config = yaml.safe_load((root / "configs" / "local_moe.yaml").read_text())
    recipe, data_args = config["prepare"]["warm_start"], {d["out"]: d["args"] for d in config["prepare"]["data"]}
    stages = []
    for stage in recipe["stages"]:
        assert make_task(["--out", str(tmp_path / stage["data"]), *cli_args(data_args[stage["data"]])]) == 0
        stages.append(WarmStartStage(data=str(tmp_path / stage["data"]), args=stage["args"]))
    digest = _fingerprint(root / config["model"]["path"], stages, str(root / recipe["upcycle"]))
    assert shipped_problem(root / recipe["shipped"], digest) is None
