"""`python -m tools.up TOPOLOGY [key.sub=value ...] [--dry-run | --show-config]`: validate a topology and start the run.

* ``key.sub=value`` overrides a key of the topology file, or of the experiment config under ``experiment.``;
  the value is read as YAML and checked by the same models as the files (topology.loading describes the grammar).
* ``--show-config`` prints every key of the resolved configuration, one ``key = value  # source`` line each,
  the source being default, topology file, config file or override; then exits 0.

* ``--record`` turns message logs on for every actor (``RUN_DIR/msglog/<name>.msglog``, inbound and
  outbound, tensors stored) so that any actor can be replayed with ``tools.replay --into``.
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
import importlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import topology as topo_mod
from actors.run import keep_files_private
from topology import Plan, TopologyError
from topology.experiment import ExperimentConfig
from topology.schema import SupervisorSection
from topology.settings import read_settings
from transport.files import atomic_write
from transport.ports import free_port

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# dry run
# ---------------------------------------------------------------------------------------------

def node_command(plan: Plan, run_dir: str = "RUN_DIR") -> str:
    """What srun runs on every node (the node agent finds its own plan file by its SLURM node name)."""
    return f"{shlex.quote(sys.executable)} -m tools.node_agent {run_dir}"


def evaluation_notes(plan: Plan) -> list[str]:
    """What evaluation the run will do, or that it will do none and why: printed by --dry-run and at launch."""
    config = plan.topology.config
    test, every = config.data.test, config.eval.every_versions
    evaluators = [g for g, group in plan.topology.groups.items() if group.cls.endswith(":EvalActor")]
    if not test:
        return ["evaluation: none: data.test is not set (neither during the run nor at its end)"]
    lines = [f"evaluation on {test}:"]
    if evaluators and every > 0:
        lines.append(f"  during the run: every {every} versions, {config.eval.max_problems} problems, in "
                     f"{', '.join(evaluators)}")
    elif evaluators:
        lines.append("  during the run: none: eval.every_versions is 0 (the evaluator idles)")
    else:
        lines.append("  during the run: none: the topology has no evaluator group"
                     + (f" (eval.every_versions {every} is unused)" if every > 0 else ""))
    if config.run.final_eval:
        lines.append("  at the end: the start model and the last checkpoint, greedy and sampled "
                     "(tools.eval; SGLang servers on a machine with a GPU and SGLang, else the embedded engine)")
    else:
        lines.append("  at the end: none: run.final_eval is false")
    return lines


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
    if warning := insecure_bus_warning(plan):
        lines.append(warning)
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
                     f"rendezvous {link.master_host}:{link.port or 'auto'}, timeout {link.timeout_s:g} s")
        lines.append(f"    ranks: {members}")
        if link.env:
            lines.append("    env: " + " ".join(f"{k}={v}" for k, v in sorted(link.env.items())))
    for gname, world in plan.worlds.items():
        lines.append(f"  {gname} world: {world.backend} world of {len(world.members)} ranks "
                     f"({_ranges(world.members)}), rank 0 = {world.members[0]} leads, rendezvous "
                     f"{world.master_host}:{world.port or 'auto'} (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE)")
        if world.env:
            lines.append("    env: " + " ".join(f"{k}={v}" for k, v in sorted(world.env.items())))
        pp = int(topo.groups[gname].parallel.get("pp", 1))
        if pp > 1:
            # Megatron's rank order (tp-cp-ep-dp-pp): stage k begins at rank k * world / pp.
            senders = [world.members[k * len(world.members) // pp] for k in range(pp)]
            lines.append(f"    {pp} pipeline stages: each stage's sender hosts a weights group of its own with the "
                         f"rollouts' servers: {', '.join(senders)}")
    lines.append("")
    lines.extend(_engines(plan))
    lines.append("")
    lines.extend(evaluation_notes(plan))
    lines.append("")
    lines.extend(_memory(plan))
    lines.append("")
    lines.append("commands")
    if len(topo.nodes) == 1 and not topo.nodes_from_allocation:
        lines.append(f"  local: supervisor on this machine starts {len(plan.instances)} process(es): "
                     f"{shlex.quote(sys.executable)} -m actors.run RUN_DIR/specs/<actor>.json")
    else:
        lines.append(f"  srun -N{len(topo.nodes)} --ntasks-per-node=1 {' '.join(slurm_resources(plan))} "
                     f"--kill-on-bad-exit=1 {node_command(plan)}")
        for node_idx, insts in plan.by_node().items():
            lines.append(f"    on {topo.nodes[node_idx].name}: node agent -> supervisor -> {len(insts)} actor(s): "
                         f"{_ranges([i.name for i in insts]) or '-'}")
    return "\n".join(lines)


def insecure_bus_warning(plan: Plan) -> str | None:
    """The line the dry run and every launch print when the topology runs a tcp bus without CurveZMQ."""
    bus = plan.topology.bus
    if bus.transport != "tcp" or bus.curve:
        return None
    return ("WARNING: bus.insecure_tcp is true: this run's tcp bus has no CurveZMQ. Messages and the actors' "
            "tokens travel in clear: anyone who can sniff its network, or bind one of its ports while that "
            f"actor is down ({bus.base_port}-{bus.base_port + bus.port_range - 1}), can command the run")


def busy_ports(plan: Plan) -> list[str]:
    """One problem per port the plan binds on this machine that something else already holds: each actor's
    tcp bus port and each link's and world's fixed rendezvous port ("auto" ports are picked free at launch).
    Ports on other nodes cannot be checked from here."""
    local = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    wanted: list[tuple[str, str, int]] = []   # (key, host, port)
    base = plan.topology.bus.base_port
    for inst in plan.instances:
        if inst.port:
            wanted.append((f"bus.base_port (+{inst.port - base}: {inst.name})", inst.host, inst.port))
    for link in plan.links.values():
        if link.port:
            wanted.append((f"links.{link.name}.port", link.master_host, link.port))
    for gname, world in plan.worlds.items():
        if world.port:
            wanted.append((f"actors.{gname}.world_port", world.master_host, world.port))
    problems = []
    for key, host, port in wanted:
        if host not in local:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a port in TIME_WAIT is free to us
            try:
                probe.bind(("0.0.0.0", port))
            except OSError as exc:
                problems.append(f"{key}: port {port} is already in use on this node ({exc.strerror}); "
                                f"choose another or \"auto\"")
    return problems


def memory_problems(plan: Plan) -> list[str]:
    """GPU groups that do not fit their GPUs by the planner's estimate (tools/plan), naming the largest term."""
    from tools.plan import setup
    from tools.plan.shapes import ShapeError

    try:
        return setup.memory_problems(plan)
    except (ShapeError, ValueError):
        return []   # no model shape: _memory says so in the report


def prepare_problems(plan: Plan) -> list[str]:
    """What tools.prepare would refuse in the experiment's prepare section (the tools' own arguments)."""
    from tools.prepare import stage_problems

    return [f"experiment.{line}" for line in stage_problems(plan.topology.config.prepare)]


def engine_placements(plan: Plan) -> dict[str, dict[str, str]]:
    """Group -> where its engine runs (device, dtype, parallel layout, process-group backend), from the
    settings its first instance will get, by the actor class's own ``placement`` (the rule its engine is
    built by). Groups whose class drives no engine are left out."""
    first: dict[str, dict[str, Any]] = {}
    for spec in plan.specs("RUN_DIR"):
        first.setdefault(spec["name"].split(".")[0], spec)
    out = {}
    for gname, group in plan.topology.groups.items():
        module, _, name = group.cls.partition(":")
        klass = getattr(importlib.import_module(module), name)
        placement = getattr(klass, "placement", None)
        if placement is not None and gname in first:
            out[gname] = placement(read_settings(klass, first[gname]["settings"], first[gname]["name"]))
    return out


def _engines(plan: Plan) -> list[str]:
    placements = engine_placements(plan)
    if not placements:
        return ["engines: none"]
    rows = [("group", "engine", "device", "dtype", "parallel", "memory", "process group")]
    rows += [(g, p["engine"], p["device"], p["dtype"], p["parallel"], p["memory"], p["process_group"])
             for g, p in placements.items()]
    return ["engines", *_table(rows)]


def _memory(plan: Plan) -> list[str]:
    """The planner's memory estimate per GPU of every GPU group (tools/plan)."""
    from tools.plan import report, setup
    from tools.plan.shapes import ShapeError

    try:
        found = setup.read(plan)
    except (ShapeError, ValueError) as exc:
        return [f"memory per GPU: not estimated ({exc})"]
    line = f"{found.shape.name if found.shape else '-'}, {found.gpu.name} {found.gpu.memory_bytes / 1e9:.0f} GB"
    return report.memory_table(line, setup.group_memory(found))


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
    ap.add_argument("overrides", nargs="*",
                    help="key.sub=value, value read as YAML: a topology key (actors.rollout.count=4), or experiment.* "
                         "for the experiment config (experiment.algo.eta=2); checked by the same models as the files")
    ap.add_argument("--dry-run", action="store_true", help="print the placement and commands, start nothing")
    ap.add_argument("--show-config", action="store_true",
                    help="print every key of the resolved configuration with where its value came from (default, "
                         "topology file, config file, override), start nothing")
    ap.add_argument("--run-dir", help="run directory (default: <run_root>/<name>/<timestamp>)")
    ap.add_argument("--ready-timeout", type=float, default=None,
                    help="seconds to wait for every actor's ready, where the topology's supervisor section does not "
                         "say (the override supervisor.ready_timeout=S sets that key itself; default "
                         f"{SupervisorSection.model_fields['ready_timeout'].default:g})")
    ap.add_argument("--duration", type=float, default=None, help="stop the run after this many seconds")
    ap.add_argument("--no-progress", action="store_true", help="plain log lines instead of a live display")
    ap.add_argument("--sbatch", action="store_true", help="submit a SLURM allocation and launch inside it")
    ap.add_argument("--record", action="store_true",
                    help="message logs for every actor (in and out, tensors stored): RUN_DIR/msglog/<name>.msglog, "
                         "replayable with tools.replay --into")
    ap.add_argument("--no-import-check", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_intermixed_args(argv)


def load_plan(args: argparse.Namespace) -> Plan:
    return topo_mod.load(args.topology, args.overrides, check_imports=not args.no_import_check)


def make_run_dir(plan: Plan, requested: str | None) -> Path:
    """The requested directory; else, with `run.recover: auto`, the newest run of this topology that
    has a checkpoint but did not finish (it is resumed); else a new timestamped one."""
    from actors.recovery import latest_checkpoint, recovering, resume_checkpoint, run_finished

    recover = recovering(plan.topology.config)
    if requested:
        path = Path(requested)
    else:
        root = Path(plan.topology.run_root) / plan.topology.name
        unfinished = sorted(d for d in root.glob("*") if d.is_dir() and latest_checkpoint(d) and not run_finished(d)) \
            if root.is_dir() and recover else []
        path = unfinished[-1] if unfinished else root / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if recover and path.is_dir() and not run_finished(path):
        # Checked here, once, with checksums: every actor then resumes from the same complete checkpoint.
        found = resume_checkpoint(path)
        if found is not None:
            print(f"resuming {path} from its checkpoint of step {found[0]} (run.recover: auto; "
                  f"experiment.run.recover=off starts afresh)", flush=True)
    keep_files_private()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:   # a --run-dir that already existed
        path.chmod(0o700)
    return path.resolve()



# ---------------------------------------------------------------------------------------------
# launching
# ---------------------------------------------------------------------------------------------

def supervisor_options(plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for actors.supervisor.Supervisor: the topology's `supervisor:` section over its defaults;
    --ready-timeout where the file does not say."""
    opts = SupervisorSection.model_validate(plan.topology.supervisor).model_dump()
    if args.ready_timeout is not None and "ready_timeout" not in plan.topology.supervisor:
        opts["ready_timeout"] = args.ready_timeout
    return opts


# What `--record` turns on in every actor: tools.replay --into needs the outbound records to compare with
# and the tensors themselves to rebuild the inbound messages, not their checksums.
RECORD_SETTINGS = {"outbound": True, "tensors": "store"}


def build_specs(plan: Plan, run_dir: Path, record: bool = False) -> list[dict[str, Any]]:
    """ActorSpec dictionaries for the run: ipc paths made concrete, CurveZMQ keys (or, without CURVE, the
    actors' tokens) made for this run, message logs on for every actor with ``record``."""
    from transport.auth import generate_run_keys, generate_run_tokens
    from transport.bulk import generate_rendezvous_secret

    curve = tokens = None
    names = [i.name for i in plan.instances]
    if plan.topology.bus.curve:
        curve = {"keys_dir": generate_run_keys(str(run_dir), names)}
    else:
        tokens = {"tokens_dir": generate_run_tokens(str(run_dir), names)}
    for link in [*plan.links.values(), *plan.worlds.values()]:
        if link.port == 0:  # `port: auto`
            link.port = free_port(topo_mod.resolve_host(link.master_host) if link.master_host else "127.0.0.1")
    specs = plan.specs(run_dir, curve=curve, tokens=tokens)
    if plan.links:
        # the links' rendezvous stores sign their values with it (transport.bulk.SignedStore)
        secret_file = generate_rendezvous_secret(run_dir)
        for spec in specs:
            for link in spec["settings"]["links"].values():
                link["secret_file"] = secret_file
    if plan.topology.bus.transport == "ipc":
        ipc_dir = run_dir / "ipc"
        longest = max(len(i.name) for i in plan.instances)
        if len(str(ipc_dir)) + longest + 8 > 100:  # unix socket paths stop at 107 bytes
            import tempfile
            ipc_dir = Path(tempfile.mkdtemp(prefix="areal-ipc-"))
            (run_dir / "ipc_dir").write_text(str(ipc_dir))
        ipc_dir.mkdir(parents=True, exist_ok=True)
        ipc_dir.chmod(0o700)   # the sockets are the bus: only the run's user may reach them
        for spec in specs:
            spec["endpoint"] = spec["endpoint"].replace("{ipc_dir}", str(ipc_dir))
            spec["peers"] = {n: e.replace("{ipc_dir}", str(ipc_dir)) for n, e in spec["peers"].items()}
    if record:
        for spec in specs:
            spec["settings"]["message_log"] = dict(RECORD_SETTINGS)
    return specs


def write_plan(plan: Plan, run_dir: Path, specs: list[dict[str, Any]], overrides: Sequence[str]) -> None:
    (run_dir / "plan.txt").write_text(describe(plan, overrides) + "\n")
    (run_dir / "plan.json").write_text(json.dumps({
        "topology": plan.topology.source, "overrides": list(overrides), "document": plan.topology.document,
        "experiment": plan.topology.experiment, "specs": specs}, indent=1, default=str))


class ProgressView:
    """Live actor status: a rich table on a terminal, one line per change otherwise."""

    def __init__(self, title: str, enabled: bool) -> None:
        self.title = title
        self.live = None
        self.last: dict[str, str] = {}
        if enabled and sys.stdout.isatty():
            from rich.live import Live
            self.live = Live(refresh_per_second=4, transient=False)
            self.live.start()

    def update(self, rows: dict[str, dict[str, Any]], elapsed: float, training: str | None = None) -> None:
        if self.live is not None:
            from rich.table import Table
            table = Table(title=f"{self.title}  {elapsed:6.1f} s", caption=training)
            for col in ("actor", "node", "state", "pid", "restarts"):
                table.add_column(col)
            for name, row in rows.items():
                table.add_row(name, str(row.get("node", "")), row["state"], str(row.get("pid") or ""),
                              str(row.get("restarts", 0)))
            self.live.update(table)
            return
        for name, row in rows.items():
            text = f"{row['state']} (restarts {row.get('restarts', 0)})"
            if self.last.get(name) != text:
                self.last[name] = text
                print(f"[{elapsed:7.1f}s] {name:<20} {row.get('node', ''):<10} {text}", flush=True)
        if training and self.last.get("\0training") != training:
            self.last["\0training"] = training
            print(f"[{elapsed:7.1f}s] {training}", flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


class TrainingProgress:
    """Follows RUN_DIR/metrics.jsonl (one line per training step, written by the trainer) and renders
    the latest step as one progress line."""

    def __init__(self, run_dir: Path, total_steps: int | None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.total = total_steps
        self.offset = 0
        self.latest: dict[str, Any] | None = None

    def poll(self) -> str | None:
        if self.path.exists():
            with open(self.path) as f:
                f.seek(self.offset)
                for line in f:
                    if not line.endswith("\n"):
                        break  # a line still being written: read it next time
                    self.offset += len(line)
                    self.latest = json.loads(line)
        m = self.latest
        if m is None:
            return None
        of = f"/{self.total}" if self.total else ""
        return (f"step {m['step']}{of}  reward {m['task_reward']:+.2f}  accuracy {100 * m['accuracy']:5.1f}%  "
                f"throughput {m['effective_throughput']:7.0f} tok/s  staleness {m['staleness_mean']:.2f} "
                f"(max {m['staleness_max']:.0f})  weight sync {m['weight_sync_seconds']:.3f} s  "
                f"buffer {m['buffer_depth']}")


def _summary(title: str, rows: dict[str, dict[str, Any]], elapsed: float, run_dir: Path, outcome: str) -> str:
    lines = [f"{title}: {outcome} after {elapsed:.1f} s; run directory {run_dir}"]
    table = [("actor", "node", "state", "exit", "restarts")]
    for name, row in rows.items():
        table.append((name, str(row.get("node", "")), row["state"], str(row.get("exit", "")),
                      str(row.get("restarts", 0))))
    lines.extend(_table(table))
    return "\n".join(lines)


def _child_rows(sup: Any, node_of: dict[str, str]) -> dict[str, dict[str, Any]]:
    rows = {}
    for name, child in sup.children.items():
        proc = child.proc
        if child.finished:
            state = "finished"
        elif child.ready:
            state = "ready"
        elif proc is not None and proc.returncode is not None:
            state = "restarting"
        else:
            state = "starting"
        rows[name] = {"node": node_of.get(name, ""), "state": state, "restarts": sup.restarts[name],
                      "pid": proc.pid if proc is not None and proc.returncode is None else None,
                      "exit": child.last_exit if child.last_exit is not None else ""}
    return rows


async def supervise(specs: list[dict[str, Any]], run_dir: Path, options: dict[str, Any], *, title: str,
                    progress: bool, duration: float | None, node_of: dict[str, str],
                    status_file: Path | None = None, stop_file: Path | None = None,
                    training: TrainingProgress | None = None) -> int:
    """Start actors under the Supervisor, show progress, stop on Ctrl-C/SIGTERM, on ``duration``, when
    ``stop_file`` appears (a multi-node launcher's stop request), or when every actor has finished by
    itself; print a summary. Returns the exit status."""
    import asyncio

    from actors.base import ActorSpec
    from actors.supervisor import NotReadyError, Supervisor, SupervisorError

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_reason: list[str] = []

    def on_signal(name: str) -> None:
        stop_reason.append(f"stopped by {name}")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    from actors.recovery import run_finished
    sup = Supervisor([ActorSpec.from_dict(s) for s in specs], run_dir, run_over=lambda: run_finished(run_dir),
                     **options)
    view = ProgressView(title, progress)
    t0 = time.monotonic()
    outcome, code = "finished", EXIT_OK

    def publish(state: str) -> dict[str, dict[str, Any]]:
        rows = _child_rows(sup, node_of)
        view.update(rows, time.monotonic() - t0, training.poll() if training is not None else None)
        if status_file is not None:
            atomic_write(status_file, json.dumps({"state": state, "actors": rows, "time": time.time()}, default=str),
                         durable=False)   # a live view, rewritten on every change
        return rows

    try:
        starting = asyncio.ensure_future(sup.start())
        while not starting.done():
            publish("starting")
            await asyncio.wait({starting, asyncio.ensure_future(stop.wait())}, timeout=0.25,
                               return_when=asyncio.FIRST_COMPLETED)
            if stop_file is not None and stop_file.exists():
                stop_reason.append(stop_file.read_text().strip() or "stop requested")
                stop.set()
            if stop.is_set() and not starting.done():
                starting.cancel()
                await sup.stop()
                raise asyncio.CancelledError
        starting.result()
        publish("running")
        running = asyncio.ensure_future(sup.run())
        deadline = None if duration is None else t0 + duration
        while True:
            rows = publish("running")
            if running.done():
                running.result()  # raises SupervisorError when an actor could not be kept up
                break
            if all(r["state"] == "finished" for r in rows.values()):
                break
            if stop_file is not None and stop_file.exists() and not stop.is_set():
                stop_reason.append(stop_file.read_text().strip() or "stop requested")
                stop.set()
            if stop.is_set():
                outcome = stop_reason[0] if stop_reason else "stopped"
                break
            if deadline is not None and time.monotonic() >= deadline:
                outcome = f"stopped after --duration {duration:g} s"
                break
            await asyncio.wait({running, asyncio.ensure_future(stop.wait())}, timeout=0.25,
                               return_when=asyncio.FIRST_COMPLETED)
        await sup.stop()
    except asyncio.CancelledError:
        outcome = stop_reason[0] if stop_reason else "cancelled"
    except NotReadyError as exc:
        outcome, code = f"failed: actors not ready: {exc}", EXIT_FAILED
    except SupervisorError as exc:
        outcome, code = f"failed: {exc}", EXIT_FAILED
        await sup.stop()
    finally:
        rows = publish("failed" if code else "stopped")
        view.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    print(_summary(title, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
    return code


def run_local(plan: Plan, args: argparse.Namespace) -> int:
    """Every actor on this machine under one Supervisor."""
    import asyncio

    from tools.prepare import PrepareError, prepare

    if problems := busy_ports(plan):
        print(f"{plan.topology.source}: {len(problems)} problem(s)\n  " + "\n  ".join(problems), file=sys.stderr)
        return EXIT_INVALID
    try:
        # the run's plan is the one built from the prepared document (model.path at the warm start it made)
        plan = plan.with_experiment(prepare(plan.topology.experiment))
    except PrepareError as exc:
        print(f"{plan.topology.source}: experiment.{exc}", file=sys.stderr)
        return EXIT_INVALID
    except TopologyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    config = plan.topology.config
    run_dir = make_run_dir(plan, args.run_dir)
    specs = build_specs(plan, run_dir, record=args.record)
    write_plan(plan, run_dir, specs, args.overrides)
    print(f"run {plan.topology.name}: {len(specs)} actor(s), run directory {run_dir}", flush=True)
    if warning := insecure_bus_warning(plan):
        print(warning, flush=True)
    print("\n".join(evaluation_notes(plan)), flush=True)
    node_of = {i.name: i.host for i in plan.instances}
    total = config.run.total_steps
    code = asyncio.run(supervise(specs, run_dir, supervisor_options(plan, args), title=plan.topology.name,
                                 progress=not args.no_progress, duration=args.duration, node_of=node_of,
                                 training=TrainingProgress(run_dir, total)))
    if code == EXIT_OK and config.run.final_eval:
        final_evaluation(config, run_dir)
    return code


def final_evaluation(config: ExperimentConfig, run_dir: Path) -> dict[str, Any] | None:
    """Greedy held-out accuracy of the model the run started from and of its last checkpoint, side by
    side, per level; written to RUN_DIR/summary.json and RUN_DIR/eval.jsonl (read by tools.plot)."""
    from actors.dataset import resolve_data_path
    from actors.recovery import latest_checkpoint
    from tools.eval import evaluate_held_out
    from tools.lm import has_weights

    test = config.data.test
    found = latest_checkpoint(run_dir)
    if not test or not resolve_data_path(test).exists() or found is None:
        why = ("data.test is not set" if not test else f"data.test {test}: no such file" if
               not resolve_data_path(test).exists() else "the run wrote no checkpoint")
        print(f"no final evaluation: {why}", flush=True)
        return None
    step, ckpt = found
    models = {"start": config.model.path, "final": str(ckpt / "model")}
    reports = {name: evaluate_held_out(path, config) for name, path in models.items() if path and has_weights(path)}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    keys = sorted({k for r in reports.values() for k in r["by_level"]}, key=lambda k: (len(k), k))
    rows = [("model", "step", "overall", *[f"level {k}" for k in keys])]
    for name, r in reports.items():
        rows.append((name, str(step if name == "final" else 0), f"{100 * r['overall']['greedy_accuracy']:.1f}%",
                     *[f"{100 * r['by_level'][k]['greedy_accuracy']:.1f}%" if k in r["by_level"] else "" for k in keys]))
    summary = {"final_step": step, "start_model": models["start"], "final_model": models["final"],
               "greedy_accuracy": {n: r["overall"]["greedy_accuracy"] for n, r in reports.items()},
               "greedy_accuracy_by_level": {n: {k: v["greedy_accuracy"] for k, v in r["by_level"].items()}
                                            for n, r in reports.items()}}
    if metrics:
        wall = metrics[-1]["time"] - metrics[0]["time"] + metrics[0]["step_seconds"]
        summary.update(steps=len(metrics), wall_seconds=wall,
                       tokens_trained=sum(m["n_tokens"] for m in metrics),
                       effective_throughput=sum(m["n_tokens"] for m in metrics) / max(wall, 1e-9),
                       staleness_max=max(m["staleness_max"] for m in metrics))
    if "start" in reports and "final" in reports:
        summary["gain_points"] = 100 * (reports["final"]["overall"]["greedy_accuracy"]
                                        - reports["start"]["overall"]["greedy_accuracy"])
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    with open(run_dir / "eval.jsonl", "a") as f:
        for name, r in reports.items():
            entry = {"model": name, "step": step if name == "final" else 0,
                     "overall": r["overall"], "by_level": r["by_level"]}
            if metrics:  # on the metrics' clock, so tools.plot can place it on its time axis
                entry["time"] = metrics[-1]["time"] if name == "final" else metrics[0]["time"] - metrics[0]["step_seconds"]
            f.write(json.dumps(entry) + "\n")
    print(f"held-out greedy accuracy ({test}):")
    print("\n".join(_table(rows)))
    if "gain_points" in summary:
        print(f"RL gain over the start: {summary['gain_points']:+.1f} points; "
              f"{summary.get('steps', 0)} steps, {summary.get('tokens_trained', 0):.0f} tokens trained, "
              f"{summary.get('effective_throughput', 0):.0f} tok/s effective, max staleness "
              f"{summary.get('staleness_max', 0):.0f}", flush=True)
    return summary


def allocation_hosts() -> list[str]:
    """Host names of the current SLURM allocation, in SLURM node order."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return out.stdout.split()


def node_plan_path(run_dir: Path, host: str) -> Path:
    return run_dir / "nodes" / f"{host}.json"


def run_slurm(plan: Plan, args: argparse.Namespace) -> int:
    """Inside an allocation: one node agent per node through srun; each runs its node's actors under the
    Supervisor. The run directory must be on a file system every node sees (it holds the plans)."""
    try:
        plan = plan.with_hosts(allocation_hosts())
    except TopologyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    if short := allocation_shortfall(plan, os.environ):
        print(f"{plan.topology.source}: {short}", file=sys.stderr)
        return EXIT_INVALID
    run_dir = make_run_dir(plan, args.run_dir)
    specs = build_specs(plan, run_dir, record=args.record)
    write_plan(plan, run_dir, specs, args.overrides)
    by_name = {s["name"]: s for s in specs}
    hosts = [n.name for n in plan.topology.nodes]
    (run_dir / "nodes").mkdir(exist_ok=True)
    for node_idx, insts in plan.by_node().items():
        host = plan.topology.nodes[node_idx].name
        node_plan_path(run_dir, host).write_text(json.dumps({
            "host": host, "title": f"{plan.topology.name}@{host}", "supervisor": supervisor_options(plan, args),
            "specs": [by_name[i.name] for i in insts]}, indent=1))
    cmd = ["srun", f"-N{len(hosts)}", f"-n{len(hosts)}", "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}",
           *slurm_resources(plan), "--kill-on-bad-exit=1", f"--chdir={topo_mod.REPO_ROOT}", "--overlap",
           sys.executable, "-m", "tools.node_agent", str(run_dir)]
    print(f"run {plan.topology.name}: {len(specs)} actor(s) on {len(hosts)} node(s), run directory {run_dir}\n"
          f"  {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    if warning := insecure_bus_warning(plan):
        print(warning, flush=True)
    print("\n".join(evaluation_notes(plan)), flush=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(topo_mod.REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.monotonic()
    with open(run_dir / "srun.out", "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    view = ProgressView(plan.topology.name, not args.no_progress)
    node_of = {i.name: i.host for i in plan.instances}
    outcome = "finished"
    stopping = []

    stop_file = run_dir / "nodes" / "STOP"
    forced_at: list[float] = []

    def request_stop(reason: str) -> None:
        # srun answers SIGTERM by killing the step outright, so the clean way is a stop request on the
        # shared run directory that every node agent watches; srun is signalled only if that stalls.
        stopping.append(reason)
        stop_file.write_text(f"stopped by {reason}\n")
        forced_at.append(time.monotonic() + supervisor_options(plan, args)["stop_timeout"] + 15)

    def forward(signum: int, _frame: Any) -> None:
        if stopping:  # a second Ctrl-C: do not wait for the clean stop
            proc.send_signal(signal.SIGTERM)
        else:
            request_stop(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    deadline = None if args.duration is None else t0 + args.duration
    try:
        while proc.poll() is None:
            view.update(_slurm_rows(run_dir, hosts, node_of), time.monotonic() - t0)
            if deadline is not None and time.monotonic() >= deadline and not stopping:
                request_stop(f"--duration {args.duration:g} s")
            if forced_at and time.monotonic() > forced_at[0] and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                forced_at[0] = float("inf")
            try:
                proc.wait(timeout=0.25)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        rows = _slurm_rows(run_dir, hosts, node_of)
        view.close()
    code = proc.returncode
    failed = [h for h in hosts if _node_status(run_dir, h).get("state") == "failed"]
    if stopping:
        outcome = f"stopped by {stopping[0]}"
    if failed or (code != 0 and not stopping):
        reasons = "; ".join(_node_status(run_dir, h).get("reason", "") for h in failed)
        outcome = f"failed (srun exit {code}{', nodes ' + ', '.join(failed) if failed else ''})" + \
                  (f": {reasons}" if reasons.strip("; ") else f"; see {run_dir}/srun.out")
        print(_summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
        return EXIT_FAILED
    print(_summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
    return EXIT_OK


def _node_status(run_dir: Path, host: str) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "nodes" / f"{host}.status.json").read_text())
    except (OSError, ValueError):
        return {}


def _slurm_rows(run_dir: Path, hosts: list[str], node_of: dict[str, str]) -> dict[str, dict[str, Any]]:
    rows = {name: {"node": host, "state": "pending", "restarts": 0} for name, host in node_of.items()}
    for host in hosts:
        rows.update(_node_status(run_dir, host).get("actors", {}))
    return rows


def slurm_resources(plan: Plan) -> list[str]:
    """What each node's task needs, as srun and sbatch flags: every GPU and core of the node (the node agent
    places the actors on them itself) and all its memory. Without them a step gets one core and, where
    SLURM confines GPUs, no GPU at all."""
    node = plan.topology.nodes[0] if plan.topology.nodes else None
    flags = [f"--cpus-per-task={node.cpus if node else 1}", "--mem=0"]
    if node is not None and node.gpus:
        flags.append(f"--gpus-per-node={node.gpus}")
    return flags


def allocation_shortfall(plan: Plan, env: dict[str, str]) -> str | None:
    """Why this SLURM allocation cannot hold the topology's nodes (too few cores or GPUs per node), or None.
    A plain `salloc -N64` grants one core per node on many clusters; the step would then fail."""
    node = plan.topology.nodes[0] if plan.topology.nodes else None
    if node is None:
        return None
    cpus = int(env.get("SLURM_CPUS_ON_NODE") or 0)
    gpus = int(env.get("SLURM_GPUS_ON_NODE") or 0)
    if (cpus and cpus < node.cpus) or gpus < node.gpus:
        return (f"the allocation gives each node {cpus or '?'} core(s) and {gpus} GPU(s); the topology's nodes "
                f"have {node.cpus} and {node.gpus}: allocate whole nodes, e.g. `salloc -N{len(plan.topology.nodes)} "
                f"--exclusive{f' --gpus-per-node={node.gpus}' if node.gpus else ''}`, or use --sbatch")
    return None


def submit_sbatch(plan: Plan, args: argparse.Namespace) -> int:
    """Submit a batch job that reruns this launcher inside its own allocation."""
    run_dir = make_run_dir(plan, args.run_dir)
    n = len(plan.topology.nodes)
    argv = [sys.executable, "-m", "tools.up", str(Path(plan.topology.source).resolve()), *args.overrides,
            "--run-dir", str(run_dir), "--no-progress"]
    if args.ready_timeout is not None:
        argv += ["--ready-timeout", str(args.ready_timeout)]
    if args.duration is not None:
        argv += ["--duration", str(args.duration)]
    if args.record:
        argv.append("--record")
    script = run_dir / "sbatch.sh"
    script.write_text("\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={plan.topology.name}",
        f"#SBATCH --nodes={n}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",                      # the nodes are the run's alone
        *(f"#SBATCH {flag}" for flag in slurm_resources(plan)),
        f"#SBATCH --output={run_dir}/sbatch.out",
        f"cd {shlex.quote(str(topo_mod.REPO_ROOT))}",
        "exec " + " ".join(shlex.quote(a) for a in argv), ""]))
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        print(f"sbatch failed: {out.stderr.strip()}", file=sys.stderr)
        return EXIT_FAILED
    job = out.stdout.strip().split(";")[0]
    (run_dir / "slurm_job_id").write_text(job + "\n")
    print(f"submitted SLURM job {job} ({n} node(s)); output {run_dir}/sbatch.out", flush=True)
    if warning := insecure_bus_warning(plan):
        print(warning, flush=True)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.show_config:
            print(topo_mod.show_config(args.topology, args.overrides, check_imports=not args.no_import_check))
            return EXIT_OK
        plan = load_plan(args)
    except TopologyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    if args.dry_run:
        print(describe(plan, args.overrides))
        if problems := busy_ports(plan) + memory_problems(plan) + prepare_problems(plan):
            print(f"{plan.topology.source}: {len(problems)} problem(s)\n  " + "\n  ".join(problems), file=sys.stderr)
            return EXIT_INVALID
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
