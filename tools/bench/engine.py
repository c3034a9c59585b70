"""`python -m tools.bench engine`: the embedded engines measured side by side in one run (CPU by default).

(a) generation: our continuous-batching engine vs transformers' `generate`, same model, same 64 prompts,
    same sampling (temperature 1, no top-k/top-p), answer lengths drawn from a long-tailed distribution
    (each request's max_new_tokens). `generate` cannot end rows separately, so it runs to the longest
    budget; its useful tokens are the ones inside each row's budget (its raw rate is shown too).
(b) weight swap: while 64 sequences decode, a new version streams in as buckets; the stall is the
    decode time lost in the window from the update call to the end of the first step after the swap,
    in units of the median step before it, minus the KV-cache rebuild (reported on its own).
(c) training: one optimizer step over the same long-tailed sequences, packed micro-batches vs padded
    batches (and the packed attention's two implementations, per-sequence loop vs block mask).
(d) with --beside DIR: another model (the tiny Qwen3-MoE, configs/models/arith-tiny-moe, has the dense
    default's active size) generating the same prompts and training on the same packed micro-batches; its
    speeds as ratios to the first model's.

    python -m tools.bench engine [--json] [--threads 1] [--model-dir configs/models/arith-tiny]
                                 [--beside configs/models/arith-tiny-moe]
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import torch

from actors.engines.base import GenerationRequest, PackedBatch, SamplingParams
from actors.engines.checkpoint import hf_state_dict, load_config, load_model, save_model
from actors.engines.model import Qwen2ForCausalLM, token_logprobs
from actors.engines.torch_gen import TorchGenerationEngine
from actors.engines.torch_train import TorchTrainEngine, TrainConfig, token_nll_loss

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models", "arith-tiny")


def build_model(model_dir: str, seed: int) -> Qwen2ForCausalLM:
    """The directory's weights if it has any, else its config with random weights."""
    if any(f.endswith(".safetensors") for f in os.listdir(model_dir)):
        return load_model(model_dir)
    return Qwen2ForCausalLM(load_config(model_dir)).init_weights(seed).eval()


def long_tailed(count: int, low: int, high: int, gen: torch.Generator, sigma: float = 0.8) -> list[int]:
    """Lognormal lengths clipped to [low, high]: most short, a few long (like reasoning answers)."""
    median = low + (high - low) / 8
    values = torch.empty(count).log_normal_(mean=float(torch.log(torch.tensor(median))), std=sigma, generator=gen)
    return [int(min(high, max(low, v))) for v in values.tolist()]


def sync_device(device: str | torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock timer measures it (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# --- (a) and (b): generation ---------------------------------------------------------------------------

async def ours_generate(model: Qwen2ForCausalLM, prompts: list[list[int]], budgets: list[int],
                        ) -> tuple[int, float, list[tuple[float, float, int]]]:
    """Tokens generated, seconds, and the engine's per-step log (end time, seconds, rows)."""
    engine = TorchGenerationEngine(model=model)
    await engine.start()
    try:
        warm = GenerationRequest("warm", prompts[0], SamplingParams(max_new_tokens=8, seed=0))
        await engine.generate(warm)
        start = time.perf_counter()
        results = await asyncio.gather(*[engine.generate(GenerationRequest(
            f"p{i}", p, SamplingParams(temperature=1.0, max_new_tokens=b, seed=i))) for i, (p, b) in
            enumerate(zip(prompts, budgets))])
        elapsed = time.perf_counter() - start
    finally:
        await engine.stop()
    return sum(len(r[0].output_ids) for r in results), elapsed, list(engine.step_log)


def hf_generate(model_dir: str, prompts: list[list[int]], budgets: list[int], pad_id: int,
                device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[int, int, float]:
    import transformers
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate() requires for decoder-only models
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id, eos_token_id=None)
    with torch.no_grad():
        hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=8, **kwargs)
        torch.manual_seed(0)
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(budgets), min_new_tokens=max(budgets), **kwargs)
        sync_device(device)
        elapsed = time.perf_counter() - start
    raw = (out.shape[1] - longest) * len(prompts)
    return sum(budgets), raw, elapsed


async def swap_stall(model: Qwen2ForCausalLM, prompts: list[list[int]], new_weights: dict[str, torch.Tensor],
                     bucket_bytes: int, swap_after: int = 40) -> dict[str, float]:
    engine = TorchGenerationEngine(model=model)
    await engine.start()
    reached = threading.Event()
    engine.on_step = lambda step: reached.set() if step == swap_after else None
    try:
        tasks = [asyncio.ensure_future(engine.generate(GenerationRequest(
            f"s{i}", p, SamplingParams(temperature=1.0, max_new_tokens=swap_after + 80, seed=i))))
            for i, p in enumerate(prompts)]
        assert await asyncio.to_thread(reached.wait, 120.0)

        def buckets():
            bucket, size = [], 0
            for name, tensor in new_weights.items():
                bucket.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
                if size >= bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
            if bucket:
                yield bucket

        called = time.perf_counter()
        await engine.update_weights(1, buckets())
        swap = engine.swaps[-1]
        results = await asyncio.gather(*tasks)
    finally:
        await engine.stop()
    steps = list(engine.step_log)
    before = [d for end, d, _ in steps if end < called][-30:]
    median = statistics.median(before)
    after = [end for end, _, _ in steps if end > swap.swapped_at]
    window_end = after[0]
    in_window = sum(1 for end, _, _ in steps if called < end <= window_end)
    lost = (window_end - called - swap.rebuild_s) / median - in_window
    mixed = sum(1 for [r] in results if 0 in r.versions and 1 in r.versions)
    return {"swap_stall_steps": max(0.0, lost), "steps_during_update": in_window - 1,
            "stage_s": swap.staged_at - called, "swap_s": swap.swap_s, "rebuild_s": swap.rebuild_s,
            "rebuild_steps": swap.rebuild_s / median, "median_step_s": median, "rows_rebuilt": swap.rows_rebuilt,
            "tokens_rebuilt": swap.tokens_rebuilt, "answers_with_both_versions": mixed}


# --- (c): training -------------------------------------------------------------------------------------

def pack_groups(lengths: list[int], budget: int) -> list[list[int]]:
    groups, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    return groups + [current] if current else groups


def train_packed(model: Qwen2ForCausalLM, seqs: list[list[int]], groups: list[list[int]],
                 attn: str, repeats: int) -> float:
    trainer = TorchTrainEngine(model=model, config=TrainConfig(packed_attn=attn))
    batches = [PackedBatch.from_sequences([seqs[i] for i in g]) for g in groups]
    trainer.train_step(batches[:1], token_nll_loss)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.train_step(batches, token_nll_loss)
        best = min(best, time.perf_counter() - start)
    return best


def train_padded(model: Qwen2ForCausalLM, seqs: list[list[int]], batch_size: int, repeats: int) -> float:
    """The baseline: fixed-size batches right-padded to their longest sequence, same loss and optimizer."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, eps=1e-5)
    batches = []
    for s in range(0, len(seqs), batch_size):
        group = seqs[s:s + batch_size]
        longest = max(len(x) for x in group)
        ids = torch.zeros((len(group), longest), dtype=torch.long)
        mask = torch.zeros((len(group), longest - 1))
        for r, x in enumerate(group):
            ids[r, :len(x)] = torch.tensor(x)
            mask[r, :len(x) - 1] = 1.0
        batches.append((ids, mask))
    denominator = sum(float(m.sum()) for _, m in batches)

    def step(chosen):
        optimizer.zero_grad(set_to_none=True)
        for ids, mask in chosen:
            logp, _ = token_logprobs(model(ids)[:, :-1], ids[:, 1:])
            (-(logp * mask).sum() / denominator).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    step(batches[:1])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step(batches)
        best = min(best, time.perf_counter() - start)
    return best


# --- driver --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench engine", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--model-dir", default=DEFAULT_MODEL_DIR, help="model directory (config.json; weights optional)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the embedded default gives rollout 1)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=160, help="longest answer budget")
    parser.add_argument("--train-seqs", type=int, default=64)
    parser.add_argument("--pad-batch", type=int, default=8, help="sequences per padded batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--beside", default=None,
                        help="another model directory measured on the same generation and training work (d)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    model = build_model(args.model_dir, args.seed)
    cfg = model.config
    vocab, max_len = cfg.vocab_size, cfg.max_position_embeddings
    pad_id = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 0

    prompt_lens = torch.randint(8, 41, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    budgets = long_tailed(args.prompts, 8, min(args.max_new_tokens, max_len - 41), gen)

    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, tmp)
        ours_tokens, ours_s, _ = asyncio.run(ours_generate(load_model(tmp), prompts, budgets))
        hf_useful, hf_raw, hf_s = hf_generate(tmp, prompts, budgets, pad_id)

    other = Qwen2ForCausalLM(cfg).init_weights(args.seed + 1)
    stall = asyncio.run(swap_stall(build_model(args.model_dir, args.seed), prompts, hf_state_dict(other),
                                   bucket_bytes=256 << 10))

    train_lens = long_tailed(args.train_seqs, 16, max_len, gen, sigma=1.0)
    seqs = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in train_lens]
    n_batches = (len(seqs) + args.pad_batch - 1) // args.pad_batch
    groups = pack_groups(train_lens, max(max(train_lens), -(-sum(train_lens) // n_batches)))
    real_tokens = sum(train_lens)
    padded_s = train_padded(build_model(args.model_dir, args.seed), seqs, args.pad_batch, args.repeats)
    loop_s = train_packed(build_model(args.model_dir, args.seed), seqs, groups, "loop", args.repeats)
    mask_s = train_packed(build_model(args.model_dir, args.seed), seqs, groups, "mask", args.repeats)
    packed_s = min(loop_s, mask_s)
    padded_tokens = sum(len(seqs[s:s + args.pad_batch]) * max(train_lens[s:s + args.pad_batch])
                        for s in range(0, len(seqs), args.pad_batch))

    ours_tps, hf_tps = ours_tokens / ours_s, hf_useful / hf_s
    result = {
        "device": "cpu", "threads": args.threads, "params": sum(p.numel() for p in model.parameters()),
        "gen_ratio_vs_hf": ours_tps / hf_tps, "gen_tokens_per_s": ours_tps, "hf_useful_tokens_per_s": hf_tps,
        "hf_raw_tokens_per_s": hf_raw / hf_s, "gen_ratio_vs_hf_raw": ours_tps / (hf_raw / hf_s),
        "gen_tokens": ours_tokens, "prompts": args.prompts, "answer_budget_mean": sum(budgets) / len(budgets),
        "answer_budget_max": max(budgets),
        **stall,
        "packed_vs_padded": padded_s / packed_s, "train_tokens_per_s_packed": real_tokens / packed_s,
        "train_tokens_per_s_padded": real_tokens / padded_s, "packed_attn_loop_s": loop_s,
        "packed_attn_mask_s": mask_s, "packed_attn_best": "loop" if loop_s <= mask_s else "mask",
        "train_seqs": len(seqs), "train_real_tokens": real_tokens, "train_padded_tokens": padded_tokens,
        "micro_batches_packed": len(groups), "micro_batches_padded": n_batches,
        "active_params": cfg.num_parameters(active=True), "model_type": cfg.MODEL_TYPE,
    }
    if args.beside:
        beside = build_model(args.beside, args.seed)
        tokens, seconds, _ = asyncio.run(ours_generate(copy.deepcopy(beside), prompts, budgets))
        train_s = train_packed(beside, seqs, groups, result["packed_attn_best"], args.repeats)
        result["beside"] = {
            "model_dir": args.beside, "model_type": beside.config.MODEL_TYPE,
            "params": beside.config.num_parameters(), "active_params": beside.config.num_parameters(active=True),
            "gen_tokens_per_s": tokens / seconds, "train_tokens_per_s_packed": real_tokens / train_s,
            "gen_ratio": (tokens / seconds) / ours_tps, "train_ratio": packed_s / train_s}
    if args.json:
        print(json.dumps(result, indent=None))
        return 0
    rows = [
        ("model parameters", f"{result['params']:,}", f"torch threads {args.threads}"),
        ("(a) ours tokens/s", f"{ours_tps:,.0f}", f"{ours_tokens} tokens, {args.prompts} prompts"),
        ("(a) HF generate useful tokens/s", f"{hf_tps:,.0f}", f"raw {hf_raw / hf_s:,.0f}/s incl. past-budget rows"),
        ("(a) gen_ratio_vs_hf", f"{result['gen_ratio_vs_hf']:.2f}x", f"vs raw: {result['gen_ratio_vs_hf_raw']:.2f}x  (target >= 2x)"),
        ("(b) swap_stall_steps", f"{stall['swap_stall_steps']:.2f}", f"{stall['steps_during_update']} steps decoded while staging (target <= 2)"),
        ("(b) KV rebuild", f"{stall['rebuild_s'] * 1e3:.1f} ms", f"= {stall['rebuild_steps']:.1f} steps, {stall['rows_rebuilt']} rows, {stall['tokens_rebuilt']} tokens"),
        ("(b) swap itself", f"{stall['swap_s'] * 1e3:.2f} ms", f"staging {stall['stage_s'] * 1e3:.1f} ms; median step {stall['median_step_s'] * 1e3:.2f} ms"),
        ("(c) packed tokens/s", f"{result['train_tokens_per_s_packed']:,.0f}", f"{len(groups)} micro-batches, attention '{result['packed_attn_best']}'"),
        ("(c) padded tokens/s", f"{result['train_tokens_per_s_padded']:,.0f}", f"{n_batches} batches of {args.pad_batch}, {padded_tokens} padded tokens for {real_tokens}"),
        ("(c) packed_vs_padded", f"{result['packed_vs_padded']:.2f}x", "(target >= 1.5x)"),
        ("(c) packed attention loop vs mask", f"{loop_s:.3f} s / {mask_s:.3f} s", "one optimizer step"),
    ]
    if args.beside:
        b = result["beside"]
        rows += [
            ("(d) beside", f"{b['model_type']}", f"{b['params']:,} parameters, {b['active_params']:,} active per token "
                                                 f"(first: {result['model_type']}, {result['active_params']:,} active)"),
            ("(d) beside gen tokens/s", f"{b['gen_tokens_per_s']:,.0f}", f"{b['gen_ratio']:.2f}x the first model's"),
            ("(d) beside packed train tokens/s", f"{b['train_tokens_per_s_packed']:,.0f}",
             f"{b['train_ratio']:.2f}x the first model's"),
        ]
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")
    print(json.dumps({k: round(result[k], 3) for k in ("gen_ratio_vs_hf", "swap_stall_steps", "packed_vs_padded")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
