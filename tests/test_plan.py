"""tools.plan: the memory fit per GPU (and tools.up --dry-run's refusal) and the run's simulation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.engines.model import Qwen2Config, Qwen2ForCausalLM, param_count
from tools import topology, up
from tools.plan import memory, setup
from tools.plan.shapes import BUILTIN, ShapeError, from_hf_config, resolve

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = sorted((ROOT / "topology").glob("*.yaml"))


def test_shape_from_a_hugging_face_config_counts_the_model_s_parameters():
    path = ROOT / "configs/models/arith-tiny/config.json"
    shape = from_hf_config(path)
    model = Qwen2ForCausalLM(Qwen2Config.from_dict(json.loads(path.read_text())))
    assert shape.params == param_count(model)


def test_builtin_shapes_match_the_published_parameter_counts():
    # Model cards: 1.78B, 7.62B and 32.8B parameters.
    assert [round(BUILTIN[k].params / 1e9, 2) for k in ("1.5B", "7B", "32B")] == [1.78, 7.62, 32.76]
    assert resolve("/storage/models/DeepSeek-R1-Distill-Qwen-7B") is BUILTIN["7B"]


def test_a_model_without_a_shape_is_an_error_naming_model_path():
    with pytest.raises(ShapeError, match="experiment.model.path: '/nowhere/mystery'"):
        resolve("/nowhere/mystery")


def _dry_run(capsys, *overrides: str) -> tuple[int, str]:
    rc = up.main(["topology/64node.yaml", *overrides, "--dry-run", "--no-import-check"])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_dry_run_refuses_7b_at_32k_without_recompute_and_accepts_it_with_recompute(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc, text = _dry_run(capsys, "actors.trainer.settings.recompute=none")
    assert rc == up.EXIT_INVALID
    assert "actors.trainer: needs" in text and "largest term: activations" in text
    rc, text = _dry_run(capsys, "actors.trainer.settings.recompute=full")
    assert rc == up.EXIT_OK, text
    assert "memory per GPU" in text and "DOES NOT FIT" not in text


def test_the_log_prob_chunk_bounds_the_float32_logits_term():
    shape = BUILTIN["7B"]
    whole = memory.trainer_terms(shape, memory.TrainerLayout(tp=4, micro_batch_tokens=32768))["logits"]
    chunked = memory.trainer_terms(shape, memory.TrainerLayout(tp=4, micro_batch_tokens=32768,
                                                               logprob_chunk_tokens=4096))["logits"]
    bf16_logits = 2 * 2 * 32768 * shape.vocab / 4
    assert chunked - bf16_logits == pytest.approx((whole - bf16_logits) / 8)


def test_sequence_parallelism_and_pipeline_stages_change_the_activation_term_as_they_should():
    shape = BUILTIN["7B"]
    base = memory.TrainerLayout(tp=4, micro_batch_tokens=8192)
    act = lambda **kw: memory.trainer_terms(shape, memory.TrainerLayout(**{**base.__dict__, **kw}))["activations"]
    shared, split = memory.activation_elements_per_token(shape)
    assert act() - act(sequence_parallel=True) == pytest.approx(2 * 8192 * shared * (1 - 1 / 4) * shape.layers)
    # pp=2: half the layers per stage, two micro-batches in flight (1F1B) on the first stage.
    assert act(pp=2) == pytest.approx(act())


def test_a_kv_cache_too_small_for_one_answer_is_named():
    lay = memory.RolloutLayout(tp=1, mem_fraction_static=0.2, answer_tokens=32768)
    m = memory.rollout_memory("rollout", BUILTIN["7B"], lay, 80e9)
    assert not m.fits and m.answers_at_once == 0
    assert "actors.rollout: the KV cache holds" in m.problem()


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.stem)
def test_every_shipped_topology_plans_and_its_gpu_groups_fit(path):
    found = setup.read(topology.load(path, check_imports=False))
    groups = setup.group_memory(found)
    gpu_groups = [g for g in found.groups if g.device == "cuda"]
    assert len(groups) == len(gpu_groups)
    for m in groups:
        assert m.fits, m.problem()
