"""Validation and placement of a topology: the checks that need several sections (node names, core ids,
capacity per node, ports, links), and the assignment of actor instances to nodes, GPUs, CPU cores and ports.

``validate(doc)`` checks a topology document (its keys, types and bounds by the models of topology.schema,
the rest here) and returns a :class:`Topology`; ``place(topology)`` returns a :class:`Plan`: one
:class:`Instance` per actor process (node, GPUs, cores, bus endpoint) and one :class:`LinkPlan` per bulk link
(members in rank order, rendezvous address and port, the NCCL/gloo environment). The plan turns into ActorSpec
dictionaries with :meth:`Plan.specs`; ``tools/up.py`` prints or launches it (through launch/).
docs/topology.md has the schema.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import math
import re
import socket
from pathlib import Path
from typing import Any, Iterable, TypeVar

from pydantic import BaseModel, ValidationError

from topology.experiment import ExperimentConfig, experiment_problems
from topology.schema import (RESERVED_SETTINGS, BusSection, ClusterSection, GroupSection, LinkSection,
                             SupervisorSection, TopologyDocument, drain_budget_s, expert_tensor_parallel,
                             problem_lines)
from topology.settings import settings_model

REPO_ROOT = Path(__file__).resolve().parent.parent
SectionT = TypeVar("SectionT", bound=BaseModel)

__all__ = ["TopologyError", "Topology", "NodeSpec", "LinkSpec", "GroupSpec", "Instance", "LinkPlan", "Plan",
           "validate", "place", "expand_nodelist", "resolve_host"]


class TopologyError(ValueError):
    """A topology is invalid. ``problems`` holds one line per problem, each naming its key path."""

    def __init__(self, problems: list[str], source: str = "topology"):
        self.problems = list(problems)
        self.source = source
        super().__init__(f"{source}: {len(self.problems)} problem(s)\n" + "\n".join(f"  {p}" for p in self.problems))


@dataclasses.dataclass
class NodeSpec:
    name: str  # host name, or "#i" for a node that comes from the SLURM allocation
    gpus: int = 0
    gpu_kind: str | None = None
    gpu_memory_gb: float | None = None
    cpus: int = 1
    memory_gb: float | None = None
    nics: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class LinkSpec:
    name: str
    backend: str
    members: list[str]
    port: int
    gdr: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    timeout_s: float = 300.0


@dataclasses.dataclass
class GroupSpec:
    name: str
    cls: str
    count: int = 1
    nodes: list[int] = dataclasses.field(default_factory=list)  # indices into Topology.nodes
    per_node: int | None = None
    gpus: int = 0  # per instance
    cpus: list[list[int]] | None = None  # per instance core list (CPU affinity)
    threads: int | None = None
    cpu_workers: int = 0  # worker processes per instance (reward pools), counted against node cores
    parallel: dict[str, int] = dataclasses.field(default_factory=dict)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    world_port: int | None = None  # the instances form one torch.distributed world (0: a free port at launch)
    ready_timeout_s: float | None = None  # each instance's ready budget (None: the launcher derives it)
    min_ready: int | None = None          # instances the run needs ready to start (None: the class's rule)

    @property
    def actor_package(self) -> str:
        """The class path's module with a trailing ``.actor`` dropped: `actors.trainer:TrainerActor` and
        `actors.trainer.actor:TrainerActor` name the same actor, `actors.trainer`."""
        return self.cls.partition(":")[0].removesuffix(".actor")


@dataclasses.dataclass(frozen=True)
class Topology:
    """A validated topology. ``experiment`` is the experiment document as written (the actors' settings are
    merged from it); ``config`` is that document typed (its defaults filled in), built once when the topology
    is made. The topology keeps its own copy of the document, so the two always agree: a changed document
    (``tools.prepare``'s warm start) is a new plan (:meth:`Plan.with_experiment`), never an edit of this one."""
    name: str
    source: str
    nodes: list[NodeSpec]
    nodes_from_allocation: bool  # `cluster.nodes: N`: host names come from the SLURM allocation
    bus: BusSection  # curve resolved (on for tcp unless the file says otherwise)
    links: dict[str, LinkSpec]
    groups: dict[str, GroupSpec]
    experiment: dict[str, Any]
    config_path: str | None
    run_root: str
    description: str = ""
    supervisor: dict[str, Any] = dataclasses.field(default_factory=dict)  # Supervisor keyword arguments the file sets
    document: dict[str, Any] = dataclasses.field(default_factory=dict)  # after overrides
    config: ExperimentConfig = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        experiment = copy.deepcopy(self.experiment)
        object.__setattr__(self, "experiment", experiment)
        object.__setattr__(self, "config", ExperimentConfig.model_validate(experiment))


@dataclasses.dataclass
class Instance:
    name: str
    group: str
    index: int
    node: int
    host: str
    gpus: list[int]
    cpus: list[int]
    port: int | None
    endpoint: str
    env: dict[str, str]


@dataclasses.dataclass
class LinkPlan:
    name: str
    backend: str
    members: list[str]  # instance names in rank order; rank 0 hosts the rendezvous store
    master_host: str
    port: int
    env: dict[str, str]
    timeout_s: float


@dataclasses.dataclass
class Plan:
    topology: Topology
    instances: list[Instance]
    links: dict[str, LinkPlan]
    worlds: dict[str, LinkPlan] = dataclasses.field(default_factory=dict)  # by group: one rank per instance

    def by_node(self) -> dict[int, list[Instance]]:
        out: dict[int, list[Instance]] = {i: [] for i in range(len(self.topology.nodes))}
        for inst in self.instances:
            out[inst.node].append(inst)
        return out

    def group_members(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {g: [] for g in self.topology.groups}
        for inst in self.instances:
            out[inst.group].append(inst.name)
        return out

    def specs(self, run_dir: str | Path, curve: dict[str, Any] | None = None,
              tokens: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """One ActorSpec dictionary per instance (fields as in docs/architecture.md)."""
        topo, groups = self.topology, self.group_members()
        drain_s = drain_budget_s(SupervisorSection.model_validate(topo.supervisor).stop_timeout)
        peers = {inst.name: inst.endpoint for inst in self.instances}
        out = []
        for inst in self.instances:
            group = topo.groups[inst.group]
            settings = _deep_merge(copy.deepcopy(topo.experiment), copy.deepcopy(group.settings))
            settings["instance"] = {
                "group": inst.group, "index": inst.index, "count": group.count, "node": inst.host,
                "address": resolve_host(inst.host), "node_index": inst.node, "gpus": inst.gpus, "cpus": inst.cpus, "cpu_workers": group.cpu_workers,
                "parallel": dict(group.parallel),
            }
            settings["groups"] = groups
            settings["drain_timeout"] = drain_s
            settings["links"] = {name: self.link_config(name, inst) for name, link in self.links.items()
                                 if inst.name in link.members}
            env = dict(inst.env)
            world = self.worlds.get(inst.group)
            if world is not None:
                # torchrun's variables: the engine joins with env://. LOCAL_RANK 0: CUDA_VISIBLE_DEVICES
                # already narrows each instance to its own GPU.
                settings["instance"]["world"] = {"master_addr": resolve_host(world.master_host),
                                                 "master_port": world.port, "rank": inst.index,
                                                 "world_size": len(world.members)}
                env.update(world.env, MASTER_ADDR=resolve_host(world.master_host), MASTER_PORT=str(world.port),
                           RANK=str(inst.index), WORLD_SIZE=str(len(world.members)), LOCAL_RANK="0")
            out.append({
                "name": inst.name, "cls": group.cls, "endpoint": inst.endpoint,
                "peers": {n: e for n, e in peers.items() if n != inst.name}, "settings": settings,
                "run_dir": str(run_dir), "curve": curve, "env": env, "tokens": tokens,
            })
        return out

    def link_config(self, link_name: str, inst: Instance) -> dict[str, Any]:
        """The transport.bulk.LinkConfig dictionary for one member of a link."""
        link = self.links[link_name]
        return {"name": link.name, "backend": link.backend, "master_addr": resolve_host(link.master_host),
                "master_port": link.port, "rank": link.members.index(inst.name), "world_size": len(link.members),
                "members": list(link.members), "bind_addr": _bind_addr(inst.host), "timeout_s": link.timeout_s,
                "env": dict(link.env)}

    def with_hosts(self, hosts: list[str]) -> "Plan":
        """Fill in host names from a SLURM allocation (``hosts[i]`` is node i). A topology that names
        its hosts must find every one of them in the allocation."""
        topo = self.topology
        if topo.nodes_from_allocation:
            if len(hosts) < len(topo.nodes):
                raise TopologyError([f"cluster.nodes: topology needs {len(topo.nodes)} nodes but the allocation "
                                     f"has {len(hosts)} ({', '.join(hosts)})"], topo.source)
            names = hosts[: len(topo.nodes)]
        else:
            missing = [n.name for n in topo.nodes if n.name not in hosts]
            if missing:
                raise TopologyError([f"cluster.nodes: {', '.join(missing)} not in the allocation "
                                     f"({', '.join(hosts)})"], topo.source)
            names = [n.name for n in topo.nodes]
        new_topo = dataclasses.replace(topo, nodes=[dataclasses.replace(n, name=h) for n, h in zip(topo.nodes, names)],
                                       nodes_from_allocation=False)
        return place(new_topo)

    def with_experiment(self, experiment: dict[str, Any]) -> "Plan":
        """This plan with another experiment document (``tools.prepare``'s result): a new plan whose typed
        config is built from it; this one is left as it was."""
        problems = experiment_problems(experiment)
        if problems:
            raise TopologyError(problems, self.topology.source)
        return place(dataclasses.replace(self.topology, experiment=experiment))


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------

class _Checker:
    """Collects problems while reading typed values out of the document."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def add(self, key: str, msg: str) -> None:
        self.problems.append(f"{key}: {msg}")

    def int_(self, value: Any, key: str, default: int | None = None, minimum: int = 0) -> int | None:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.add(key, f"expected an integer, got {value!r}")
            return default
        if value < minimum:
            self.add(key, f"must be >= {minimum}, got {value}")
            return default
        return value

    def env(self, value: Any, key: str) -> dict[str, str]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.add(key, f"expected a mapping of environment variables, got {type(value).__name__}")
            return {}
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                self.add(f"{key}.{k}", "not a valid environment variable name")
            elif isinstance(v, (dict, list)) or v is None:
                self.add(f"{key}.{k}", f"expected a scalar value, got {v!r}")
            else:
                out[k] = str(v).lower() if isinstance(v, bool) else str(v)
        return out


def _closest(word: str, options: Iterable[str]) -> str | None:
    hits = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return hits[0] if hits else None


def expand_nodelist(pattern: str) -> list[str]:
    """Expand a SLURM node list such as ``node[001-003,7],gpu-a[1-2]`` (zero padding kept)."""
    out, depth, start = [], 0, 0
    parts = []
    for i, ch in enumerate(pattern):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
    parts.append(pattern[start:])
    for part in (p.strip() for p in parts):
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", part)
        if not m:
            if not part or "[" in part or "]" in part:
                raise ValueError(f"bad node list {pattern!r}")
            out.append(part)
            continue
        head, ranges, tail = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"bad range {r!r} in node list {pattern!r}")
            width = len(lo)
            for n in range(int(lo), int(hi or lo) + 1):
                out.append(f"{head}{n:0{width}d}{tail}")
    return out


def validate(doc: dict[str, Any], *, source: str = "topology", experiment: dict[str, Any] | None = None,
             config_path: str | None = None, check_imports: bool = True,
             prior_problems: Iterable[str] = ()) -> Topology:
    """Check a topology document and build a :class:`Topology`; raise TopologyError with every problem.

    The schema (topology.schema) checks every key's name, type and bounds in one pass; each section that passes
    is then read here for what needs other sections (node names, core ids, capacity, ports, links), so a typo in
    one group does not hide a capacity problem in another."""
    c = _Checker()
    c.problems.extend(prior_problems)
    c.problems.extend(experiment_problems(experiment or {}))
    if not isinstance(doc, dict):
        raise TopologyError(c.problems + [f"top level: expected a mapping, got {type(doc).__name__}"], source)
    try:
        TopologyDocument.model_validate(doc)
    except ValidationError as exc:
        c.problems.extend(problem_lines(exc, "", TopologyDocument))
    top = _section(TopologyDocument, {k: v for k, v in doc.items() if k in ("name", "description", "run_root")}
                   | {"cluster": {}, "actors": {}})
    name = top.name or Path(source).stem
    supervisor = _section(SupervisorSection, doc.get("supervisor"))
    cluster = _section(ClusterSection, doc.get("cluster"))
    template = NodeSpec(name="", gpus=cluster.node.gpus, gpu_kind=cluster.node.gpu_kind,
                        gpu_memory_gb=cluster.node.gpu_memory_gb, cpus=cluster.node.cpus,
                        memory_gb=cluster.node.memory_gb, nics=cluster.node.nics.model_dump(exclude_none=True))
    raw_nodes = cluster.nodes
    from_alloc = False
    if isinstance(raw_nodes, bool):
        c.add("cluster.nodes", f"expected a count, a node list pattern or a list of host names, got {raw_nodes!r}")
        names = ["localhost"]
    elif isinstance(raw_nodes, int):
        if raw_nodes < 1:
            c.add("cluster.nodes", f"must be >= 1, got {raw_nodes}")
        n = max(raw_nodes, 1)
        from_alloc = n > 1
        names = ["localhost"] if n == 1 else [f"#{i}" for i in range(n)]
    elif isinstance(raw_nodes, str):
        try:
            names = expand_nodelist(raw_nodes)
        except ValueError as exc:
            c.add("cluster.nodes", str(exc))
            names = ["localhost"]
    elif isinstance(raw_nodes, list) and raw_nodes and all(isinstance(x, str) for x in raw_nodes):
        names = list(raw_nodes)
    else:
        c.add("cluster.nodes", f"expected a count, a node list pattern or a list of host names, got {raw_nodes!r}")
        names = ["localhost"]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        c.add("cluster.nodes", f"duplicate host name(s) {', '.join(dupes)}")
    nodes = [dataclasses.replace(template, name=n, nics=dict(template.nics)) for n in names]

    bus = _section(BusSection, doc.get("bus"))
    bus = bus.model_copy(update={"curve": _bus_curve(c, bus)})
    if bus.base_port + bus.port_range - 1 > 65535:
        c.add("bus.port_range", f"ports {bus.base_port}-{bus.base_port + bus.port_range - 1} go past 65535")
    if bus.transport == "ipc" and len(nodes) > 1:
        c.add("bus.transport", f"ipc works on one node only; the cluster has {len(nodes)} (use tcp)")

    # actor groups
    groups: dict[str, GroupSpec] = {}
    actors = doc.get("actors")
    if not isinstance(actors, dict) or not actors:
        if not any(p.startswith("actors:") for p in c.problems):
            c.add("actors", "missing or empty: name at least one actor group")
        actors = {}
    for gname, gdoc in actors.items():
        key = f"actors.{gname}"
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", str(gname)):
            c.add(key, "group names are letters, digits and underscores, starting with a letter")
        try:
            g = GroupSection.model_validate(gdoc)
        except ValidationError:
            continue  # reported by the schema pass above
        group = GroupSpec(
            name=str(gname), cls=g.class_, count=g.count,
            nodes=_node_selection(c, g.nodes, f"{key}.nodes", names), per_node=g.per_node, gpus=g.gpus,
            cpus=_cpu_lists(c, g.cpus, f"{key}.cpus", g.count, template.cpus), threads=g.threads,
            cpu_workers=g.cpu_workers, parallel=g.parallel.model_dump(exclude_none=True), settings=dict(g.settings),
            env=c.env(g.env, f"{key}.env"), ready_timeout_s=g.ready_timeout_s, min_ready=g.min_ready)
        if g.min_ready is not None and g.min_ready > g.count:
            c.add(f"{key}.min_ready", f"{g.min_ready} instances cannot be ready: the group has {g.count} (count)")
        if g.world_port is not None:
            group.world_port = _rendezvous_port(c, g.world_port, f"{key}.world_port")
            if group.gpus > 1:
                c.add(f"{key}.world_port", f"a world has one rank per instance, and each instance has {group.gpus} "
                                           f"GPUs: use gpus: 1 and count: ranks")
        for reserved in RESERVED_SETTINGS:
            if reserved in group.settings:
                c.add(f"{key}.settings.{reserved}", "reserved: the launcher fills it in")
        groups[str(gname)] = group
        if check_imports:
            actor_cls = _check_class(c, group.cls, f"{key}.class")
            if actor_cls is not None:
                _check_settings(c, actor_cls, group.settings, f"{key}.settings")
        elif not re.fullmatch(r"[\w.]+:\w+", group.cls):
            c.add(f"{key}.class", f"expected module.path:ClassName, got {group.cls!r}")
        _check_parallel(c, group, key, template)

    # links
    links: dict[str, LinkSpec] = {}
    links_doc = doc.get("links") or {}
    for lname, ldoc in (links_doc.items() if isinstance(links_doc, dict) else ()):
        key = f"links.{lname}"
        try:
            spec = LinkSection.model_validate(ldoc)
        except ValidationError:
            continue  # reported by the schema pass above
        port = _rendezvous_port(c, spec.port, f"{key}.port")
        link = LinkSpec(name=str(lname), backend=spec.backend, members=list(spec.members), port=port or 0,
                        gdr=spec.gdr, env=c.env(spec.env, f"{key}.env"), timeout_s=spec.timeout_s)
        if link.gdr and link.backend == "gloo":
            c.add(f"{key}.gdr", "GPUDirect RDMA needs backend nccl")
        if link.gdr and link.backend == "nccl" and not template.nics.get("ib"):
            c.add(f"{key}.gdr", "GPUDirect RDMA needs InfiniBand/RoCE HCAs in cluster.node.nics.ib")
        links[str(lname)] = link

    if c.problems:
        raise TopologyError(c.problems, source)
    topo = Topology(name=name, source=source, nodes=nodes, nodes_from_allocation=from_alloc, bus=bus, links=links,
                    groups=groups, experiment=experiment or {}, config_path=config_path, run_root=top.run_root,
                    description=top.description, supervisor=supervisor.model_dump(exclude_unset=True), document=doc)
    _check_placement(c, topo)
    if c.problems:
        raise TopologyError(c.problems, source)
    return topo


def _bus_curve(c: _Checker, bus: BusSection) -> bool:
    """Whether the bus runs CurveZMQ: always on tcp, unless the topology opts out with bus.insecure_tcp (a bare
    `curve: false` would leave the ports open to every user of the machine without anyone having said so)."""
    if bus.transport != "tcp":
        if bus.insecure_tcp:
            c.add("bus.insecure_tcp", f"is for a tcp bus; this bus is {bus.transport} (remove the key)")
        return bool(bus.curve)
    if bus.insecure_tcp:
        if bus.curve:
            c.add("bus.insecure_tcp", "contradicts bus.curve: true (remove one of them)")
        return False
    if bus.curve is False:
        c.add("bus.curve", "false is refused on a tcp bus: any user who can reach its ports could command the run. "
                           "CurveZMQ stays on unless you set bus.insecure_tcp: true")
    return True


def _section(model: type[SectionT], value: Any) -> SectionT:
    """The section as its model, or the model's defaults when it has problems (the schema pass reported them)."""
    try:
        return model.model_validate(value if value is not None else {})
    except ValidationError:
        return model.model_construct()


def _check_settings(c: _Checker, actor_cls: type, settings: dict[str, Any], key: str) -> None:
    """A group's settings against its actor class's Settings model (the reserved keys are reported apart)."""
    model = settings_model(actor_cls)
    try:
        model.model_validate({k: v for k, v in settings.items() if k not in RESERVED_SETTINGS})
    except ValidationError as exc:
        c.problems.extend(problem_lines(exc, key, model))


def _rendezvous_port(c: _Checker, value: Any, key: str) -> int | None:
    """A link's or a world's rendezvous port. "auto" (0): the launcher picks a free port at launch (one-node
    topologies only: other nodes could not know it), so two runs on one machine never fight over one."""
    if value == "auto":
        return 0
    port = c.int_(value, key, None, minimum=1024)
    if port is not None and port > 65535:
        c.add(key, f"{port} is not a port")
    return port


def _node_selection(c: _Checker, value: Any, key: str, names: list[str]) -> list[int]:
    """Group `nodes:` -> node indices. Accepts node indices, "a-b" index ranges, host names, or a
    node list pattern; default is every node."""
    if value is None:
        return list(range(len(names)))
    items = value if isinstance(value, list) else [value]
    out: list[int] = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]" if isinstance(value, list) else key
        if isinstance(item, bool):
            c.add(where, f"expected a node index, range or host name, got {item!r}")
        elif isinstance(item, int):
            if 0 <= item < len(names):
                out.append(item)
            else:
                c.add(where, f"node index {item} out of range (cluster has {len(names)} nodes: 0-{len(names) - 1})")
        elif isinstance(item, str) and re.fullmatch(r"\d+-\d+", item):
            lo, hi = map(int, item.split("-"))
            if not (0 <= lo <= hi < len(names)):
                c.add(where, f"node range {item} out of range (cluster has {len(names)} nodes: 0-{len(names) - 1})")
            else:
                out.extend(range(lo, hi + 1))
        elif isinstance(item, str):
            try:
                hosts = expand_nodelist(item)
            except ValueError as exc:
                c.add(where, str(exc))
                continue
            for h in hosts:
                if h in names:
                    out.append(names.index(h))
                else:
                    c.add(where, f"host {h!r} is not in cluster.nodes")
        else:
            c.add(where, f"expected a node index, range or host name, got {item!r}")
    if len(set(out)) != len(out):
        c.add(key, "a node is listed twice")
    return list(dict.fromkeys(out))


def _cpu_lists(c: _Checker, value: Any, key: str, count: int, node_cpus: int) -> list[list[int]] | None:
    """`cpus: [0, 1]` (every instance on cores 0 and 1) or `cpus: [[0], [1]]` (one list per instance)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value:
        c.add(key, f"expected a list of core ids or one list per instance, got {value!r}")
        return None
    per_instance = all(isinstance(v, list) for v in value)
    lists = value if per_instance else [value]
    if per_instance and len(lists) != count:
        c.add(key, f"{len(lists)} per-instance core lists for {count} instances")
        return None
    out = []
    for i, cores in enumerate(lists):
        where = f"{key}[{i}]" if per_instance else key
        if not cores or not all(isinstance(x, int) and not isinstance(x, bool) for x in cores):
            c.add(where, f"expected a non-empty list of core ids, got {cores!r}")
            return None
        bad = [x for x in cores if not 0 <= x < node_cpus]
        if bad:
            c.add(where, f"core(s) {bad} do not exist (nodes have {node_cpus} cores: 0-{node_cpus - 1})")
        out.append(list(cores))
    return out if per_instance else out * count


def _check_class(c: _Checker, cls: str, key: str) -> type | None:
    """Import the actor class; None (and a problem) when it does not import or is not an Actor."""
    if not re.fullmatch(r"[\w.]+:\w+", cls):
        c.add(key, f"expected module.path:ClassName, got {cls!r}")
        return None
    module_name, _, attr = cls.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure is the user's to see, in one line
        c.add(key, f"cannot import {module_name}: {type(exc).__name__}: {exc}")
        return None
    obj = getattr(module, attr, None)
    if obj is None:
        c.add(key, f"{module_name} has no attribute {attr!r}")
        return None
    # By name, not by importing actors.runtime.base: this package sits below actors in the import direction.
    if not (isinstance(obj, type) and any(f"{k.__module__}:{k.__qualname__}" == "actors.runtime.base:Actor" for k in obj.__mro__)):
        c.add(key, f"{cls} is not an Actor subclass")
        return None
    return obj


def _check_parallel(c: _Checker, group: GroupSpec, key: str, node: NodeSpec) -> None:
    par = group.parallel
    if not par:
        return
    on_gpus = group.gpus > 0
    total = group.count * group.gpus if on_gpus else group.count
    unit = "GPUs assigned" if on_gpus else "instances (no GPUs)"
    if {"dp", "tp", "pp"} <= set(par):
        product = par["dp"] * par["tp"] * par["pp"]
        if product != total:
            c.add(f"{key}.parallel", f"dp*tp*pp = {product} but {total} {unit}")
    for pk in ("dp", "tp", "pp"):
        if pk in par and total % par[pk]:
            c.add(f"{key}.parallel.{pk}", f"{par[pk]} does not divide the {total} {unit}")
    tp, pp, ep = par.get("tp", 1), par.get("pp", 1), par.get("ep", 1)
    etp = expert_tensor_parallel(tp, ep, par.get("etp"))
    if etp not in (1, tp):
        c.add(f"{key}.parallel.etp", f"{etp} is neither 1 (experts whole on each rank) nor tp = {tp} (experts split "
                                     f"as the dense layers)")
    ranks = (par.get("dp") or total // (tp * pp)) * tp * pp
    if ranks % (ep * etp * pp):
        c.add(f"{key}.parallel.ep", f"ep x etp x pp = {ep} x {etp} x {pp} does not divide the {ranks} ranks (each "
                                    f"expert-parallel group of ep x etp ranks is repeated over the expert data-parallel "
                                    f"ranks)")
    if on_gpus and group.gpus > 1 and group.gpus % tp and tp % group.gpus:
        c.add(f"{key}.parallel.tp", f"{tp} does not divide the {group.gpus} GPUs per instance")
    if on_gpus and node.gpus and tp > node.gpus:
        c.add(f"{key}.parallel.tp", f"{tp} is larger than the {node.gpus} GPUs of a node (tensor parallelism "
                                    f"stays inside a node's NVLink)")
    elif on_gpus and node.gpus and node.gpus % tp:
        c.add(f"{key}.parallel.tp", f"{tp} does not divide the {node.gpus} GPUs of a node")


def _check_placement(c: _Checker, topo: Topology) -> None:
    """Checks that need every section: capacity per node, ports, links."""
    plan_nodes = _assign_nodes(c, topo)
    # (group key, node capacity, what it is called, the unit of the capacity)
    for key, capacity, what, unit in (("gpus", "gpus", "GPUs", ""), ("cpu_workers", "cpus", "CPU workers", " cores")):
        use: dict[int, dict[str, int]] = {}
        for gname, assignment in plan_nodes.items():
            per_instance = getattr(topo.groups[gname], key)
            for node in assignment if per_instance else ():
                use.setdefault(node, {}).setdefault(gname, 0)
                use[node][gname] += per_instance
        for node, by_group in sorted(use.items()):
            have, total = getattr(topo.nodes[node], capacity), sum(by_group.values())
            if total > have:
                detail = ", ".join(f"{g}: {n}" for g, n in by_group.items())
                c.add(f"actors.{list(by_group)[-1]}.{key}", f"{what} over-subscribed on node {topo.nodes[node].name}: "
                                                          f"{total} requested ({detail}) but it has {have}{unit}")
    # ports: the bus takes one port per instance from its range; link ports must stay clear of it
    n_instances = sum(g.count for g in topo.groups.values())
    bus = topo.bus
    if bus.transport == "tcp" and n_instances > bus.port_range:
        c.add("bus.port_range", f"{n_instances} actor instances need {n_instances} ports but the range has "
                                f"{bus.port_range}")
    bus_lo, bus_hi = bus.base_port, bus.base_port + bus.port_range - 1
    rendezvous: list[tuple[str, str, int, int | None]] = []   # (key, owner, port, node of rank 0)
    for link in topo.links.values():
        key = f"links.{link.name}"
        members, complete = [], True
        for i, m in enumerate(link.members):
            gname, _, idx = m.partition(".")
            complete = complete and gname in topo.groups
            if gname not in topo.groups:
                hint = _closest(gname, topo.groups)
                c.add(f"{key}.members[{i}]", f"no actor group {gname!r}"
                                             f"{f' (did you mean {hint!r}?)' if hint else ''}")
                continue
            g = topo.groups[gname]
            if idx:
                if not idx.isdigit() or int(idx) >= g.count:
                    c.add(f"{key}.members[{i}]", f"{m!r}: group {gname} has instances 0-{g.count - 1}")
                    continue
                members.append((gname, int(idx)))
            else:
                members.extend((gname, j) for j in range(g.count))
        if len(set(members)) != len(members):
            c.add(f"{key}.members", "an instance is listed twice")
        if len(members) < 2 and complete:
            c.add(f"{key}.members", f"a link needs at least 2 instances, got {len(members)}")
        if link.backend == "nccl":
            for gname in dict.fromkeys(g for g, _ in members):
                if topo.groups[gname].gpus == 0:
                    c.add(f"{key}.backend", f"nccl needs GPUs but member group {gname} has none (use gloo)")
        master_node = plan_nodes.get(members[0][0], [None] * (members[0][1] + 1))[members[0][1]] if members else None
        rendezvous.append((f"{key}.port", key, link.port, master_node))
    for gname, g in topo.groups.items():   # a group's world: rendezvous at its instance 0, like a link
        if g.world_port is not None:
            key = f"actors.{gname}.world_port"
            rendezvous.append((key, key, g.world_port, plan_nodes.get(gname, [None])[0]))
    used: dict[tuple[int, int], str] = {}
    for key, owner, port, node in rendezvous:
        if port == 0 and len(topo.nodes) > 1:
            c.add(key, "auto needs a one-node topology: every node must know the rendezvous port")
        if bus.transport == "tcp" and bus_lo <= port <= bus_hi:
            c.add(key, f"{port} collides with the bus ports {bus_lo}-{bus_hi}")
        if node is not None and port:
            if (node, port) in used:
                c.add(key, f"{port} is already the rendezvous port of {used[(node, port)]} on the same node")
            used[(node, port)] = owner
    # one process takes its NCCL settings from its environment: two links may not disagree on one
    env_of: dict[str, dict[str, tuple[str, str]]] = {}
    for link in topo.links.values():
        env = _link_env(topo, link)
        for gname in {m.partition(".")[0] for m in link.members if m.partition(".")[0] in topo.groups}:
            seen = env_of.setdefault(gname, {})
            for k, v in env.items():
                if k in seen and seen[k][0] != v:
                    c.add(f"links.{link.name}.env.{k}", f"{v!r} conflicts with {seen[k][0]!r} from "
                                                        f"links.{seen[k][1]} for group {gname}")
                seen.setdefault(k, (v, link.name))


def _assign_nodes(c: _Checker | None, topo: Topology) -> dict[str, list[int]]:
    """Node index of every instance of every group: blocks of `per_node` instances, in node order."""
    out = {}
    for gname, g in topo.groups.items():
        nodes = g.nodes or list(range(len(topo.nodes)))
        per_node = g.per_node or math.ceil(g.count / len(nodes))
        if per_node * len(nodes) < g.count:
            if c is not None:
                c.add(f"actors.{gname}.per_node", f"{per_node} per node on {len(nodes)} node(s) holds "
                                                  f"{per_node * len(nodes)} instances, count is {g.count}")
            per_node = math.ceil(g.count / len(nodes))
        out[gname] = [nodes[i // per_node] for i in range(g.count)]
    return out


def _link_env(topo: Topology, link: LinkSpec) -> dict[str, str]:
    """The environment a link implies, then the link's own `env:` on top."""
    nics = topo.nodes[0].nics if topo.nodes else {}
    env: dict[str, str] = {}
    if link.backend == "nccl":
        if nics.get("ib"):
            env["NCCL_IB_HCA"] = ",".join(nics["ib"])
        if nics.get("socket"):
            env["NCCL_SOCKET_IFNAME"] = nics["socket"]
        # PHB: use GPUDirect RDMA when GPU and NIC share a PCIe host bridge; LOC: never
        env["NCCL_NET_GDR_LEVEL"] = "PHB" if link.gdr else "LOC"
        if link.gdr:
            env["NCCL_NET_GDR_READ"] = "1"
    elif nics.get("socket"):
        env["GLOO_SOCKET_IFNAME"] = nics["socket"]
    env.update(link.env)
    return env


# ---------------------------------------------------------------------------------------------
# placement
# ---------------------------------------------------------------------------------------------

def resolve_host(host: str) -> str:
    """An address for a host name (fake SLURM nodes resolve through /etc/hosts); names that do not
    resolve here (a cluster seen from a laptop's dry run) stay names."""
    if host.startswith("#"):
        return host
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _bind_addr(host: str) -> str:
    addr = resolve_host(host)
    return addr if re.fullmatch(r"[\d.]+", addr) else ""


def place(topo: Topology) -> Plan:
    """Assign every instance a node, GPU ids, cores and a bus endpoint; build each link's plan."""
    node_of = _assign_nodes(None, topo)
    next_gpu = {i: 0 for i in range(len(topo.nodes))}
    single_node = len(topo.nodes) == 1
    instances, port = [], topo.bus.base_port
    for gname, g in topo.groups.items():
        for i in range(g.count):
            node = node_of[gname][i]
            name = gname if g.count == 1 else f"{gname}.{i}"
            gpus = list(range(next_gpu[node], next_gpu[node] + g.gpus))
            next_gpu[node] += g.gpus
            cpus = g.cpus[i] if g.cpus else []
            host = topo.nodes[node].name
            if topo.bus.transport == "ipc":
                endpoint, inst_port = f"ipc://{{ipc_dir}}/{name}", None
            else:
                addr = topo.bus.host or ("127.0.0.1" if single_node and host == "localhost" else resolve_host(host))
                endpoint, inst_port = f"tcp://{addr}:{port}", port
                port += 1
            env = {"OMP_NUM_THREADS": str(g.threads or (len(cpus) if cpus else 1))}
            if topo.nodes[node].nics.get("socket"):
                # Every gloo group of the process (the trainer's control groups, Megatron's CPU groups) and
                # NCCL's bootstrap talk over the node's socket NIC, not whichever interface comes first.
                env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = topo.nodes[node].nics["socket"]
            if cpus:
                env["AREAL_CPU_AFFINITY"] = ",".join(map(str, cpus))
            if topo.nodes[node].gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))  # "" keeps CPU actors off the GPUs
            env.update(g.env)
            instances.append(Instance(name=name, group=gname, index=i, node=node, host=host, gpus=gpus, cpus=cpus,
                                      port=inst_port, endpoint=endpoint, env=env))
    by_group: dict[str, list[Instance]] = {}
    for inst in instances:
        by_group.setdefault(inst.group, []).append(inst)
    links = {}
    for link in topo.links.values():
        members: list[Instance] = []
        for m in link.members:
            gname, _, idx = m.partition(".")
            members.extend(by_group[gname] if not idx else [by_group[gname][int(idx)]])
        env = _link_env(topo, link)
        for inst in members:
            inst.env.update(env)
        links[link.name] = LinkPlan(name=link.name, backend=link.backend, members=[m.name for m in members],
                                    master_host=members[0].host, port=link.port, env=env, timeout_s=link.timeout_s)
    worlds = {}
    for gname, g in topo.groups.items():
        if g.world_port is None:
            continue
        members = by_group[gname]
        spec = LinkSpec(name=f"{gname}.world", backend="nccl" if g.gpus else "gloo", members=[gname],
                        port=g.world_port, gdr=g.gpus > 0 and bool(topo.nodes[members[0].node].nics.get("ib")))
        env = _link_env(topo, spec)
        # NCCL reads its variables once per process, and every rank of a world must agree: what a link gives
        # some of the world's ranks (trainer.0 in the weights link: NCCL_IB_GID_INDEX, NCCL_IB_TC) every
        # rank gets. The validator has already refused links that disagree on one group.
        names = {m.name for m in members}
        for link_plan in links.values():
            if names & set(link_plan.members):
                env.update({k: v for k, v in link_plan.env.items() if k.startswith("NCCL_")})
        worlds[gname] = LinkPlan(name=spec.name, backend=spec.backend, members=[m.name for m in members],
                                 master_host=members[0].host, port=g.world_port, env=env, timeout_s=spec.timeout_s)
    return Plan(topology=topo, instances=instances, links=links, worlds=worlds)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = v
    return base
