"""What the planner reads from a topology: the model's shape, the GPU, and the trainer and rollout groups
with the settings their first instance gets (the same settings `tools.up` hands the actors)."""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

from actors.reward.actor import RewardActor
from actors.rollout.actor import rollout_placement
from actors.trainer.actor import trainer_placement
from actors.weight_sync import sends_direct
from tools.plan import hardware, memory
from tools.plan.shapes import ModelShape, resolve
from tools.plan.costs import MeasuredCosts, TrainerShape
from tools.plan.sim import SimConfig, lengths_for
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
    """One line per GPU group that does not fit (what `tools.up --dry-run` refuses)."""
    return [p for m in group_memory(read(plan)) if (p := m.problem())]


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


def workload_fields(workload: dict[str, Any] | None, max_new_tokens: int) -> dict[str, Any]:
    """SimConfig fields of a measured workload (`tools.plan.calibrate --workload-from`): answer lengths as a
    lognormal with the run's mean and share cut at max_new_tokens (fixed at the mean when none was cut),
    the prompt's mean length, and the share of groups dynamic sampling kept."""
    if not workload:
        return {}
    mean, cut = float(workload["mean_answer_tokens"]), float(workload["cut_share"])
    lengths = ({"kind": "lognormal", "mean_tokens_at_cut": mean, "cut_share": cut, "cut": max_new_tokens}
               if 0.001 <= cut < 0.5 and mean < max_new_tokens else {"kind": "fixed", "tokens": round(mean)})
    return {"lengths": lengths, "prompt_tokens": max(1, round(float(workload["prompt_tokens"]))),
            "kept_group_share": float(workload["kept_group_share"])}


def sim_config(setup: Setup, *, eta: int | None = None, rollout_gpus: int | None = None,
               colocated: bool = False, steps: int = 4, seed: int = 0, measured: MeasuredCosts | None = None,
               workload: dict[str, Any] | None = None) -> SimConfig:
    """The simulation of this topology's run: its trainer and rollout groups and the experiment's algo,
    gen and buffer settings. `eta` overrides the staleness bound; `rollout_gpus` moves the split between
    inference and training (whole servers and whole trainer replicas); `colocated` runs generation and then
    training on all the GPUs, the synchronous baseline of systems that time-share them. On CPUs `measured`
    (required) gives the costs and `workload` the answers (`workload_fields`); the split is the topology's. On GPUs
    the answers' lengths are the model size's (`sim.lengths_for`)."""
    trainers, rollouts = setup.of_kind("trainer"), setup.of_kind("rollout")
    if len(trainers) != 1 or len(rollouts) != 1:
        raise ValueError(f"the simulation needs one trainer and one rollout group, found "
                         f"{len(trainers)} and {len(rollouts)}")
    if setup.shape is None:
        raise ValueError("experiment.model.path: no model shape")
    tr, ro = trainers[0], rollouts[0]
    exp = setup.experiment
    algo, gen, buf = exp.algo, exp.gen, exp.buffer
    if on_cpus(setup):
        return _cpu_sim_config(setup, tr, ro, eta, steps, seed, measured, workload)
    par = tr.settings.instance.parallel
    tp, pp, ep = par.get("tp", 1), par.get("pp", 1), par.get("ep", 1)
    server_tp = ro.settings.instance.parallel.get("tp", 1)
    train_gpus, infer_gpus = tr.count * max(tr.gpus_each, 1), ro.count * max(ro.gpus_each, 1)
    total = train_gpus + infer_gpus
    if colocated:
        train_gpus = infer_gpus = total
        eta = 0
    elif rollout_gpus is not None:
        infer_gpus, train_gpus = rollout_gpus, total - rollout_gpus
    servers, dp = infer_gpus // server_tp, train_gpus // (tp * pp)
    if servers < 1 or dp < 1:
        raise ValueError(f"a split of {infer_gpus} inference and {train_gpus} training GPUs leaves no "
                         f"{'server' if servers < 1 else 'trainer replica'}")
    if dp % ep:
        raise ValueError(f"a split of {train_gpus} training GPUs gives dp {dp}, which expert parallelism {ep} "
                         f"does not divide")
    rollout_mem = memory.rollout_memory(ro.name, setup.shape, memory.rollout_layout(ro.settings), setup.gpu.memory_bytes)
    lay = memory.trainer_layout(tr.settings, False)
    return SimConfig(
        shape=setup.shape, gpu=setup.gpu, gpus_per_node=setup.gpus_per_node, servers=servers, server_tp=server_tp,
        trainer=TrainerShape(tp=tp, pp=pp, dp=dp, ep=ep, micro_batch_tokens=lay.micro_batch_tokens,
                             minibatches=algo.ppo_minibatches, recompute=lay.recompute,
                             gpus_per_node=setup.gpus_per_node, reference=algo.kl_coef > 0),
        batch_size=algo.batch_size, group_size=algo.group_size,
        eta=algo.eta if eta is None else eta, max_new_tokens=gen.max_new_tokens,
        max_groups_per_rollout=buf.max_groups_per_rollout, max_concurrent_groups=buf.max_concurrent_groups,
        group_timeout_s=buf.group_timeout_s, pace=pace_of(gen), engine="sglang",
        kv_tokens_per_server=int(rollout_mem.kv_tokens or 0), context_len=setup.shape.context_len,
        interruptible=gen.interruptible, dynamic_sampling=algo.dynamic_sampling, lengths=lengths_for(setup.shape),
        rewards=setup.reward_actors, **eval_fields(setup),
        weights_across_nodes=total > setup.gpus_per_node, steps=steps, seed=seed)


def eval_fields(setup: Setup) -> dict[str, int]:
    """The periodic evaluation's load on the rollouts (an evaluator with weights_from: rollouts, eval.every_versions
    > 0): every that many versions, eval.max_problems greedy answers, at most rollout_concurrency on one rollout."""
    ev = setup.experiment.eval
    if setup.eval_on_rollouts is None or ev.every_versions <= 0:
        return {}
    return {"eval_every": ev.every_versions, "eval_prompts": ev.max_problems, "eval_per_rollout": setup.eval_on_rollouts}


def pace_of(gen: Any) -> tuple[float, float, float]:
    """The buffer's timeout pace settings (gen.assumed_tokens_per_s, gen.timeout_slack, gen.timeout_floor_s)."""
    return gen.assumed_tokens_per_s, gen.timeout_slack, gen.timeout_floor_s


def _cpu_sim_config(setup: Setup, tr: Group, ro: Group, eta: int | None, steps: int, seed: int,
                    measured: MeasuredCosts | None, workload: dict[str, Any] | None) -> SimConfig:
    if measured is None:
        raise ValueError("a CPU topology is simulated from measured costs: pass a cost file "
                         "(python -m tools.plan.calibrate; docs/plan.md)")
    assert setup.shape is not None
    exp = setup.experiment
    algo, gen, buf = exp.algo, exp.gen, exp.buffer
    devices, engines = cpu_servers(ro)
    max_new = gen.max_new_tokens
    group_size = algo.group_size
    # the engine's own row limit (actors.rollout.actor's max_running) caps the groups it decodes at once
    assert isinstance(ro.settings, RolloutSettings)
    max_running = ro.settings.max_running
    return SimConfig(
        shape=setup.shape, gpu=setup.gpu, gpus_per_node=1, servers=devices, server_tp=1,
        trainer=TrainerShape(tp=1, pp=1, dp=1, micro_batch_tokens=algo.max_tokens_per_mb,
                             minibatches=algo.ppo_minibatches, recompute="none", gpus_per_node=1),
        batch_size=algo.batch_size, group_size=group_size,
        eta=algo.eta if eta is None else eta, max_new_tokens=max_new,
        max_groups_per_rollout=buf.max_groups_per_rollout, max_concurrent_groups=buf.max_concurrent_groups,
        group_timeout_s=buf.group_timeout_s, pace=pace_of(gen), engine="embedded", max_running=max_running,
        interruptible=gen.interruptible,
        dynamic_sampling=algo.dynamic_sampling, weights_across_nodes=False, steps=steps,
        seed=seed, measured=measured, engines_per_server=engines, reward_latency_s=measured.reward_s,
        rewards=setup.reward_actors,
        **workload_fields(workload, max_new))
