"""`python -m tools.up TOPOLOGY [key.sub=value ...] [--dry-run]`: validate a topology and start the run.

* ``--dry-run`` prints the placement (node -> actors -> GPUs / cores / CPU workers), the bus endpoints,
  the NCCL/gloo group of every link and the command each node would run, then exits 0.
* One node and no SLURM allocation: every actor starts on this machine under ``actors.supervisor``.
* Several nodes: inside a SLURM allocation (``salloc``/``sbatch``) the launcher writes one plan file per
  node into the run directory and ``srun`` starts one ``tools.node_agent`` per node, which runs that
  node's actors under the same supervisor; ``--sbatch`` submits the allocation first. No SSH.

The run directory (``runs/<name>/<timestamp>`` unless ``--run-dir``) holds the plan, the ActorSpecs,
logs, message logs, metrics and checkpoints. Exit status: 0 clean end, 2 invalid topology, 1 failed run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from tools import topology as topo_mod
from tools.topology import Plan, TopologyError

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# dry run
# ---------------------------------------------------------------------------------------------

def node_command(plan: Plan, run_dir: str = "RUN_DIR") -> str:
    """What srun runs on every node (the node agent finds its own plan file by its SLURM node name)."""
    return f"{shlex.quote(sys.executable)} -m tools.node_agent {run_dir}"


def describe(plan: Plan, overrides: Sequence[str] = ()) -> str:
    """The dry-run report: placement table, bus endpoints, links and per-node commands."""
    topo = plan.topology
    lines: list[str] = []
    n_gpus = sum(n.gpus for n in topo.nodes)
    kind = f" x {topo.nodes[0].gpu_kind}" if topo.nodes and topo.nodes[0].gpu_kind else ""
    lines.append(f"topology {topo.name} ({topo.source})" + (f": {topo.description}" if topo.description else ""))
    lines.append(f"  {len(topo.nodes)} node(s), {n_gpus} GPU(s){kind}, {len(plan.instances)} actor instance(s)"
                 + (f", experiment config {topo.config_path}" if topo.config_path else ""))
    if overrides:
        lines.append(f"  overrides: {' '.join(overrides)}")
    if topo.nodes_from_allocation:
        lines.append("  node names #i are filled in from the SLURM allocation at launch")
    lines.append("")
    lines.append("placement")
    rows = [("node", "actor", "class", "gpus", "cores", "threads", "cpu_workers")]
    for node_idx, insts in plan.by_node().items():
        node = topo.nodes[node_idx]
        used = sum(len(i.gpus) for i in insts)
        workers = sum(topo.groups[i.group].cpu_workers for i in insts)
        label = f"{node.name} [{used}/{node.gpus} gpu, {workers}/{node.cpus} cpu_workers]"
        if not insts:
            rows.append((label, "-", "", "", "", "", ""))
        for k, inst in enumerate(_compress(plan, insts)):
            rows.append((label if k == 0 else "", inst["name"], inst["cls"], inst["gpus"], inst["cpus"],
                         inst["threads"], inst["workers"]))
    lines.extend(_table(rows))
    lines.append("")
    lines.append(f"bus: {topo.bus.transport}, CurveZMQ {'on' if topo.bus.curve else 'off'}"
                 + (f", ports {topo.bus.base_port}-{topo.bus.base_port + topo.bus.port_range - 1}"
                    if topo.bus.transport == "tcp" else ""))
    eps = [(i.name, i.endpoint) for i in plan.instances]
    for name, ep in eps[:12]:
        lines.append(f"  {name:<24} {ep}")
    if len(eps) > 12:
        lines.append(f"  ... {len(eps) - 12} more, up to {eps[-1][0]} {eps[-1][1]}")
    lines.append("")
    lines.append("links" if plan.links else "links: none")
    for link in plan.links.values():
        members = _ranges(link.members)
        lines.append(f"  {link.name}: {link.backend} group of {len(link.members)}, rank 0 = {link.members[0]}, "
                     f"rendezvous {link.master_host}:{link.port}, timeout {link.timeout_s:g} s")
        lines.append(f"    ranks: {members}")
        if link.env:
            lines.append("    env: " + " ".join(f"{k}={v}" for k, v in sorted(link.env.items())))
    lines.append("")
    lines.append("commands")
    if len(topo.nodes) == 1 and not topo.nodes_from_allocation:
        lines.append(f"  local: supervisor on this machine starts {len(plan.instances)} process(es): "
                     f"{shlex.quote(sys.executable)} -m actors.run RUN_DIR/specs/<actor>.json")
    else:
        lines.append(f"  srun -N{len(topo.nodes)} --ntasks-per-node=1 --kill-on-bad-exit=1 {node_command(plan)}")
        for node_idx, insts in plan.by_node().items():
            lines.append(f"    on {topo.nodes[node_idx].name}: node agent -> supervisor -> {len(insts)} actor(s): "
                         f"{_ranges([i.name for i in insts]) or '-'}")
    return "\n".join(lines)


def _compress(plan: Plan, insts: list) -> list[dict[str, str]]:
    """One row per run of consecutive instances of one group on a node with the same cores."""
    runs: list[list] = []
    for inst in insts:
        if runs and runs[-1][0].group == inst.group and runs[-1][0].cpus == inst.cpus:
            runs[-1].append(inst)
        else:
            runs.append([inst])
    rows = []
    for run in runs:
        first, group = run[0], plan.topology.groups[run[0].group]
        name = first.name if len(run) == 1 else f"{first.name} .. {run[-1].name} (x{len(run)})"
        gpus = [g for inst in run for g in inst.gpus]
        gpu_text = _ids(gpus) + (f" ({group.gpus} each)" if len(run) > 1 and gpus else "")
        rows.append({"name": name, "cls": group.cls, "gpus": gpu_text or "-", "cpus": _ids(first.cpus) or "any",
                     "threads": first.env.get("OMP_NUM_THREADS", ""),
                     "workers": str(group.cpu_workers * len(run)) if group.cpu_workers else "-"})
    return rows


def _ids(ids: list[int]) -> str:
    if not ids:
        return ""
    spans, start, prev = [], ids[0], ids[0]
    for x in ids[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        spans.append(f"{start}-{prev}" if prev != start else str(start))
        if x is not None:
            start = prev = x
    return ",".join(spans)


def _ranges(names: list[str]) -> str:
    """rollout.0, rollout.1, ..., rollout.9 -> rollout.0-9"""
    out, i = [], 0
    while i < len(names):
        base, _, idx = names[i].rpartition(".")
        if base and idx.isdigit():
            j = i
            while j + 1 < len(names) and names[j + 1] == f"{base}.{int(names[j].rpartition('.')[2]) + 1}":
                j += 1
            out.append(names[i] if j == i else f"{base}.{idx}-{names[j].rpartition('.')[2]}")
            i = j + 1
        else:
            out.append(names[i])
            i += 1
    return ", ".join(out)


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    return ["  " + "  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.up", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology", help="topology YAML, e.g. topology/local.yaml")
    ap.add_argument("overrides", nargs="*", help="key.sub=value (topology keys, or experiment.* for the config)")
    ap.add_argument("--dry-run", action="store_true", help="print the placement and commands, start nothing")
    ap.add_argument("--run-dir", help="run directory (default: <run_root>/<name>/<timestamp>)")
    ap.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for every actor's ready")
    ap.add_argument("--duration", type=float, default=None, help="stop the run after this many seconds")
    ap.add_argument("--no-progress", action="store_true", help="plain log lines instead of a live display")
    ap.add_argument("--sbatch", action="store_true", help="submit a SLURM allocation and launch inside it")
    ap.add_argument("--no-import-check", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def load_plan(args: argparse.Namespace) -> Plan:
    return topo_mod.load(args.topology, args.overrides, check_imports=not args.no_import_check)


def make_run_dir(plan: Plan, requested: str | None) -> Path:
    if requested:
        path = Path(requested)
    else:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path(plan.topology.run_root) / plan.topology.name / stamp
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan = load_plan(args)
    except TopologyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    if args.dry_run:
        print(describe(plan, args.overrides))
        return EXIT_OK
    if args.sbatch:
        return submit_sbatch(plan, args)
    if os.environ.get("SLURM_JOB_ID") and (len(plan.topology.nodes) > 1 or plan.topology.nodes_from_allocation):
        return run_slurm(plan, args)
    if len(plan.topology.nodes) > 1 or plan.topology.nodes_from_allocation:
        print(f"{plan.topology.source}: {len(plan.topology.nodes)} nodes need a SLURM allocation: run inside "
              f"`salloc -N{len(plan.topology.nodes)}` or add --sbatch", file=sys.stderr)
        return EXIT_INVALID
    return run_local(plan, args)


if __name__ == "__main__":
    sys.exit(main())
