"""`python -m tools.bench bus [--json]`: our bus against raw pyzmq, side by side, on loopback TCP.

Every case runs in two fresh processes (sender, receiver) on DEALER -> ROUTER sockets with the same
high-water mark, and raw and ours alternate ``--repeat`` times (the median is reported), so both see the
same machine load:

  small  ~100 bytes of fields per message. raw: msgpack.packb(dict) / recv_multipart + unpackb on plain
         blocking sockets. ours: ``await bus.send(peer, Small(...))`` -> decoded, validated and dispatched
         to a handler, one by one (the bus coalesces the sends of one event-loop tick into one ZeroMQ
         message; the raw side sends one ZeroMQ message per payload, as a plain pyzmq program would).
         Rate measured at the receiver from the first to the last message.
  bulk   one 64 MiB float32 tensor per message. raw: send_multipart([header, memoryview], copy=False) /
         recv_multipart(copy=False). ours: a message with a torch.Tensor field (zero-copy both ways, the
         receiver gets a torch tensor). Bandwidth in GB/s (1e9 bytes).
  rtt    sequential request/reply round trips (ours: ``bus.request``), p50/p99 in microseconds; raw
         DEALER/ROUTER ping-pong for reference.

JSON keys: small_ratio, bulk_ratio, ours_msgs_per_s, raw_msgs_per_s, ours_bulk_gb_per_s,
raw_bulk_gb_per_s, rtt_p50_us, rtt_p99_us, raw_rtt_p50_us, raw_rtt_p99_us, the per-run rates and the
ratio of each alternating pair (small_pair_ratios, bulk_pair_ratios), plus the parameters.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from typing import Any

import torch

from transport.messages import Message, message
from transport.ports import free_port

HWM = 1000
BULK_BYTES = 64 << 20

SMALL_FIELDS = {"prompt_id": 123456, "version": 7, "reward": 0.5,
                "text": "the answer is \\boxed{42} (short one)", "tokens": [101, 2023, 2003, 1037, 3231, 102]}


@message("bench.small")
class Small(Message):
    prompt_id: int
    version: int
    reward: float
    text: str
    tokens: list[int]


@message("bench.bulk")
class Bulk(Message):
    seq: int
    t: torch.Tensor


# ------------------------------------------------------------------------------------------ receivers

def _raw_socket(kind: str, endpoint: str) -> tuple[Any, Any]:
    """The plain ZeroMQ baseline's socket and its context: a ROUTER bound at ``endpoint`` (the receiver) or
    a DEALER connected to it (the sender), with the bus's high-water marks so both sides queue alike."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER if kind == "router" else zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.SNDHWM, HWM)
    if kind == "router":
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return ctx, sock


def _rx(mode: str, endpoint: str, n: int, ready: Any, results: Any, done: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if mode.startswith("raw"):
        import msgpack

        ctx, sock = _raw_socket("router", endpoint)
        ready.set()
        if mode == "raw_small":
            frames = sock.recv_multipart()
            msgpack.unpackb(frames[1])
            t0 = time.perf_counter()
            for _ in range(n - 1):
                frames = sock.recv_multipart()
                msgpack.unpackb(frames[1])
        elif mode == "raw_bulk":
            import torch
            frames = sock.recv_multipart(copy=False)
            t0 = time.perf_counter()
            for _ in range(n - 1):
                frames = sock.recv_multipart(copy=False)
                msgpack.unpackb(frames[1].bytes)
                torch.frombuffer(frames[2].buffer, dtype=torch.float32)
        else:  # raw_rtt
            t0 = time.perf_counter()
            for _ in range(n):
                frames = sock.recv_multipart()
                sock.send_multipart(frames)
        results.put((mode, time.perf_counter() - t0))
        done.wait(60)
        sock.close(0)
        ctx.term()
        return

    import asyncio

    import uvloop

    from transport.bus import Bus

    async def main() -> None:
        count = 0
        t0 = 0.0
        finished = asyncio.Event()

        def handler(env: Any) -> Any:
            nonlocal count, t0
            count += 1
            if count == 1:
                t0 = time.perf_counter()
            if env.header.wants_reply:
                return env.msg
            if count == n:
                finished.set()
            return None

        bus = await Bus("rx", endpoint, handler=handler, hwm=HWM, heartbeat_interval=None).start()
        ready.set()
        if mode == "ours_rtt":
            start = time.perf_counter()
            while count < n:
                await asyncio.sleep(0.01)
            results.put((mode, time.perf_counter() - start))
        else:
            await finished.wait()
            results.put((mode, time.perf_counter() - t0))
        await asyncio.get_running_loop().run_in_executor(None, done.wait, 60)
        await bus.close(linger=0)

    uvloop.run(main())


# -------------------------------------------------------------------------------------------- senders

def _tx(mode: str, endpoint: str, n: int, results: Any, done: Any, coalesce: bool = True) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if mode.startswith("raw"):
        import msgpack

        ctx, sock = _raw_socket("dealer", endpoint)
        if mode == "raw_small":
            for _ in range(n):
                sock.send(msgpack.packb(SMALL_FIELDS))
        elif mode == "raw_bulk":
            import torch
            t = torch.ones(BULK_BYTES // 4, dtype=torch.float32)
            view = memoryview(t.numpy())
            for i in range(n):
                sock.send_multipart([msgpack.packb({"seq": i, "dtype": "float32", "shape": [t.numel()]}), view],
                                    copy=False)
        else:  # raw_rtt
            payload = msgpack.packb(SMALL_FIELDS)
            samples = []
            for _ in range(n):
                s = time.perf_counter()
                sock.send(payload)
                sock.recv()
                samples.append(time.perf_counter() - s)
            results.put((mode + "_samples", samples))
        done.wait(60)
        sock.close(0)
        ctx.term()
        return

    import asyncio

    import uvloop

    from transport.bus import Bus

    async def main() -> None:
        bus = await Bus("tx", "tcp://127.0.0.1:*", {"rx": endpoint}, hwm=HWM, heartbeat_interval=None,
                        coalesce=coalesce).start()
        if mode == "ours_small":
            for _ in range(n):
                await bus.send("rx", Small(**SMALL_FIELDS))
        elif mode == "ours_bulk":
            import torch
            t = torch.ones(BULK_BYTES // 4, dtype=torch.float32)
            for i in range(n):
                await bus.send("rx", Bulk(i, t))
        else:
            samples = []
            msg = Small(**SMALL_FIELDS)
            for _ in range(n):
                s = time.perf_counter()
                await bus.request("rx", msg, timeout=30)
                samples.append(time.perf_counter() - s)
            results.put((mode + "_samples", samples))
        await asyncio.get_running_loop().run_in_executor(None, done.wait, 60)
        await bus.close(linger=0)

    uvloop.run(main())


def _run_case(mode: str, n: int, coalesce: bool = True) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    results = ctx.Queue()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    rx = ctx.Process(target=_rx, args=(mode, endpoint, n, ready, results, done), daemon=True)
    rx.start()
    if not ready.wait(60):
        raise RuntimeError(f"{mode}: receiver did not start")
    tx = ctx.Process(target=_tx, args=(mode, endpoint, n, results, done, coalesce), daemon=True)
    tx.start()
    out: dict[str, Any] = {}
    wanted = 2 if mode.endswith("rtt") else 1
    deadline = time.monotonic() + 300
    try:
        while len(out) < wanted:
            try:
                key, value = results.get(timeout=1)
                out[key] = value
            except queue.Empty:
                dead = [p.name for p in (tx, rx) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"{mode}: {'a process failed' if dead else 'timed out'}") from None
    finally:
        done.set()
        for p in (tx, rx):
            p.join(30)
            if p.is_alive():
                p.kill()
    return out


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench bus", description="bus vs raw pyzmq")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--small-n", type=int, default=200_000, help="small messages per run")
    ap.add_argument("--bulk-n", type=int, default=24, help="64 MiB messages per run")
    ap.add_argument("--rtt-n", type=int, default=5_000, help="request/reply round trips")
    ap.add_argument("--repeat", type=int, default=3, help="alternating raw/ours runs per case (median)")
    ap.add_argument("--no-coalesce", action="store_true",
                    help="our sender hands every message to ZeroMQ on its own (the per-message cost of the typed layer)")
    args = ap.parse_args(argv)

    def rates(mode: str, n: int, unit: float) -> float:
        return (n - 1) * unit / _run_case(mode, n, coalesce=not args.no_coalesce)[mode]

    small = {"raw": [], "ours": []}
    bulk = {"raw": [], "ours": []}
    for _ in range(args.repeat):
        small["raw"].append(rates("raw_small", args.small_n, 1))
        small["ours"].append(rates("ours_small", args.small_n, 1))
        bulk["raw"].append(rates("raw_bulk", args.bulk_n, BULK_BYTES / 1e9))
        bulk["ours"].append(rates("ours_bulk", args.bulk_n, BULK_BYTES / 1e9))
    rtt = _run_case("ours_rtt", args.rtt_n)["ours_rtt_samples"]
    raw_rtt = _run_case("raw_rtt", args.rtt_n)["raw_rtt_samples"]
    med = statistics.median
    result = {
        "ours_msgs_per_s": round(med(small["ours"])), "raw_msgs_per_s": round(med(small["raw"])),
        "small_ratio": round(med(small["ours"]) / med(small["raw"]), 3),
        "ours_bulk_gb_per_s": round(med(bulk["ours"]), 3), "raw_bulk_gb_per_s": round(med(bulk["raw"]), 3),
        "bulk_ratio": round(med(bulk["ours"]) / med(bulk["raw"]), 3),
        "rtt_p50_us": round(_pct(rtt, 0.5), 1), "rtt_p99_us": round(_pct(rtt, 0.99), 1),
        "raw_rtt_p50_us": round(_pct(raw_rtt, 0.5), 1), "raw_rtt_p99_us": round(_pct(raw_rtt, 0.99), 1),
        "small_runs": {k: [round(x) for x in v] for k, v in small.items()},
        "bulk_runs": {k: [round(x, 3) for x in v] for k, v in bulk.items()},
        "small_pair_ratios": [round(o / r, 3) for o, r in zip(small["ours"], small["raw"])],
        "bulk_pair_ratios": [round(o / r, 3) for o, r in zip(bulk["ours"], bulk["raw"])],
        "small_n": args.small_n, "bulk_n": args.bulk_n, "bulk_bytes": BULK_BYTES, "rtt_n": args.rtt_n,
        "repeat": args.repeat, "coalesce": not args.no_coalesce, "cpus": len(os.sched_getaffinity(0)), "transport": "tcp loopback",
    }
    if args.json:
        print(json.dumps(result))
        return 0
    rows = [("small msgs/s", result["raw_msgs_per_s"], result["ours_msgs_per_s"], result["small_ratio"]),
            ("64 MiB GB/s", result["raw_bulk_gb_per_s"], result["ours_bulk_gb_per_s"], result["bulk_ratio"]),
            ("rtt p50 us", result["raw_rtt_p50_us"], result["rtt_p50_us"],
             round(result["raw_rtt_p50_us"] / result["rtt_p50_us"], 3)),
            ("rtt p99 us", result["raw_rtt_p99_us"], result["rtt_p99_us"],
             round(result["raw_rtt_p99_us"] / result["rtt_p99_us"], 3))]
    print(f"bus benchmark, {result['cpus']} cpus, tcp loopback, median of {args.repeat} alternating runs")
    print(f"{'case':<16}{'raw pyzmq':>14}{'ours':>14}{'ours/raw':>10}")
    for name, raw, ours, ratio in rows:
        print(f"{name:<16}{raw:>14}{ours:>14}{ratio:>10}")
    print("(rtt rows: ratio is raw/ours, higher is better)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
