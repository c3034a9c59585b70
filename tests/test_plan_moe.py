"""tools.plan on mixture-of-experts models: the shape's active parameters, the FLOPs, bytes, all-to-alls and
memory it charges for them, each on a case small enough to work by hand, and the Qwen3-30B-A3B topology."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from actors.engines.model import config_from_json_file
import topology
from tools import up
from launch.plan import hardware, memory, sizing
from tools.plan import costs, setup
from launch.plan.shapes import BUILTIN, ModelShape, from_hf_config, resolve

ROOT = Path(__file__).resolve().parent.parent
H800 = hardware.GPUS["H800"]

# One sparse layer: hidden 4, 2 query heads of 2 (q width 4), 1 KV head, Qwen3's q/k norms and no biases,
# 4 experts of width 3, 1 per token, tied embeddings over a vocabulary of 10.
TINY = ModelShape("tiny-moe", layers=1, hidden=4, intermediate=8, heads=2, kv_heads=1, vocab=10, tied=True,
                  source="test", head_size=2, qkv_bias=False, qk_norm=True, experts=4, experts_per_token=1,
                  moe_intermediate=3, sparse_layers=1)


def test_a_sparse_layer_counts_every_expert_in_its_parameters_and_one_per_token_in_its_active_ones():
    # attention: q 4x4, k and v 4x2 each, o 4x4, q/k norms 2 + 2 = 52; two norms 8; router 4 x 4 = 16;
    # experts 4 x (3 x 4 x 3) = 144; the tied embedding 40; the final norm 4.
    assert TINY.attention_params == 52
    assert TINY.expert_params == 144
    assert TINY.params == 52 + 8 + 16 + 144 + 40 + 4 == 264
    assert TINY.active_params == 264 - 144 + 36 == 156
    assert TINY.dense_params == 120


def test_qwen3_30b_a3b_has_its_model_card_s_counts_and_is_found_by_name():
    shape = BUILTIN["30B-A3B"]
    # Model card: 30.5B parameters in all, 3.3B activated.
    assert round(shape.params / 1e9, 1) == 30.5 and 3.3e9 < shape.active_params < 3.4e9
    assert shape.q_dim == 4096 and shape.kv_dim == 512
    assert resolve("/storage/models/Qwen3-30B-A3B") is shape
    assert resolve("/storage/models/DeepSeek-R1-Distill-Qwen-7B") is BUILTIN["7B"]


def test_a_config_json_s_shape_counts_what_the_embedded_model_counts():
    path = ROOT / "configs/models/arith-tiny-moe/config.json"
    shape, config = from_hf_config(path), config_from_json_file(str(path))
    assert shape.params == config.num_parameters()
    assert shape.active_params == config.num_parameters(active=True) < shape.params


def test_a_forward_pass_charges_the_active_parameters_and_the_query_width():
    # 2 x 156 active parameters a token; causal attention 2 x layers x q_dim x L^2 = 2 x 1 x 4 x 9 for L = 3.
    assert costs.forward_flops(TINY, 10, 0) == 2 * 156 * 10
    assert costs.forward_flops(TINY, 3, 9) == 2 * 156 * 3 + 2 * 1 * 4 * 9


def test_a_decode_step_reads_only_the_experts_its_answers_route_to():
    # 4 experts, 1 per token: one answer touches 1 expert, two touch 4 x (1 - (3/4)^2) = 1.75 on average.
    assert TINY.experts_read(1) == pytest.approx(1.0)
    assert TINY.experts_read(2) == pytest.approx(1.75)
    one_expert = 2 * 3 * 4 * 3
    assert costs.decode_weight_bytes(TINY, 1) == pytest.approx(2 * 120 + one_expert)
    assert costs.decode_weight_bytes(TINY, 2) == pytest.approx(2 * 120 + 1.75 * one_expert)
    # a large batch reads every expert: the whole model
    assert costs.decode_weight_bytes(TINY, 10_000) == pytest.approx(2 * TINY.params)
    dense = dataclasses.replace(TINY, experts=0, experts_per_token=0, moe_intermediate=0, sparse_layers=0)
    assert costs.decode_weight_bytes(dense, 7) == 2 * dense.params


def _trainer(**kw) -> costs.TrainerShape:
    base = dict(tp=1, pp=1, dp=16, micro_batch_tokens=4096, minibatches=1, recompute="none", gpus_per_node=8)
    return costs.TrainerShape(**{**base, **kw})


def test_the_expert_parallel_all_to_all_by_hand():
    shape = BUILTIN["30B-A3B"]
    # one pass over 1,000 tokens: each of 48 sparse layers dispatches and combines 8 bf16 copies of a 2,048-wide
    # hidden state a token, 7/8 of them to other GPUs, over one direction of NVLink (ep 8 fits a node).
    sent = 48 * 2 * 8 * 2048 * 2 * 1000 * 7 / 8
    nvlink = H800.nvlink_bytes_per_s / 2 * hardware.NVLINK_EFFICIENCY
    assert costs.ep_alltoall_seconds(shape, H800, _trainer(ep=8), 1000, 1) == pytest.approx(sent / nvlink)
    # ep 16 spans two nodes: each GPU's share of the node's network; 15/16 leave the GPU
    network = hardware.ROCE_NODE_BYTES_PER_S / 8 * hardware.NIC_EFFICIENCY
    assert costs.ep_alltoall_seconds(shape, H800, _trainer(ep=16), 1000, 3) == pytest.approx(
        3 * sent * (15 / 16) / (7 / 8) / network)
    # no expert parallelism, or a dense model: nothing
    assert costs.ep_alltoall_seconds(shape, H800, _trainer(ep=1), 1000, 1) == 0
    assert costs.ep_alltoall_seconds(BUILTIN["7B"], H800, _trainer(ep=8), 1000, 1) == 0


def test_a_training_step_pays_active_flops_and_its_all_to_alls():
    shape = BUILTIN["30B-A3B"]
    lay = _trainer(dp=1, ep=1)
    lengths, groups = [1000, 1000], [0, 1]
    rate = H800.bf16_flops * hardware.TRAIN_MFU
    # forward + backward (3 passes) + the proximal log-probs (1), no recompute; one rank, no dp sync
    flops = 4 * costs.forward_flops(shape, 2000, 2 * 1000 ** 2)
    assert costs.train_step_seconds(shape, H800, lay, lengths, groups) == pytest.approx(flops / rate)
    # with ep 2 (dp 2: a sequence a rank) each rank adds 3 all-to-all rounds over its 1,000 tokens
    lay8 = _trainer(dp=2, ep=2)
    step = costs.train_step_seconds(shape, H800, lay8, lengths, groups)
    rank = 4 * costs.forward_flops(shape, 1000, 1000 ** 2) / rate + costs.ep_alltoall_seconds(shape, H800, lay8, 1000, 3)
    assert step == pytest.approx(rank + costs.dp_sync_seconds(shape, H800, lay8))


def test_the_gradient_sync_reduces_the_experts_over_the_expert_data_parallel_group_only():
    shape = BUILTIN["30B-A3B"]
    bw = hardware.ROCE_NODE_BYTES_PER_S / 8 * hardware.NIC_EFFICIENCY     # dp 16 spans two nodes
    # dense: 6 bytes x dense x 15/16 over dp 16; experts: a rank's eighth, 6 bytes x 1/8 x 1/2 over dp/ep = 2
    expected = 6 * (shape.dense_params * 15 / 16 + shape.expert_params / 8 * 1 / 2) / bw
    assert costs.dp_sync_seconds(shape, H800, _trainer(dp=16, ep=8)) == pytest.approx(expected)
    assert costs.dp_sync_seconds(shape, H800, _trainer(dp=16, ep=1)) == pytest.approx(6 * shape.params * 15 / 16 / bw)
    # tp 2 folded (etp 1): a rank's experts are 1/ep = 1/8 whole, over dp x tp / ep = 4 expert data-parallel ranks
    folded = 6 * (shape.dense_params / 2 * 15 / 16 + shape.expert_params / 8 * 3 / 4) / bw
    assert costs.dp_sync_seconds(shape, H800, _trainer(tp=2, dp=16, ep=8)) == pytest.approx(folded)


def test_a_trainer_rank_holds_its_share_of_the_experts_and_their_optimizer_shard():
    shape = BUILTIN["30B-A3B"]
    lay = memory.TrainerLayout(tp=2, dp=16, ep=4, etp=2, recompute="full", micro_batch_tokens=4096)
    terms = memory.trainer_terms(shape, lay)
    dense, experts = shape.dense_params / 2, shape.expert_params / 8        # / tp, / (etp x ep)
    assert terms["weights"] == pytest.approx(2 * (dense + experts))
    assert terms["gradients"] == pytest.approx(4 * (dense + experts))
    # 12 bytes a parameter, dense over dp 16, experts over the expert data-parallel dp x tp / (etp x ep) = 4
    assert terms["optimizer"] == pytest.approx(12 * (dense / 16 + experts / 4))
    # folded (etp 1, the default with ep > 1): whole experts, 1/ep of them a rank, their optimizer over 32 / 4 = 8
    folded = memory.trainer_terms(shape, dataclasses.replace(lay, etp=None))
    assert folded["weights"] == pytest.approx(2 * (dense + shape.expert_params / 4))
    assert folded["optimizer"] == pytest.approx(12 * (dense / 16 + shape.expert_params / 4 / 8))
    # ep 8 with whole experts holds what ep 4 with experts split over tp 2 holds
    assert memory.trainer_terms(shape, dataclasses.replace(lay, ep=8, etp=1)) == terms
    # without expert parallelism the experts split over tp as the dense layers (etp defaults to tp)
    alone = memory.trainer_terms(shape, dataclasses.replace(lay, ep=1, etp=None))
    assert alone["weights"] == pytest.approx(2 * shape.params / 2)


def test_a_sparse_layer_s_activations_count_its_dispatched_copies_and_expert_activations():
    shared, split = memory.activation_elements_per_token(TINY)
    # 4h + router logits (float32: 2 x 4) + 1 copy in and 1 out (2 x 1 x 4)
    assert shared == 4 * 4 + 2 * 4 + 2 * 1 * 4
    # q, k, v after RoPE (4 + 2 + 2), their RoPE inputs (4 + 2), attention output 4; 1 copy x 4 x 3 expert
    assert split == (4 + 4) + (4 + 2) + 4 + 1 * 4 * 3


def test_the_30b_a3b_topology_dry_runs_with_experts_and_expert_parallelism(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = up.main(["topology/16node_moe.yaml", "--dry-run", "--no-import-check"])
    text = capsys.readouterr()
    out = text.out + text.err
    assert rc == up.EXIT_OK, out
    assert "memory per GPU (GB; Qwen3-30B-A3B" in out and "ep=8 etp=1" in out and "DOES NOT FIT" not in out
    # ep 4 with whole experts: a rank holds twice the experts, and their float32 gradients no longer fit
    rc = up.main(["topology/16node_moe.yaml", "actors.trainer.parallel.ep=4", "--dry-run", "--no-import-check"])
    out = capsys.readouterr()
    assert rc == up.EXIT_INVALID and "largest term: gradients" in out.out + out.err
    # tp 1 and ep 8: the untied vocabulary's logits no longer fit
    rc = up.main(["topology/16node_moe.yaml", "actors.trainer.parallel.tp=1", "actors.trainer.parallel.dp=32",
                  "actors.trainer.parallel.ep=8", "actors.trainer.settings.sequence_parallel=false",
                  "--dry-run", "--no-import-check"])
    out = capsys.readouterr()
    assert rc == up.EXIT_INVALID and "largest term: logits" in out.out + out.err


def test_expert_parallelism_that_does_not_divide_dp_is_refused_with_its_path(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = up.main(["topology/16node_moe.yaml", "actors.trainer.parallel.ep=3", "--dry-run", "--no-import-check"])
    out = capsys.readouterr()
    assert rc == up.EXIT_INVALID
    assert "actors.trainer.parallel.ep: ep x etp x pp = 3 x 1 x 1 does not divide the 32 ranks" in out.out + out.err
    rc = up.main(["topology/16node_moe.yaml", "actors.trainer.parallel.etp=4", "--dry-run", "--no-import-check"])
    out = capsys.readouterr()
    assert rc == up.EXIT_INVALID
    assert "actors.trainer.parallel.etp: 4 is neither 1 (experts whole on each rank) nor tp = 2" in out.out + out.err


def test_the_planner_reads_the_topology_s_expert_parallelism():
    found = sizing.read(topology.load(str(ROOT / "topology/16node_moe.yaml")))
    cfg = setup.sim_config(found, steps=2)
    assert found.shape is BUILTIN["30B-A3B"]
    assert (cfg.trainer.tp, cfg.trainer.dp, cfg.trainer.ep, cfg.trainer.etp, cfg.servers, cfg.server_tp) == (
        2, 16, 8, 1, 48, 2)


def test_the_30b_a3b_layout_launches_folded_and_refuses_experts_split_over_tp_with_ep(monkeypatch):
    """tp 2 with ep 8 and whole experts (etp 1) launches; experts split over tp (etp 2) with ep plans, but the
    megatron engine refuses it: the dry run says so, a launch is refused before any node starts."""
    from launch.inputs import check_inputs

    monkeypatch.chdir(ROOT)
    plan = topology.load(str(ROOT / "topology/16node_moe.yaml"), check_imports=False)
    for launch in (False, True):
        lines, problems = check_inputs(plan, launch=launch)
        assert not any("etp" in x for x in lines + problems), lines + problems
    split = topology.load(str(ROOT / "topology/16node_moe.yaml"), ["actors.trainer.parallel.ep=4",
                                                                   "actors.trainer.parallel.etp=2"], check_imports=False)
    lines, problems = check_inputs(split, launch=False)
    assert any("actors.trainer.parallel: etp 2 with ep 4" in x and "planned, not launched" in x for x in lines)
    lines, problems = check_inputs(split, launch=True)
    assert any("actors.trainer.parallel: etp 2 with ep 4" in x for x in problems)
