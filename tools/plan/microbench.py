"""`python -m tools.plan.microbench`: the published decode microbenchmark's fit (launch/plan/decode_fit.py) and
the cost model's predictions of its long-prompt rows, which are not fitted (a check of the model)."""
from __future__ import annotations

from launch.plan import hardware
from launch.plan.decode_fit import CHECK_ROWS, FIT_ROWS, OUTPUT_TOKENS, QWEN25, SOURCE, TP_ROW, fit
from tools.plan import costs


def check_rows() -> list[dict[str, float | int | str]]:
    """The long-prompt rows predicted by the cost model (not fitted): prefill of the prompt, then 2048 decode
    steps over a KV cache growing from it, on the A100's datasheet figures."""
    gpu = hardware.GPUS["A100"]
    out = []
    for row in CHECK_ROWS:
        shape = QWEN25[row.model]
        prefill = costs.prefill_seconds(shape, gpu, row.gpus, row.prompt, row.prompt ** 2)
        decode = costs.decode_cost(shape, gpu, row.gpus, 1).steps(row.prompt, 1, OUTPUT_TOKENS)
        out.append({"model": row.model, "prompt": row.prompt, "gpus": row.gpus, "published_s": row.seconds,
                    "predicted_s": prefill + decode, "ratio": (prefill + decode) / row.seconds})
    return out


def main() -> int:
    """`python -m tools.plan.microbench`: the fit and the rows it is checked on, as Markdown."""
    f = fit()
    print(f"fit over {len(FIT_ROWS)} one-token rows ({SOURCE}): {f.per_layer_s * 1e6:.1f} us per layer and step, "
          f"HBM efficiency {f.hbm_efficiency:.3f} (largest error {f.max_rel_error:.1%}); one tensor-parallel "
          f"all-reduce {f.allreduce_s * 1e6:.1f} us ({TP_ROW.model} on {TP_ROW.gpus} GPUs)")
    print("| model | prompt | GPUs | published s | predicted s | ratio |")
    print("|---|---|---|---|---|---|")
    for r in check_rows():
        print(f"| {r['model']} | {r['prompt']:,} | {r['gpus']} | {r['published_s']:.1f} | {r['predicted_s']:.1f} | "
              f"{r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
