"""`python -m tools.plan.calibrate [--out FILE] [--workload-from RUN_DIR] [--quick]`: per-token costs of the
embedded engines on this machine, for `python -m tools.plan` to simulate a CPU topology (docs/plan.md).

What it measures, each on the core `topology/local.yaml` gives that actor (rollouts core 0, trainer and
parameter server core 1; one torch thread each):

  decode     `TorchGenerationEngine`'s own step log while n answers decode together (n = 1 .. 128), fitted
             as seconds = a + b_row * n + b_kv * K (K: KV tokens the step reads); the engine's per-step
             Python and kernel-launch cost is a, which no byte or FLOP count gives
  prefill    `Qwen2ForCausalLM.prefill` of right-padded prompts, fitted as a + b * tokens
  train      the trainer's own step, `actors.trainer.actor.train_on_batch` (advantages, proximal log-probs, PPO
             micro-batches packed by `algo.packing`, backward, AdamW) with the experiment's algo settings, on
             synthetic batches of 4-32 groups, fitted as a + b * tokens
  weights    the model's export buckets over the two gloo bulk links of the topology (trainer -> parameter
             server, parameter server -> both rollouts), each between barriers, in forked processes
  reward     `grade_math_fast` on a group's answers (what `MathReward` runs off its event loop)

With `--workload-from RUN_DIR` it also records the run's workload from its metrics.jsonl (mean answer length,
share of answers cut at max_new_tokens, share of groups dynamic sampling kept): inputs of the simulation,
not times, so the comparison with that run's step time stays a prediction.

Costs depend on the model's shape, not its weights: the model directory's weights are used when it has
any, else its config with random weights. Figures are medians of repeats (the machine is shared).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from topology.experiment import ExperimentConfig
from transport.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "configs/models/arith-tiny"
DEFAULT_OUT = "docs/measurements/local-costs.json"
ROLLOUT_CORE, TRAINER_CORE = 0, 1
#: A prompt of the arithmetic task ("Compute: 6-8-2+2\n") is 8.3 tokens on average (`prompt_tokens`); the
#: decode fit counts the prompt in the KV tokens, so this only sets where its range starts.
PROMPT_TOKENS = 8


def _pin(core: int) -> None:
    """One thread on one core, as the topology's `cpus: [core]`, `threads: 1` gives the actor."""
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def _model(model_dir: str) -> Any:
    from tools.bench.engine import build_model

    return build_model(str(ROOT / model_dir) if not Path(model_dir).is_absolute() else model_dir, seed=0)


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares of the relative error of y ~ x @ coef (so that the small cases, a decode step of one
    row, count as much as the large ones), and the median relative residual (how well the form holds)."""
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    rel = np.abs(x @ coef - y) / np.maximum(y, 1e-12)
    return coef, float(np.median(rel))


# --- decode and prefill (the rollout's core) ------------------------------------------------------------

async def _decode_run(model: Any, n: int, new_tokens: int, seed: int) -> list[tuple[float, int]]:
    """(seconds, rows) of every decode step while n answers of new_tokens each decode together."""
    from actors.engines.base import GenerationRequest, SamplingParams
    from actors.engines.torch_gen import TorchGenerationEngine

    engine = TorchGenerationEngine(model=model)
    await engine.start()
    try:
        prompt = list(range(1, PROMPT_TOKENS + 1))
        per = min(n, 8)   # groups of 8 samples, as the buffer sends them (one prefill, copied rows)
        reqs = [GenerationRequest(f"d{n}-{i}", prompt, SamplingParams(max_new_tokens=new_tokens, seed=seed + i),
                                  n=min(per, n - i * per)) for i in range(-(-n // per))]
        await asyncio.gather(*[engine.generate(r) for r in reqs])
    finally:
        await engine.stop()
    return [(sec, rows) for _, sec, rows in engine.step_log]


def measure_decode(model: Any, sizes: Sequence[int], new_tokens: int, repeats: int) -> dict[str, Any]:
    """The decode step's fit over batches of `sizes` answers (the fastest of `repeats` for each step: the
    machine is shared, and other jobs only ever add time)."""
    rows_x, ys, per_n = [], [], {}
    for n in sizes:
        best: list[float] | None = None
        for r in range(repeats):
            log = asyncio.run(_decode_run(model, n, new_tokens, seed=100 * r))
            # steps with all n rows live; step i of them reads n * (prompt + i + 1) KV tokens
            full = [sec for sec, rows in log if rows == n]
            best = full if best is None else [min(a, b) for a, b in zip(best, full)]
        assert best is not None
        per_n[str(n)] = statistics.median(best)
        for i, sec in enumerate(best):
            rows_x.append([1.0, n, n * (PROMPT_TOKENS + i + 1)])
            ys.append(sec)
    coef, resid = _fit(np.array(rows_x), np.array(ys))
    return {"a_s": float(coef[0]), "b_row_s": float(coef[1]), "b_kv_s": float(coef[2]),
            "median_rel_residual": resid, "median_step_s_by_rows": per_n, "new_tokens": new_tokens,
            "form": "seconds per step = a_s + b_row_s * rows + b_kv_s * kv_tokens"}


def measure_prefill(model: Any, repeats: int) -> dict[str, Any]:
    """The prefill's fit over right-padded batches of 1-64 rows of 8-60 tokens (median of `repeats`)."""
    xs, ys = [], []
    with torch.inference_mode():
        cache = model.new_cache(8, 64)
        for rows in (1, 8, 32, 64):
            for length in (8, 16, 32, 60):
                ids = torch.randint(1, model.config.vocab_size, (rows, length))
                lengths = torch.full((rows,), length)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    model.prefill(ids, lengths, cache, 0)
                    times.append(time.perf_counter() - t0)
                xs.append([1.0, rows * length, rows * length ** 2])
                ys.append(statistics.median(times))
    coef, resid = _fit(np.array(xs), np.array(ys))
    return {"a_s": float(coef[0]), "b_token_s": float(coef[1]), "b_sq_s": float(coef[2]),
            "median_rel_residual": resid,
            "form": "seconds = a_s + b_token_s * tokens + b_sq_s * sum of squared lengths"}


# --- training (the trainer's core) ----------------------------------------------------------------------

def _batch(groups: int, group_size: int, prompt: int, answer: int, vocab: int, gen: torch.Generator) -> Any:
    """A Batch as the buffer hands it over: groups of scored answers around `answer` tokens long, half right."""
    from actors.batch import Batch, BatchGroup
    from transport.protocol import BufferStats, Sample

    out = []
    for g in range(groups):
        samples = []
        for i in range(group_size):
            n = max(2, answer + int(torch.randint(-4, 5, (1,), generator=gen)))
            samples.append(Sample(output_ids=torch.randint(1, vocab, (n,), generator=gen).tolist(),
                                  logprobs=(-torch.rand(n, generator=gen) * 3).tolist(), versions=[0] * n,
                                  finish_reason="stop", reward=5.0 if i % 2 else -5.0, correct=bool(i % 2)))
        out.append(BatchGroup(prompt_ids=torch.randint(1, vocab, (prompt,), generator=gen).tolist(), level=1,
                              samples=samples))
    return Batch(step=1, groups=out, stats=BufferStats())


def measure_train(model_dir: str, repeats: int, experiment: dict[str, Any]) -> dict[str, Any]:
    """The trainer's own step (`actors.trainer.actor.train_on_batch`: advantages, proximal log-probs, PPO
    micro-batches, backward, AdamW) with the experiment's algo settings, on batches of the config's shape."""
    from actors.engines.torch_train import TorchTrainEngine, TrainConfig
    from actors.trainer.actor import StepConfig, train_on_batch

    config = ExperimentConfig.model_validate(experiment)
    algo = config.algo
    engine = TorchTrainEngine(model=_model(model_dir), config=TrainConfig(lr=algo.lr))
    cfg = StepConfig.from_settings(config)
    vocab = engine.model.config.vocab_size
    group_size = algo.group_size
    gen = torch.Generator().manual_seed(0)
    xs, ys = [], []
    for groups, answer in ((4, 16), (8, 16), (16, 8), (16, 16), (16, 32), (16, 44), (32, 24)):
        times, tokens = [], 0
        for r in range(repeats + 1):   # the first is warm-up (allocator, autograd graph caches)
            batch = _batch(groups, group_size, PROMPT_TOKENS, answer, vocab, gen)
            tokens = sum(len(g.prompt_ids) + len(s.output_ids) for g in batch.groups for s in g.samples)
            t0 = time.perf_counter()
            train_on_batch(engine, batch, cfg, version=1)
            if r:
                times.append(time.perf_counter() - t0)
        xs.append([1.0, float(tokens)])
        ys.append(statistics.median(times))
    coef, resid = _fit(np.array(xs), np.array(ys))
    return {"a_s": float(coef[0]), "b_token_s": float(coef[1]), "median_rel_residual": resid,
            "max_tokens_per_mb": cfg.max_tokens_per_mb,
            "form": "seconds per step = a_s + b_token_s * tokens (prompt + answer of every answer)"}


# --- weights over the bulk links (forked processes, as the actors are) ----------------------------------

def _link_member(role: str, ports: tuple[int, int], model_dir: str, reps: int, queue: Any) -> None:
    from transport.bulk import BulkLink, LinkConfig

    _pin(TRAINER_CORE if role in ("trainer", "ps") else ROLLOUT_CORE)
    a_port, b_port = ports
    links: dict[str, BulkLink] = {}
    if role in ("trainer", "ps"):
        links["a"] = BulkLink(LinkConfig(name="train_to_ps", backend="gloo", master_addr="127.0.0.1",
                                         master_port=a_port, rank=0 if role == "trainer" else 1, world_size=2,
                                         timeout_s=120))
    if role != "trainer":
        rank = {"ps": 0, "r0": 1, "r1": 2}[role]
        links["b"] = BulkLink(LinkConfig(name="ps_to_rollout", backend="gloo", master_addr="127.0.0.1",
                                         master_port=b_port, rank=rank, world_size=3, timeout_s=120))
    for link in links.values():
        link.open(0)
    buckets = None
    if role == "trainer":
        from actors.engines.torch_train import TorchTrainEngine, TrainConfig

        buckets = list(TorchTrainEngine(model=_model(model_dir), config=TrainConfig()).export_weights())
    n_buckets = len(buckets) if buckets is not None else None
    times: dict[str, list[float]] = {"a": [], "b": []}
    # Link a: trainer -> parameter server; link b: parameter server -> both rollouts.
    senders = {"a": "trainer", "b": "ps"}
    for _ in range(reps):
        for key in ("a", "b"):
            if key in links:
                links[key].barrier()
                t0 = time.perf_counter()
                got = _relay(links[key], buckets if role == senders[key] else None)
                if key == "a" and role != "trainer":
                    buckets = got
                links[key].barrier()
                times[key].append(time.perf_counter() - t0)
    if role == "ps":
        queue.put({"trainer_to_ps_s": statistics.median(times["a"]), "ps_to_rollouts_s": statistics.median(times["b"]),
                   "buckets": len(buckets or [])})
    elif role == "trainer":
        queue.put({"buckets_sent": n_buckets})
    for link in links.values():
        link.close()


def _relay(link: Any, buckets: list | None) -> list:
    """Broadcast `buckets` from this member (the source), or receive them (None): the count travels as a last
    "end" bucket. Returns what was received (the sender's own buckets at the source)."""
    if buckets is not None:
        for bucket in buckets:
            link.broadcast(bucket, src=0)
        link.broadcast([("end", torch.zeros(1))], src=0)
        return buckets
    received = []
    while (bucket := link.broadcast(None, src=0))[0][0] != "end":
        received.append(bucket)
    return received


def measure_weights(model_dir: str, reps: int) -> dict[str, Any]:
    """One weight update over the topology's two bulk links, four forked members (median of `reps`)."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=_link_member, args=(role, ports, model_dir, reps, queue))
             for role in ("trainer", "ps", "r0", "r1")]
    for p in procs:
        p.start()
    out: dict[str, Any] = {}
    for _ in range(2):
        out.update(queue.get(timeout=300))
    for p in procs:
        p.join(timeout=60)
    out["seconds"] = out["trainer_to_ps_s"] + out["ps_to_rollouts_s"]
    out["form"] = "seconds per update = trainer_to_ps_s + ps_to_rollouts_s (wire, both links, between barriers)"
    return out


# --- reward ---------------------------------------------------------------------------------------------

def measure_reward(group_size: int, repeats: int) -> dict[str, Any]:
    """Grading one group of answers with the math reward's fast path (median of `repeats`)."""
    from actors.reward.math_grader import grade_math_fast

    answers = [f"6-8=-2, -2-2=-4, -4+2=-2 \\boxed{{{v}}}" for v in (-2, -3, -2, 0, -2, -2, 1, -2)]
    answers = (answers * (group_size // len(answers) + 1))[:group_size]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for text in answers:
            grade_math_fast(text, "-2")
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "group_size": group_size,
            "form": "seconds from a group's last answer to its rewards (grading only; the bus hops are not in it)"}


# --- the workload of a run -----------------------------------------------------------------------------

def prompt_tokens(data: str | Path, model_dir: str, limit: int = 2000) -> float:
    """Mean prompt length in tokens of the data's first `limit` prompts, as the model's tokenizer cuts them."""
    from actors.engines.tokenizer import load_tokenizer

    tok = load_tokenizer(str(ROOT / model_dir) if not Path(model_dir).is_absolute() else model_dir)
    lines = Path(data).read_text().splitlines()[:limit]
    return float(np.mean([len(tok.encode(json.loads(line)["prompt"])) for line in lines if line.strip()]))


def workload_from_run(run_dir: str | Path, batch_size: int, prompt: float) -> dict[str, Any]:
    """The run's answers as the simulation needs them, from the trainer's metrics.jsonl: mean answer length,
    share cut at max_new_tokens, and the share of finished groups that dynamic sampling kept."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl: no steps")
    # the buffer's counters run from its start: the last step's are the run's; accepted groups are the
    # trained ones and those still waiting in the buffer at the last batch
    kept = batch_size * len(rows) + float(rows[-1].get("buffer_depth", 0))
    dropped = float(rows[-1].get("dropped_uniform", 0))
    return {"source": str(run_dir), "steps": len(rows), "prompt_tokens": prompt,
            "mean_answer_tokens": float(np.mean([r["avg_seq_len"] for r in rows])),
            "cut_share": float(np.mean([r["no_eos_ratio"] for r in rows])),
            "kept_group_share": kept / (kept + dropped), "dropped_stale": float(rows[-1].get("dropped_stale", 0)),
            "accuracy": float(np.mean([r["accuracy"] for r in rows]))}


def _timed(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """fn's result with the share of a core this process had meanwhile (CPU over wall seconds): on a shared
    machine the costs are only as fast as that share."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    out["core_share"] = (time.process_time() - c0) / (time.perf_counter() - w0)
    return out


def measure(model_dir: str, quick: bool, experiment: dict[str, Any]) -> dict[str, Any]:
    """Every cost of the cost file, each on the core its actor has in topology/local.yaml."""
    reps = 1 if quick else 3
    sizes = (1, 8, 32, 64) if quick else (1, 4, 8, 16, 32, 64, 128)
    t0, load0 = time.time(), os.getloadavg()
    _pin(ROLLOUT_CORE)
    model = _model(model_dir)
    out: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads_per_actor": 1},
        "model": model_dir, "params": sum(p.numel() for p in model.parameters()),
        "placement": {"rollout_core": ROLLOUT_CORE, "trainer_core": TRAINER_CORE},
        "decode": _timed(lambda: measure_decode(model, sizes, new_tokens=24 if quick else 48, repeats=reps)),
        "prefill": _timed(lambda: measure_prefill(model, repeats=reps if quick else 5)),
    }
    _pin(TRAINER_CORE)
    out["train"] = _timed(lambda: measure_train(model_dir, repeats=reps, experiment=experiment))
    out["weights"] = measure_weights(model_dir, reps=3 if quick else 10)
    out["reward"] = measure_reward(8, repeats=5 if quick else 20)
    out["seconds"] = time.time() - t0
    # the machine is shared: what else ran shows in the load average (runnable processes, 1/5/15 min)
    out["machine"]["loadavg_start"], out["machine"]["loadavg_end"] = list(load0), list(os.getloadavg())
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.plan.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model directory (its shape; weights optional)")
    ap.add_argument("--topology", default="topology/local.yaml", help="whose experiment's algo settings the "
                    "training step uses (default topology/local.yaml)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"cost file to write (default {DEFAULT_OUT})")
    ap.add_argument("--workload-from", metavar="RUN_DIR", action="append", default=[],
                    help="record this run's workload (repeatable; NAME=RUN_DIR names it, else the folder name)")
    ap.add_argument("--batch-size", type=int, default=16, help="the runs' algo.batch_size (for the kept share)")
    ap.add_argument("--data", default="data/arith/train.jsonl", help="the runs' prompts (for their mean length)")
    ap.add_argument("--keep-costs", action="store_true", help="only add workloads to an existing cost file")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats (seconds, for tests)")
    args = ap.parse_args(argv)
    out_path = Path(args.out)
    if args.keep_costs:
        data = json.loads(out_path.read_text())
    else:
        import topology

        experiment = topology.load(ROOT / args.topology, check_imports=False).topology.experiment
        data = measure(args.model, args.quick, experiment)
        data["topology"] = args.topology
        data["command"] = "python -m tools.plan.calibrate " + " ".join(argv if argv is not None else sys.argv[1:])
    for spec in args.workload_from:
        name, _, path = spec.rpartition("=")
        data.setdefault("workloads", {})[name or Path(path).name] = workload_from_run(
            path, args.batch_size, prompt_tokens(args.data, args.model))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(data, indent=1) + "\n")
    d, t = data["decode"], data["train"]
    print(f"decode step {d['a_s'] * 1e3:.2f} ms + {d['b_row_s'] * 1e6:.1f} us/row + {d['b_kv_s'] * 1e9:.1f} ns/KV token; "
          f"prefill {data['prefill']['a_s'] * 1e3:.2f} ms + {data['prefill']['b_token_s'] * 1e6:.1f} us/token; "
          f"train {t['a_s'] * 1e3:.1f} ms + {t['b_token_s'] * 1e6:.1f} us/token; "
          f"weights {data['weights']['seconds'] * 1e3:.1f} ms; reward {data['reward']['seconds'] * 1e3:.2f} ms/group"
          f" -> {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
