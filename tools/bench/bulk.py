"""`python -m tools.bench bulk`: a bucket broadcast on a bulk link against a raw broadcast of the same bytes.

Two processes form one link (gloo on loopback; `--backend nccl` on a GPU) and broadcast a bucket of 8 float32
tensors of `--mib` MiB in all, each transfer timed alone between barriers, the modes interleaved in `--reps`
rounds; each mode's ratio is the median over rounds of raw's time over its time in the same round (so the
load of a shared machine at that moment cancels), its GB/s the median:

    raw           `BulkLink.broadcast_tensor`: one collective of a buffer of the bucket's size, no header, no
                  checksum, the same preallocated buffers every time
    bucket        `BulkLink.broadcast`: the sender's tensors go out as they are (no packing copy) with the
                  header and an XXH3 checksum computed as the ranges go; the receiver verifies each range as it
                  lands into a recycled buffer and lets the views go, as an engine that copies a bucket does
    kept          the direct-weights path: the sender broadcasts a bucket it packed and kept
                  (`broadcast_packed`), the receiver as above
    receiver_keeps  `bucket`, with a receiver that keeps every bucket (the parameter server keeps versions):
                  each lands in a fresh buffer and pays its page faults (a phase of its own, against raw)

Each member runs one thread (`torch.set_num_threads(1)`), as an actor pinned to one core does. `parts_ms` is
what packing a bucket in host memory costs one side (which the sender saves by sending tensors as they
are).

    python -m tools.bench bulk [--mib 64] [--reps 5] [--backend gloo] [--json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import torch
import xxhash

from transport.bulk import BulkLink, LinkConfig, pack_bucket
from transport.ports import free_port

MODES = ("raw", "bucket", "kept", "receiver_keeps")
PHASES = (("raw", "bucket", "kept"), ("raw", "receiver_keeps"))   # each mode's ratio is to raw of its phase


def bucket_of(mib: int, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)
    return [(f"t{i}", torch.randn(mib * 2**20 // 32, generator=g, device=device)) for i in range(8)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _member(rank: int, world: int, port: int, mib: int, reps: int, backend: str, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        device = "cuda" if backend == "nccl" else "cpu"
        if device == "cuda":
            torch.cuda.set_device(0)
        link = BulkLink(LinkConfig(name="bench", backend=backend, master_addr="127.0.0.1", master_port=port,
                                   rank=rank, world_size=world, timeout_s=120))
        link.open(0)
        bucket = bucket_of(mib, device) if rank == 0 else None
        kept = pack_bucket(bucket, 0) if bucket is not None else None
        size = pack_bucket(bucket_of(mib, device), 0).flat.numel() if rank != 0 else kept.flat.numel()
        raw = torch.ones(size, dtype=torch.uint8, device=device)
        held: list[Any] = []   # receiver_keeps: every bucket it received stays alive

        def run(mode: str) -> None:
            if mode == "raw":
                link.broadcast_tensor(raw, 0)
            elif rank == 0:
                if mode == "kept":
                    link.broadcast_packed(kept, 0)
                else:
                    link.broadcast(bucket, 0)
            else:
                views = link.broadcast(None, 0)
                if mode == "receiver_keeps":
                    held.append(views)

        for mode in MODES:   # warm-up: NCCL builds its communicator, the receive buffers come into use
            run(mode)
        held.clear()
        held.clear()
        # Each transfer timed alone between barriers (which every mode pays alike), the modes interleaved: the
        # ratio of each round's pair (raw, mode) shares that moment's load on a shared machine.
        # The receiver that keeps every bucket runs in a phase of its own: the buffers it keeps are the link's
        # recycled ones, which the next mode in a round would otherwise find taken.
        times: dict[str, list[float]] = {}
        for phase in PHASES:
            for _ in range(reps):
                for mode in phase:
                    link.barrier()
                    _sync(device)
                    t0 = time.perf_counter()
                    run(mode)
                    link.barrier()
                    _sync(device)
                    times.setdefault(f"{phase[-1]}:{mode}", []).append(time.perf_counter() - t0)
            held.clear()
        queue.put((rank, {"times": times, "nbytes": size}))
    except Exception as exc:
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"[:600]}))


def parts_ms(mib: int, reps: int = 5) -> dict[str, float]:
    """What packing a bucket in host memory costs one side, best of ``reps``: a fresh buffer (its page
    faults), the copy into it, and the checksum."""
    src = torch.randn(mib * 2**20 // 4)
    flat = torch.empty(mib * 2**20, dtype=torch.uint8)
    flat.copy_(src.view(torch.uint8))
    parts = {"fresh_buffer": lambda: torch.zeros(flat.numel(), dtype=torch.uint8),
             "copy": lambda: flat.copy_(src.view(torch.uint8)),
             "xxh3_64": lambda: xxhash.xxh3_64_intdigest(memoryview(flat.numpy()))}
    out = {}
    for name, fn in parts.items():
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = round(best * 1e3, 2)
    return out


def measure(mib: int = 64, reps: int = 20, backend: str = "gloo", world: int = 2,
            timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the members and return each mode's GB/s and its ratio to raw (or {"error": ...})."""
    # Fresh interpreters: CUDA must not be forked, and a fork of a process whose threads hold locks (the test
    # suite's, after megatron-core's import) can hang in the child.
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_member, args=(r, world, port, mib, reps, backend, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        for _ in range(world):
            rank, res = queue.get(timeout=timeout_s)
            results[rank] = res
    except Exception as exc:   # a member hung or died without a word
        results[-1] = {"error": f"no answer from every member within {timeout_s:g} s ({type(exc).__name__})"}
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        return {"error": errors[0]}
    nbytes = results[0]["nbytes"]
    # every member waits at the closing barrier: the slowest member's clock is the transfer's
    slowest = {k: [max(r["times"][k][i] for r in results.values()) for i in range(reps)] for k in results[0]["times"]}
    out: dict[str, Any] = {"backend": backend, "world": world, "mib": mib, "reps": reps}
    out["raw_gb_per_s"] = round(nbytes / statistics.median(slowest[f"{PHASES[0][-1]}:raw"]) / 1e9, 3)
    for phase in PHASES:
        raw = slowest[f"{phase[-1]}:raw"]
        for m in phase[1:]:
            mine = slowest[f"{phase[-1]}:{m}"]
            out[f"{m}_gb_per_s"] = round(nbytes / statistics.median(mine) / 1e9, 3)
            ratios = sorted(r / t for r, t in zip(raw, mine))
            out[f"{m}_ratio"] = round(statistics.median(ratios), 3)
            out[f"{m}_ratio_quartiles"] = [round(ratios[len(ratios) // 4], 3), round(ratios[3 * len(ratios) // 4], 3)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench bulk", description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = measure(args.mib, args.reps, args.backend, args.world)
    if "error" in out:
        print(f"bench bulk failed: {out['error']}", file=sys.stderr)
        return 1
    out["parts_ms"] = parts_ms(args.mib)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.backend} link of {args.world}, a {args.mib} MiB bucket ({args.reps} rounds, modes interleaved; "
          f"medians)")
    print(f"{'transfer':<58}{'GB/s':>8}{'x raw':>8}")
    labels = {"raw": "raw broadcast of the same bytes (broadcast_tensor)",
              "bucket": "bucket broadcast (header, checksum, verified)",
              "kept": "kept bucket broadcast (direct weights)",
              "receiver_keeps": "bucket broadcast, receiver keeps every bucket"}
    for m in MODES:
        ratio = "" if m == "raw" else f"{out[f'{m}_ratio']:.2f}"
        print(f"{labels[m]:<58}{out[f'{m}_gb_per_s']:>8.2f}{ratio:>8}")
    print("packing in host memory, one side, ms: " + ", ".join(f"{k} {v}" for k, v in out["parts_ms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
