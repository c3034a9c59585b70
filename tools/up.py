"""`python -m tools.up TOPOLOGY [key.sub=value ...] [--dry-run | --show-config]`: validate a topology and start the run.

* ``key.sub=value`` overrides a key of the topology file, or of the experiment config under ``experiment.``;
  the value is read as YAML and checked by the same models as the files (topology.loading describes the grammar).
* ``--show-config`` prints every key of the resolved configuration, one ``key = value  # source`` line each,
  the source being default, topology file, config file or override; then exits 0.

* ``--record`` turns message logs on for every actor (``RUN_DIR/msglog/<name>.msglog``, inbound and
  outbound, tensors stored) so that any actor can be replayed with ``tools.replay --into``.
* ``--dry-run`` prints the placement (node -> actors -> GPUs / cores / CPU workers), the bus endpoints,
  the NCCL/gloo group of every link and the command each node would run, then exits 0.
* One node and no SLURM allocation: every actor starts on this machine under ``actors.runtime.supervisor``.
* Several nodes: inside a SLURM allocation (``salloc``/``sbatch``) the launcher writes one plan file per
  node into the run directory and ``srun`` starts one ``tools.node_agent`` per node, which runs that
  node's actors under the same supervisor; ``--sbatch`` submits the allocation first. No SSH.

The run directory (``runs/<name>/<timestamp>`` unless ``--run-dir``) holds the plan, the ActorSpecs,
logs, message logs, metrics and checkpoints. Exit status: 0 clean end, 2 invalid topology or input, 1 failed
run (an actor that cannot be kept up, or a run that stopped making progress: tools/watchdog.py prints a
diagnosis), 128 + N for a training run stopped by signal N before its last step.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import importlib
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import topology as topo_mod
from actors.runtime.run import keep_files_private
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
    sources = {g: plan.topology.groups[g].settings.get("weights_from", "param_server") for g in evaluators}
    if evaluators and every > 0:
        on = {"rollouts": "answered greedily by the rollouts' own engines, the weights they hold then",
              "checkpoints": "on each complete checkpoint, with an engine of its own",
              "param_server": "on the versions the parameter server keeps for it (relay weights only)"}
        lines.append(f"  during the run: every {every} versions, {config.eval.max_problems} problems, in "
                     f"{', '.join(evaluators)}: " + "; ".join(on.get(w, w) for w in sorted(set(sources.values()))))
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
    lines.append("links (the process groups the code forms)" if plan.links else "links: none")
    servers = server_groups(plan)
    for link in plan.links.values():
        members = _ranges(link.members)
        if link.name in servers:
            lines.extend(servers[link.name].describe(link))
        else:
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
    lines.extend(_open_ports(plan, servers))
    lines.append("")
    lines.extend(_readiness(plan))
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
                     f"{shlex.quote(sys.executable)} -m actors.runtime.run RUN_DIR/specs/<actor>.json")
    else:
        lines.append(f"  srun -N{len(topo.nodes)} --ntasks-per-node=1 {' '.join(slurm_resources(plan))} "
                     f"--kill-on-bad-exit=1 {node_command(plan)}")
        for node_idx, insts in plan.by_node().items():
            lines.append(f"    on {topo.nodes[node_idx].name}: node agent -> supervisor -> {len(insts)} actor(s): "
                         f"{_ranges([i.name for i in insts]) or '-'}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ServerGroups:
    """A weights link whose rollouts' SGLang servers join the trainer's group themselves
    (actors/weight_sync/servers.py): what is formed instead of the link's own group. Each pipeline stage's
    sender hosts one group of `world` ranks (its rank 0; rollout i's server tp ranks follow at rank_offset),
    rendezvous at a free port of the sender's node picked at each formation."""

    hosts: list[str]          # each group's rank 0 (a stage's sender), in stage order
    host_nodes: list[str]
    rollouts: list[tuple[str, int]]   # (instance, tp ranks its server joins with), in rank order

    @property
    def world(self) -> int:
        return 1 + sum(tp for _, tp in self.rollouts)

    def describe(self, link: Any) -> list[str]:
        tps = sorted({tp for _, tp in self.rollouts})
        sizes = f"1 + {len(self.rollouts)} x {tps[0]}" if len(tps) == 1 else \
            "1 + " + " + ".join(str(tp) for _, tp in self.rollouts)
        first = self.rollouts[0]
        lines = [f"  {link.name}: the rollouts' SGLang servers join the trainer's {link.backend} weights group "
                 f"themselves (not the link's own group of {len(link.members)}):",
                 f"    {len(self.hosts)} group(s) of {sizes} = {self.world} ranks, rank 0 = "
                 f"{', '.join(self.hosts)}; {first[0]}'s server is rank{f's 1-{first[1]}' if first[1] > 1 else ' 1'}, the next follow "
                 f"(rank_offset = 1 + the tp of those before)",
                 f"    rendezvous: {', '.join(f'{h} on {n}' for h, n in zip(self.hosts, self.host_nodes))}, a free port "
                 f"picked at each formation; name {link.name}-g<epoch>" + ("-pp<stage>" if len(self.hosts) > 1 else ""),
                 f"    the link's port {link.port or 'auto'} is not used: no member receives on the link itself; "
                 f"timeout {link.timeout_s:g} s"]
        return lines


def server_groups(plan: Plan) -> dict[str, ServerGroups]:
    """Links whose rollouts receive through their SGLang servers, as the code decides it: the link's rank 0
    is a trainer and every other member is an SGLang rollout with weights_via_server (its server joins with
    `parallel.tp` ranks, model_runner's rank_offset + tp_rank)."""
    from topology.settings import RolloutSettings, TrainerSettings

    classes = group_classes(plan)
    by_name = {i.name: i for i in plan.instances}
    out = {}
    for link in plan.links.values():
        head, *rest = [by_name[m] for m in link.members]
        head_cfg = classes.get(head.group, (None, None))[1]
        cfgs = [classes.get(m.group, (None, None))[1] for m in rest]
        if not rest or not isinstance(head_cfg, TrainerSettings) or not all(
                isinstance(c, RolloutSettings) and c.engine == "sglang" and c.weights_via_server for c in cfgs):
            continue
        trainer = plan.topology.groups[head.group]
        pp = int(trainer.parallel.get("pp", 1))
        world = plan.worlds.get(head.group)
        senders = [world.members[k * len(world.members) // pp] for k in range(pp)] if world and pp > 1 else [head.name]
        out[link.name] = ServerGroups(senders, [by_name[n].host for n in senders],
                                      [(m.name, int(plan.topology.groups[m.group].parallel.get("tp", 1)))
                                       for m in rest])
    return out


def _ephemeral_range() -> str:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return f"{low}-{high} here"
    except (OSError, ValueError):
        return "the OS's"


def _open_ports(plan: Plan, servers: dict[str, ServerGroups]) -> list[str]:
    """The ports a multi-node run connects to across nodes, as the code opens them."""
    topo = plan.topology
    lines = ["ports the run connects to (a firewall between the nodes must let them through)"]
    if topo.bus.transport == "tcp":
        ports = [i.port for i in plan.instances if i.port]
        lines.append(f"  bus: tcp {min(ports)}-{max(ports)}, each actor's own port on its node "
                     f"({'CurveZMQ' if topo.bus.curve else 'no CurveZMQ'}), from every node")
    else:
        lines.append("  bus: ipc sockets in the run directory (one node)")
    for gname, world in plan.worlds.items():
        nodes = sorted({i.host for i in plan.instances if i.group == gname})
        lines.append(f"  {gname} world: {world.master_host}:{world.port or 'auto'} (rendezvous), from its "
                     f"{len(nodes)} node(s); then {world.backend}'s own connections between its {len(world.members)} "
                     f"ranks")
    ephemeral = _ephemeral_range()
    for link in plan.links.values():
        members = [i for i in plan.instances if i.name in link.members]
        nodes = sorted({i.host for i in members})
        if link.name in servers:
            group = servers[link.name]
            lines.append(f"  {link.name}: a free port on {', '.join(sorted(set(group.host_nodes)))} (rendezvous, picked "
                         f"at each formation in the ephemeral range, {ephemeral}), from every rollout node; then "
                         f"{link.backend}'s own connections between the {group.world} ranks"
                         + (" (bootstrap on NCCL_SOCKET_IFNAME, data over IB/RoCE)" if link.backend == "nccl" else ""))
        else:
            lines.append(f"  {link.name}: {link.master_host}:{link.port or 'auto'} (rendezvous), from "
                         f"{len(nodes)} node(s); then {link.backend}'s own connections")
    sglang = [g for g, (_, cfg) in group_classes(plan).items() if getattr(cfg, "engine", None) == "sglang"]
    for g in sglang:
        cfg = group_classes(plan)[g][1]
        where = cfg.sglang_url or f"{cfg.sglang.host}:{cfg.sglang.port or 'a free port'}"
        lines.append(f"  {g}'s SGLang servers: HTTP at {where}" + (", on each rollout's own node (not across nodes)"
                     if not cfg.sglang_url and cfg.sglang.host in ("127.0.0.1", "localhost") else ""))
    return lines


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


def group_classes(plan: Plan) -> dict[str, tuple[type, Any]]:
    """Group -> (its actor class, the settings its first instance will get, typed by that class)."""
    first: dict[str, dict[str, Any]] = {}
    for spec in plan.specs("RUN_DIR"):
        first.setdefault(spec["name"].split(".")[0], spec)
    out = {}
    for gname, group in plan.topology.groups.items():
        module, _, name = group.cls.partition(":")
        klass = getattr(importlib.import_module(module), name)
        if gname in first:
            out[gname] = (klass, read_settings(klass, first[gname]["settings"], first[gname]["name"]))
    return out


def engine_placements(plan: Plan) -> dict[str, dict[str, str]]:
    """Group -> where its engine runs (device, dtype, parallel layout, process-group backend), from the
    settings its first instance will get, by the actor class's own ``placement`` (the rule its engine is
    built by). Groups whose class drives no engine are left out."""
    return {g: klass.placement(cfg) for g, (klass, cfg) in group_classes(plan).items()
            if getattr(klass, "placement", None) is not None}


@dataclasses.dataclass(frozen=True)
class ReadyRule:
    """How long a group's instances may take to report ready (each from its first start), where that comes
    from, and how many must be ready for the run to start (the others join when they are)."""

    group: str
    count: int
    budget_s: float
    source: str
    needed: int

    @property
    def joins_late(self) -> bool:
        return self.needed < self.count


def ready_rules(plan: Plan, base_s: float) -> dict[str, ReadyRule]:
    """Every group's ReadyRule: `actors.<group>.ready_timeout_s` when set; else `base_s`
    (supervisor.ready_timeout) plus what its class starts (`ready_budget`: an SGLang rollout waits for its
    server's own start budget, sglang.health_timeout_s). The run needs `min_ready` instances, or all; a class
    of interchangeable workers (`joins_late`: the rollouts) half of them, rounded up."""
    out = {}
    for gname, (klass, cfg) in group_classes(plan).items():
        group = plan.topology.groups[gname]
        if group.ready_timeout_s is not None:
            budget, source = group.ready_timeout_s, f"actors.{gname}.ready_timeout_s"
        else:
            extra = klass.ready_budget(cfg) if getattr(klass, "ready_budget", None) is not None else None
            budget, source = (base_s, "supervisor.ready_timeout") if extra is None else \
                (base_s + extra[0], f"supervisor.ready_timeout {base_s:g} + {extra[1]} {extra[0]:g}")
        needed = group.min_ready if group.min_ready is not None else \
            math.ceil(group.count / 2) if getattr(klass, "joins_late", False) else group.count
        out[gname] = ReadyRule(gname, group.count, budget, source, needed)
    return out


def _readiness(plan: Plan) -> list[str]:
    rules = ready_rules(plan, SupervisorSection.model_validate(plan.topology.supervisor).ready_timeout)
    rows = [("group", "instances", "run starts with", "ready budget each", "from")]
    rows += [(g, str(r.count), f"{r.needed} (the rest join when ready)" if r.joins_late else "all",
              f"{r.budget_s:g} s", r.source) for g, r in rules.items()]
    return ["readiness (each budget counts from the instance's first start; a late one past it is reported, "
            "not waited for)", *_table(rows)]


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


class RunDirError(OSError):
    """The run directory cannot be made or used; the message names it and why."""


def inputs_ok(plan: Plan) -> bool:
    """Check what the run's actors will read (tools/inputs.py) before any starts: print the report, and each
    problem on a line of its own; False when there is one."""
    from tools.inputs import check_inputs

    lines, problems = check_inputs(plan, launch=True)
    if lines:
        print("inputs\n" + "\n".join(f"  {line}" for line in lines), flush=True)
    if problems:
        print(f"{plan.topology.source}: {len(problems)} problem(s)\n  " + "\n  ".join(problems), file=sys.stderr)
    return not problems


def checked_run_dir(plan: Plan, requested: str | None, inputs: bool = True) -> Path | None:
    """The run directory (`make_run_dir`), once what the run reads is checked (``inputs``: `inputs_ok`); None
    after printing why there is none."""
    if inputs and not inputs_ok(plan):
        return None
    try:
        return make_run_dir(plan, requested)
    except RunDirError as exc:
        print(f"{plan.topology.source}: {exc}", file=sys.stderr)
        return None


def make_run_dir(plan: Plan, requested: str | None) -> Path:
    """The requested directory; else, with `run.recover: auto`, the newest run of this topology that
    has a checkpoint but did not finish (it is resumed); else a new timestamped one. RunDirError when it
    cannot be made."""
    try:
        return _make_run_dir(plan, requested)
    except OSError as exc:
        where = exc.filename or requested or plan.topology.run_root
        raise RunDirError(f"the run directory cannot be made: {where}: {exc.strerror or exc}") from None


def _make_run_dir(plan: Plan, requested: str | None) -> Path:
    from actors.runtime.recovery import latest_checkpoint, recovering, resume_checkpoint, run_finished

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
    """Keyword arguments for actors.runtime.supervisor.Supervisor: the topology's `supervisor:` section over its defaults;
    --ready-timeout where the file does not say; every actor's ready budget and, for late-joining groups, how
    many instances the run needs (ready_rules)."""
    opts = SupervisorSection.model_validate(plan.topology.supervisor).model_dump()
    if args.ready_timeout is not None and "ready_timeout" not in plan.topology.supervisor:
        opts["ready_timeout"] = args.ready_timeout
    rules = ready_rules(plan, opts["ready_timeout"])
    opts["ready_budgets"] = {i.name: rules[i.group].budget_s for i in plan.instances}
    opts["late_joiners"] = {g: r.needed for g, r in rules.items() if r.joins_late}
    return opts


def node_supervisor_options(opts: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A node agent's share of `supervisor_options`: its own actors' budgets, and no number of late joiners
    of its own (the launcher counts them across the nodes: `quorum_problem`), so a node whose rollouts cannot
    come up never exits non-zero, which would make srun --kill-on-bad-exit stop every node."""
    return {**opts, "ready_budgets": {n: b for n, b in opts["ready_budgets"].items() if n in names},
            "late_joiners": {g: 0 for g in opts["late_joiners"]}}


# Seconds past a late-joining group's ready budget before the launcher says the group fell short.
QUORUM_GRACE_S = 30.0


def quorum_problem(rows: dict[str, dict[str, Any]], rules: dict[str, ReadyRule], elapsed: float,
                   reached: set[str]) -> str | None:
    """Why a multi-node run cannot go on (None: it can): a late-joining group whose instances never reached
    the number the run needs within their budget, or of which too many could not be kept up. `reached`:
    the groups that had their number ready once (updated here; a restart later is not a shortfall)."""
    from actors.runtime.supervisor import Supervisor

    for g, r in rules.items():
        if not r.joins_late:
            continue
        members = [row for name, row in rows.items() if Supervisor.group_of(name) == g]
        ready = sum(1 for row in members if row.get("state") in ("ready", "finished"))
        down = sum(1 for row in members if row.get("state") == "failed")
        if ready >= r.needed:
            reached.add(g)
        if r.count - down < r.needed:
            return (f"actors.{g}: {down} of {r.count} instances could not be kept up; the run needs {r.needed} "
                    f"(min_ready)")
        if g not in reached and elapsed > r.budget_s + QUORUM_GRACE_S:
            return (f"actors.{g}: {ready} of {r.count} instances ready after their ready budget ({r.budget_s:g} s: "
                    f"{r.source}); the run needs {r.needed} (min_ready)")
    return None


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
    bus = plan.topology.bus
    bus_ports = range(bus.base_port, bus.base_port + bus.port_range) if bus.transport == "tcp" else range(0)
    for link in [*plan.links.values(), *plan.worlds.values()]:
        if link.port == 0:  # `port: auto`: free now, and not one the actors' tcp bus will bind later
            host = topo_mod.resolve_host(link.master_host) if link.master_host else "127.0.0.1"
            for _ in range(100):
                if (port := free_port(host)) not in bus_ports:
                    break
            link.port = port
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
            # A relaunch of this run directory reuses the one its earlier launcher made (killed, it could
            # not remove it); run_local removes it at the end.
            ipc_dir = _recorded_ipc_dir(run_dir) or Path(tempfile.mkdtemp(prefix="areal-ipc-"))
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


def _recorded_ipc_dir(run_dir: Path) -> Path | None:
    """The bus's socket directory outside the run directory that a launcher of this run made (RUN_DIR/ipc_dir),
    if it is still there and this user's."""
    import tempfile
    try:
        path = Path((run_dir / "ipc_dir").read_text().strip())
        mine = path.stat().st_uid == os.getuid()
    except OSError:
        return None
    if mine and path.parent == Path(tempfile.gettempdir()) and path.name.startswith("areal-ipc-"):
        return path
    return None


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
        if child.given_up:
            state = "failed"        # a late joiner left down after its restart limit; the run goes on
        elif child.finished:
            state = "finished"
        elif child.ready:
            state = "ready"
        elif proc is not None and proc.returncode is not None:
            state = "restarting"
        elif child.late_reported:
            state = "late"          # past its ready budget, still starting
        else:
            state = "starting"
        rows[name] = {"node": node_of.get(name, ""), "state": state, "restarts": sup.restarts[name],
                      "pid": proc.pid if proc is not None and proc.returncode is None else None,
                      "exit": child.last_exit if child.last_exit is not None else ""}
    return rows


async def supervise(specs: list[dict[str, Any]], run_dir: Path, options: dict[str, Any], *, title: str,
                    progress: bool, duration: float | None, node_of: dict[str, str],
                    status_file: Path | None = None, stop_file: Path | None = None,
                    training: TrainingProgress | None = None, watchdog: Any = None,
                    finished: Callable[[], bool] | None = None) -> int:
    """Start actors under the Supervisor, show progress, stop on Ctrl-C/SIGTERM, on ``duration``, when
    ``stop_file`` appears (a multi-node launcher's stop request), when ``watchdog`` (tools/watchdog.py) finds
    the run stalled, or when every actor has finished by itself; print a summary. Returns the exit status:
    a stall fails the run, and a signal before ``finished()`` (the run's last step) exits 128 + its number."""
    import asyncio

    from actors.runtime.base import ActorSpec
    from actors.runtime.supervisor import NotReadyError, Supervisor, SupervisorError

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_reason: list[str] = []
    signalled: list[int] = []

    def on_signal(name: str) -> None:
        stop_reason.append(f"stopped by {name}")
        signalled.append(int(signal.Signals[name]))
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    from actors.runtime.recovery import run_finished
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
        if watchdog is not None:
            watchdog.local_pids = sup.pids
            watchdog.start()
        while True:
            rows = publish("running")
            if running.done():
                running.result()  # raises SupervisorError when an actor could not be kept up
                break
            if watchdog is not None and (diagnosis := watchdog.check()) is not None:
                print(diagnosis, flush=True)
                outcome, code = f"failed: {diagnosis.splitlines()[0]} (diagnosis above and in {run_dir}/stall.txt)", \
                    EXIT_FAILED
                break
            if all(r["state"] in ("finished", "failed") for r in rows.values()):
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
    if code == EXIT_OK and signalled and finished is not None and not finished():
        code = 128 + signalled[0]   # stopped before its last step: not a clean end
        outcome += f" before the run's last step (exit {code})"
    print(_summary(title, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
    return code


def trains_steps(plan: Plan) -> bool:
    """Whether the plan has a trainer, whose run.total_steps end the run (demo topologies have none)."""
    return any(group.actor_package == "actors.trainer" for group in plan.topology.groups.values())


def progress_watchdog(plan: Plan, run_dir: Path) -> Any:
    """The run's progress watchdog (tools/watchdog.py), set by the experiment's run.watchdog."""
    from tools.watchdog import ProgressWatchdog

    return ProgressWatchdog(run_dir, plan.topology.config.run.watchdog)


def run_local(plan: Plan, args: argparse.Namespace) -> int:
    """Every actor on this machine under one Supervisor."""
    import asyncio

    from actors.runtime.recovery import run_finished

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
    if (run_dir := checked_run_dir(plan, args.run_dir)) is None:
        return EXIT_INVALID
    specs = build_specs(plan, run_dir, record=args.record)
    write_plan(plan, run_dir, specs, args.overrides)
    print(f"run {plan.topology.name}: {len(specs)} actor(s), run directory {run_dir}", flush=True)
    if warning := insecure_bus_warning(plan):
        print(warning, flush=True)
    print("\n".join(evaluation_notes(plan)), flush=True)
    node_of = {i.name: i.host for i in plan.instances}
    total = config.run.total_steps
    trains = trains_steps(plan)
    code = asyncio.run(supervise(specs, run_dir, supervisor_options(plan, args), title=plan.topology.name,
                                 progress=not args.no_progress, duration=args.duration, node_of=node_of,
                                 training=TrainingProgress(run_dir, total),
                                 watchdog=progress_watchdog(plan, run_dir) if trains else None,
                                 finished=(lambda: run_finished(run_dir)) if trains else None))
    if (ipc_dir := _recorded_ipc_dir(run_dir)) is not None:
        import shutil
        shutil.rmtree(ipc_dir, ignore_errors=True)
    if code == EXIT_OK and config.eval.every_versions > 0 and evaluates_during_run(plan):
        catch_up_evaluations(config, run_dir)
    if code == EXIT_OK and config.run.final_eval:
        final_evaluation(config, run_dir)
    return code


def evaluates_during_run(plan: Plan) -> bool:
    """Whether the plan's evaluator can evaluate during the run: it has one, and the parameter server holds the
    weights (the relay: it sits in a link; with direct weights it holds none, and the evaluator idles), and the
    evaluator takes them from there (``weights_from: checkpoints`` evaluates checkpoints only, by design)."""
    groups = plan.topology.groups
    if any(g.settings.get("weights_from", "param_server") != "param_server"
           for g in groups.values() if g.cls.endswith(":EvalActor")):
        return False
    modules = {name: group.actor_package for name, group in groups.items()}
    servers = {i.name for i in plan.instances if modules.get(i.group) == "actors.param_server"}
    return ("actors.evaluator" in modules.values() and "actors.trainer" in modules.values()
            and any(servers & set(link.members) for link in plan.links.values()))


def catch_up_evaluations(config: ExperimentConfig, run_dir: Path) -> None:
    """The periodic evaluations the evaluator missed (it was away when the run ended, or fell behind): those
    whose weights are left on disk are evaluated here, the rest named as skipped in eval.jsonl."""
    from actors.evaluator.actor import catch_up
    from actors.runtime.recovery import FINISHED

    try:
        final = int(json.loads((run_dir / FINISHED).read_text())["step"])
    except (OSError, ValueError, KeyError):
        return
    caught, skipped = catch_up(config, run_dir, final)
    if caught or skipped:
        print(f"periodic evaluations the evaluator missed: {', '.join(map(str, caught)) or 'none'} evaluated from "
              f"their checkpoints now" + (f"; {', '.join(map(str, skipped))} skipped (their weights are no longer "
                                           f"kept)" if skipped else ""), flush=True)


def final_evaluation(config: ExperimentConfig, run_dir: Path) -> dict[str, Any] | None:
    """Greedy held-out accuracy of the model the run started from and of its last checkpoint, side by
    side, per level; written to RUN_DIR/summary.json and RUN_DIR/eval.jsonl (read by tools.plot)."""
    from actors.dataset import resolve_data_path
    from actors.runtime.recovery import latest_checkpoint
    from actors.trainer.metrics import trained_history
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
    metrics = trained_history([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                              if (run_dir / "metrics.jsonl").exists() else [])
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


def write_node_plans(plan: Plan, run_dir: Path, specs: list[dict[str, Any]], options: dict[str, Any]) -> list[str]:
    """RUN_DIR/nodes/<host>.json for every node, what its node agent runs; returns the hosts in node order."""
    by_name = {s["name"]: s for s in specs}
    (run_dir / "nodes").mkdir(exist_ok=True)
    for node_idx, insts in plan.by_node().items():
        host = plan.topology.nodes[node_idx].name
        node_plan_path(run_dir, host).write_text(json.dumps({
            "host": host, "title": f"{plan.topology.name}@{host}",
            "supervisor": node_supervisor_options(options, [i.name for i in insts]),
            "specs": [by_name[i.name] for i in insts]}, indent=1))
    return [n.name for n in plan.topology.nodes]


def run_slurm(plan: Plan, args: argparse.Namespace) -> int:
    """Inside an allocation: one node agent per node through srun; each runs its node's actors under the
    Supervisor. The run directory must be on a file system every node sees (it holds the plans, and the
    actors' status files the progress watchdog reads here)."""
    from actors.runtime.recovery import run_finished

    try:
        hosts = allocation_hosts()
        plan = plan.with_hosts(hosts)
    except TopologyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    allocation = read_allocation(dict(os.environ), hosts)
    if short := allocation_shortfall(plan, allocation):
        print(f"{plan.topology.source}: {short}", file=sys.stderr)
        return EXIT_INVALID
    node = plan.topology.nodes[0]
    if node.gpus and allocation.gpus is None:
        print(f"{plan.topology.source}: the allocation's GPUs could not be read ({allocation.source}); the "
              f"topology's nodes have {node.gpus} each", file=sys.stderr, flush=True)
    if (run_dir := checked_run_dir(plan, args.run_dir)) is None:
        return EXIT_INVALID
    specs = build_specs(plan, run_dir, record=args.record)
    write_plan(plan, run_dir, specs, args.overrides)
    options = supervisor_options(plan, args)
    hosts = write_node_plans(plan, run_dir, specs, options)
    rules = ready_rules(plan, options["ready_timeout"])
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

    signalled: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if stopping:  # a second Ctrl-C: do not wait for the clean stop
            proc.send_signal(signal.SIGTERM)
        else:
            signalled.append(signum)
            request_stop(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    deadline = None if args.duration is None else t0 + args.duration
    reached: set[str] = set()
    short: list[str] = []
    trains = trains_steps(plan)
    watchdog = progress_watchdog(plan, run_dir) if trains else None
    stalled: list[str] = []
    try:
        while proc.poll() is None:
            rows = _slurm_rows(run_dir, hosts, node_of)
            view.update(rows, time.monotonic() - t0)
            if not stopping and (problem := quorum_problem(rows, rules, time.monotonic() - t0, reached)):
                short.append(problem)
                print(f"{plan.topology.name}: {problem}; stopping the run", file=sys.stderr, flush=True)
                request_stop(problem)
            if watchdog is not None and not stopping:   # its clock starts once every node runs its actors
                if not watchdog.started and all(_node_status(run_dir, h).get("state") == "running"
                                                      for h in hosts):
                    watchdog.start()
                if (diagnosis := watchdog.check()) is not None:
                    print(diagnosis, flush=True)
                    stalled.append(diagnosis.splitlines()[0])
                    request_stop("the progress watchdog")
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
    if short:
        print(_summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, f"failed: {short[0]}"), flush=True)
        return EXIT_FAILED
    if stalled:
        outcome = f"failed: {stalled[0]} (diagnosis above and in {run_dir}/stall.txt)"
        print(_summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
        return EXIT_FAILED
    if failed or (code != 0 and not stopping):
        reasons = "; ".join(_node_status(run_dir, h).get("reason", "") for h in failed)
        outcome = f"failed (srun exit {code}{', nodes ' + ', '.join(failed) if failed else ''})" + \
                  (f": {reasons}" if reasons.strip("; ") else f"; see {run_dir}/srun.out")
        print(_summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
        return EXIT_FAILED
    if signalled and trains and not run_finished(run_dir):
        outcome += f" before the run's last step (exit {128 + signalled[0]})"
        print(_summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
        return 128 + signalled[0]
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


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The cores and GPUs a SLURM job holds on each of its nodes (None: not known), and where that was read."""

    cpus: dict[str, int] | None
    gpus: dict[str, int] | None
    source: str

    def least(self, what: str) -> int | None:
        per_node = self.cpus if what == "cpus" else self.gpus
        return min(per_node.values()) if per_node else None


def _count_ids(ids: str) -> int:
    """`0-23,48-71` -> 48."""
    total = 0
    for part in ids.split(","):
        lo, _, hi = part.partition("-")
        total += int(hi or lo) - int(lo) + 1
    return total


def _gres_gpus(gres: str) -> int:
    """GPUs in a GRES string of `scontrol show job -d`: `gpu:8(IDX:0-7)`, `gpu:a100:4(IDX:0-3),...`."""
    return sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:(,]+)?:(\d+)", gres))


def parse_job_details(text: str) -> Allocation:
    """The per-node lines of `scontrol show job -d JOB` (`Nodes=n[1-2] CPU_IDs=0-47 Mem=0 GRES=gpu:8(IDX:0-7)`)."""
    from topology.placement import expand_nodelist

    cpus: dict[str, int] = {}
    gpus: dict[str, int] = {}
    for m in re.finditer(r"^\s*Nodes=(\S+) CPU_IDs=(\S+)(?: Mem=\S+)?(?: GRES=(\S*))?", text, re.MULTILINE):
        for host in expand_nodelist(m.group(1)):
            cpus[host] = _count_ids(m.group(2))
            gpus[host] = _gres_gpus(m.group(3) or "")
    if not cpus:
        raise ValueError("no per-node lines (Nodes=... CPU_IDs=...)")
    return Allocation(cpus, gpus, "scontrol show job -d")


def allocation_from_env(env: dict[str, str], hosts: list[str]) -> Allocation:
    """What the environment says, for when the controller cannot be asked. Under salloc (whose command runs
    outside any step) SLURM_CPUS_ON_NODE and SLURM_GPUS_ON_NODE are unset; SLURM_JOB_CPUS_PER_NODE
    (`72(x2),36`) is set by salloc, sbatch and srun; GPUs show only as SLURM_GPUS_ON_NODE (a step's node),
    SLURM_GPUS_PER_NODE (when --gpus-per-node was asked for) or SLURM_JOB_GPUS (batch and interactive jobs)."""
    cpus: dict[str, int] | None = None
    if per_node := env.get("SLURM_JOB_CPUS_PER_NODE"):
        counts = []
        for part in per_node.split(","):
            m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if m:
                counts += [int(m.group(1))] * int(m.group(2) or 1)
        if len(counts) == len(hosts):
            cpus = dict(zip(hosts, counts))
    gpus_each = None
    if env.get("SLURM_GPUS_ON_NODE"):
        gpus_each = int(env["SLURM_GPUS_ON_NODE"])
    elif env.get("SLURM_GPUS_PER_NODE"):
        gpus_each = int(env["SLURM_GPUS_PER_NODE"].rpartition(":")[2])
    elif env.get("SLURM_JOB_GPUS"):
        gpus_each = len(env["SLURM_JOB_GPUS"].split(","))
    gpus = {h: gpus_each for h in hosts} if gpus_each is not None else None
    return Allocation(cpus, gpus, "the SLURM_* environment")


def read_allocation(env: dict[str, str], hosts: list[str]) -> Allocation:
    """The job's cores and GPUs per node, asked of the controller (`scontrol show job -d $SLURM_JOB_ID`), which
    answers alike under salloc, sbatch and srun; the environment only when it cannot be asked."""
    job = env.get("SLURM_JOB_ID", "")
    try:
        out = subprocess.run(["scontrol", "show", "job", "-d", job], capture_output=True, text=True, timeout=60,
                             env=dict(env))
        if out.returncode == 0:
            return parse_job_details(out.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    return allocation_from_env(env, hosts)


def allocation_shortfall(plan: Plan, allocation: Allocation) -> str | None:
    """Why this SLURM allocation cannot hold the topology's nodes (too few cores or GPUs on a node), or None.
    A plain `salloc -N64` grants one core per node on many clusters; the step would then fail. What the
    allocation does not say is not held against it."""
    node = plan.topology.nodes[0] if plan.topology.nodes else None
    if node is None:
        return None
    cpus, gpus = allocation.least("cpus"), allocation.least("gpus")
    if (cpus is not None and cpus < node.cpus) or (gpus is not None and gpus < node.gpus):
        return (f"the allocation gives a node {cpus if cpus is not None else '?'} core(s) and "
                f"{gpus if gpus is not None else '?'} GPU(s) ({allocation.source}); the topology's nodes have "
                f"{node.cpus} and {node.gpus}: allocate whole nodes, e.g. `salloc -N{len(plan.topology.nodes)} "
                f"--exclusive{f' --gpus-per-node={node.gpus}' if node.gpus else ''}`, or use --sbatch")
    return None


def submit_sbatch(plan: Plan, args: argparse.Namespace) -> int:
    """Submit a batch job that reruns this launcher inside its own allocation."""
    if (run_dir := checked_run_dir(plan, args.run_dir, inputs=False)) is None:
        return EXIT_INVALID
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
        from tools.inputs import check_inputs
        inputs, input_problems = check_inputs(plan, launch=False)
        print("\ninputs (a sample of each data file; tools/inputs.py)" + "".join(f"\n  {line}" for line in inputs))
        if problems := busy_ports(plan) + memory_problems(plan) + prepare_problems(plan) + input_problems:
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
