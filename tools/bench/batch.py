"""`python -m tools.bench batch`: a training batch of the 7B recipe's shape from the buffer to the trainer.

Two processes on TCP loopback, each with our Bus at its default 256 MiB frame limit: the "buffer" answers a
BatchRequest with a synthetic `BatchTensors` (512 prompts x 16 answers of 31,744 new tokens by default,
every answer at the recipe's maximum: the worst case), the "trainer" asks for it R times and times each
request to the decoded reply. Then, in the trainer process, the shares trainer.0 would send to the ranks of
a world of `--dp` data-parallel replicas (`actors.trainer.actor.rank_samples`, `actors.batch.shares`): their size
against the whole batch's, and the time to build them.

With `--trainer-cpu`: the trainer's CPU time per step outside the model, at the same shape, in one process.
One data-parallel rank of `--dp` (rank 0) gets its share of the batch and runs the whole training step
(`actors.trainer.step.train_share`: the layout, advantages, corrections, every micro-batch of every PPO
minibatch) on an engine with no model (`_NoModel`: zero log-probs, no loss, no optimizer), so only the
batch's path from the wire form to the micro-batches is timed. `--against TREE` runs the same measurement
in another checkout of the project (one that has this benchmark) and reports both and their ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from typing import Any, Iterator

import torch

from actors.batch import BATCH_FRAME_BYTES, from_columns, sample_groups, shares as batch_shares
from transport.ports import free_port
from transport.protocol import BatchRequest, BatchTensors, BufferStats


def synthetic_batch(groups: int = 512, answers: int = 16, max_new: int = 31744, prompt_len: int = 300,
                    vocab: int = 152064, full_length: bool = True, seed: int = 0,
                    frame_bytes: int = BATCH_FRAME_BYTES) -> BatchTensors:
    """A batch of random tokens, log-probs and versions: every answer `max_new` tokens (`full_length`) or
    uniformly 1..max_new; prompts `prompt_len` tokens give or take a quarter."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(prompt_len * 3 // 4, prompt_len * 5 // 4 + 1, (groups,), generator=gen).tolist()
    n = groups * answers
    out_lens = ([max_new] * n if full_length
                else torch.randint(1, max_new + 1, (n,), generator=gen).tolist())
    total = sum(out_lens)
    return from_columns(
        step=1, stats=BufferStats(), levels=[g % 5 for g in range(groups)], group_sizes=[answers] * groups,
        prompt_ids=torch.randint(0, vocab, (sum(prompt_lens),), generator=gen, dtype=torch.int32),
        prompt_lens=prompt_lens, output_ids=torch.randint(0, vocab, (total,), generator=gen, dtype=torch.int32),
        output_lens=out_lens, logprobs=-torch.rand(total, generator=gen) * 10,
        versions=torch.randint(0, 8, (total,), generator=gen, dtype=torch.int32),
        rewards=[5.0 if i % 3 == 0 else -5.0 for i in range(n)], correct=[i % 3 == 0 for i in range(n)],
        finish_reasons=["stop" if i % 4 else "length" for i in range(n)], frame_bytes=frame_bytes)


def token_bytes(batch: BatchTensors) -> int:
    return sum(t.numel() * t.element_size() for col in (batch.prompt_ids, batch.output_ids, batch.logprobs,
                                                        batch.versions) for t in col)


class _NoModel:
    """A training engine without a model, standing for data-parallel rank `rank` of `size`: log-probs are
    zeros, a training step reads each micro-batch's size and nothing else. What a step costs with it is the
    trainer's own work on the batch."""

    def __init__(self, rank: int, size: int) -> None:
        self.data_parallel = (rank, size)
        self.reports_stats = True
        self.version = 0

    def compute_logprobs(self, batch: Any, temperature: float = 1.0, **_: Any) -> Any:
        from actors.engines.base import TokenLogProbs
        return TokenLogProbs(logprobs=torch.zeros(batch.num_tokens, dtype=torch.float32))

    def train_step(self, micro_batches: list[Any], loss_fn: Any, **_: Any) -> dict[str, float]:
        return {"loss": 0.0, "tokens": float(sum(mb.num_tokens for mb in micro_batches))}

    def data_parallel_sum(self, values: list[float]) -> list[float]:
        return [float(v) for v in values]

    def export_weights(self, bucket_bytes: int = 0) -> Iterator[Any]:
        return iter(())


def trainer_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's training step on its share of a synthetic batch, `args.repeat` times: CPU and wall seconds."""
    from actors.trainer.step import StepConfig, rank_samples, train_share

    batch = synthetic_batch(args.groups, args.answers, args.max_new, args.prompt_len, full_length=not args.uniform)
    cfg = StepConfig.defaults(minibatches=args.minibatches, max_tokens_per_mb=args.max_tokens_per_mb)
    share = batch_shares(batch, rank_samples(batch, cfg, args.dp)[:1])[0]
    engine = _NoModel(0, args.dp)
    cpu, wall = [], []
    for _ in range(args.repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        train_share(engine, share, cfg, version=7, ref_engine=None)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    carried = share.carried or []
    return {"groups": args.groups, "answers": args.answers, "max_new": args.max_new, "uniform": args.uniform,
            "dp": args.dp, "minibatches": args.minibatches, "max_tokens_per_mb": args.max_tokens_per_mb,
            "batch_tokens": sum(batch.output_lens) + sum(batch.prompt_lens[g] for g in sample_groups(batch)),
            "rank_sequences": len(carried), "rank_answer_tokens": sum(batch.output_lens[i] for i in carried),
            "torch_threads": torch.get_num_threads(),
            "cpu_seconds": [round(s, 3) for s in cpu], "cpu_seconds_median": round(sorted(cpu)[len(cpu) // 2], 3),
            "wall_seconds_median": round(sorted(wall)[len(wall) // 2], 3)}


def _trainer_cpu_main(args: argparse.Namespace, argv: list[str]) -> int:
    result = {"this": trainer_cpu(args)}
    if args.against:
        # The same measurement in another checkout (its own code, this command line less --against).
        rest = [a for a in argv if a != "--json"]
        k = rest.index("--against")
        rest = rest[:k] + rest[k + 2:]
        env = {**os.environ, "PYTHONPATH": os.path.abspath(args.against)}
        done = subprocess.run([sys.executable, "-m", "tools.bench", "batch", *rest, "--json"], cwd=args.against,
                              env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise SystemExit(f"--against {args.against}: the benchmark failed there: {done.stderr.strip()[-400:]}")
        result["against"] = json.loads(done.stdout.strip().splitlines()[-1])["this"]
        result["ratio_cpu"] = round(result["against"]["cpu_seconds_median"] / result["this"]["cpu_seconds_median"], 2)
    if args.json:
        print(json.dumps(result))
        return 0
    for name, r in (("this tree", result["this"]), (f"against {args.against}", result.get("against"))):
        if r is not None:
            print(f"{name}: rank 0 of dp {r['dp']}, {r['rank_sequences']} sequences, {r['rank_answer_tokens']} answer "
                  f"tokens of a {r['batch_tokens']}-token batch: {r['cpu_seconds_median']:.2f} s CPU "
                  f"({r['wall_seconds_median']:.2f} s wall) per step outside the model, median of {len(r['cpu_seconds'])}")
    if "ratio_cpu" in result:
        print(f"CPU per step: {result['ratio_cpu']}x less in this tree")
    return 0


def _buffer_side(args: argparse.Namespace, endpoints: dict[str, str], ready: Any, done: Any) -> None:
    from transport.bus import Bus

    batch = synthetic_batch(args.groups, args.answers, args.max_new, args.prompt_len, full_length=not args.uniform)

    async def serve() -> None:
        # Each side knows the other as a peer, as in a run: the buffer's own pings reach the trainer on
        # a connection of their own while the reply (and the pongs behind it) is on the way.
        bus = await Bus("buffer", endpoints["buffer"], {"trainer": endpoints["trainer"]},
                        handler=lambda env: batch if isinstance(env.msg, BatchRequest) else None).start()
        ready.set()
        await asyncio.to_thread(done.wait)
        await bus.close(linger=1.0)

    asyncio.run(serve())


def main(argv: list[str] | None = None) -> int:
    from actors.trainer.actor import StepConfig, rank_samples
    from transport.bus import Bus

    p = argparse.ArgumentParser(prog="python -m tools.bench batch", description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=512)
    p.add_argument("--answers", type=int, default=16)
    p.add_argument("--max-new", type=int, default=31744)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--uniform", action="store_true", help="answer lengths uniform in 1..max-new (default: all at max)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dp", type=int, default=32, help="data-parallel replicas (topology/64node.yaml: 32)")
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--max-tokens-per-mb", type=int, default=32768)
    p.add_argument("--trainer-cpu", action="store_true",
                   help="time the trainer's step outside the model (rank 0 of --dp) instead of the transfer")
    p.add_argument("--against", metavar="TREE", help="with --trainer-cpu: also run it in this checkout, and compare")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.against and not args.trainer_cpu:
        p.error("--against goes with --trainer-cpu")
    if args.trainer_cpu:
        return _trainer_cpu_main(args, list(sys.argv[1:] if argv is None else argv))

    ctx = mp.get_context("fork")
    endpoints = {"buffer": f"tcp://127.0.0.1:{free_port()}", "trainer": f"tcp://127.0.0.1:{free_port()}"}
    ready, done = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_buffer_side, args=(args, endpoints, ready, done), daemon=True)
    server.start()
    try:
        if not ready.wait(timeout=600):
            raise RuntimeError("the buffer side did not start within 600 s")

        async def ask() -> tuple[list[float], BatchTensors]:
            bus = await Bus("trainer", endpoints["trainer"], {"buffer": endpoints["buffer"]}).start()
            seconds, batch = [], None
            try:
                for step in range(args.repeat):
                    batch = None   # the previous reply's frames are freed before the next arrives
                    t0 = time.perf_counter()
                    batch = await bus.request("buffer", BatchRequest(step=step + 1), timeout=600)
                    seconds.append(time.perf_counter() - t0)
            finally:
                await bus.close(linger=0.0)
            assert isinstance(batch, BatchTensors)
            return seconds, batch

        seconds, batch = asyncio.run(ask())
    finally:
        done.set()
        server.join(timeout=60)
    whole = token_bytes(batch)
    frames = [t.numel() * t.element_size() for col in (batch.prompt_ids, batch.output_ids, batch.logprobs,
                                                       batch.versions) for t in col]
    median = sorted(seconds)[len(seconds) // 2]
    cfg = StepConfig.defaults(minibatches=args.minibatches, max_tokens_per_mb=args.max_tokens_per_mb)
    t0 = time.perf_counter()
    shares = batch_shares(batch, rank_samples(batch, cfg, args.dp))
    share_seconds = time.perf_counter() - t0
    share_bytes = [token_bytes(s) for s in shares]
    result = {
        "groups": args.groups, "answers": args.answers, "max_new": args.max_new, "uniform": args.uniform,
        "answer_tokens": sum(batch.output_lens), "token_bytes": whole, "tensor_frames": len(frames),
        "max_frame_bytes": max(frames), "frame_limit": 256 << 20,
        "seconds": [round(s, 3) for s in seconds], "seconds_median": round(median, 3),
        "gb_per_s": round(whole / median / 1e9, 3), "dp": args.dp,
        "share_bytes_max": max(share_bytes), "share_fraction_max": round(max(share_bytes) / whole, 4),
        "shares_build_seconds": round(share_seconds, 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"batch {args.groups} x {args.answers} answers of {'<= ' if args.uniform else ''}{args.max_new} tokens: "
              f"{whole / 1e9:.2f} GB of token data in {len(frames)} tensor frames of at most "
              f"{max(frames) / 2**20:.0f} MiB (limit 256 MiB)")
        print(f"buffer -> trainer over the bus: {median:.2f} s median of {args.repeat} ({whole / median / 1e9:.2f} GB/s)")
        print(f"per-rank share at dp {args.dp}: at most {max(share_bytes) / 1e6:.0f} MB "
              f"({100 * max(share_bytes) / whole:.1f}% of the batch), {args.dp} shares built in {share_seconds:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
