"""The dry run's report (`describe`): placement, bus endpoints, links and the process groups the code forms,
the ports a firewall must pass, readiness, engines, evaluation, memory per GPU and each node's command, with
consecutive nodes that hold the same actors shown once (`node_blocks`; every node with --full). The launch
writes the same report to RUN_DIR/plan.txt; `busy_ports` is checked before a launch too."""
from __future__ import annotations

import dataclasses
import shlex
import socket
import sys
from pathlib import Path
from typing import Any, Sequence

from launch.readiness import group_classes, ready_rules
from launch.slurm import slurm_resources
from topology import Plan
from topology.schema import SupervisorSection


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
        how = (f"greedy and {config.eval.samples} sampled answers a problem" if config.eval.samples
               else "greedy only (eval.samples 0)")
        lines.append(f"  at the end: the start model and the last checkpoint, {how} "
                     "(tools.eval; SGLang servers on a machine with a GPU and SGLang, else the embedded engine)")
    else:
        lines.append("  at the end: none: run.final_eval is false")
    return lines


def describe(plan: Plan, overrides: Sequence[str], full: bool = False) -> str:
    """The dry-run report: placement table, bus endpoints, links and per-node commands. Consecutive nodes that
    hold the same actors (the same groups, counts, GPUs and cores, instance numbers continuing) are shown once
    with their count; ``full`` lists every node."""
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
    blocks = node_blocks(plan, full)
    for block in blocks:
        node, insts = topo.nodes[block.nodes[0]], plan.by_node()[block.nodes[0]]
        used = sum(len(i.gpus) for i in insts)
        workers = sum(topo.groups[i.group].cpu_workers for i in insts)
        label = f"{block.label(plan)} [{used}/{node.gpus} gpu, {workers}/{node.cpus} cpu_workers" \
                + (" each]" if len(block.nodes) > 1 else "]")
        if not insts:
            rows.append((label, "-", "", "", "", "", ""))
        for k, row in enumerate(block.rows):
            rows.append((label if k == 0 else "", row["name"], row["cls"], row["gpus"], row["cpus"],
                         row["threads"], row["workers"]))
    lines.extend(table_lines(rows))
    if len(blocks) < len(topo.nodes):
        lines.append(f"  ({len(topo.nodes)} nodes in {len(blocks)} rows: consecutive nodes holding the same actors "
                     f"are shown once; --full lists every node)")
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
    from launch.plan.sizing import memory_report   # the actor classes it reads load torch: only when asked

    lines.extend(memory_report(plan))
    lines.append("")
    lines.append("commands")
    if len(topo.nodes) == 1 and not topo.nodes_from_allocation:
        forked = SupervisorSection.model_validate(plan.topology.supervisor).fork_start
        lines.append(f"  local: supervisor on this machine starts {len(plan.instances)} process(es): "
                     f"{shlex.quote(sys.executable)} -m actors.runtime.run RUN_DIR/specs/<actor>.json"
                     + (", each forked from one start template (-m actors.runtime.template) that imported "
                        "torch once" if forked else ""))
    else:
        lines.append(f"  srun -N{len(topo.nodes)} --ntasks-per-node=1 {' '.join(slurm_resources(plan))} "
                     f"--kill-on-bad-exit=1 {node_command(plan)}")
        for block in node_blocks(plan, full):
            insts = plan.by_node()[block.nodes[0]]
            if len(block.nodes) == 1:
                lines.append(f"    on {block.label(plan)}: node agent -> supervisor -> {len(insts)} actor(s): "
                             f"{_ranges([i.name for i in insts]) or '-'}")
            else:
                lines.append(f"    on {block.label(plan)}: node agent -> supervisor -> {len(insts)} actor(s) each: "
                             + ", ".join(row["name"] for row in block.rows))
    return "\n".join(lines)


@dataclasses.dataclass
class NodeBlock:
    """Consecutive nodes shown as one: their indices and the placement rows (`_compress`) they share, the
    names spanning from the first node's first instance to the last node's last."""

    nodes: list[int]
    rows: list[dict[str, Any]]

    def label(self, plan: Plan) -> str:
        first, last = plan.topology.nodes[self.nodes[0]].name, plan.topology.nodes[self.nodes[-1]].name
        return first if len(self.nodes) == 1 else f"{first} .. {last} (x{len(self.nodes)})"


def _same_shape(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """b's rows hold what a's do, and each of b's instance numbers continues a's."""
    shape = ("group", "count", "cls", "gpus", "cpus", "threads", "workers")
    return len(a) == len(b) and all(
        [x[k] for k in shape] == [y[k] for k in shape] and y["first_index"] == x["last_index"] + 1
        for x, y in zip(a, b))


def node_blocks(plan: Plan, full: bool = False) -> list[NodeBlock]:
    """The placement's nodes in order, consecutive nodes of the same shape (`_same_shape`) in one block
    (``full``: a block per node)."""
    blocks: list[NodeBlock] = []
    last_rows: list[dict[str, Any]] = []
    for node_idx, insts in plan.by_node().items():
        rows = _compress(plan, insts)
        if not full and blocks and rows and _same_shape(last_rows, rows):
            block = blocks[-1]
            block.nodes.append(node_idx)
            for shown, row in zip(block.rows, rows):
                first = shown["name"].split(" .. ")[0]
                shown["name"] = f"{first} .. {row['last']} ({row['count']} per node)"
        else:
            blocks.append(NodeBlock([node_idx], [dict(row) for row in rows]))
        last_rows = rows
    return blocks


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


def engine_placements(plan: Plan) -> dict[str, dict[str, str]]:
    """Group -> where its engine runs (device, dtype, parallel layout, process-group backend), from the
    settings its first instance will get, by the actor class's own ``placement`` (the rule its engine is
    built by). Groups whose class drives no engine are left out."""
    return {g: klass.placement(cfg) for g, (klass, cfg) in group_classes(plan).items()
            if getattr(klass, "placement", None) is not None}


def _readiness(plan: Plan) -> list[str]:
    rules = ready_rules(plan, SupervisorSection.model_validate(plan.topology.supervisor).ready_timeout)
    rows = [("group", "instances", "run starts with", "ready budget each", "from")]
    rows += [(g, str(r.count), f"{r.needed} (the rest join when ready)" if r.joins_late else "all",
              f"{r.budget_s:g} s", r.source) for g, r in rules.items()]
    return ["readiness (each budget counts from the instance's first start; a late one past it is reported, "
            "not waited for)", *table_lines(rows)]


def _engines(plan: Plan) -> list[str]:
    placements = engine_placements(plan)
    if not placements:
        return ["engines: none"]
    rows = [("group", "engine", "device", "dtype", "parallel", "memory", "process group")]
    rows += [(g, p["engine"], p["device"], p["dtype"], p["parallel"], p["memory"], p["process_group"])
             for g, p in placements.items()]
    return ["engines", *table_lines(rows)]


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
                     "workers": str(group.cpu_workers * len(run)) if group.cpu_workers else "-",
                     "group": first.group, "count": len(run), "last": run[-1].name,
                     "first_index": _index(first.name), "last_index": _index(run[-1].name)})
    return rows


def _index(name: str) -> int:
    """rollout.12 -> 12; a single instance (buffer) -> 0."""
    tail = name.rpartition(".")[2]
    return int(tail) if tail.isdigit() else 0


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


def table_lines(rows: list[tuple]) -> list[str]:
    """Rows as aligned text columns, indented two spaces (the first row is the header)."""
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    return ["  " + "  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
