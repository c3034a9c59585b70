"""What the planner reads from a topology: the model's shape, the GPU, and the trainer and rollout groups
with the settings their first instance gets (the same settings `tools.up` hands the actors), and the memory per
GPU of every GPU group by that reading (`memory_problems`, which the dry run refuses; `memory_report`, its
lines in the dry run's report)."""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

from actors.reward.actor import RewardActor
from actors.rollout.actor import rollout_placement
from actors.trainer.actor import trainer_placement
from actors.weight_sync import sends_direct
from launch.plan import hardware, memory
from launch.plan.report import memory_table
from launch.plan.shapes import ModelShape, ShapeError, resolve
from topology import Plan
from topology.experiment import ExperimentConfig
from topology.settings import EvaluatorSettings, RolloutSettings, TrainerSettings, read_settings, settings_model


@dataclasses.dataclass
class Group:
    name: str
    kind: str                 # "trainer" | "rollout"
    count: int
    gpus_each: int
    settings: TrainerSettings | RolloutSettings   # its first instance's
    device: str               # "cuda" | "cpu"
    cpus: list[list[int]] | None = None   # per instance core list, where the topology pins them


@dataclasses.dataclass
class Setup:
    shape: ModelShape | None       # None when no trainer or rollout group needs it
    gpu: hardware.GPU
    gpus_per_node: int
    groups: list[Group]
    experiment: ExperimentConfig
    reward_actors: int = 1         # the buffer spreads groups over them
    #: An evaluator whose prompts the rollouts answer (weights_from: rollouts): its rollout_concurrency; None: none
    eval_on_rollouts: int | None = None

    def of_kind(self, kind: str) -> list[Group]:
        return [g for g in self.groups if g.kind == kind]


def read(plan: Plan) -> Setup:
    topo = plan.topology
    first: dict[str, dict[str, Any]] = {}
    for spec in plan.specs("RUN_DIR"):
        first.setdefault(spec["name"].split(".")[0], spec["settings"])
    groups = []
    rewards = 0
    eval_on_rollouts = None
    for gname, group in topo.groups.items():
        module, _, cls_name = group.cls.partition(":")
        klass = getattr(importlib.import_module(module), cls_name)
        if isinstance(klass, type) and issubclass(klass, RewardActor):
            rewards += group.count
        placement = getattr(klass, "placement", None)
        kind = {trainer_placement: "trainer", rollout_placement: "rollout"}.get(placement)
        if kind is None and gname in first and settings_model(klass) is EvaluatorSettings:
            evaluator = read_settings(klass, first[gname], gname)
            assert isinstance(evaluator, EvaluatorSettings)
            if evaluator.weights_from == "rollouts":
                eval_on_rollouts = evaluator.rollout_concurrency
        if kind is None or gname not in first:
            continue
        settings = read_settings(klass, first[gname], gname)
        device = placement(settings)["device"]
        groups.append(Group(gname, kind, group.count, group.gpus or 0, settings, device, group.cpus))
    root = Path(topo.source).resolve().parent.parent if topo.source else Path(".")
    model_path = topo.config.model.path
    shape = resolve(model_path, root if (root / str(model_path or "")).exists() else ".") if groups else None
    node = topo.nodes[0] if topo.nodes else None
    gpu = hardware.gpu(node.gpu_kind if node else None)
    if node is not None and node.gpu_memory_gb:
        gpu = dataclasses.replace(gpu, memory_bytes=node.gpu_memory_gb * hardware.GB)
    return Setup(shape, gpu, (node.gpus if node else 0) or 8, groups, topo.config, max(1, rewards), eval_on_rollouts)


def group_memory(setup: Setup) -> list[memory.GroupMemory]:
    """Memory per GPU of every GPU trainer and rollout group (CPU groups are left out)."""
    out: list[memory.GroupMemory] = []
    for g in setup.groups:
        if g.device != "cuda" or setup.shape is None:
            continue
        if g.kind == "trainer":
            lay = memory.trainer_layout(g.settings, sends_direct(g.settings))
            out.append(memory.trainer_memory(g.name, setup.shape, lay, setup.gpu.memory_bytes))
        else:
            out.append(memory.rollout_memory(g.name, setup.shape, memory.rollout_layout(g.settings),
                                             setup.gpu.memory_bytes))
    return out


def memory_problems(plan: Plan) -> list[str]:
    """One line per GPU group that does not fit, naming the largest term (what `tools.up --dry-run` refuses);
    none without a model shape (`memory_report` says so)."""
    try:
        return [p for m in group_memory(read(plan)) if (p := m.problem())]
    except (ShapeError, ValueError):
        return []


def memory_report(plan: Plan) -> list[str]:
    """The memory estimate per GPU of every GPU group, as the dry run's report prints it."""
    try:
        found = read(plan)
    except (ShapeError, ValueError) as exc:
        return [f"memory per GPU: not estimated ({exc})"]
    line = f"{found.shape.name if found.shape else '-'}, {found.gpu.name} {found.gpu.memory_bytes / 1e9:.0f} GB"
    return memory_table(line, group_memory(found))


def on_cpus(setup: Setup) -> bool:
    """Every trainer and rollout group runs on CPUs (the embedded engines): the roofline does not apply."""
    return bool(setup.groups) and all(g.device == "cpu" for g in setup.groups)


def cpu_servers(group: Group) -> tuple[int, int]:
    """(devices, engines per device) of a CPU rollout group: instances pinned to the same cores time-share
    them, so each distinct core list is one simulated server; unpinned instances are servers of their own."""
    if not group.cpus:
        return group.count, 1
    devices = len({tuple(c) for c in group.cpus})
    return devices, -(-group.count // devices)
