"""`python -m tools.bench serve`: what serving one training batch costs the buffer and the trainer, per batch and
per answer token.

A batch request is answered by `BufferActor.on_batch_request`: the ready groups (lists, as ScoredGroups deliver
them) become a `BatchTensors` (`actors.batch.from_batch`), which is encoded and written to disk with its ledger
record and the buffer's state (`BufferFiles.write_served`, fsynced), then sent as the bus's reply; the trainer
decodes it. This bench times that path between two of our buses in one process (TCP loopback), from the request
to the decoded reply, for batches of the same number of answers and growing answer lengths, side by side in
one run (each size `--repeat` times, interleaved), and fits seconds = per_batch + per_token x answer tokens by
least squares over the sizes' medians. It reports the elapsed seconds and the process's CPU seconds (both
sides, ZeroMQ's threads): on a machine shared with other work the elapsed time is the CPU time stretched by the
wait for a core, about the load average over the cores, which the CPU time leaves out.

The planner's simulation (tools/plan/sim.py, `SimConfig.serve`) charges the trainer this cost before each step;
`tools.rehearse` converts it to the rehearsal's scales.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from actors.batch import Batch, BatchGroup
from actors.buffer.actor import BufferFiles
from transport.ports import free_port
from transport.protocol import BatchRequest, BatchTensors, BufferStats, Sample


def list_batch(groups: int, answers: int, tokens: int, prompt_tokens: int = 4, seed: int = 0) -> Batch:
    """A batch as the buffer holds it before serving: `groups` prompts of `answers` answers of `tokens` tokens,
    every per-token field a Python list."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        samples = [Sample(output_ids=rng.integers(0, 152064, tokens).tolist(),
                          logprobs=(-rng.random(tokens) * 10).tolist(), versions=[g % 4] * tokens,
                          finish_reason="stop", reward=5.0 if a % 2 else -5.0) for a in range(answers)]
        out.append(BatchGroup(prompt_ids=rng.integers(0, 152064, prompt_tokens).tolist(), level=g % 5, samples=samples))
    return Batch(step=1, groups=out, stats=BufferStats())


async def timed_serves(files: BufferFiles, batches: dict[int, Batch], repeat: int) -> dict[int, list[tuple[float, float]]]:
    """Each batch served `repeat` times (sizes interleaved, so a burst of other work on the machine spreads over
    every size) from a "buffer" bus to a "trainer" bus on TCP loopback in this process, the buffer's handler doing
    what `BufferActor.on_batch_request` does once the groups are taken: the served copy written off the event
    loop, the batch the reply. Per serve: (elapsed, CPU seconds of this process: both sides and ZeroMQ's
    threads), from the request to the decoded reply."""
    from transport.bus import Bus

    endpoints = {"buffer": f"tcp://127.0.0.1:{free_port()}", "trainer": f"tcp://127.0.0.1:{free_port()}"}
    state = {"data_pass": 0, "position": 0, "reissue": [], "attempts": 0}

    async def handler(env: Any) -> Any:
        if not isinstance(env.msg, BatchRequest):
            return None
        listed = batches[env.msg.step]
        record = {"event": "batch", "step": listed.step, "keys": [[0, i] for i in range(len(listed.groups))]}
        return await asyncio.to_thread(files.write_served, listed, record, state)

    buffer = await Bus("buffer", endpoints["buffer"], {"trainer": endpoints["trainer"]}, handler=handler).start()
    trainer = await Bus("trainer", endpoints["trainer"], {"buffer": endpoints["buffer"]}).start()
    runs: dict[int, list[tuple[float, float]]] = {n: [] for n in batches}
    try:
        for rep in range(repeat + 1):   # the first round warms imports and allocations
            for n in batches:
                t0, c0 = time.perf_counter(), time.process_time()
                reply = await trainer.request("buffer", BatchRequest(step=n), timeout=600)
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
                assert isinstance(reply, BatchTensors) and len(reply.output_lens) == sum(
                    len(g.samples) for g in batches[n].groups)
                if rep:
                    runs[n].append((elapsed, cpu))
    finally:
        await trainer.close(linger=0.0)
        await buffer.close(linger=0.0)
    return runs


def fit(tokens: list[int], seconds: list[float]) -> tuple[float, float]:
    """(per_batch, per_token) of the least-squares line through (tokens, seconds)."""
    slope, intercept = np.polyfit(np.asarray(tokens, float), np.asarray(seconds, float), 1)
    return float(intercept), float(slope)


def measure(groups: int, answers: int, lengths: list[int], repeat: int) -> dict[str, Any]:
    batches = {n: list_batch(groups, answers, n, seed=i) for i, n in enumerate(lengths)}
    for n, b in batches.items():
        b.step = n   # the request names the batch by its answer length
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        runs = asyncio.run(timed_serves(BufferFiles(Path(tmp)), batches, repeat))
    load = (load_before + os.getloadavg()[0]) / 2
    tokens = [groups * answers * n for n in lengths]
    wall = [statistics.median(r[0] for r in runs[n]) for n in lengths]
    cpu = [statistics.median(r[1] for r in runs[n]) for n in lengths]
    (wall_b, wall_t), (cpu_b, cpu_t) = fit(tokens, wall), fit(tokens, cpu)
    return {"groups": groups, "answers": answers, "answer_lengths": lengths, "repeat": repeat,
            "answer_tokens": tokens, "elapsed_s_median": wall, "cpu_s_median": cpu,
            "elapsed_fit": {"per_batch_s": wall_b, "per_token_s": wall_t},
            "cpu_fit": {"per_batch_s": cpu_b, "per_token_s": cpu_t},
            "elapsed_over_cpu": sum(wall) / sum(cpu), "load_average": load, "cores": cores(),
            "load_over_cores": load / cores()}


def cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=32, help="prompts per batch (default 32)")
    p.add_argument("--answers", type=int, default=16, help="answers per prompt (default 16)")
    p.add_argument("--lengths", default="64,128,256,512,1024", help="answer lengths to time, comma-separated")
    p.add_argument("--repeat", type=int, default=5, help="serves of each size (default 5)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    if len(lengths) < 2 or min(lengths) < 1 or a.repeat < 1:
        p.error("--lengths needs at least two positive lengths and --repeat at least 1")
    r = measure(a.groups, a.answers, lengths, a.repeat)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"serving a batch of {a.groups} x {a.answers} answers (median of {a.repeat}, sizes interleaved):")
    print(f"  {'answer tokens':>14} {'elapsed s':>10} {'CPU s':>8}")
    for n, w, c in zip(r["answer_tokens"], r["elapsed_s_median"], r["cpu_s_median"]):
        print(f"  {n:>14,} {w:>10.4f} {c:>8.4f}")
    for kind in ("cpu", "elapsed"):
        f = r[f"{kind}_fit"]
        print(f"  {kind:>7}: {f['per_batch_s'] * 1e3:.2f} ms a batch + {f['per_token_s'] * 1e9:.1f} ns an answer token")
    print(f"  elapsed / CPU: {r['elapsed_over_cpu']:.2f} (load average {r['load_average']:.1f} on {r['cores']} cores: "
          f"{r['load_over_cores']:.2f} runnable a core)")
    return 0
