"""`python -m tools.plan.published [--steps N] [--seeds S] [--json]`: the planner against AReaL's published
end-to-end figures, on the layouts AReaL actually ran them with.

Sources (AReaL's repository, github.com/inclusionAI/AReaL):

* Step times: the tutorial's hardware table, "Single-step Time (seconds)" (examples/README.md, added by
  commit aff05c2 "Update time estimation in README", 2025-04-02, after the v0.2.0 release): 1.5B on 1 / 4 /
  16 nodes 3,461 / 997 / 391 s, 7B on 4 / 16 nodes 2,275 / 815 s (512 x 16), 32B on 16 nodes 6,707 s
  (512 x 32). AReaL v0.2 ran PPO synchronously: generate the batch, then train, on disjoint GPUs.
* Throughput of the same runs (`TUTORIAL_THROUGHPUT`): the v0.2 blog's "AReaL Throughput Benchmark (on H800
  GPUs)" (blog/AReaL_v0_2.md, assets/thpt_comparison.png, commit 5997ba8): each row is also compared in tokens
  per second, and the tokens per sequence the published runs had follow from it and the step time.
* Layouts (`LAYOUTS`): the v0.2.0 tag's examples/configs, whose trial names match the tutorial's:
  1.5B-distill/ppo-1.5B-distill-gpus-{8,32,128}.yaml and 7B-distill/ppo-7B-distill-gpus-{32,128}.yaml have
  allocation_mode `sglang.d{N/2}p1m1+d{N/4}p2m1` (half the GPUs serve SGLang at tp 1, half train at pp 2);
  32B-distill/ppo-32B-distill-gpus-128.yaml has `sglang.d8m8p1+d4p4m4` (8 servers at tp 8; dp 4, pp 4, tp 4).
  All: max_new_tokens 27,648, max_tokens_per_mb 30,720, ppo_n_minibatches 4, mem_fraction_static 0.8,
  train_bs_n_seqs 512. v0.2's sync PPO hands the whole batch to the servers at once and lets SGLang's
  scheduler decide what runs (`AREAL_DISPATCH`).
* The tutorial's own 7B log (2,122-2,406 s a step) is not a row of that table: AReaL's first commit
  (2963a67, 2025-02-24) shows the same log lines under the command `ppo-zero-distill-7B-n16 ... 1024 16 16
  vllm.d16p1m4+d32p2m1 16384`, i.e. 1024 prompts x 16 answers (the log's n_seqs is 16,384), vLLM 0.6.3 on
  16 servers at tp 4, and answers cut at 16,384; a later commit relabelled its header "512x16".
  `LOG_RUN` simulates that run (with SGLang's scheduler standing in for vLLM's).
* "Up to 2.77x": the v0.3 blog (blog/AReaL_v0_3.md, Table 2) and the paper (arXiv:2505.24298): 1,000 PPO
  steps of the 1.5B model on 16 nodes took 41.0 hours synchronous and 14.8 asynchronous (41.0 / 14.8 =
  2.77), and the 7B model on 24 nodes 57.7 and 25.4 hours (2.27). "Synchronous AReaL" is the same system and
  allocation with max_head_offpolicyness (eta) 0: training/configs/sync-ppo.yaml and async-ppo.yaml of
  v0.3.0 share `sglang.d{N/2}p1m1+d{N/4}p2m1` and differ in eta (4) and the decoupled loss. So the 2.77x is
  async (eta 4) over sync (eta 0) on the same split, a ratio of mean step times over a run, which is what
  `SPEEDUP_RUNS` computes (steady-state steps, not the first).
* Mixture of experts (`NEMO_RL_30B_A3B`): NeMo-RL's performance page (docs/about/performance-summary.md, "NeMo
  RL v0.6", H100 BF16) gives GRPO on Qwen3-30B-A3B, 8-step off-policy, 192 GPUs, 34.5 s a step; its recipe
  examples/configs/recipes/llm/performance/grpo-qwen3-30ba3b-24n8g-async-8off.yaml at tag v0.6.0 (over
  grpo-qwen3-30ba3b-4n8g.yaml and examples/configs/grpo_math_1B.yaml) gives the setup `moe_rows` simulates.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

import numpy as np

from actors.buffer.state import BufferState
from launch.plan import hardware, sizing
from launch.plan.shapes import BUILTIN
from tools.plan import setup, sim
from topology.experiment import ExperimentConfig
from topology.settings import RolloutSettings, TrainerSettings

MAX_NEW_TOKENS = 27648
MICRO_BATCH_TOKENS = 30720


@dataclasses.dataclass(frozen=True)
class Layout:
    """An AReaL allocation: SGLang servers of `server_tp` GPUs, Megatron `tp` x `pp` x dp on the rest."""

    server_tp: int
    tp: int
    pp: int
    #: share of the GPUs generating (AReaL's v0.2 configs: half)
    rollout_share: float = 0.5
    ep: int = 1


LAYOUTS = {"1.5B": Layout(server_tp=1, tp=1, pp=2), "7B": Layout(server_tp=1, tp=1, pp=2),
           "32B": Layout(server_tp=8, tp=4, pp=4)}
#: (model, nodes, group size, published seconds per step)
TUTORIAL_STEPS = [("1.5B", 1, 16, 3461), ("1.5B", 4, 16, 997), ("1.5B", 16, 16, 391),
                  ("7B", 4, 16, 2275), ("7B", 16, 16, 815), ("32B", 16, 32, 6707)]
#: (model, nodes) -> AReaL v0.2's published end-to-end RL training throughput, tokens/s: the v0.2 blog's figure
#: "AReaL Throughput Benchmark (on H800 GPUs)" (blog/AReaL_v0_2.md, assets/thpt_comparison.png, commit 5997ba8,
#: 2025-03-28, in the v0.2.0 tag), the same six runs as `TUTORIAL_STEPS` (1.5B on 8 / 32 / 128 GPUs, 7B on 32 /
#: 128, 32B on 128), rounded there to the thousand. Times the step time it gives the tokens of a step, so the
#: answer lengths the published runs had: the per-token comparison separates those from the costs.
TUTORIAL_THROUGHPUT = {("1.5B", 1): 20e3, ("1.5B", 4): 68e3, ("1.5B", 16): 173e3,
                       ("7B", 4): 26e3, ("7B", 16): 95e3, ("32B", 16): 20e3}
#: The tutorial's 7B log: 16 nodes, vllm.d16p1m4 (16 servers at tp 4) + d32p2m1, 1024 x 16, cut at 16,384.
LOG_RUN = {"model": "7B", "nodes": 16, "batch": 1024, "group": 16, "max_new": 16384,
           "layout": Layout(server_tp=4, tp=1, pp=2), "published_s": (2122.318, 2405.716),
           "published_mean_s": float(np.mean([2124.429, 2405.716, 2122.318, 2313.134, 2296.076, 2299.448]))}
#: (model, nodes, eta of the async run, published hours sync, published hours async)
SPEEDUP_RUNS = [("1.5B", 16, 4, 41.0, 14.8), ("7B", 24, 4, 57.7, 25.4)]


class AReaLDispatch(BufferState):
    """AReaL's controller: a server takes whatever it is handed (SGLang's scheduler decides what runs); the
    in-flight bound is the gate's and max_concurrent_rollouts'. The rules of this project's buffer it lacks:
    a rollout whose newest weights are older than the gate allows gets one group at a time, a rollout holds
    only what its server's KV pool fits (`rollout_cap`), and a group whose time ran out is aborted and issued
    again (`group_timeout`)."""

    def rollout_cap(self, rollout: str) -> int:
        return self.max_per_rollout

    def group_timeout(self) -> float:
        """Never: AReaL never issues a generation again for taking long. v0.2 posts each /generate with
        `aiohttp.ClientTimeout(total=None)` and waits for every answer of the batch
        (realhf/impl/model/backend/sglang.py, `_do_generate`); v0.3's client session bound (6 hours,
        realhf/api/core/model_api.py `AIOHTTP_TIMEOUT`) fails the request, it does not issue it again."""
        return math.inf


def cluster(model: str, nodes: int, group_size: int, *, batch: int = 512, max_new: int = MAX_NEW_TOKENS,
            lay: Layout | None = None, rollout_share: float | None = None, eta: int = 4,
            gpus_per_node: int = 8, gpu: str = "H800", micro_batch_tokens: int = MICRO_BATCH_TOKENS,
            recompute: str = "full", kl_coef: float = 0.0, buffer: dict[str, Any] | None = None) -> sizing.Setup:
    """A Setup like the one `sizing.read` makes from a topology, for AReaL's allocation of `model` on `nodes`
    (`rollout_share` moves the split in whole servers and whole trainer replicas); the keywords after
    `gpus_per_node` describe another system's run (`moe_rows`)."""
    lay = lay or LAYOUTS[model]
    total = nodes * gpus_per_node
    share = lay.rollout_share if rollout_share is None else rollout_share
    infer = int(round(total * share / lay.server_tp)) * lay.server_tp
    unit = lay.tp * lay.pp
    train = ((total - infer) // unit) * unit
    servers = infer // lay.server_tp
    experiment: dict[str, Any] = {
        "algo": {"batch_size": batch, "group_size": group_size, "eta": eta, "ppo_minibatches": 4,
                 "max_tokens_per_mb": micro_batch_tokens, "kl_coef": kl_coef},
        "gen": {"max_new_tokens": max_new, "interruptible": True},
        # AReaL's controller hands out up to max_concurrent_rollouts (default: the batch) prompts at once.
        "buffer": buffer if buffer is not None else {"max_groups_per_rollout": max(1, math.ceil(batch / max(servers, 1))),
                                                     "max_concurrent_groups": batch}}
    trainer = {**experiment, "backend": "megatron", "sequence_parallel": lay.tp > 1, "recompute": recompute,
               "logprob_chunk_tokens": 4096,
               "instance": {"parallel": {"tp": lay.tp, "pp": lay.pp, "dp": train // unit, "ep": lay.ep}}}
    rollout = {**experiment, "engine": "sglang", "sglang": {"mem_fraction_static": 0.8},
               "instance": {"parallel": {"tp": lay.server_tp}}}
    groups = [sizing.Group("rollout", "rollout", servers, lay.server_tp, RolloutSettings.model_validate(rollout),
                          "cuda"),
              sizing.Group("trainer", "trainer", train, 1, TrainerSettings.model_validate(trainer), "cuda")]
    return sizing.Setup(BUILTIN[model], hardware.GPUS[gpu], gpus_per_node, groups,
                       ExperimentConfig.model_validate(experiment), reward_actors=nodes)


def run(found: sizing.Setup, *, eta: int, steps: int, seeds: int, rules: type[BufferState] = AReaLDispatch,
        rollout_gpus: int | None = None, **fields: Any) -> dict[str, Any]:
    """`seeds` simulations of `steps` steps (the first is warm-up); mean and spread of the figures. `fields`
    replace the simulation's (SimConfig) fields, e.g. another system's answer lengths."""
    results = [sim.simulate(dataclasses.replace(setup.sim_config(found, eta=eta, steps=steps, seed=s,
                                                                 rollout_gpus=rollout_gpus), buffer_rules=rules,
                                                **fields))
               for s in range(seeds)]
    step = [r.step_time for r in results]
    summ = [r.summary() for r in results]
    out = {"step_s": float(np.mean(step)), "step_s_min": float(min(step)), "step_s_max": float(max(step)),
           "throughput": float(np.mean([r.throughput for r in results])),
           "train_s": float(np.mean([s["train_s"] for s in summ])),
           "generation_s": float(np.mean([s["wait_batch_s"] for s in summ])),
           "weights_s": float(np.mean([s["export_s"] + s["wait_weights_s"] for s in summ])),
           "staleness_mean": float(np.mean([sum(int(k) * v for k, v in s["staleness"].items()) for s in summ])),
           "retractions": float(np.mean([s["counters"]["retractions"] for s in summ])),
           "split": f"{results[0].config.servers * results[0].config.server_tp}/"
                    f"{results[0].config.trainer.dp * results[0].config.trainer.tp * results[0].config.trainer.pp}"}
    return out


def tutorial_rows(steps: int, seeds: int, models: tuple[str, ...] = tuple(LAYOUTS)) -> list[dict[str, Any]]:
    out = []
    for model, nodes, group_size, published in (r for r in TUTORIAL_STEPS if r[0] in models):
        found = cluster(model, nodes, group_size)
        problems = [m.problem() for m in sizing.group_memory(found) if not m.fits]
        r = run(found, eta=0, steps=steps, seeds=seeds)
        ours = run(found, eta=0, steps=steps, seeds=1, rules=BufferState)
        out.append({"model": model, "nodes": nodes, "group_size": group_size, "published_s": published,
                    **r, "ratio": r["step_s"] / published,
                    **per_token(model, nodes, group_size, published, r["throughput"]),
                    "memory_problems": problems, "project_rules_step_s": ours["step_s"]})
    return out


def per_token(model: str, nodes: int, group_size: int, step_s: float, throughput: float,
              batch: int = 512) -> dict[str, float]:
    """A tutorial row against the published throughput (`TUTORIAL_THROUGHPUT`): the tokens per sequence (prompt
    and answer) that the published throughput and step time (`step_s`) imply, and the predicted over the published
    throughput (tokens/s), a ratio the answers' lengths enter far less than the step times'."""
    published = TUTORIAL_THROUGHPUT[(model, nodes)]
    return {"published_throughput": published, "throughput_ratio": throughput / published,
            "published_tokens_per_sequence": published * step_s / (batch * group_size)}


def log_row(steps: int, seeds: int) -> dict[str, Any]:
    g = LOG_RUN
    found = cluster(g["model"], g["nodes"], g["group"], batch=g["batch"], max_new=g["max_new"], lay=g["layout"])
    r = run(found, eta=0, steps=steps, seeds=seeds)
    return {**r, "published_range_s": g["published_s"], "published_mean_s": g["published_mean_s"],
            "ratio": r["step_s"] / g["published_mean_s"]}


def speedup_rows(steps: int, seeds: int, models: tuple[str, ...] = tuple(LAYOUTS)) -> list[dict[str, Any]]:
    out = []
    for model, nodes, eta, sync_h, async_h in (r for r in SPEEDUP_RUNS if r[0] in models):
        found = cluster(model, nodes, 16, eta=eta)
        a = run(found, eta=eta, steps=steps, seeds=seeds)
        s = run(found, eta=0, steps=steps, seeds=seeds)
        out.append({"model": model, "nodes": nodes, "eta": eta, "published": sync_h / async_h,
                    "speedup": s["step_s"] / a["step_s"], "async": a, "sync": s,
                    "speedup_min": s["step_s_min"] / a["step_s_max"], "speedup_max": s["step_s_max"] / a["step_s_min"]})
    return out


#: NeMo-RL's GRPO run of Qwen3-30B-A3B, 8-step off-policy (its performance page, NeMo RL v0.6, H100 BF16 table:
#: T-Max Sequence Length 4,096, G-Average Seq len 3,206, 192 GPUs, G-GBS 2,048, T-GBS 512, generation [TP 2, PP 1],
#: training [TP 1, CP 1, EP 8, PP 1], 1,025 tokens/s/GPU, 34.5 s a step). The recipe at v0.6.0
#: (grpo-qwen3-30ba3b-24n8g-async-8off.yaml over grpo-qwen3-30ba3b-4n8g.yaml and grpo_math_1B.yaml): 24 nodes
#: of 8 H100, generation on 8 of them (vLLM, tp 2, gpu_memory_utilization 0.8, not colocated), training on the
#: other 16 (Megatron, tp 1, ep 8, so dp 128); 64 prompts x 32 answers a step; train_global_batch_size 512, so
#: 4 optimizer steps a step; max_trajectory_age_steps 8 with in-flight weight updates; sequence packing,
#: 4,096 tokens a micro-batch (train_micro_batch_size 1 x max_total_sequence_length); no activation
#: checkpointing; reference_policy_kl_penalty 0.01 (a reference model's log-probs every step); the alltoall
#: token dispatcher; OpenMathInstruct-2. Not published: the prompts' length (the planner takes its AReaL
#: figure, 108 tokens) and the share of answers cut at the limit.
NEMO_RL_30B_A3B = {"nodes": 24, "gpu": "H100", "layout": Layout(server_tp=2, tp=1, pp=1, rollout_share=64 / 192, ep=8),
                   "batch": 64, "group": 32, "eta": 8, "max_total_tokens": 4096, "mean_total_tokens": 3206,
                   "micro_batch_tokens": 4096, "recompute": "none", "kl_coef": 0.01, "published_s": 34.5}


def moe_rows(steps: int, seeds: int) -> list[dict[str, Any]]:
    """NeMo-RL's Qwen3-30B-A3B run (`NEMO_RL_30B_A3B`) simulated on this project's actors: the same GPUs, split,
    parallelism, batch, staleness bound and sequence lengths, without and with the KL penalty's reference pass
    (this trainer computes it over the whole batch on every data-parallel replica, NeMo-RL's over each
    replica's share). The answers: a lognormal with the published mean (less the prompt) at the cut, of the
    7B's spread (`sim.SIGMA_7B`). The buffer's own defaults (8 groups a rollout, under its KV pool; the
    staleness gate, not the batch, bounds the groups in flight), as NeMo-RL's generation runs up to 8 steps
    ahead."""
    g = NEMO_RL_30B_A3B
    prompt = sim.PROMPT_TOKENS
    max_new = g["max_total_tokens"] - prompt
    lengths = {"kind": "lognormal", "mean_tokens_at_cut": g["mean_total_tokens"] - prompt, "sigma": sim.SIGMA_7B,
               "cut": max_new}
    out = []
    for kl in (0.0, g["kl_coef"]):
        found = cluster("30B-A3B", g["nodes"], g["group"], batch=g["batch"], max_new=max_new, lay=g["layout"],
                        eta=g["eta"], gpu=g["gpu"], micro_batch_tokens=g["micro_batch_tokens"],
                        recompute=g["recompute"], kl_coef=kl, buffer={})
        r = run(found, eta=g["eta"], steps=steps, seeds=seeds, rules=BufferState, lengths=lengths,
                prompt_tokens=prompt)
        out.append({"run": "NeMo-RL Qwen3-30B-A3B, 8-step off, 192 H100", "kl_coef": kl, **r,
                    "published_s": g["published_s"], "ratio": r["step_s"] / g["published_s"],
                    "memory_problems": [m.problem() for m in sizing.group_memory(found) if not m.fits]})
    return out


def split_sweep(steps: int, seeds: int, splits: tuple[float, ...] | None = None,
                etas: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
    """The split and eta sweep (tools.plan's) on AReaL's 7B run on 16 nodes, with this project's buffer rules
    (`splits`, `etas`: subsets of the shares of GPUs generating and of the etas, to run the sweep in parts)."""
    from tools.plan.__main__ import sweep
    return sweep(cluster("7B", 16, 16), steps, seeds, progress=True, splits=splits, etas=etas)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.plan.published", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per simulation, the first is warm-up")
    ap.add_argument("--seeds", type=int, default=3, help="simulations per figure (mean, min-max)")
    ap.add_argument("--parts", default="tutorial,log,speedup",
                    help="comma-separated: tutorial (the step-time table), log (the tutorial's 7B log), speedup "
                         "(async over sync), moe (NeMo-RL's Qwen3-30B-A3B run), sweep (splits 25-87.5 %% and "
                         "eta 0-16, 7B on 16 nodes; long)")
    ap.add_argument("--splits", help="sweep: comma-separated shares of GPUs generating (default 0.25,0.375,...,0.875)")
    ap.add_argument("--etas", help="sweep: comma-separated etas (default 0,1,2,4,8,16)")
    ap.add_argument("--models", help="comma-separated model sizes whose rows to run (default: all of "
                                      f"{','.join(LAYOUTS)}; the 7B log is the 7B's), to run the parts side by side")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.seeds < 1:
        print("--steps must be >= 2 (the first step is warm-up) and --seeds >= 1", file=sys.stderr)
        return 2
    parts = set(args.parts.split(","))
    unknown = parts - {"tutorial", "log", "speedup", "moe", "sweep"}
    if unknown:
        print(f"--parts: {', '.join(sorted(unknown))} not one of tutorial, log, speedup, moe, sweep", file=sys.stderr)
        return 2
    models = tuple(args.models.split(",")) if args.models else tuple(LAYOUTS)
    if unknown_models := [m for m in models if m not in LAYOUTS]:
        print(f"--models: {', '.join(unknown_models)} not one of {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    try:
        splits = tuple(float(x) for x in args.splits.split(",")) if args.splits else None
    except ValueError:
        print(f"--splits: {args.splits!r} is not a comma-separated list of shares", file=sys.stderr)
        return 2
    if splits and not all(0 < x < 1 for x in splits):
        print(f"--splits: every share must be between 0 and 1, got {args.splits}", file=sys.stderr)
        return 2
    try:
        etas = tuple(int(x) for x in args.etas.split(",")) if args.etas else None
    except ValueError:
        print(f"--etas: {args.etas!r} is not a comma-separated list of whole numbers", file=sys.stderr)
        return 2
    if etas and min(etas) < 0:
        print(f"--etas: every eta must be >= 0, got {args.etas}", file=sys.stderr)
        return 2
    print("tutorial rows", file=sys.stderr, flush=True)
    table = tutorial_rows(args.steps, args.seeds, models) if "tutorial" in parts else []
    print("the tutorial's 7B log", file=sys.stderr, flush=True)
    log = log_row(args.steps, args.seeds) if "log" in parts and LOG_RUN["model"] in models else None
    print("async over sync", file=sys.stderr, flush=True)
    speed = speedup_rows(max(args.steps, 12), args.seeds, models) if "speedup" in parts else []
    moe = moe_rows(max(args.steps, 12), args.seeds) if "moe" in parts else []
    sweep_rows = split_sweep(max(args.steps, 12), args.seeds, splits, etas) if "sweep" in parts else []
    if args.json:
        print(json.dumps({"steps": args.steps, "seeds": args.seeds, "tutorial": table, "log": log, "speedup": speed,
                          "moe": moe, "sweep": sweep_rows}, indent=1))
        return 0
    print("| run (AReaL's layout: inference/training GPUs) | generation | training | weights | predicted step "
          "(min-max over seeds) | published | ratio | throughput predicted / published |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        note = f"; memory: {'; '.join(r['memory_problems'])}" if r["memory_problems"] else ""
        print(f"| {r['model']} on {r['nodes']} node(s), 512 x {r['group_size']} ({r['split']}{note}) | "
              f"{r['generation_s']:,.0f} s | {r['train_s']:,.0f} s | {r['weights_s']:,.1f} s | {r['step_s']:,.0f} s "
              f"({r['step_s_min']:,.0f}-{r['step_s_max']:,.0f}) | {r['published_s']:,} s | {r['ratio']:.2f} | "
              f"{r['throughput']:,.0f} / {r['published_throughput']:,.0f} tokens/s ({r['throughput_ratio']:.2f}) |")
    if log is not None:
        print(f"| tutorial 7B log: 16 nodes, 1024 x 16, cut at 16,384 ({log['split']}) | "
              f"{log['generation_s']:,.0f} s | {log['train_s']:,.0f} s | {log['weights_s']:,.1f} s | {log['step_s']:,.0f} s "
              f"({log['step_s_min']:,.0f}-{log['step_s_max']:,.0f}) | {log['published_range_s'][0]:,.0f}-"
              f"{log['published_range_s'][1]:,.0f} s | {log['ratio']:.2f} | (no published throughput) |")
    print()
    print("| async over sync, same split | sync step | async step (eta) | predicted (min-max) | published |")
    print("|---|---|---|---|---|")
    for r in speed:
        print(f"| {r['model']} on {r['nodes']} nodes | {r['sync']['step_s']:,.0f} s | {r['async']['step_s']:,.0f} s "
              f"({r['eta']}) | {r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | "
              f"{r['published']:.2f}x |")
    if moe:
        print()
        print("| mixture of experts (inference/training GPUs) | KL reference pass | training | predicted step "
              "(min-max) | published | ratio |")
        print("|---|---|---|---|---|---|")
        for r in moe:
            print(f"| {r['run']} ({r['split']}) | {'yes' if r['kl_coef'] else 'no'} | {r['train_s']:,.1f} s | "
                  f"{r['step_s']:,.1f} s ({r['step_s_min']:,.1f}-{r['step_s_max']:,.1f}) | {r['published_s']} s | "
                  f"{r['ratio']:.2f} |")
    if sweep_rows:
        print()
        print("| GPUs generating | " + " | ".join(f"eta {e}" for e in sorted({r['eta'] for r in sweep_rows})) + " |")
        print("|---" * (1 + len({r['eta'] for r in sweep_rows})) + "|")
        for share in sorted({r["share"] for r in sweep_rows}):
            cells = [f"{r['throughput']:,.0f} ({r['throughput_min']:,.0f}-{r['throughput_max']:,.0f})"
                     for r in sweep_rows if r["share"] == share]
            print(f"| {100 * share:.1f} % | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
