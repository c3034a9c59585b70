"""The simulation of a topology's run (`sim_config`), from what the planner reads of it
(launch/plan/sizing.py: the model's shape, the GPU, the trainer and rollout groups)."""
from __future__ import annotations

from typing import Any

from launch.plan import memory
from launch.plan.sizing import Group, Setup, cpu_servers, on_cpus
from tools.plan.costs import MeasuredCosts, TrainerShape
from tools.plan.sim import SimConfig, lengths_for
from topology.schema import expert_tensor_parallel
from topology.settings import RolloutSettings


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
    etp = expert_tensor_parallel(tp, ep, par.get("etp"))
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
    if train_gpus % (etp * ep * pp):
        raise ValueError(f"a split of {train_gpus} training GPUs is not a multiple of etp x ep x pp "
                         f"({etp} x {ep} x {pp})")
    rollout_mem = memory.rollout_memory(ro.name, setup.shape, memory.rollout_layout(ro.settings), setup.gpu.memory_bytes)
    lay = memory.trainer_layout(tr.settings, False)
    return SimConfig(
        shape=setup.shape, gpu=setup.gpu, gpus_per_node=setup.gpus_per_node, servers=servers, server_tp=server_tp,
        trainer=TrainerShape(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, micro_batch_tokens=lay.micro_batch_tokens,
                             minibatches=algo.ppo_minibatches, recompute=lay.recompute,
                             gpus_per_node=setup.gpus_per_node, reference=algo.kl_coef > 0,
                             lora_params=int(memory.lora_params(setup.shape, lay.lora_rank, lay.lora_targets))
                             if lay.lora_rank else 0),
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
