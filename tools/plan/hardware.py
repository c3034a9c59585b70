"""Hardware figures the planner's cost model uses, each with its source: datasheet peaks, utilisations from
published benchmarks (Megatron-LM's MFU table, the decode microbenchmark in `decode_fit`), and the two link
figures that are stated, not measured (say so where they are used). None is fitted to the end-to-end step
times the planner is compared with (docs/plan.md)."""
from __future__ import annotations

import dataclasses

from tools.plan import decode_fit

GB = 1e9
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    bf16_flops: float        # dense (no sparsity) bf16 tensor-core peak, FLOP/s
    hbm_bytes_per_s: float   # peak HBM bandwidth
    nvlink_bytes_per_s: float  # total NVLink bandwidth per GPU (both directions)
    pcie_bytes_per_s: float    # host <-> GPU, one direction
    source: str


# NVIDIA H100 Tensor Core GPU datasheet (SXM5): 1,979 TFLOPS bf16 "with sparsity", i.e. 989.5 dense; 3.35 TB/s
# HBM3; NVLink 900 GB/s; PCIe Gen5 128 GB/s (64 GB/s each way). The H800 SXM5 is the export variant with the
# same SMs, HBM3 and PCIe and NVLink cut to 400 GB/s (NVIDIA H800 datasheet). H200: 141 GB HBM3e at 4.8 TB/s,
# same compute (H200 datasheet). A100 80GB SXM (A100 datasheet): 312 TFLOPS bf16 dense, 2,039 GB/s HBM2e,
# NVLink 600 GB/s, PCIe Gen4 64 GB/s; the decode microbenchmark (tools/plan/decode_fit.py) ran on it.
GPUS: dict[str, GPU] = {
    "H100": GPU("H100", 80 * GB, 989.5e12, 3.35e12, 900 * GB, 64 * GB, "NVIDIA H100 SXM5 datasheet"),
    "H800": GPU("H800", 80 * GB, 989.5e12, 3.35e12, 400 * GB, 64 * GB, "NVIDIA H800 SXM5 datasheet"),
    "H200": GPU("H200", 141 * GB, 989.5e12, 4.8e12, 900 * GB, 64 * GB, "NVIDIA H200 SXM datasheet"),
    "A100": GPU("A100", 80 * GB, 312e12, 2.039e12, 600 * GB, 32 * GB, "NVIDIA A100 80GB SXM datasheet"),
}

#: The AReaL tutorial's hardware table: "NVSwitch + RoCE 3.2 Tbps" per 8-GPU node (400 GB/s per node).
ROCE_NODE_BYTES_PER_S = 3.2e12 / 8

# Utilisations. None is fitted to an end-to-end step time.
#: Training FLOP utilisation: Megatron-LM's README (its GPT weak-scaling table on H100, sequence length 4096)
#: reports MFU rising from 41 % for its smallest model (2B) to 47-48 % for the largest; the models here are
#: 1.5B-32B, so the small end, 41 %.
TRAIN_MFU = 0.41
#: Prefill, and the matmuls of a decode step when it is compute-bound, run the same GEMMs as training's
#: forward pass: the same utilisation. (tests/test_plan.py predicts the published long-prompt rows of the
#: decode microbenchmark with it, prefill included: within 15 %.)
PREFILL_MFU = TRAIN_MFU
#: From the published decode microbenchmark (tools/plan/decode_fit.py: the Qwen2.5 speed benchmark, vLLM 0.6.3
#: on A100, least squares over its one-token-prompt rows): the share of peak HBM bandwidth a decode step's
#: weight reads reach, and its fixed cost per layer (launches, the small per-layer kernels, the engine's
#: per-step work and sampling), and one tensor-parallel all-reduce of a decode step (its 72B row on 4 GPUs).
_DECODE = decode_fit.fit()
HBM_EFFICIENCY = _DECODE.hbm_efficiency
DECODE_FIXED_PER_LAYER_S = _DECODE.per_layer_s
TP_ALLREDUCE_LATENCY_S = _DECODE.allreduce_s
#: Fraction of NIC / NVLink / PCIe peak a large transfer reaches: stated 0.8, not measured here (no published
#: figure for these links was found; `python -m tools.bench gpu`'s link probe measures it on a GPU).
LINK_EFFICIENCY = 0.8
#: Fixed cost of one weight bucket's broadcast (NCCL launch plus the bus message that names it): stated 2 ms,
#: not measured (a 7B model is about 240 buckets of 64 MiB, so 0.5 s a push).
BUCKET_LATENCY_S = 2e-3
#: CUDA context, NCCL communicator buffers and allocator slack that every GPU process holds besides its
#: tensors: stated 3 GiB (a CUDA context alone takes 0.5-1 GiB on H100; NCCL buffers grow with communicators).
PROCESS_RESERVE_BYTES = 3 * GIB


def gpu(kind: str | None) -> GPU:
    """The datasheet entry for a topology's `gpu_kind` (default H800, AReaL's cluster)."""
    key = (kind or "H800").upper()
    for name, spec in GPUS.items():
        if name in key:
            return spec
    raise ValueError(f"cluster.node.gpu_kind: {kind!r} is not in the planner's table ({', '.join(GPUS)})")
