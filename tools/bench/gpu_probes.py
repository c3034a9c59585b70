"""The probes `python -m tools.bench gpu` runs by default: what only a GPU can prove about the 7B/32k trainer
and the weight path, each at a size one H100 holds (and tiny on the CPU, where the same code runs in CI).

    attention   the trainer's packed attention call (`megatron.packed_causal_attention`, forward + backward)
                at 8k/16k/32k tokens, 7 query heads and 1 key/value head of 128 (7B at tp=4), bf16, on each
                kernel alone: peak memory and time; torch's math kernel is refused past 4,096 tokens
    megatron    one Megatron train step and the log-probs of one 24k-token sequence (prompt + answer) on a
                1.5B-shaped model (random weights, bf16, full recompute, 4,096-token log-prob chunks):
                `max_memory_allocated` against `tools.plan`'s terms for the same shape
    publish     exporting a version into page-locked host memory as the trainer publishes it
                (`KeptVersions.keep`): the peak increase, the time and the pinned bytes, beside holding
                every bucket and then packing them
    overlap     a train step alone, with a bucket push running on the push stream, and with the same push on
                the default stream
    broadcast   `tools.bench.bulk`: a bucket broadcast against a raw broadcast of the same bytes (an NCCL link
                of one rank on a GPU: NCCL refuses two ranks on one device; gloo between two processes on the CPU)
    decode      the embedded engine's decode step (`Qwen2ForCausalLM.decode`, 0.5B shape, 64 rows) eager and
                replayed from a CUDA graph
    moe         the embedded engines on Qwen3-30B-A3B's layer shape (128 experts, top-8, 2 of its 48 layers):
                one train step with native and with replayed routing (tokens/s, peak memory), and the decode
                step with and without recording the routed experts (the capture's cost per step). Expert
                parallelism is not here: it needs a Megatron world of several GPUs (docs/engines-megatron.md)
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from actors.engines.base import PackedBatch
from actors.engines.checkpoint import save_model
from actors.engines.model import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig
from actors.engines.moe import RoutingTrace
from actors.engines.torch_train import TorchTrainEngine, TrainConfig, token_nll_loss
from actors.weight_sync import KeptVersions
from actors.weight_sync.base import push_stream
from launch.plan import memory as plan_memory
from launch.plan.shapes import from_hf_config
from transport.bulk import BulkLink, LinkConfig, pack_buckets
from transport.ports import free_port

GIB = 2**30
# Qwen2.5 base models' config.json values (the architecture; weights are random here).
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97, max_position_embeddings=1024, rope_theta=1e4,
                 rms_norm_eps=1e-6, tie_word_embeddings=False),
}
# Qwen3-MoE shapes (Qwen3MoeConfig keys): Qwen3-30B-A3B's config.json values with 2 of its 48 layers.
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "30b-a3b-2l": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=2, num_attention_heads=32,
                       num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=128,
                       num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=1024, rope_theta=1e4,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, norm_topk_prob=True),
}


@dataclasses.dataclass(frozen=True)
class ProbeSizes:
    """The sizes the probes run at: on one GPU, or tiny on the CPU (the same code, so it cannot rot)."""

    attention_lengths: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    train_shape: str
    train_tokens: int
    logprob_chunk: int
    step_tokens: int           # overlap: the train step a push runs beside
    bucket_bytes: int
    decode_shape: str
    decode_rows: int
    decode_span: int
    bulk_mib: int
    bulk_reps: int
    moe_shape: str
    moe_tokens: int            # tokens of the MoE train step
    moe_rows: int              # rows of the MoE decode step


GPU_SIZES = ProbeSizes(attention_lengths=(8192, 16384, 32768), heads=7, kv_heads=1, head_dim=128,
                       train_shape="1.5b", train_tokens=24576, logprob_chunk=4096, step_tokens=8192,
                       bucket_bytes=64 << 20, decode_shape="0.5b", decode_rows=64, decode_span=1024,
                       bulk_mib=256, bulk_reps=10, moe_shape="30b-a3b-2l", moe_tokens=8192, moe_rows=64)
CPU_SIZES = ProbeSizes(attention_lengths=(64, 128, 256), heads=4, kv_heads=2, head_dim=16, train_shape="tiny",
                       train_tokens=256, logprob_chunk=64, step_tokens=128, bucket_bytes=4096, decode_shape="tiny",
                       decode_rows=8, decode_span=64, bulk_mib=1, bulk_reps=3, moe_shape="tiny", moe_tokens=256,
                       moe_rows=8)


class Device:
    """Timing and memory figures on the probe's device (memory only where CUDA counts it)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.cuda = kind == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def peak_during(self, fn: Callable[[], Any]) -> tuple[Any, float, float | None]:
        """fn's result, seconds, and how far allocated memory rose above where it stood (GiB; None on CPU)."""
        if not self.cuda:
            out, seconds = self.timed(fn)
            return out, seconds, None
        self.sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out, seconds = self.timed(fn)
        return out, seconds, (torch.cuda.max_memory_allocated() - base) / GIB

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


# --- attention -------------------------------------------------------------------------------------------

def probe_attention(sizes: ProbeSizes, dev: Device) -> dict[str, Any]:
    from actors.engines import megatron as mg

    kernels: dict[str, list[SDPBackend] | None] = {"sdpa_flash": [SDPBackend.FLASH_ATTENTION],
                                                   "sdpa_efficient": [SDPBackend.EFFICIENT_ATTENTION],
                                                   "sdpa_math": [SDPBackend.MATH]}
    if mg.flash_attn_varlen_func is not None and dev.cuda:
        kernels = {"flash_attn_varlen": None, **kernels}
    out: dict[str, Any] = {"heads": sizes.heads, "kv_heads": sizes.kv_heads, "head_dim": sizes.head_dim,
                           "dtype": str(dev.dtype), "math_kernel_max_tokens": mg.MATH_KERNEL_MAX_TOKENS}
    g = torch.Generator(device=dev.kind).manual_seed(0)
    for length in sizes.attention_lengths:
        row: dict[str, Any] = {}
        for name, backends in kernels.items():
            def call() -> None:
                q = torch.randn(length, sizes.heads, sizes.head_dim, generator=g, device=dev.kind, dtype=dev.dtype,
                                requires_grad=True)
                k, v = (torch.randn(length, sizes.kv_heads, sizes.head_dim, generator=g, device=dev.kind,
                                    dtype=dev.dtype, requires_grad=True) for _ in range(2))
                cu = torch.tensor([0, length], dtype=torch.int32, device=dev.kind)
                ctx = sdpa_kernel(backends) if backends is not None else contextlib.nullcontext()
                with ctx:
                    o = mg.packed_causal_attention(q, k, v, cu, length, None, varlen=backends is None)
                    o.float().square().sum().backward()
            try:
                call()   # the first call of a kernel at a shape pays its set-up: time the second
                _, seconds, peak = dev.peak_during(call)
                row[name] = {"seconds": round(seconds, 4), "peak_gib": None if peak is None else round(peak, 3)}
            except (RuntimeError, mg.LongSequenceAttentionError) as exc:   # refused, or out of memory
                row[name] = {"error": _error(exc)}
            if dev.cuda:
                torch.cuda.empty_cache()
        out[str(length)] = row
    return out


# --- the Megatron trainer ----------------------------------------------------------------------------------

def model_dir_of(shape: str, root: str, seed: int = 0) -> str:
    """A Hugging Face directory of ``shape`` with random weights (bf16 on disk)."""
    path = os.path.join(root, f"{shape}-shape")
    if not os.path.exists(os.path.join(path, "config.json")):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape])).init_weights(seed)
        save_model(model, path, dtype=torch.bfloat16)
    return path


def _sequence(vocab: int, tokens: int, seed: int) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    return PackedBatch.from_sequences([torch.randint(1, vocab, (tokens,), generator=g).tolist()])


def megatron_engine(model_dir: str, sizes: ProbeSizes, dev: Device) -> Any:
    from actors.engines.megatron import MegatronConfig, MegatronTrainEngine

    return MegatronTrainEngine(model_dir, MegatronConfig(device=dev.kind, bf16=dev.cuda, recompute="full",
                                                         logprob_chunk_tokens=sizes.logprob_chunk))


def probe_megatron(engine: Any, model_dir: str, sizes: ProbeSizes, dev: Device) -> dict[str, Any]:
    vocab = engine.hf_config.vocab_size
    engine.train_step([_sequence(vocab, 64, 1)], token_nll_loss)   # warm-up: the optimizer's state exists after it
    batch = _sequence(vocab, sizes.train_tokens, 2)
    stats, step_s, step_peak = dev.peak_during(lambda: engine.train_step([batch], token_nll_loss))
    _, logprob_s, logprob_peak = dev.peak_during(lambda: engine.compute_logprobs(batch))
    shape = from_hf_config(os.path.join(model_dir, "config.json"))
    lay = plan_memory.TrainerLayout(tp=1, pp=1, dp=1, bf16=dev.cuda, distributed_optimizer=True, recompute="full",
                                    micro_batch_tokens=sizes.train_tokens, logprob_chunk_tokens=sizes.logprob_chunk)
    terms = plan_memory.trainer_terms(shape, lay)
    planned = sum(v for k, v in terms.items() if k not in ("CUDA/NCCL reserve", "publish transient"))
    out: dict[str, Any] = {"shape": sizes.train_shape, "tokens": sizes.train_tokens, "params": shape.params,
                           "step_s": round(step_s, 3), "logprob_s": round(logprob_s, 3), "loss": stats["loss"],
                           "plan_terms_gib": {k: round(v / GIB, 3) for k, v in terms.items()},
                           "plan_gib_without_reserve": round(planned / GIB, 3)}
    if dev.cuda:
        out.update(max_memory_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 3),
                   step_rise_gib=round(step_peak, 3), logprob_rise_gib=round(logprob_peak, 3),
                   allocated_before_gib=round(torch.cuda.memory_allocated() / GIB, 3))
        out["measured_over_plan"] = round(out["max_memory_allocated_gib"] / out["plan_gib_without_reserve"], 3)
    return out


def probe_publish(engine: Any, sizes: ProbeSizes, dev: Device) -> dict[str, Any]:
    """Versions 1-3 kept as the trainer keeps them: the first allocates its page-locked host buffers; the
    third finds the first's freed (KeptVersions holds two at most) in torch's caching host allocator."""
    kept = KeptVersions()
    packed, seconds, rise = dev.peak_during(lambda: kept.keep(1, engine.export_weights(sizes.bucket_bytes)))
    nbytes = sum(p.flat.numel() for p in packed)
    out: dict[str, Any] = {"buckets": len(packed), "bucket_bytes": sizes.bucket_bytes, "bytes": nbytes,
                           "seconds": round(seconds, 4), "gb_per_s": round(nbytes / seconds / 1e9, 3),
                           "pinned": all(p.flat.is_pinned() for p in packed) if dev.cuda else False,
                           "peak_rise_gib": None if rise is None else round(rise, 3)}
    del packed
    for version in (2, 3):
        _, seconds = dev.timed(lambda: kept.keep(version, engine.export_weights(sizes.bucket_bytes)))
        out[f"version_{version}"] = {"seconds": round(seconds, 4), "gb_per_s": round(nbytes / seconds / 1e9, 3)}
    del kept

    def held_then_packed() -> int:   # every bucket held, then a packed copy of each
        buckets = list(engine.export_weights(sizes.bucket_bytes))
        return len(pack_buckets(buckets))
    _, old_s, old_rise = dev.peak_during(held_then_packed)
    out["before"] = {"seconds": round(old_s, 4), "peak_rise_gib": None if old_rise is None else round(old_rise, 3)}
    return out


def probe_overlap(engine: Any, sizes: ProbeSizes, dev: Device) -> dict[str, Any]:
    """Step time alone and beside a push that loops over a kept version until the step ends."""
    packed = KeptVersions().keep(1, engine.export_weights(sizes.bucket_bytes))
    link = BulkLink(LinkConfig(name="probe", backend="nccl" if dev.cuda else "gloo", master_addr="127.0.0.1",
                               master_port=free_port(), rank=0, world_size=1, timeout_s=120))
    link.open(0)
    batch = _sequence(engine.hf_config.vocab_size, sizes.step_tokens, 3)
    engine.train_step([batch], token_nll_loss)   # warm-up at this length

    def step_beside(mode: str | None) -> dict[str, float]:
        stop, sent = threading.Event(), [0]

        def push() -> None:
            while not stop.is_set():
                for bucket in packed:
                    with push_stream(dev.cuda) if mode == "push_stream" else contextlib.nullcontext():
                        link.broadcast_packed(bucket, 0)
                    sent[0] += bucket.flat.numel()
        pusher = threading.Thread(target=push, name="probe-push", daemon=True) if mode else None
        if pusher is not None:
            pusher.start()
        try:
            _, seconds = dev.timed(lambda: engine.train_step([batch], token_nll_loss))
        finally:
            stop.set()
            if pusher is not None:
                pusher.join(120)
        return {"step_s": round(seconds, 4), "pushed_gb_per_s": round(sent[0] / seconds / 1e9, 3)}

    out = {"step_tokens": sizes.step_tokens, "alone": step_beside(None), "push_stream": step_beside("push_stream"),
           "default_stream": step_beside("default_stream")}
    link.close()
    for mode in ("push_stream", "default_stream"):
        out[f"{mode}_step_ratio"] = round(out[mode]["step_s"] / out["alone"]["step_s"], 3)
    return out


# --- the bulk link ------------------------------------------------------------------------------------------

def probe_broadcast(sizes: ProbeSizes, dev: Device) -> dict[str, Any]:
    from tools.bench.bulk import measure

    if dev.cuda:
        return measure(sizes.bulk_mib, sizes.bulk_reps, backend="nccl", world=1, timeout_s=300)
    return measure(sizes.bulk_mib, sizes.bulk_reps, backend="gloo", world=2, timeout_s=300)


# --- decoding -----------------------------------------------------------------------------------------------

def probe_decode(sizes: ProbeSizes, dev: Device, steps: int = 50) -> dict[str, Any]:
    config = Qwen2Config(**SHAPES[sizes.decode_shape])
    model = Qwen2ForCausalLM(config).init_weights(0).to(dev.kind, dev.dtype).eval()
    rows, span = sizes.decode_rows, sizes.decode_span
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(rows, span)
    tokens = torch.randint(1, config.vocab_size, (rows,), generator=g).to(dev.kind)
    lens = torch.randint(span // 2, span, (rows,), generator=g).to(dev.kind)

    def step() -> torch.Tensor:
        return model.decode(tokens, lens, cache, span)

    def median_ms(fn: Callable[[], Any]) -> float:
        times = [dev.timed(fn)[1] for _ in range(steps)]
        return round(1e3 * sorted(times)[len(times) // 2], 3)

    with torch.inference_mode():
        for _ in range(3):
            eager = step()
        out: dict[str, Any] = {"shape": sizes.decode_shape, "rows": rows, "span": span,
                               "eager_step_ms": median_ms(step)}
        if not dev.cuda:
            out["graph"] = "no CUDA: CUDA graphs need a GPU"
            return out
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # torch's rule: warm up on a side stream before capturing
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
        torch.cuda.synchronize()
        out["graph_step_ms"] = median_ms(graph.replay)
        out["graph_speedup"] = round(out["eager_step_ms"] / out["graph_step_ms"], 3)
        out["graph_vs_eager_max_abs_diff"] = float((captured.float() - eager.float()).abs().max())
    return out


# --- mixture of experts -------------------------------------------------------------------------------------

def probe_moe(sizes: ProbeSizes, dev: Device) -> dict[str, Any]:
    config = Qwen3MoeConfig(**MOE_SHAPES[sizes.moe_shape])
    model = Qwen2ForCausalLM(config).init_weights(0)
    out: dict[str, Any] = {"shape": sizes.moe_shape, "params": config.num_parameters(),
                           "active_params": config.num_parameters(active=True), "tokens": sizes.moe_tokens,
                           "expert_parallel": "not probed: an expert-parallel step needs a Megatron world of several GPUs"}
    engine = TorchTrainEngine(model=model, config=TrainConfig(device=dev.kind, lr=1e-5))
    g = torch.Generator().manual_seed(0)
    lengths = [sizes.moe_tokens // 4] * 4   # four packed sequences
    batch = PackedBatch.from_sequences([torch.randint(1, config.vocab_size, (n,), generator=g).tolist()
                                        for n in lengths])
    engine.train_step([batch], token_nll_loss)   # warm-up (and the optimizer state)
    for mode in ("native", "replayed"):
        if mode == "replayed":
            routes = engine.compute_logprobs(batch, record_routing=True).routed_experts
            batch.fields["routed_experts"] = routes
        stats, seconds, peak = dev.peak_during(lambda: engine.train_step([batch], token_nll_loss))
        out[f"train_{mode}"] = {"seconds": round(seconds, 4), "tokens_per_s": round(sizes.moe_tokens / seconds, 1),
                                "peak_gib": None if peak is None else round(peak, 2), "loss": stats["loss"]}
    del engine
    model = model.to(dev.kind, dev.dtype).eval()
    rows, span = sizes.moe_rows, sizes.decode_span
    cache = model.new_cache(rows, span)
    tokens = torch.randint(1, config.vocab_size, (rows,), generator=g).to(dev.kind)
    lens = torch.randint(span // 2, span, (rows,), generator=g).to(dev.kind)

    def median_ms(record: bool) -> float:
        def step() -> None:
            trace = RoutingTrace(record=True) if record else None
            model.decode(tokens, lens, cache, span, routing=trace)
            if trace is not None:
                trace.experts()   # the engine keeps each step's [rows, sparse layers, top-k] on the device
        step()
        times = [dev.timed(step)[1] for _ in range(20 if dev.cuda else 3)]
        return round(1e3 * sorted(times)[len(times) // 2], 3)

    with torch.inference_mode():
        plain, captured = median_ms(False), median_ms(True)
    out["decode"] = {"rows": rows, "span": span, "step_ms": plain, "step_ms_capturing": captured,
                     "capture_overhead": round(captured / plain - 1, 4)}
    return out
