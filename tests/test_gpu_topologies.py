"""Every shipped topology builds its actors where its file puts them: a GPU actor of a GPU topology runs on
its GPU in bf16 with NCCL worlds, the embedded default on the CPU in float32 with gloo. The specs are the
ones the launcher writes; the placements come from the rule each engine is built by."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.engines.base import EngineError, engine_device, require_device
from actors.trainer import make_train_engine
from tools.topology import load
from tools.up import describe, engine_placements

TOPOLOGIES = sorted((Path(__file__).resolve().parent.parent / "topology").glob("*.yaml"))


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_engines_run_where_the_topology_puts_them(path):
    plan = load(path, check_imports=False)
    placements = engine_placements(plan)
    for gname, placement in placements.items():
        group = plan.topology.groups[gname]
        if group.gpus:
            assert placement["device"] == "cuda", (gname, placement)
            assert placement["dtype"] == "bfloat16", (gname, placement)
            assert placement["process_group"].startswith("nccl"), (gname, placement)
        else:
            assert placement["device"] == "cpu" and placement["process_group"] == "gloo", (gname, placement)
        world = plan.worlds.get(gname)
        if world is not None:
            assert world.backend == placement["process_group"], (gname, world.backend, placement)
    text = describe(plan)
    for gname, placement in placements.items():
        assert any(line.split()[:3] == [gname, placement["engine"], placement["device"]]
                   for line in text.splitlines()), (gname, text)


def test_gpu_topologies_train_on_gpus_in_bf16():
    gpu_plans = [load(p, check_imports=False) for p in TOPOLOGIES if "node" in p.stem and p.stem != "demo_slurm"]
    assert {p.topology.name for p in gpu_plans} >= {"64node", "4node", "1node"}
    for plan in gpu_plans:
        trainer = engine_placements(plan)["trainer"]
        assert (trainer["engine"], trainer["device"], trainer["dtype"]) == ("megatron", "cuda", "bfloat16")


def test_device_rule():
    assert engine_device({}) == "cpu"
    assert engine_device({"instance": {"gpus": [3]}}) == "cuda"
    assert engine_device({"instance": {"gpus": [3]}, "device": "cpu"}) == "cpu"
    with pytest.raises(EngineError, match="not one of"):
        engine_device({"device": "tpu"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only process gives")
def test_a_gpu_actor_without_cuda_is_an_error_not_a_cpu_run(tmp_path):
    with pytest.raises(EngineError, match="sees no CUDA device"):
        require_device("cuda")
    with pytest.raises(EngineError, match="sees no CUDA device"):
        make_train_engine({"backend": "torch", "instance": {"gpus": [0]}}, str(tmp_path), 0)
