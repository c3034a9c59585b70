"""`python -m tools.bench packing [--json] [--trials N] [--cost tokens|flops]`

Micro-batch allocation on random length distributions like AReaL's (a long-tailed one up to 31k
tokens with an ~8k mean, as in AReaL's 1.5B/7B runs, and a short uniform one). For each distribution and
allocator it reports, averaged over trials:

- micro-batches / lower bound, where the lower bound is ceil(total tokens / budget) rounded up to a
  multiple of the data-parallel ranks (1.00 is optimal);
- imbalance: max / min work over micro-batches (tokens, or FLOPs with --cost flops), and over ranks;
- padding_saved: the fraction of a padded [n, max_len] micro-batch that would be padding, for the same
  grouping: the work padding-free packing does not do;
- padded_mbs: micro-batches a padded batcher needs under the same budget (lengths sorted, n * max_len
  <= budget), against the packed count;
- ms: allocation time per batch (wall clock, this machine; compare methods side by side only).

`--json` prints one object: the default method's `mb_over_lower_bound` (mean ratio), `imbalance` (mean
max/min) and `padding_saved` (mean fraction), plus every row.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from algo.packing import DEFAULT_METHOD, allocate_micro_batches, micro_batch_lower_bound, sequence_cost, split_by_rank

METHODS = ("ffd", "lpt", "kk")

# name -> (sampler, sequences per batch, token budget, data-parallel ranks)
# 2048 sequences = one of the 4 PPO minibatches of AReaL's 512 prompts x 16 answers.
DISTRIBUTIONS = {
    "long_tail_31k": (lambda rng, n: np.clip(rng.lognormal(np.log(6200), 0.75, n), 64, 31000), 2048, 32768, 8),
    "long_tail_31k_dp1": (lambda rng, n: np.clip(rng.lognormal(np.log(6200), 0.75, n), 64, 31000), 512, 32768, 1),
    "short_uniform": (lambda rng, n: rng.uniform(32, 2048, n), 2048, 16384, 8),
    "short_uniform_dp1": (lambda rng, n: rng.uniform(32, 2048, n), 512, 16384, 1),
}


def padded_micro_batches(lengths: np.ndarray, budget: int) -> int:
    """Fewest padded micro-batches (n * max_len <= budget) for these lengths: fill in sorted order."""
    count, n, longest = 0, 0, 0
    for length in np.sort(lengths)[::-1]:
        if n and (n + 1) * max(longest, int(length)) > budget:
            count, n, longest = count + 1, 0, 0
        n, longest = n + 1, max(longest, int(length))
    return count + (1 if n else 0)


def measure(lengths: np.ndarray, budget: int, n_groups: int, method: str, cost: str) -> dict[str, float]:
    t0 = time.perf_counter()
    mbs = allocate_micro_batches(lengths, budget, n_groups=n_groups, method=method, cost=cost)
    elapsed = time.perf_counter() - t0
    work = sequence_cost(lengths, cost)
    loads = np.array([work[mb].sum() for mb in mbs])
    rank_loads = np.array([sum(work[mb].sum() for mb in rank) for rank in split_by_rank(mbs, n_groups)])
    padded = sum(len(mb) * int(lengths[mb].max()) for mb in mbs)
    return {
        "mb": len(mbs),
        "lower_bound": micro_batch_lower_bound(lengths, budget, n_groups),
        "mb_over_lower_bound": len(mbs) / micro_batch_lower_bound(lengths, budget, n_groups),
        "imbalance": float(loads.max() / loads.min()),
        "rank_imbalance": float(rank_loads.max() / rank_loads.min()),
        "padding_saved": 1.0 - float(lengths.sum()) / padded,
        "padded_mbs": padded_micro_batches(lengths, budget),
        "ms": elapsed * 1e3,
    }


def run(trials: int, cost: str, seed: int) -> dict:
    rows = []
    for name, (sample, n, budget, n_groups) in DISTRIBUTIONS.items():
        per_method: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        for trial in range(trials):
            rng = np.random.default_rng(seed + 1000 * trial)
            lengths = np.maximum(1, sample(rng, n).astype(np.int64))
            for method in METHODS:  # same lengths for every method: side by side
                per_method[method].append(measure(lengths, budget, n_groups, method, cost))
        for method, results in per_method.items():
            row = {"distribution": name, "method": method, "n_seqs": n, "budget": budget, "ranks": n_groups}
            for key in results[0]:
                row[key] = float(np.mean([r[key] for r in results]))
            row["imbalance_worst"] = float(max(r["imbalance"] for r in results))
            rows.append(row)
    default_rows = [r for r in rows if r["method"] == DEFAULT_METHOD[cost]]
    return {
        "benchmark": "packing",
        "cost": cost,
        "trials": trials,
        "default_method": DEFAULT_METHOD[cost],
        "mb_over_lower_bound": float(np.mean([r["mb_over_lower_bound"] for r in default_rows])),
        "imbalance": float(np.mean([r["imbalance"] for r in default_rows])),
        "padding_saved": float(np.mean([r["padding_saved"] for r in default_rows])),
        "rows": rows,
    }


def print_table(result: dict) -> None:
    head = f"{'distribution':<19}{'method':<7}{'mb':>7}{'lb':>7}{'mb/lb':>7}{'imbal':>7}{'worst':>7}" \
           f"{'rank':>7}{'pad_saved':>10}{'padded_mb':>10}{'ms':>9}"
    print(f"packing benchmark: cost={result['cost']}, {result['trials']} trials per distribution")
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        print(f"{r['distribution']:<19}{r['method']:<7}{r['mb']:>7.1f}{r['lower_bound']:>7.1f}"
              f"{r['mb_over_lower_bound']:>7.3f}{r['imbalance']:>7.3f}{r['imbalance_worst']:>7.3f}"
              f"{r['rank_imbalance']:>7.3f}{r['padding_saved']:>10.3f}{r['padded_mbs']:>10.1f}{r['ms']:>9.1f}")
    print(f"default ({result['default_method']}): mb_over_lower_bound={result['mb_over_lower_bound']:.4f} "
          f"(target <= 1.02), imbalance={result['imbalance']:.4f} (target <= 1.10), "
          f"padding_saved={result['padding_saved']:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench packing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--trials", type=int, default=3, help="random batches per distribution")
    parser.add_argument("--cost", choices=("tokens", "flops"), default="tokens", help="what to balance")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials: must be at least 1")
    result = run(args.trials, args.cost, args.seed)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0 if math.isfinite(result["imbalance"]) else 1
