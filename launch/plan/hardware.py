"""Hardware figures the planner's cost model uses, each with its source: datasheet peaks, utilisations from
published benchmarks (Megatron-LM's MFU table, the decode microbenchmark in `decode_fit`), links' efficiencies
and fixed costs from published measurements of those links. None is fitted to the end-to-end step times the
planner is compared with (docs/plan.md)."""
from __future__ import annotations

import dataclasses

from launch.plan import decode_fit

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
# NVLink 600 GB/s, PCIe Gen4 64 GB/s; the decode microbenchmark (launch/plan/decode_fit.py) ran on it.
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
#: From the published decode microbenchmark (launch/plan/decode_fit.py: the Qwen2.5 speed benchmark, vLLM 0.6.3
#: on A100, least squares over its one-token-prompt rows): the share of peak HBM bandwidth a decode step's
#: weight reads reach, and its fixed cost per layer (launches, the small per-layer kernels, the engine's
#: per-step work and sampling), and one tensor-parallel all-reduce of a decode step (its 72B row on 4 GPUs).
_DECODE = decode_fit.fit()
HBM_EFFICIENCY = _DECODE.hbm_efficiency
DECODE_FIXED_PER_LAYER_S = _DECODE.per_layer_s
TP_ALLREDUCE_LATENCY_S = _DECODE.allreduce_s
# Fractions of a link's peak that a large transfer reaches, each from a published measurement of that link
# (one figure for every link, 0.8, stood here before; the per-link figures move a 7B step by under 0.5 %,
# docs/plan.md "Constants and their sources").
#: NVLink: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink
#: bandwidth of 370GB/s", the bus bandwidth of NCCL's ring collectives on H100 (NCCL's maintainer in
#: github.com/NVIDIA/nccl-tests/issues/212, 2024-05-06); CUDA's p2p test reaches 380 of 450 GB/s one way
#: (github.com/NVIDIA/nccl/issues/1264). 370 / 450; the H800's NVLink is the same link, fewer of them.
NVLINK_EFFICIENCY = 370 / 450
#: Network: "For NDR @ 400Gbps you should see 46-48GB/s per NIC" in NCCL's bus bandwidth (an NCCL engineer in
#: github.com/NVIDIA/nccl-tests/issues/290, 2025-03-03): 47 of the line rate's 50 GB/s. AReaL's nodes have
#: 400 Gb/s RoCE NICs (8 per node, `ROCE_NODE_BYTES_PER_S`), the same line rate.
NIC_EFFICIENCY = 47 / 50
#: PCIe Gen5 x16 between GPU and host: 52.8 GB/s device to host on H100 in nvbandwidth's
#: device_to_host_memcpy_sm (github.com/NVIDIA/nvbandwidth/issues/24, 2024-09-11; 57 GB/s host to device with
#: copy engines on another H100 system, issues/6), against the 64 GB/s each way of the datasheet.
PCIE_EFFICIENCY = 52.8 / 64
#: Fixed cost of one weight bucket's broadcast to the servers: one HTTP request to the server plus an NCCL
#: broadcast (SGLang's /update_weights_from_distributed per bucket). Derived from a published measurement of
#: the same pattern: TRL's vLLM client updates a model one HTTP request + NCCL broadcast + barrier per named
#: parameter (trl/generation/vllm_client.py `update_named_param`), and "For Qwen2 0.5B, this cuts the weight
#: sync from 0.6sec to 0.15sec" (github.com/huggingface/trl/pull/5249, 2026-03-09): Qwen2-0.5B has 290 named
#: parameters (24 layers x 12 tensors, the embedding and the final norm; the head is tied), so 0.6 s / 290 =
#: 2.1 ms a call, its 1 GB of bytes included. 2 ms.
BUCKET_LATENCY_S = 2e-3
#: CUDA context, NCCL communicator buffers and allocator slack that every trainer GPU process holds besides
#: its tensors. Derived from published measurements: a CUDA context takes about 400 MB with lazy module
#: loading (CUDA >= 11.7; PyTorch's CUDA maintainer in github.com/pytorch/pytorch/issues/109888), and each NCCL
#: communicator about 544 MB (2 ranks) to 688 MB (3-4 ranks) on an NVLink node (github.com/NVIDIA/nccl/issues/964:
#: one 4 MB all-reduce per group, PyTorch front end); a Megatron rank communicates in about four groups (tensor,
#: data and model parallel, the default group), so 0.4 + 4 x 0.69 = 3.2 GB, 3 GiB. Allocator slack has no
#: published figure; the reserve enters only the memory check, not the step time (docs/plan.md).
PROCESS_RESERVE_BYTES = 3 * GIB

def gpu(kind: str | None) -> GPU:
    """The datasheet entry for a topology's `gpu_kind` (default H800, AReaL's cluster)."""
    key = (kind or "H800").upper()
    for name, spec in GPUS.items():
        if name in key:
            return spec
    raise ValueError(f"cluster.node.gpu_kind: {kind!r} is not in the planner's table ({', '.join(GPUS)})")
