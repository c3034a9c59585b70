"""`python -m tools.bench gpu`: the GPU probes, and the first GPU measurements of the engines.

By default the probes of `tools/bench/gpu_probes.py` (attention, megatron, publish, overlap, broadcast,
decode): what only a GPU can prove about the 7B/32k trainer and the weight path, sized to finish on one H100
in well under 8 minutes with no network. Without a GPU the same probes run tiny on the CPU (the test suite
does, so they cannot rot); their figures are then no GPU figures, and the Megatron ones run only where the
caller maps Megatron's CUDA calls to the CPU (the test suite's shim), else they say they were skipped.

`--only` also takes the first measurements' sections (GPU only):

    generation  our continuous-batching engine vs transformers' `generate`, both bf16 on the GPU, same
                prompts, same long-tailed answer budgets (as `tools.bench engine` does on CPU)
    training    one optimizer step over the same packed micro-batches, the torch engine (fp32 weights, bf16
                autocast) vs the Megatron-core engine (bf16 weights, fp32 main params, distributed optimizer)
                in a world of one over NCCL; then each engine's weight export into 64 MiB bf16 buckets
    agreement   Megatron-core on the GPU (fp32, TF32 off) against the torch engine on the CPU, same weights:
                log-probs, one step's loss and grad norm, the updated weights (a small model)
    link        bucket packing and checksum on the GPU, a link of one NCCL rank, and a link of two ranks
                sharing the GPU (NCCL may refuse two ranks on one device; the error is reported as such)

The model of those sections is a shape with random weights (no download): `--shape 0.5b` is Qwen2.5-0.5B's
config, `--shape 1.5b` Qwen2.5-1.5B's; `--model-dir` takes a Hugging Face directory instead.

    python -m tools.bench gpu [--json] [--out results.json] [--only attention,decode,...]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend

from actors.engines import model as model_lib
from actors.engines.base import PackedBatch
from actors.engines.checkpoint import load_config, save_model
from actors.engines.model import Qwen2Config, Qwen2ForCausalLM
from actors.engines.torch_train import TorchTrainEngine, TrainConfig, token_nll_loss
from testsupport.tiny_models import random_sequences, tiny_model
from tools.bench.engine import build_model, hf_generate, long_tailed, ours_generate, pack_groups, sync_device
from transport.bulk import BulkLink, LinkConfig, bucket_checksum, pack_bucket, unpack_bucket
from transport.ports import free_port

from tools.bench import gpu_probes
from tools.bench.gpu_probes import SHAPES

BUCKET_BYTES = 64 << 20


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    sync_device("cuda")
    t0 = time.perf_counter()
    out = fn()
    sync_device("cuda")
    return out, time.perf_counter() - t0


def make_model_dir(args: argparse.Namespace, root: str) -> str:
    """The benchmark's model as a Hugging Face directory (bf16 safetensors), random weights unless given."""
    if args.model_dir:
        return args.model_dir
    path = os.path.join(root, f"qwen2.5-{args.shape}-shape")
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[args.shape])).init_weights(args.seed)
    save_model(model, path, dtype=torch.bfloat16)
    return path


def kernel_launch_us(n: int = 2000) -> float:
    """Microseconds per tiny kernel, launched back to back: the floor a launch-bound decode step pays."""
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    _, dt = _timed(lambda: [x.add_(1) for _ in range(n)])
    return 1e6 * dt / n


# --- (a) generation ------------------------------------------------------------------------------------

def bench_generation(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(args.seed)
    model = build_model(model_dir, args.seed)
    vocab = model.config.vocab_size
    prompt_lens = torch.randint(32, 257, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    budgets = long_tailed(args.prompts, 16, args.max_new_tokens, gen)
    ours_tokens, ours_s, steps = asyncio.run(ours_generate(model.to("cuda", torch.bfloat16), prompts, budgets))
    del model
    torch.cuda.empty_cache()
    hf_useful, hf_raw, hf_s = hf_generate(model_dir, prompts, budgets, pad_id=0, device="cuda", dtype=torch.bfloat16)
    ours_tps, hf_tps = ours_tokens / ours_s, hf_useful / hf_s
    return {**decode_steps_with_and_without_cudnn(model_dir, prompts[:64], [min(b, 128) for b in budgets[:64]]),
            "decode_step_ms_median": _median_ms(steps), "decode_steps": len(steps),
            "decode_rows_mean": sum(rows for _, _, rows in steps) / max(1, len(steps)),
            "kernel_launch_us": kernel_launch_us(),
            "prompts": args.prompts, "answer_budget_mean": sum(budgets) / len(budgets), "answer_budget_max": max(budgets),
            "gen_tokens_per_s": ours_tps, "hf_useful_tokens_per_s": hf_tps, "hf_raw_tokens_per_s": hf_raw / hf_s,
            "gen_ratio_vs_hf": ours_tps / hf_tps, "gen_ratio_vs_hf_raw": ours_tps / (hf_raw / hf_s)}


def _median_ms(steps: list[tuple[float, float, int]]) -> float:
    return 1e3 * sorted(dt for _, dt, _ in steps)[len(steps) // 2]


def decode_steps_with_and_without_cudnn(model_dir: str, prompts: list[list[int]], budgets: list[int]) -> dict[str, float]:
    """Median decode step of the same short generation with cuDNN attention allowed (torch's default on
    Hopper) and with the backends the model uses (model.SDPA_BACKENDS, cuDNN left out), side by side."""
    default = model_lib.SDPA_BACKENDS
    out = {}
    for label, backends in (("with_cudnn", [SDPBackend.CUDNN_ATTENTION] + default), ("without_cudnn", default)):
        model_lib.SDPA_BACKENDS = backends
        try:
            model = build_model(model_dir, 0).to("cuda", torch.bfloat16)
            out[f"decode_step_ms_{label}"] = _median_ms(asyncio.run(ours_generate(model, prompts, budgets))[2])
        finally:
            model_lib.SDPA_BACKENDS = default
    out["cudnn_step_ratio"] = out["decode_step_ms_with_cudnn"] / out["decode_step_ms_without_cudnn"]
    return out


# --- (b) training and export ---------------------------------------------------------------------------

def training_batches(vocab: int, args: argparse.Namespace) -> tuple[list[PackedBatch], int]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    lengths = long_tailed(args.train_seqs, 64, args.max_seq_len, gen, sigma=1.0)
    seqs = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]
    groups = pack_groups(lengths, max(max(lengths), args.micro_batch_tokens))
    return [PackedBatch.from_sequences([seqs[i] for i in g]) for g in groups], sum(lengths)


def _step_and_export(engine: Any, batches: list[PackedBatch], repeats: int) -> dict[str, float]:
    engine.train_step(batches[:1], token_nll_loss)  # warm-up: allocator, kernels, optimizer state
    best = min(_timed(lambda: engine.train_step(batches, token_nll_loss))[1] for _ in range(repeats))

    def export() -> int:
        return sum(t.numel() * t.element_size() for b in engine.export_weights(BUCKET_BYTES, dtype=torch.bfloat16)
                   for _, t in b)
    export()
    nbytes, export_s = min((_timed(export) for _ in range(repeats)), key=lambda r: r[1])
    return {"step_s": best, "export_bytes": nbytes, "export_s": export_s, "export_gb_per_s": nbytes / export_s / 1e9,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def bench_training(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    from actors.engines.megatron import MegatronConfig, MegatronTrainEngine

    batches, tokens = training_batches(load_config(model_dir).vocab_size, args)
    out: dict[str, Any] = {"train_tokens": tokens, "micro_batches": len(batches)}
    torch.cuda.reset_peak_memory_stats()
    torch_engine = TorchTrainEngine(model_dir, TrainConfig(device="cuda"))
    res = _step_and_export(torch_engine, batches, args.repeats)
    out.update({f"torch_{k}": v for k, v in res.items()})
    del torch_engine
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    mega = MegatronTrainEngine(model_dir, MegatronConfig(device="cuda", bf16=True))
    out["megatron_attention"] = "te" if "TEDotProductAttention" in repr(mega.model) else "torch"
    res = _step_and_export(mega, batches, args.repeats)
    out.update({f"megatron_{k}": v for k, v in res.items()})
    out["torch_tokens_per_s"] = tokens / out["torch_step_s"]
    out["megatron_tokens_per_s"] = tokens / out["megatron_step_s"]
    out["megatron_vs_torch_step"] = out["torch_step_s"] / out["megatron_step_s"]
    return out


# --- (c) agreement -------------------------------------------------------------------------------------

def bench_agreement(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron fp32 on the GPU vs the torch engine on the CPU; the CPU test suite's tolerance is 1e-5."""
    from actors.engines.megatron import MegatronConfig, MegatronTrainEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    lr = 1e-3
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(0)
        save_model(model, tmp)
        seqs = random_sequences(6, 3, 14, model.config.vocab_size, seed=11)
        batches = [PackedBatch.from_sequences(seqs[i:i + 3]) for i in (0, 3)]
        whole = PackedBatch.from_sequences(seqs)
        ref = TorchTrainEngine(tmp, TrainConfig(lr=lr))
        ref_lp = ref.compute_logprobs(whole, with_entropy=True)
        initial = {k: v.clone() for b in ref.export_weights() for k, v in b}
        ref_stats = ref.train_step(batches, token_nll_loss)
        ref_w = {k: v for b in ref.export_weights() for k, v in b}
        mega = MegatronTrainEngine(tmp, MegatronConfig(lr=lr, device="cuda"))
        got_lp = mega.compute_logprobs(whole, with_entropy=True)
        got_stats = mega.train_step(batches, token_nll_loss)
        got_w = {k: v.cpu() for b in mega.export_weights() for k, v in b}
    return {"logprob_max_abs_diff": float((got_lp.logprobs.cpu() - ref_lp.logprobs).abs().max()),
            "entropy_max_abs_diff": float((got_lp.entropy.cpu() - ref_lp.entropy).abs().max()),
            "loss_abs_diff": abs(got_stats["loss"] - ref_stats["loss"]),
            "grad_norm_rel_diff": abs(got_stats["grad_norm"] - ref_stats["grad_norm"]) / ref_stats["grad_norm"],
            "weight_max_abs_diff": max(float((got_w[k] - ref_w[k]).abs().max()) for k in ref_w),
            "weight_max_moved": max(float((ref_w[k] - initial[k]).abs().max()) for k in ref_w)}


# --- (d) bulk link over NCCL ---------------------------------------------------------------------------

def _bucket(mib: int, device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)
    return [(f"t{i}", torch.randn(mib * 2**20 // 32, generator=g, device=device)) for i in range(8)]


def _link_member(rank: int, world: int, port: int, mib: int, reps: int, queue: Any) -> None:
    try:
        torch.cuda.set_device(0)
        link = BulkLink(LinkConfig(name="bench", backend="nccl", master_addr="127.0.0.1", master_port=port,
                                   rank=rank, world_size=world, timeout_s=60))
        link.open(0)
        bucket = _bucket(mib, "cuda") if rank == 0 else None
        link.broadcast(bucket, src=0)  # warm-up: NCCL builds its communicator on the first collective
        times = []
        for _ in range(reps):
            link.barrier()
            _, dt = _timed(lambda: link.broadcast(bucket, src=0))
            times.append(dt)
        queue.put((rank, {"broadcast_s": min(times)}))
    except Exception as exc:
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"[:600]}))


def _link_run(world: int, mib: int, reps: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # CUDA is initialised in the parent: children must not fork it
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_link_member, args=(r, world, port, mib, reps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        for _ in range(world):
            rank, res = queue.get(timeout=60)
            results[rank] = res
    except Exception as exc:  # a rank hung (NCCL waits for its peer) or died without a word
        results[-1] = {"error": f"no answer from every rank within 60 s ({type(exc).__name__})"}
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        return {"error": errors[0]}
    dt = max(r["broadcast_s"] for r in results.values())
    return {"broadcast_s": dt, "gb_per_s": mib * 2**20 / dt / 1e9}


def bench_link(args: argparse.Namespace) -> dict[str, Any]:
    mib = args.link_mib
    bucket = _bucket(mib, "cuda")
    pack_s = min(_timed(lambda: pack_bucket(bucket))[1] for _ in range(args.repeats + 1))
    packed = pack_bucket(bucket)
    sum_s = min(_timed(lambda: bucket_checksum(packed.flat))[1] for _ in range(args.repeats + 1))
    unpack_bucket(packed, "bench")  # the receiver's verification
    cpu = _bucket(mib, "cpu")
    cpu_pack_s = min(_timed(lambda: pack_bucket(cpu))[1] for _ in range(args.repeats + 1))
    nbytes = packed.flat.numel()
    return {"mib": mib, "gpu_pack_gb_per_s": nbytes / pack_s / 1e9, "gpu_checksum_gb_per_s": nbytes / sum_s / 1e9,
            "cpu_pack_gb_per_s": nbytes / cpu_pack_s / 1e9,
            "nccl_world1": _link_run(1, mib, args.repeats), "nccl_world2_one_gpu": _link_run(2, mib, args.repeats)}


# --- driver --------------------------------------------------------------------------------------------

def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), nccl=".".join(map(str, torch.cuda.nccl.version())))
    for module in ("megatron.core", "transformer_engine", "flash_attn", "apex"):
        try:
            imported = __import__(module, fromlist=["__version__"])
            env[module] = getattr(imported, "__version__", True)
        except ImportError:
            env[module] = False
    return env


PROBES = ("attention", "megatron", "publish", "overlap", "broadcast", "decode", "moe")
SECTIONS = ("generation", "training", "agreement", "link")
MEGATRON_PROBES = ("megatron", "publish", "overlap")


def main(argv: list[str] | None = None, megatron_on_cpu: bool = False) -> int:
    """``megatron_on_cpu``: the caller mapped Megatron's CUDA calls to the CPU (the test suite's shim), so the
    Megatron probes run on the CPU too."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the sections")
    parser.add_argument("--out", help="also write the JSON object to this file")
    parser.add_argument("--only", default=",".join(PROBES),
                        help=f"what to run: probes {','.join(PROBES)} (the default), sections {','.join(SECTIONS)}")
    parser.add_argument("--shape", default="0.5b", choices=sorted(k for k in SHAPES if k != "tiny"))
    parser.add_argument("--model-dir", help="a Hugging Face model directory instead of --shape")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="longest answer budget")
    parser.add_argument("--train-seqs", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--link-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    wanted = [w for w in args.only.split(",") if w]
    unknown = [w for w in wanted if w not in PROBES + SECTIONS]
    if unknown:
        parser.error(f"--only: unknown {unknown}; choose from {', '.join(PROBES + SECTIONS)}")
    cuda = torch.cuda.is_available()
    dev = gpu_probes.Device("cuda" if cuda else "cpu")
    sizes = gpu_probes.GPU_SIZES if cuda else gpu_probes.CPU_SIZES
    if not cuda:
        print("[gpu bench] no CUDA GPU here: the probes run tiny on the CPU (no GPU figures)", file=sys.stderr)
    result: dict[str, Any] = {"env": environment(), "device": dev.kind, "sizes": dataclasses.asdict(sizes),
                              "args": vars(args)}
    failed = False
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(args, tmp) if cuda and {"generation", "training"} & set(wanted) else ""
        train_dir = ""
        engine: Any = None

        def trainer() -> Any:
            nonlocal engine, train_dir
            if engine is None:
                train_dir = gpu_probes.model_dir_of(sizes.train_shape, tmp, args.seed)
                engine = gpu_probes.megatron_engine(train_dir, sizes, dev)
            return engine

        runs: dict[str, Callable[[], dict[str, Any]]] = {
            "attention": lambda: gpu_probes.probe_attention(sizes, dev),
            "megatron": lambda: gpu_probes.probe_megatron(trainer(), train_dir, sizes, dev),
            "publish": lambda: gpu_probes.probe_publish(trainer(), sizes, dev),
            "overlap": lambda: gpu_probes.probe_overlap(trainer(), sizes, dev),
            "broadcast": lambda: gpu_probes.probe_broadcast(sizes, dev),
            "decode": lambda: gpu_probes.probe_decode(sizes, dev),
            "moe": lambda: gpu_probes.probe_moe(sizes, dev),
            "generation": lambda: bench_generation(model_dir, args),
            "training": lambda: bench_training(model_dir, args),
            "agreement": lambda: bench_agreement(args),
            "link": lambda: bench_link(args)}
        for name in wanted:
            print(f"[gpu bench] {name} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            if name in SECTIONS and not cuda:
                result[name] = {"skipped": "needs a CUDA GPU"}
            elif name in MEGATRON_PROBES and not (cuda or megatron_on_cpu):
                result[name] = {"skipped": "megatron-core 0.11 allocates on CUDA (torch.cuda.current_device): on the "
                                           "CPU only the test suite runs this probe, under tests/megatron_cpu_shim.py"}
            else:
                try:
                    result[name] = runs[name]()
                except Exception:  # one broken path must not hide the others' figures; the exit code tells
                    result[name] = {"error": traceback.format_exc(limit=8)[-2000:]}
                    failed = True
            result[name]["section_s"] = round(time.perf_counter() - t0, 1)
            print(f"[gpu bench] {name}: {json.dumps(result[name], default=str)[:1500]}", file=sys.stderr, flush=True)
            if cuda:
                torch.cuda.empty_cache()
    result["total_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result, default=str, indent=None if args.json else 1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
