"""`python -m tools.plan.published`: the planner against AReaL's published end-to-end figures.

Rows: the tutorial's single-step times (AReaL v0.2's synchronous PPO on H800 nodes, generation and training
on disjoint GPUs, 512 prompts x 16 answers, 32 for 32B; "Single-step Time" in the tutorial's hardware table),
simulated with eta = 0 on a 75/25 split; the paper's "up to 2.77x" over synchronous training, against the
largest async (eta 4) / sync ratio of those rows; and its finding that a 75/25 inference/training split is
best, against the best split of a sweep for 7B on 16 nodes. Prints a Markdown table (docs/plan.md).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from tools.plan import hardware, memory, setup, sim
from tools.plan.shapes import BUILTIN
from topology.experiment import ExperimentConfig
from topology.settings import RolloutSettings, TrainerSettings

#: The v0.2 release notes: "we set the maximum generation length to 27K tokens".
MAX_NEW_TOKENS = 27 * 1024
#: Layouts assumed per model (the published runs' own are not given): SGLang tp and Megatron tp x pp.
LAYOUTS = {"1.5B": {"server_tp": 1, "tp": 1, "pp": 1}, "7B": {"server_tp": 2, "tp": 4, "pp": 1},
           "32B": {"server_tp": 4, "tp": 8, "pp": 2}}
#: (model, nodes, group size, published seconds per step)
TUTORIAL_STEPS = [("1.5B", 1, 16, 3461), ("1.5B", 4, 16, 997), ("1.5B", 16, 16, 391),
                  ("7B", 4, 16, 2275), ("7B", 16, 16, 815), ("32B", 16, 32, 6707)]


def cluster(model: str, nodes: int, group_size: int, rollout_share: float = 0.75, gpus_per_node: int = 8,
            eta: int = 4) -> setup.Setup:
    """A Setup like the one `setup.read` makes from a topology: rollout servers on the first share of the
    GPUs, Megatron on the rest, AReaL's recipe (configs/*_math.yaml) with the published run's sizes."""
    lay = LAYOUTS[model]
    total = nodes * gpus_per_node
    infer = int(round(total * rollout_share / lay["server_tp"])) * lay["server_tp"]
    unit = lay["tp"] * lay["pp"]
    train = ((total - infer) // unit) * unit
    experiment: dict[str, Any] = {
        "algo": {"batch_size": 512, "group_size": group_size, "eta": eta, "ppo_minibatches": 4,
                 "max_tokens_per_mb": 32768},
        "gen": {"max_new_tokens": MAX_NEW_TOKENS, "interruptible": True}, "buffer": {}}
    trainer = {**experiment, "backend": "megatron", "sequence_parallel": True, "recompute": "full",
               "logprob_chunk_tokens": 4096,
               "instance": {"parallel": {"tp": lay["tp"], "pp": lay["pp"], "dp": train // unit}}}
    rollout = {**experiment, "engine": "sglang", "sglang": {"mem_fraction_static": memory.DEFAULT_MEM_FRACTION_STATIC},
               "instance": {"parallel": {"tp": lay["server_tp"]}}}
    groups = [setup.Group("rollout", "rollout", infer // lay["server_tp"], lay["server_tp"],
                          RolloutSettings.model_validate(rollout), "cuda"),
              setup.Group("trainer", "trainer", train, 1, TrainerSettings.model_validate(trainer), "cuda")]
    return setup.Setup(BUILTIN[model], hardware.GPUS["H800"], gpus_per_node, groups,
                       ExperimentConfig.model_validate(experiment))


def rows(steps: int = 3) -> tuple[list[dict[str, Any]], float, dict[str, Any]]:
    out = []
    for model, nodes, group_size, published in TUTORIAL_STEPS:
        found = cluster(model, nodes, group_size)
        fits = [m.problem() for m in setup.group_memory(found) if not m.fits]
        sync = sim.simulate(setup.sim_config(found, eta=0, steps=steps))
        asyn = sim.simulate(setup.sim_config(found, steps=steps))
        out.append({"model": model, "nodes": nodes, "group_size": group_size, "published_s": published,
                    "predicted_s": sync.step_time, "ratio": sync.step_time / published,
                    "async_speedup": asyn.throughput / sync.throughput, "memory_problems": fits,
                    "split": f"{sync.config.servers * sync.config.server_tp}/"
                             f"{sync.config.trainer.dp * sync.config.trainer.tp * sync.config.trainer.pp}"})
    best_speedup = max(r["async_speedup"] for r in out)
    shares = {}
    for share in (0.5, 0.625, 0.75, 0.875):
        r = sim.simulate(setup.sim_config(cluster("7B", 16, 16, rollout_share=share), steps=steps))
        shares[share] = r.throughput
    return out, best_speedup, {"throughput_by_share": shares, "best_share": max(shares, key=shares.get)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.plan.published", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    table, speedup, split = rows(args.steps)
    print("| figure | settings (inference/training GPUs) | predicted | published | ratio |")
    print("|---|---|---|---|---|")
    for r in table:
        note = f"; memory: {'; '.join(r['memory_problems'])}" if r["memory_problems"] else ""
        print(f"| {r['model']} on {r['nodes']} node(s), 512 x {r['group_size']}: step time (sync) | "
              f"eta 0, {r['split']}{note} | {r['predicted_s']:,.0f} s | {r['published_s']:,} s | {r['ratio']:.2f} |")
    print(f"| async speedup over sync, largest of the rows above | eta 4 vs eta 0, same split | {speedup:.2f}x | "
          f"up to 2.77x | {speedup / 2.77:.2f} |")
    shares = ", ".join(f"{100 * k:.1f}%: {v:,.0f}" for k, v in split["throughput_by_share"].items())
    print(f"| best inference share, 7B on 16 nodes, eta 4 | tokens/s by share: {shares} | "
          f"{100 * split['best_share']:.1f}% | 75% | {split['best_share'] / 0.75:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
