"""`python -m tools.bench batch`: a training batch of the 7B recipe's shape from the buffer to the trainer.

Two processes on TCP loopback, each with our Bus at its default 256 MiB frame limit: the "buffer" answers a
BatchRequest with a synthetic `BatchTensors` (512 prompts x 16 answers of 31,744 new tokens by default,
every answer at the recipe's maximum: the worst case), the "trainer" asks for it R times and times each
request to the decoded reply. Then, in the trainer process, the shares trainer.0 would send to the ranks of
a world of `--dp` data-parallel replicas (`actors.trainer.actor.rank_samples`, `actors.batch.shares`): their size
against the whole batch's, and the time to build them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time
from typing import Any

import torch

from actors.batch import BATCH_FRAME_BYTES, from_columns, shares as batch_shares
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
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

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
