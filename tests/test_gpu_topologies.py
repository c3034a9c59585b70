"""Every shipped topology builds its actors where its file puts them: a GPU actor of a GPU topology runs on
its GPU in bf16 with NCCL worlds, the embedded default on the CPU in float32 with gloo. The specs are the
ones the launcher writes; the placements come from the rule each engine is built by."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.engines.base import EngineError, require_device
from actors.trainer.actor import TrainerActor, make_train_engine
from topology import load
from topology.settings import SettingsError, TrainerSettings, read_settings
from launch.report import describe, engine_placements

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
    text = describe(plan, ())
    for gname, placement in placements.items():
        assert any(line.split()[:3] == [gname, placement["engine"], placement["device"]]
                   for line in text.splitlines()), (gname, text)


def test_gpu_topologies_train_on_gpus_in_bf16():
    gpu_plans = [load(p, check_imports=False) for p in TOPOLOGIES if "node" in p.stem and p.stem != "demo_slurm"]
    assert {p.topology.name for p in gpu_plans} >= {"64node", "4node", "1node"}
    for plan in gpu_plans:
        trainer = engine_placements(plan)["trainer"]
        assert (trainer["engine"], trainer["device"], trainer["dtype"]) == ("megatron", "cuda", "bfloat16")
        # 7B at 32k fits only with the memory savers on (docs/engines-megatron.md)
        assert "recompute=full logprob_chunk=4096" in trainer["memory"], trainer
        if int(plan.topology.groups["trainer"].parallel.get("tp", 1)) > 1:
            assert trainer["memory"].startswith("sp "), trainer


def test_device_rule():
    def engine_device(settings: dict) -> str:
        return read_settings(TrainerActor, settings, "trainer.0").engine_device

    assert engine_device({}) == "cpu"
    assert engine_device({"instance": {"gpus": [3]}}) == "cuda"
    assert engine_device({"instance": {"gpus": [3]}, "device": "cpu"}) == "cpu"
    with pytest.raises(SettingsError, match="trainer.0: settings.device: input should be 'cpu' or 'cuda'"):
        engine_device({"device": "tpu"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only process gives")
def test_a_gpu_actor_without_cuda_is_an_error_not_a_cpu_run(tmp_path):
    with pytest.raises(EngineError, match="sees no CUDA device"):
        require_device("cuda")
    with pytest.raises(EngineError, match="sees no CUDA device"):
        make_train_engine(TrainerSettings.model_validate({"backend": "torch", "instance": {"gpus": [0]}}),
                          str(tmp_path), 0)


def test_every_rank_of_a_world_gets_the_same_nccl_settings_and_the_socket_nic():
    plan = load(Path(__file__).resolve().parent.parent / "topology" / "64node.yaml", check_imports=False)
    specs = {s["name"]: s for s in plan.specs("RUN_DIR")}
    nccl = [{k: v for k, v in specs[f"trainer.{i}"]["env"].items() if k.startswith("NCCL_")} for i in range(128)]
    # trainer.0 alone is in the weights link, whose RoCE settings once reached no other trainer rank.
    assert nccl[0]["NCCL_IB_GID_INDEX"] == "3" and nccl[0]["NCCL_IB_TC"] == "106"
    assert all(n == nccl[0] for n in nccl), "the trainer world's ranks disagree on NCCL settings"
    assert all(s["env"]["GLOO_SOCKET_IFNAME"] == "bond0" for s in specs.values())


def test_slurm_asks_for_what_each_node_has():
    from launch.slurm import slurm_resources
    plan = load(Path(__file__).resolve().parent.parent / "topology" / "64node.yaml", check_imports=False)
    assert slurm_resources(plan) == ["--cpus-per-task=48", "--mem=0", "--gpus-per-node=8"]
    assert "--cpus-per-task=48 --mem=0 --gpus-per-node=8" in describe(plan, ())


def test_an_allocation_too_small_for_the_topology_is_refused_with_the_command_that_fits():
    from launch.slurm import Allocation, allocation_shortfall
    plan = load(Path(__file__).resolve().parent.parent / "topology" / "64node.yaml", check_imports=False)
    hosts = [f"node{i:03d}" for i in range(64)]
    short = allocation_shortfall(plan, Allocation({h: 1 for h in hosts}, {h: 0 for h in hosts}, "test"))
    assert "1 core(s) and 0 GPU(s) (test)" in short and "salloc -N64 --exclusive --gpus-per-node=8" in short
    assert allocation_shortfall(plan, Allocation({h: 48 for h in hosts}, {h: 8 for h in hosts}, "test")) is None
    # one node short is enough to refuse; what the allocation does not say is not held against it
    assert allocation_shortfall(plan, Allocation({h: 48 for h in hosts}, {**{h: 8 for h in hosts}, "node007": 4},
                                                 "test")) is not None
    assert allocation_shortfall(plan, Allocation({h: 48 for h in hosts}, None, "test")) is None


def test_the_allocation_is_read_from_the_controller_and_salloc_is_not_taken_for_zero_gpus():
    # The README's `salloc -N64 ... python3 -m tools.up topology/64node.yaml` runs the launcher outside any
    # step, where SLURM sets neither SLURM_CPUS_ON_NODE nor SLURM_GPUS_ON_NODE (salloc(1), OUTPUT ENVIRONMENT
    # VARIABLES): read as 0 GPUs, the run was refused. `scontrol show job -d` answers alike everywhere.
    from launch.slurm import allocation_from_env, allocation_shortfall, parse_job_details
    plan = load(Path(__file__).resolve().parent.parent / "topology" / "64node.yaml", check_imports=False)
    details = parse_job_details("   JOB_GRES=gpu:512\n     Nodes=node[001-064] CPU_IDs=0-47 Mem=0 GRES=gpu:h800:8(IDX:0-7)\n")
    assert details.least("cpus") == 48 and details.least("gpus") == 8 and len(details.cpus) == 64
    assert allocation_shortfall(plan, details) is None
    hosts = [f"node{i:03d}" for i in range(1, 65)]
    salloc = {"SLURM_JOB_ID": "7", "SLURM_JOB_CPUS_PER_NODE": "48(x64)", "SLURM_JOB_NUM_NODES": "64"}
    from_env = allocation_from_env(salloc, hosts)
    assert from_env.least("cpus") == 48 and from_env.gpus is None     # unknown, not zero
    assert allocation_shortfall(plan, from_env) is None
    asked = allocation_from_env({**salloc, "SLURM_GPUS_PER_NODE": "h800:8"}, hosts)
    assert asked.least("gpus") == 8
    step = allocation_from_env({**salloc, "SLURM_GPUS_ON_NODE": "4"}, hosts)   # srun/sbatch: the step's node
    assert "4 GPU(s)" in allocation_shortfall(plan, step)
