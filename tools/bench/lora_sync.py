"""`python -m tools.bench lora_sync`: one weight update of full weights against one of LoRA adapters alone.

Each version goes the way a rollout gets it, in one process and one thread: the trainer exports it
(`export_weights`) and packs it into checksummed buckets in host memory (`transport.bulk.pack_to_host`, what the
senders do), the buckets are unpacked (checksums verified) and the embedded generation engine applies them
(`update_weights`: staged, with LoRA merged into the kept base, then swapped at a step boundary). The link
itself moves the packed bytes; `python -m tools.bench bulk` measures its GB/s. Full and LoRA alternate in
`--reps` rounds and each figure is the median over rounds, so the load of a shared machine at that moment
weighs on both alike.

    python -m tools.bench lora_sync [--model configs/models/arith-tiny-warm] [--config configs/local_lora.yaml]
                                    [--reps 5] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import torch
import yaml

from actors.engines.lora import LoraSpec
from actors.engines.torch_gen import TorchGenerationEngine
from actors.engines.torch_train import TorchTrainEngine, TrainConfig
from topology.experiment import ExperimentConfig
from transport.bulk import pack_to_host, unpack_bucket

BUCKET_BYTES = 64 << 20


async def one_update(trainer: TorchTrainEngine, engine: TorchGenerationEngine, version: int) -> dict[str, float]:
    t0 = time.perf_counter()
    packed = list(pack_to_host(trainer.export_weights(BUCKET_BYTES)))
    t1 = time.perf_counter()
    await engine.update_weights(version, [unpack_bucket(p, "bench") for p in packed])
    t2 = time.perf_counter()
    return {"bytes": float(sum(p.flat.numel() for p in packed)), "export_pack_s": t1 - t0, "apply_s": t2 - t1,
            "swap_s": engine.swaps[-1].swap_s}


async def run(model: str, spec: LoraSpec, reps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    trainers = {"full": TorchTrainEngine(model, TrainConfig()), "lora": TorchTrainEngine(model, TrainConfig(), lora=spec)}
    engines = {"full": TorchGenerationEngine(model), "lora": TorchGenerationEngine(model, lora=spec)}
    for engine in engines.values():
        await engine.start()
    rounds: dict[str, list[dict[str, float]]] = {"full": [], "lora": []}
    try:
        for r in range(reps):
            for kind in ("full", "lora"):
                rounds[kind].append(await one_update(trainers[kind], engines[kind], r + 1))
    finally:
        for engine in engines.values():
            await engine.stop()
    out: dict[str, Any] = {"model": model, "lora": {"rank": spec.rank, "targets": list(spec.target_modules)},
                           "reps": reps}
    for kind, rows in rounds.items():
        out[kind] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    out["ratio_bytes"] = out["full"]["bytes"] / out["lora"]["bytes"]
    out["ratio_update_s"] = ((out["full"]["export_pack_s"] + out["full"]["apply_s"])
                             / (out["lora"]["export_pack_s"] + out["lora"]["apply_s"]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench lora_sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="configs/models/arith-tiny-warm")
    parser.add_argument("--config", default="configs/local_lora.yaml", help="an experiment config with model.lora")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with open(args.config, encoding="utf-8") as f:
        config = ExperimentConfig.model_validate(yaml.safe_load(f))
    spec = LoraSpec.from_settings(config.model.lora)
    if spec is None:
        print(f"{args.config}: no model.lora", file=sys.stderr)
        return 2
    result = asyncio.run(run(args.model, spec, args.reps))
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.model}, LoRA rank {spec.rank} on {', '.join(spec.target_modules)}; medians of {args.reps} rounds")
    for kind in ("full", "lora"):
        r = result[kind]
        print(f"  {kind:5s} {r['bytes'] / 2**20:9.3f} MiB  export+pack {1e3 * r['export_pack_s']:8.1f} ms  "
              f"apply {1e3 * r['apply_s']:8.1f} ms (swap at the boundary {1e3 * r['swap_s']:.2f} ms)")
    print(f"  full / lora: {result['ratio_bytes']:.1f}x the bytes, {result['ratio_update_s']:.1f}x the time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
