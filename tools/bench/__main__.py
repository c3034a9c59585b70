"""`python -m tools.bench NAME [args]`: run one benchmark (bus, bulk, batch, serve, packing, engine, reward, e2e, ablation, gpu, chaos, issue, agent, lora_sync, startup)."""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = ("bus", "bulk", "batch", "serve", "packing", "engine", "reward", "e2e", "ablation", "gpu", "chaos", "issue", "agent",
              "lora_sync", "startup")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m tools.bench {{{','.join(BENCHMARKS)}}} [--json] [options]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    if name == "chaos" and "--soak" in rest:   # the long-run form of chaos: tools/bench/soak.py
        name = "soak"
    module = importlib.import_module(f"tools.bench.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
