"""Hardware figures the planner's cost model uses, each with its source. None is fitted to end-to-end
step times: datasheet peaks, times a utilisation stated here before any comparison was made."""
from __future__ import annotations

import dataclasses

GB = 1e9
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    bf16_flops: float        # dense (no sparsity) bf16 tensor-core peak, FLOP/s
    hbm_bytes_per_s: float   # peak HBM bandwidth
    nvlink_bytes_per_s: float  # total NVLink bandwidth per GPU (both directions)
    source: str


# NVIDIA H100 Tensor Core GPU datasheet (SXM5): 1,979 TFLOPS bf16 "with sparsity", i.e. 989.5 dense; 3.35 TB/s
# HBM3; NVLink 900 GB/s. The H800 SXM5 is the export variant with the same SMs and HBM3 and NVLink cut to
# 400 GB/s (NVIDIA H800 datasheet). H200: 141 GB HBM3e at 4.8 TB/s, same compute (H200 datasheet).
GPUS: dict[str, GPU] = {
    "H100": GPU("H100", 80 * GB, 989.5e12, 3.35e12, 900 * GB, "NVIDIA H100 SXM5 datasheet"),
    "H800": GPU("H800", 80 * GB, 989.5e12, 3.35e12, 400 * GB, "NVIDIA H800 SXM5 datasheet"),
    "H200": GPU("H200", 141 * GB, 989.5e12, 4.8e12, 900 * GB, "NVIDIA H200 SXM datasheet"),
}

#: The AReaL tutorial's hardware table: "NVSwitch + RoCE 3.2 Tbps" per 8-GPU node (400 GB/s per node).
ROCE_NODE_BYTES_PER_S = 3.2e12 / 8

# Utilisations (stated, not fitted):
#: Training FLOP utilisation. Megatron-LM's README reports up to 47 % MFU for its large GPT models on H100;
#: a 1.5B-32B model with packed, variable-length micro-batches is taken to reach a little less.
TRAIN_MFU = 0.40
#: Prefill (one long forward pass, compute-bound) reaches the same utilisation as training.
PREFILL_MFU = TRAIN_MFU
#: Decode matmuls at batch sizes of a few hundred are not at the tensor-core peak; taken as half of training's.
DECODE_MFU = TRAIN_MFU / 2
#: Fraction of peak HBM bandwidth that weight and KV-cache streaming reaches (STREAM-like copies on H100
#: reach about 90 % of peak; attention over paged KV less): stated 0.8.
HBM_EFFICIENCY = 0.8
#: Fraction of NIC / NVLink peak a large NCCL collective reaches (bus bandwidth in nccl-tests is typically
#: 80-90 % of the link rate): stated 0.8.
LINK_EFFICIENCY = 0.8
#: Fixed cost of one weight bucket's broadcast (NCCL launch plus the bus message that names it): stated 2 ms.
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
