"""The published decode microbenchmark the planner's per-step decode constants come from: its rows and their fit
(`python -m tools.plan.microbench` prints them with the cost model's predictions of the long-prompt rows).

Source: the Qwen2.5 speed benchmark (github.com/QwenLM/Qwen2.5, docs/source/benchmark/speed_benchmark.rst at
commit 010c37c33b13a1ac59944b349620e13404efe97d; script examples/speed-benchmark/speed_benchmark_vllm.py):
vLLM 0.6.3 on NVIDIA A100 80GB, CUDA graphs on (`enforce_eager=False`), one request, 2048 tokens generated
after a prompt of the given length; "Speed" is 2048 over the seconds of the whole `LLM.generate` call (the
prompt's prefill included). The Qwen2.5 models share the architecture of the DeepSeek-R1-Distill-Qwen models
AReaL trains (Qwen2 layers, grouped-query attention, a 152k vocabulary).

What is taken from it, by least squares over the rows with a one-token prompt on one GPU (`FIT_ROWS`), so
that the prompt's prefill and the KV cache play no part: a decode step costs a fixed time per layer (kernel
launches and the small per-layer kernels that move next to nothing: norms, rotary, activations; the
engine's per-step work and sampling over the vocabulary, spread over layers) plus the weights' bytes at
a fraction of the HBM bandwidth. Then, with those two fixed, the one-token row of the 72B model on four GPUs
(`TP_ROW`) gives the time of one tensor-parallel all-reduce at decode (two per layer). The rows with long
prompts (`CHECK_ROWS`) are not fitted: tests/test_plan.py predicts them (prefill at the training
utilisation, KV cache reads at the fitted bandwidth) as a check of the model.

None of these rows is an AReaL step time; nothing here is fitted to the end-to-end figures the planner is
compared with.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from launch.plan.shapes import ModelShape

SOURCE = ("Qwen2.5 speed benchmark, vLLM 0.6.3 on A100 80GB (QwenLM/Qwen2.5 "
          "docs/source/benchmark/speed_benchmark.rst @ 010c37c)")
#: Tokens each measurement generates (speed_benchmark_vllm.py: output_len = 2048).
OUTPUT_TOKENS = 2048

#: The Qwen2.5 instruct models' shapes (their config.json files; layers, heads, KV heads and tied embeddings
#: also in the Qwen2.5 technical report, arXiv:2412.15115, Table 1).
QWEN25: dict[str, ModelShape] = {
    "0.5B": ModelShape("Qwen2.5-0.5B", 24, 896, 4864, 14, 2, 151936, True, "Qwen/Qwen2.5-0.5B-Instruct config.json"),
    "1.5B": ModelShape("Qwen2.5-1.5B", 28, 1536, 8960, 12, 2, 151936, True, "Qwen/Qwen2.5-1.5B-Instruct config.json"),
    "3B": ModelShape("Qwen2.5-3B", 36, 2048, 11008, 16, 2, 151936, True, "Qwen/Qwen2.5-3B-Instruct config.json"),
    "7B": ModelShape("Qwen2.5-7B", 28, 3584, 18944, 28, 4, 152064, False, "Qwen/Qwen2.5-7B-Instruct config.json"),
    "14B": ModelShape("Qwen2.5-14B", 48, 5120, 13824, 40, 8, 152064, False, "Qwen/Qwen2.5-14B-Instruct config.json"),
    "32B": ModelShape("Qwen2.5-32B", 64, 5120, 27648, 40, 8, 152064, False, "Qwen/Qwen2.5-32B-Instruct config.json"),
    "72B": ModelShape("Qwen2.5-72B", 80, 8192, 29568, 64, 8, 152064, False, "Qwen/Qwen2.5-72B-Instruct config.json"),
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One BF16 row of the vLLM table: `model` with a `prompt`-token input on `gpus` GPUs (tensor parallel),
    `tokens_per_s` = 2048 / seconds of the call."""

    model: str
    prompt: int
    gpus: int
    tokens_per_s: float

    @property
    def seconds(self) -> float:
        return OUTPUT_TOKENS / self.tokens_per_s


FIT_ROWS = [Row("0.5B", 1, 1, 311.55), Row("1.5B", 1, 1, 183.33), Row("3B", 1, 1, 127.61),
            Row("7B", 1, 1, 84.28), Row("14B", 1, 1, 46.30)]
#: "Default" setting (CUDA graphs on); the 2-GPU 72B row used enforce_eager and is not comparable.
TP_ROW = Row("72B", 1, 4, 31.37)
CHECK_ROWS = [Row("1.5B", 6144, 1, 176.68), Row("1.5B", 14336, 1, 168.69), Row("1.5B", 30720, 1, 152.04),
              Row("7B", 6144, 1, 80.70), Row("7B", 14336, 1, 77.69), Row("7B", 30720, 1, 70.33),
              Row("14B", 6144, 1, 43.83), Row("14B", 14336, 1, 41.91), Row("14B", 30720, 1, 37.18),
              Row("32B", 30720, 2, 31.82), Row("72B", 6144, 4, 29.90)]
#: NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e.
A100_HBM_BYTES_PER_S = 2.039e12


@dataclasses.dataclass(frozen=True)
class DecodeFit:
    per_layer_s: float          # fixed seconds per layer and decode step
    hbm_efficiency: float       # share of peak HBM bandwidth the weights' reads reach
    allreduce_s: float          # one tensor-parallel all-reduce of a decode step's activations
    max_rel_error: float        # of the fit over FIT_ROWS


@functools.lru_cache(maxsize=1)
def fit() -> DecodeFit:
    """The least-squares fit described in the module docstring (a few microseconds of numpy)."""
    per_token = np.array([r.seconds / OUTPUT_TOKENS for r in FIT_ROWS])
    layers = np.array([QWEN25[r.model].layers for r in FIT_ROWS], dtype=float)
    read_s = np.array([2 * QWEN25[r.model].params / A100_HBM_BYTES_PER_S for r in FIT_ROWS])
    (per_layer, inv_eff), *_ = np.linalg.lstsq(np.c_[layers, read_s], per_token, rcond=None)
    predicted = per_layer * layers + inv_eff * read_s
    shape, tp = QWEN25[TP_ROW.model], TP_ROW.gpus
    without = per_layer * shape.layers + inv_eff * 2 * shape.params / tp / A100_HBM_BYTES_PER_S
    allreduce = (TP_ROW.seconds / OUTPUT_TOKENS - without) / (2 * shape.layers)
    return DecodeFit(per_layer_s=float(per_layer), hbm_efficiency=float(1 / inv_eff), allreduce_s=float(allreduce),
                     max_rel_error=float(np.max(np.abs(predicted / per_token - 1))))
