"""The rehearsal: scale the topology, launch it on fake nodes through the node agents, inject a fault, read what
the real actors wrote, simulate the same run, and compare (tools/rehearse/__init__.py says what is real).

Scaling. S scales the rollout nodes (their per-node fan-out is kept: rollouts and reward actors per node), the
training GPUs and the batch (prompts per step), so every server and every trainer replica sees the load it
sees at full size. The simulation is of that scaled topology as written (trainer world, tensor-parallel
servers); the launch differs where a CPU cannot stand in: the trainer world is its leading rank alone (the
actor that talks to the buffer and the weights path; its modelled step is the whole world's), each server is
one process (the modelled step is its tensor-parallel GPUs'), a reward actor has one grading worker, and
links run over gloo.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Any, Sequence

from launch.plan import sizing
from tools.plan import setup, sim
from tools.rehearse.costs import RehearsalCosts
from tools.rehearse.trainer import COST_FILE
import topology as topo_mod
from topology import Plan, TopologyError

FAULTS = ("none", "kill-node", "straggler", "no-server")
EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
REQUIRED_GROUPS = ("rollout", "reward", "trainer", "buffer", "param_server")
WARMUP_STEPS = 1           # as the simulation's Result: the first step is warm-up
FIRST_NODE_ADDRESS = 11    # fake node i binds 127.0.0.(11 + i)


# ---------------------------------------------------------------------------------------------------------
# scaling
# ---------------------------------------------------------------------------------------------------------

def parse_scale(text: str) -> float:
    """'1/16', '0.0625' -> 0.0625 (a fraction of the topology's fan-out, in (0, 1])."""
    try:
        value = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"--scale {text!r}: a fraction such as 1/16 or 0.0625") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--scale {text!r}: must be in (0, 1]")
    return value


@dataclasses.dataclass(frozen=True)
class Layout:
    """The scaled fan-out: what the simulation models and what the launch starts."""

    rollout_nodes: int
    rollouts_per_node: int
    rewards_per_node: int
    trainer_gpus: int
    trainer_parallel: dict[str, int]
    gpus_per_node: int
    batch_size: int
    #: the topology's other groups (an evaluator): placed on the buffer's node
    others: tuple[str, ...] = ()

    @property
    def rollouts(self) -> int:
        return self.rollout_nodes * self.rollouts_per_node

    @property
    def rewards(self) -> int:
        return self.rollout_nodes * self.rewards_per_node

    @property
    def trainer_nodes(self) -> int:
        return -(-self.trainer_gpus // self.gpus_per_node)


def scaled_layout(plan: Plan, scale: float) -> Layout:
    topo = plan.topology
    missing = [g for g in REQUIRED_GROUPS if g not in topo.groups]
    if missing:
        raise ValueError(f"{topo.source}: the rehearsal needs actor groups {', '.join(REQUIRED_GROUPS)}; "
                         f"missing {', '.join(missing)}")
    nodes_of = {g: sorted({i.node for i in plan.instances if i.group == g}) for g in ("rollout", "reward")}
    if nodes_of["reward"] != nodes_of["rollout"]:
        raise ValueError(f"{topo.source}: the rehearsal scales reward actors with the rollout nodes they share; "
                         f"rollouts are on nodes {nodes_of['rollout']}, rewards on {nodes_of['reward']}")
    n_nodes = len(nodes_of["rollout"])
    rollout, reward, trainer = topo.groups["rollout"], topo.groups["reward"], topo.groups["trainer"]
    par = {k: int(trainer.parallel.get(k, 1)) for k in ("tp", "pp")}
    replica = par["tp"] * par["pp"]
    full_gpus = trainer.count * max(trainer.gpus, 1)
    gpus = max(replica, round(full_gpus * scale / replica) * replica)
    node_gpus = topo.nodes[0].gpus if topo.nodes else 8
    return Layout(rollout_nodes=max(1, round(n_nodes * scale)), rollouts_per_node=rollout.count // n_nodes,
                  rewards_per_node=max(1, reward.count // n_nodes), trainer_gpus=gpus,
                  trainer_parallel={"dp": gpus // replica, **par}, gpus_per_node=node_gpus or 8,
                  batch_size=max(1, round(topo.config.algo.batch_size * scale)),
                  others=tuple(g for g in topo.groups if g not in REQUIRED_GROUPS))


def _yaml(value: Any) -> str:
    return json.dumps(value)   # JSON is YAML: the overrides' values are read as YAML


def simulated_overrides(layout: Layout, max_new_tokens: int) -> list[str]:
    """The scaled topology as the simulation reads it (the full topology's groups, fewer of them)."""
    r, t = layout.rollout_nodes, layout.trainer_nodes
    return [f"cluster.nodes={r + t}",
            f"actors.rollout.count={layout.rollouts}", f"actors.rollout.nodes={_yaml(f'0-{r - 1}')}",
            f"actors.reward.count={layout.rewards}", f"actors.reward.nodes={_yaml(f'0-{r - 1}')}",
            f"actors.trainer.count={layout.trainer_gpus}", f"actors.trainer.nodes={_yaml(f'{r}-{r + t - 1}')}",
            f"actors.trainer.parallel={_yaml(layout.trainer_parallel)}",
            f"actors.buffer.nodes=[{r}]", f"actors.param_server.nodes=[{r}]",
            *(f"actors.{g}.nodes=[{r}]" for g in layout.others),
            f"experiment.algo.batch_size={layout.batch_size}",
            f"experiment.gen.max_new_tokens={max_new_tokens}"]


@dataclasses.dataclass(frozen=True)
class Assets:
    model_dir: Path
    train_data: Path


def launched_overrides(layout: Layout, plan: Plan, costs: RehearsalCosts, assets: Assets, run_dir: Path,
                       steps: int, base_port: int, health_timeout_s: float) -> list[str]:
    """The scaled topology as it is launched here: the simulated one with the stand-ins and the scales."""
    r, k, ts = layout.rollout_nodes, costs.token_scale, costs.time_scale
    exp = plan.topology.config
    server = [sys.executable, "-m", "tools.rehearse.server", "--rehearsal", str(run_dir / COST_FILE)]
    gen = exp.gen
    out = simulated_overrides(layout, costs.sim.max_new_tokens) + [
        f"cluster.nodes={r + 1}",
        "cluster.node.nics={}",   # the fake nodes' one interface is the loopback's
        f"bus.base_port={base_port}",
        # the trainer world's leading rank, on CPU, with the modelled step
        "actors.trainer.count=1", "actors.trainer.gpus=0", f"actors.trainer.nodes=[{r}]",
        'actors.trainer.parallel={"dp": 1, "tp": 1, "pp": 1}', "actors.trainer.world_port=null",
        "actors.trainer.threads=1", "actors.trainer.class=tools.rehearse.trainer:CostModelTrainer",
        'actors.trainer.settings={"backend": "torch", "sequence_parallel": false, "recompute": "none", '
        '"logprob_chunk_tokens": 0}',
        # one process per server, serving the modelled steps
        "actors.rollout.gpus=1", 'actors.rollout.parallel={"tp": 1}', "actors.rollout.threads=1",
        f"actors.rollout.settings.sglang.command={_yaml(server)}",
        'actors.rollout.settings.sglang.extra_args=["--no-weights-hash"]',
        f"actors.rollout.settings.sglang.health_timeout_s={health_timeout_s}",
        "actors.rollout.settings.sglang.backoff_s=0.5",
        "actors.reward.cpu_workers=1", "actors.buffer.threads=1", "actors.param_server.threads=1",
    ]
    for i, name in enumerate(plan.topology.links):   # rendezvous ports just below the bus's range
        out += [f"links.{name}.backend=gloo", f"links.{name}.gdr=false", f"links.{name}.env={{}}",
                f"links.{name}.port={base_port - 10 - i}", f"links.{name}.timeout_s=120"]
    out += [
        f"experiment.model.path={_yaml(str(assets.model_dir))}", 'experiment.model.dtype="float32"',
        f"experiment.data.train={_yaml(str(assets.train_data))}", "experiment.data.test=null",
        "experiment.data.prompt_template=null", f"experiment.data.max_prompt_tokens={exp_prompt_cap(exp, k)}",
        f"experiment.gen.max_new_tokens={costs.sim.max_new_tokens // k}",
        # the buffer's clock rules in the run's time and tokens (timeouts come out 1/time_scale as long)
        f"experiment.gen.assumed_tokens_per_s={gen.assumed_tokens_per_s * ts / k}",
        f"experiment.gen.timeout_floor_s={gen.timeout_floor_s / ts}",
        f"experiment.run.total_steps={steps}", f"experiment.run.checkpoint_every_steps={10 * steps}",
        "experiment.run.checkpoint_every_s=null",
        "experiment.run.recover=off", "experiment.run.final_eval=false", "experiment.eval.every_versions=0",
    ]
    if exp.buffer.group_timeout_s is not None:
        out.append(f"experiment.buffer.group_timeout_s={exp.buffer.group_timeout_s / ts}")
    return out


def exp_prompt_cap(exp: Any, k: int) -> int:
    cap = exp.data.max_prompt_tokens or (exp.gen.max_new_tokens // 31)   # 1k of a 32k context, when unset
    return max(8, cap // k)


# ---------------------------------------------------------------------------------------------------------
# what the run wrote
# ---------------------------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue   # a line still being written
    return out


def measured_figures(metrics: list[dict[str, Any]], ledger: list[dict[str, Any]], *, time_scale: float,
                     token_scale: int, prompt_tokens: int, warmup: int = WARMUP_STEPS) -> dict[str, float]:
    """`sim.Result.figures()` of the rehearsed run, in the modelled run's seconds and tokens, from the trainer's
    metrics.jsonl and the buffer's ledger, over the steps after `warmup` (the simulation's window: from the end
    of the last warm-up step to the end of the last step)."""
    rows = sorted(metrics, key=lambda m: m["step"])
    if len(rows) <= warmup:
        raise ValueError(f"the run trained {len(rows)} step(s); the figures need more than {warmup}")
    first, measured = rows[warmup - 1], rows[warmup:]
    window = (measured[-1]["time"] - first["time"]) * time_scale
    tokens = sum(m["n_tokens"] * token_scale + m["n_seqs"] * prompt_tokens for m in measured)
    steps = {m["step"] for m in measured}
    stale = [rec["version"] - s for rec in ledger if rec.get("event") == "batch" and rec["step"] in steps
             for s in rec["start_versions"]]
    reissued = lambda m: m.get("reissued", 0) + m.get("dropped_stale", 0)   # noqa: E731
    n = len(measured)
    busy = [m["rollout_utilisation"] for m in measured if "rollout_utilisation" in m]
    return {"step_time_s": window / n,
            "effective_throughput_tok_s": tokens / window,
            "trainer_wait_share": sum(m["wait_seconds"] for m in measured) / sum(m["step_seconds"] for m in measured),
            "rollout_busy_share": sum(busy) / len(busy) if busy else float("nan"),
            "staleness_mean": sum(max(0, s) for s in stale) / len(stale) if stale else 0.0,
            "reissued_per_step": (reissued(measured[-1]) - reissued(first)) / n,
            "dropped_stale_per_step": (measured[-1].get("dropped_stale", 0) - first.get("dropped_stale", 0)) / n}


def time_shares(metrics: list[dict[str, Any]], servers: dict[str, list[dict[str, Any]]],
                warmup: int = WARMUP_STEPS) -> dict[str, dict[str, float]]:
    """The rehearsal's time shares per group over the measured steps: the trainer's from its metrics, the
    servers' from their modelled clocks (every server process's snapshots at the window's ends)."""
    rows = sorted(metrics, key=lambda m: m["step"])
    measured = rows[warmup:]
    span = sum(m["step_seconds"] for m in measured) or 1.0
    trainer = {"train": sum(m["train_seconds"] for m in measured) / span,
               "weights": sum(m["weight_sync_seconds"] for m in measured) / span,
               "wait_batch": sum(m["wait_seconds"] for m in measured) / span}
    a, b = rows[warmup - 1]["time"], measured[-1]["time"]
    spent: Counter[str] = Counter()
    total = 0.0
    for snaps in servers.values():
        inside = [s for s in snaps if a <= s["time"] <= b]
        if len(inside) < 2:
            continue
        first, last = inside[0], inside[-1]
        total += last["modelled_s"] - first["modelled_s"]
        for k in ("decode", "prefill", "paused"):
            spent[k] += last["seconds"][k] - first["seconds"][k]
    roll = {k: spent[k] / total if total else float("nan") for k in ("decode", "prefill", "paused")}
    roll["idle"] = max(0.0, 1 - sum(roll.values())) if total else float("nan")
    return {"trainer": trainer, "rollout": roll}


def server_stats(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every server process's snapshots (a restarted server is a new process: a file of its own)."""
    return {path.stem: read_jsonl(path) for path in sorted((run_dir / "servers").glob("*.jsonl"))}


def decisions(run_dir: Path, metrics: list[dict[str, Any]], servers: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The decisions' counters as the actors counted them: the buffer's (re-issues, stale drops, overdue groups
    and their aborts, from its metrics and log), the servers' (aborted requests, retractions, groups held)."""
    buffer_log = read_jsonl(run_dir / "logs" / "buffer.jsonl")
    events = Counter(e.get("event") for e in buffer_log)
    last = max(metrics, key=lambda m: m["step"]) if metrics else {}
    by_server: dict[int, dict[str, Any]] = {}
    for s in (snaps[-1] for snaps in servers.values() if snaps):   # a server's processes (restarts) add up
        b = by_server.setdefault(s["index"], {"processes": 0, "aborted": 0, "retractions": 0, "groups_mean": 0.0,
                                              "groups_max": 0, "answers": 0})
        b["processes"] += 1
        b["aborted"] += s["aborted"]
        b["answers"] += s["answers"]
        b["retractions"] += s["device"]["retractions"]
        b["groups_mean"] = max(b["groups_mean"], s["groups_mean"])
        b["groups_max"] = max(b["groups_max"], s["groups_max"])
    means = [b["groups_mean"] for b in by_server.values()]
    return {"reissued": last.get("reissued", 0) + last.get("dropped_stale", 0), "handed_back": last.get("reissued", 0),
            "dropped_stale": last.get("dropped_stale", 0), "overdue_groups": events.get("group_overdue", 0),
            "aborted_requests": sum(b["aborted"] for b in by_server.values()),
            "retractions": sum(b["retractions"] for b in by_server.values()),
            "groups_per_server": {"mean": sum(means) / len(means) if means else 0.0,
                                  "max": max((b["groups_max"] for b in by_server.values()), default=0)},
            "per_server": {str(i): b for i, b in sorted(by_server.items())}}


def trainer_wait(metrics: list[dict[str, Any]], served: list[dict[str, Any]],
                 warmup: int = WARMUP_STEPS) -> dict[str, float]:
    """Where the trainer's wait for its batches went over the measured steps, in real seconds a step: the
    trainer's own count (`wait_s`), and the buffer's (its `batch_served` lines): waiting for groups still to
    come, and serving (converting, writing the served copy). The rest is the request and the reply on the bus
    and in the two actors' queues. `served`: the buffer's lines of the measured steps (`batches_served`)."""
    steps = measured_steps(metrics, warmup)
    n = max(1, len(steps))
    out = {"wait_s": sum(m["wait_seconds"] for m in metrics if m["step"] in steps) / n}
    if served:
        for key, field in (("buffer_waited_for_groups_s", "waited_for_groups_s"), ("buffer_serve_s", "serve_s"),
                           ("buffer_serve_cpu_s", "serve_cpu_s"), ("buffer_serve_core_wait_s", "serve_core_wait_s")):
            values = [e[field] for e in served if e.get(field) is not None]
            if len(values) == len(served):
                out[key] = sum(values) / len(values)
    return out


def serve_stretch(served: list[dict[str, Any]]) -> float:
    """How much this machine stretched the buffer's serve CPU work, from the serves themselves (`served`: the
    buffer's `batch_served` lines): the serve's CPU seconds plus its wait for a core, over its CPU seconds;
    where the kernel gives no wait, the serve's elapsed over its CPU seconds (then the disk's wait counts too).
    At least 1. A probe of its own cannot stand in: under Linux's scheduler a short piece of work that has slept
    runs at once on waking, so a 1 ms probe saw a stretch of 1.0-1.2 while the serve's 20 ms of CPU waited
    for a core nine times as long as it ran (its thread's schedstat)."""
    cpu = sum(e.get("serve_cpu_s") or 0.0 for e in served)
    if cpu <= 0:
        return 1.0
    if all(e.get("serve_core_wait_s") is not None for e in served):
        return max(1.0, (cpu + sum(e["serve_core_wait_s"] for e in served)) / cpu)
    return max(1.0, sum(e["serve_s"] for e in served) / cpu)


def measured_steps(metrics: list[dict[str, Any]], warmup: int = WARMUP_STEPS) -> set[int]:
    """The steps the figures are taken over: every step after the first `warmup`."""
    return {m["step"] for m in sorted(metrics, key=lambda m: m["step"])[warmup:]}


def batches_served(run_dir: Path, steps: set[int]) -> list[dict[str, Any]]:
    """The buffer's `batch_served` lines of `steps`."""
    return [e for e in read_jsonl(run_dir / "logs" / "buffer.jsonl")
            if e.get("event") == "batch_served" and e.get("step") in steps]


def ledger_account(run_dir: Path) -> dict[str, int]:
    """What became of every prompt the buffer handed out (tools/bench/chaos.py's account: trained, dropped on
    purpose, still pending, lost; and how many were trained more than once)."""
    from tools.bench.chaos import account
    return account(run_dir)


# ---------------------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------------------

class ProcessWatch:
    """The process tree under the node agents: how many processes, and their resident memory (RSS summed,
    shared pages counted in each; PSS, shared pages split among their users), sampled; the peaks kept."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots
        self.peak = {"processes": 0, "rss_bytes": 0, "pss_bytes": 0}

    def tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
        out, todo = [], list(self.roots)
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    @staticmethod
    def _kb(path: str, key: str) -> int:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(key):
                        return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def sample(self) -> dict[str, int]:
        pids = self.tree()
        now = {"processes": len(pids),
               "rss_bytes": 1024 * sum(self._kb(f"/proc/{p}/status", "VmRSS:") for p in pids),
               "pss_bytes": 1024 * sum(self._kb(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)}
        for k, v in now.items():
            self.peak[k] = max(self.peak[k], v)
        return now


# ---------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------

def make_assets(run_dir: Path, seed: int) -> Assets:
    """A tiny model the actors load (its weights travel the real weights path) and a dataset of short prompts."""
    from testsupport.tiny_models import tiny_model_dir
    from tools import make_task

    model = tiny_model_dir(run_dir / "model", seed=seed)
    data = run_dir / "data"
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            make_task.main(["--out", str(data), "--seed", str(seed)])
        finally:
            sys.stdout = stdout
    return Assets(model, data / "train.jsonl")


def pick_base_port(plan_for: Any, tries: int = 20) -> tuple[int, Plan]:
    """A bus base port whose whole range is free here (several runs share this machine)."""
    from launch.report import busy_ports

    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(tries):
        base = rng.randrange(21000, 60000, 100)
        plan = plan_for(base)
        if not busy_ports(plan):
            return base, plan
    raise RuntimeError(f"no free bus port range found in {tries} tries")


@dataclasses.dataclass
class Options:
    topology: str
    overrides: list[str]
    scale: float
    time_scale: float
    token_scale: int
    steps: int
    fault: str
    fault_at_step: int
    seed: int
    run_dir: Path
    timeout_s: float
    health_timeout_s: float
    progress: bool


def rehearse(opts: Options) -> dict[str, Any]:
    """Launch, watch, fault, collect, simulate, compare. Returns the report (also RUN_DIR/rehearsal-report.json)."""
    say = (lambda text: print(text, flush=True)) if opts.progress else (lambda text: None)
    full = topo_mod.load(opts.topology, opts.overrides)
    layout = scaled_layout(full, opts.scale)
    k = opts.token_scale
    max_new = full.topology.config.gen.max_new_tokens // k * k
    sim_overrides = list(opts.overrides) + simulated_overrides(layout, max_new)
    sim_plan = topo_mod.load(opts.topology, sim_overrides)
    sim_cfg = setup.sim_config(sizing.read(sim_plan), steps=opts.steps, seed=opts.seed)
    slow = {layout.rollouts - 1: 10.0} if opts.fault == "straggler" else {}
    never = (layout.rollouts - 1,) if opts.fault == "no-server" else ()
    costs = RehearsalCosts(sim_cfg, opts.time_scale, k, slow, never)

    run_dir = opts.run_dir
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    costs.write(run_dir / COST_FILE)
    assets = make_assets(run_dir, opts.seed)

    def plan_for(base_port: int) -> Plan:
        extra = launched_overrides(layout, sim_plan, costs, assets, run_dir, opts.steps, base_port,
                                   opts.health_timeout_s)
        plan = topo_mod.load(opts.topology, list(opts.overrides) + extra)
        hosts = [f"127.0.0.{FIRST_NODE_ADDRESS + i}" for i in range(len(plan.topology.nodes))]
        return plan.with_hosts(hosts)

    _, plan = pick_base_port(plan_for)
    from launch.nodes import write_node_plans
    from launch.options import LaunchRequest
    from launch.readiness import supervisor_options
    from launch.rundir import build_specs, write_plan

    specs = build_specs(plan, run_dir)
    launch_overrides = list(opts.overrides) + launched_overrides(layout, sim_plan, costs, assets, run_dir,
                                                                  opts.steps, plan.topology.bus.base_port,
                                                                  opts.health_timeout_s)
    write_plan(plan, run_dir, specs, launch_overrides)
    options = supervisor_options(plan, LaunchRequest())
    hosts = write_node_plans(plan, run_dir, specs, options)
    say(f"rehearsal of {opts.topology} at scale {Fraction(opts.scale).limit_denominator(1000)}: "
        f"{layout.rollouts} rollouts + servers and {layout.rewards} reward actors on {layout.rollout_nodes} node(s), "
        f"the trainer (modelling {layout.trainer_gpus} GPUs, {layout.trainer_parallel}), buffer and parameter "
        f"server on 1; {len(specs)} actors on {len(hosts)} fake nodes; time x{opts.time_scale:g}, tokens "
        f"x{k}; fault: {opts.fault}; run directory {run_dir}")

    env = dict(os.environ)
    env["PYTHONPATH"] = str(topo_mod.REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    agents: list[subprocess.Popen] = []
    t0 = time.monotonic()
    for host in hosts:   # what srun starts, one per node: the node finds its plan by SLURMD_NODENAME
        with open(run_dir / f"agent-{host}.out", "ab") as out:
            agents.append(subprocess.Popen([sys.executable, "-m", "tools.node_agent", str(run_dir)],
                                           env={**env, "SLURMD_NODENAME": host}, stdout=out,
                                           stderr=subprocess.STDOUT, cwd=str(topo_mod.REPO_ROOT),
                                           start_new_session=True))
    watch = ProcessWatch([p.pid for p in agents])
    fault_done: dict[str, Any] = {}
    stop_reason = None
    seen_steps = 0
    try:
        while any(p.poll() is None for p in agents):
            watch.sample()
            metrics = read_jsonl(run_dir / "metrics.jsonl")
            if len(metrics) > seen_steps:
                seen_steps = len(metrics)
                m = metrics[-1]
                say(f"[{time.monotonic() - t0:6.1f} s] step {m['step']}/{opts.steps}: {m['step_seconds']:.2f} s "
                    f"(modelled {m['step_seconds'] * opts.time_scale:.0f} s), staleness max {m['staleness_max']:.0f}, "
                    f"re-issued {m.get('reissued', 0)}")
            if opts.fault == "kill-node" and not fault_done and seen_steps >= opts.fault_at_step:
                fault_done = kill_node(run_dir, hosts[0])
                say(f"[{time.monotonic() - t0:6.1f} s] killed (-9) node {hosts[0]}'s rollouts: "
                    f"{', '.join(fault_done['killed'])}")
            if time.monotonic() - t0 > opts.timeout_s and stop_reason is None:
                stop_reason = f"timeout after {opts.timeout_s:g} s"
                (run_dir / "nodes" / "STOP").write_text(stop_reason + "\n")
                say(f"stopping: {stop_reason}")
            time.sleep(0.5)
    finally:
        for p in agents:
            if p.poll() is None:
                (run_dir / "nodes" / "STOP").write_text("rehearsal ended\n")
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
    wall = time.monotonic() - t0
    return report(opts, run_dir, plan, layout, costs, sim_cfg, specs, agents, watch, wall, fault_done, stop_reason,
                  launch_overrides, sim_overrides)


def write_traces(run_dir: Path, result: sim.Result) -> dict[str, str]:
    """The rehearsal's timeline and its simulation's, in one format, to open side by side in Perfetto:
    RUN_DIR/trace.json (`python -m tools.trace RUN_DIR`) and RUN_DIR/trace-simulated.json."""
    from tools.trace import timeline
    from tools.trace.records import read_run
    from tools.trace.simulated import write_simulated

    real = timeline.write(timeline.build(read_run(run_dir)), run_dir / "trace.json")
    simulated = write_simulated(result, run_dir / "trace-simulated.json", f"simulation of {run_dir.name}")
    return {"rehearsal": str(real), "simulation": str(simulated)}


def kill_node(run_dir: Path, host: str) -> dict[str, Any]:
    """SIGKILL every rollout actor of one node (a node's worth of rollouts; their servers follow them: the
    parent-death signal), by the pids its node agent publishes."""
    status = json.loads((run_dir / "nodes" / f"{host}.status.json").read_text())
    killed = []
    for name, row in status.get("actors", {}).items():
        if name.startswith("rollout") and row.get("pid"):
            try:
                os.kill(int(row["pid"]), signal.SIGKILL)
                killed.append(name)
            except ProcessLookupError:
                pass
    return {"killed": killed, "host": host, "at": time.time()}


def report(opts: Options, run_dir: Path, plan: Plan, layout: Layout, costs: RehearsalCosts, sim_cfg: sim.SimConfig,
           specs: list[dict[str, Any]], agents: list[subprocess.Popen], watch: ProcessWatch, wall: float,
           fault: dict[str, Any], stop_reason: str | None, launch_overrides: list[str],
           sim_overrides: list[str]) -> dict[str, Any]:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    ledger = read_jsonl(run_dir / "buffer" / "ledger.jsonl")
    servers = server_stats(run_dir)
    out: dict[str, Any] = {
        "topology": opts.topology, "scale": opts.scale, "time_scale": opts.time_scale, "token_scale": opts.token_scale,
        "fault": opts.fault, "steps": opts.steps, "trained_steps": len(metrics), "wall_s": wall,
        "agents_exit": [p.returncode for p in agents], "stopped": stop_reason,
        "layout": dataclasses.asdict(layout), "actors": len(specs), "fake_nodes": len(plan.topology.nodes),
        "max_groups_per_rollout": plan.topology.config.buffer.max_groups_per_rollout,
        "processes_peak": watch.peak["processes"], "rss_peak_bytes": watch.peak["rss_bytes"],
        "pss_peak_bytes": watch.peak["pss_bytes"],
        "command": "python -m tools.rehearse " + " ".join(shlex.quote(a) for a in [opts.topology, *opts.overrides])
                   + f" --scale {Fraction(opts.scale).limit_denominator(1000)} --time-scale {opts.time_scale:g} "
                     f"--token-scale {opts.token_scale} --steps {opts.steps} --fault {opts.fault} --seed {opts.seed} "
                     f"--health-timeout {opts.health_timeout_s:g}",
        "launch_overrides": launch_overrides, "simulated_overrides": sim_overrides}
    if fault:
        out["fault_detail"] = fault
    if len(metrics) > WARMUP_STEPS:
        measured = measured_figures(metrics, ledger, time_scale=opts.time_scale, token_scale=opts.token_scale,
                                    prompt_tokens=sim_cfg.prompt_tokens)
        # The buffer's serve costs real seconds, stretched by the machine's load: in modelled seconds, time_scale
        # times that, for answers of 1/token_scale the modelled tokens.
        served = batches_served(run_dir, measured_steps(metrics))
        stretch = serve_stretch(served)
        serve = sim_cfg.serve.scaled(opts.time_scale * stretch, opts.token_scale)
        result = sim.simulate(dataclasses.replace(sim_cfg, steps=len(metrics), serve=serve), trace=True)
        out["traces"] = write_traces(run_dir, result)
        out["serve_stretch"] = stretch
        out["trainer_wait"] = trainer_wait(metrics, served)
        out["serve_cost"] = dataclasses.asdict(serve)
        out["measured"] = measured
        out["simulated"] = result.figures()
        out["agreement"] = sim.agreement(result.figures(), measured)
        out["time_shares"] = {"rehearsal": time_shares(metrics, servers), "simulation": result.shares()}
        out["simulated_counters"] = {k: v for k, v in result.counters.items() if k != "measured"}
    out["decisions"] = decisions(run_dir, metrics, servers)
    if (run_dir / "buffer" / "final_state.json").exists():
        out["ledger"] = ledger_account(run_dir)
    out["ok"] = ok(out)
    (run_dir / "rehearsal-report.json").write_text(json.dumps(out, indent=1, default=str))
    return out


def ok(r: dict[str, Any]) -> bool:
    """The run trained every step; nothing lost, nothing trained twice; without a fault, every figure agrees
    within 15 %; with one, re-issues stay within what the fault took away (no cascade)."""
    led = r.get("ledger", {})
    sound = r["trained_steps"] >= r["steps"] and led.get("lost", 1) == 0 and led.get("twice", 1) == 0
    if r["fault"] == "none":
        return sound and bool(r.get("agreement", {}).get("all_agree"))
    return sound and not cascade(r)


def cascade(r: dict[str, Any]) -> bool:
    """More groups issued again than the fault could have taken: every group a killed node held (its rollouts
    x max groups each), or, for a slow or absent server, the groups one server holds, once per step."""
    per_rollout = r.get("max_groups_per_rollout", 8)
    held = len(r.get("fault_detail", {}).get("killed", [])) * per_rollout if r["fault"] == "kill-node" else \
        per_rollout * r["trained_steps"]
    return r["decisions"]["reissued"] > held


# ---------------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------------

def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(row[c])) for row in rows) for c in range(len(rows[0]))]
    return ["  " + "  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]


def render(r: dict[str, Any]) -> str:
    gib = 1 << 30
    lines = [f"rehearsal {r['topology']} at scale {Fraction(r['scale']).limit_denominator(1000)} "
             f"(time x{r['time_scale']:g}, tokens x{r['token_scale']}), fault {r['fault']}: "
             f"{r['trained_steps']}/{r['steps']} steps in {r['wall_s']:.0f} s",
             f"  {r['actors']} actors on {r['fake_nodes']} fake nodes; peak {r['processes_peak']} processes, "
             f"RSS {r['rss_peak_bytes'] / gib:.1f} GiB summed (PSS {r['pss_peak_bytes'] / gib:.1f} GiB)"]
    if r.get("stopped"):
        lines.append(f"  stopped: {r['stopped']}")
    if "agreement" in r:
        rows = [("figure", "simulated", "rehearsed", "ratio", "within 15 %")]
        for name, row in r["agreement"]["rows"].items():
            rows.append((name, f"{row['simulated']:.4g}", f"{row['measured']:.4g}",
                         "-" if row["ratio"] is None else f"{row['ratio']:.3f}",
                         "NO" if not row["agrees"] else "yes (both < 0.05)" if row.get("near_zero") else "yes"))
        lines += ["", "figures (modelled seconds and tokens; measured steps after the first)", *_table(rows)]
        if "serve_stretch" in r:
            serve = r["serve_cost"]
            lines.append(f"  the buffer's serve, simulated: CPU x{r['serve_stretch']:.2f} (the machine's stretch of "
                         f"the serves' own CPU work) = {serve['per_batch_s']:.3g} s a batch + "
                         f"{serve['per_token_s'] * 1e6:.3g} s per million modelled answer tokens")
        if "buffer_serve_s" in r.get("trainer_wait", {}):
            w = r["trainer_wait"]
            lines.append(f"  the trainer's wait, real seconds a step: {w['wait_s']:.3f}, of which the buffer waited "
                         f"{w['buffer_waited_for_groups_s']:.3f} for groups and served for {w['buffer_serve_s']:.3f}")
            if "buffer_serve_core_wait_s" in w:
                cpu, queued = w["buffer_serve_cpu_s"], w["buffer_serve_core_wait_s"]
                lines.append(f"  the serve: {cpu:.3f} s on a core, {queued:.3f} s waiting for one, the rest "
                             f"({w['buffer_serve_s'] - cpu - queued:.3f} s) the disk and the event loop")
        worst = max((abs(x["ratio"] - 1) for x in r["agreement"]["rows"].values()
                     if x["ratio"] is not None and not x.get("near_zero")), default=0.0)
        lines.append(f"  agreement: {'all within 15 %' if r['agreement']['all_agree'] else 'NOT all within 15 %'}"
                     f" (largest deviation {100 * worst:.1f} %)")
        shares = r["time_shares"]
        lines += ["", "time shares", "  trainer (rehearsal): " + _shares(shares["rehearsal"]["trainer"]),
                  "  trainer (simulation): " + _shares(shares["simulation"]["trainer"]),
                  "  servers (rehearsal, modelled clocks): " + _shares(shares["rehearsal"]["rollout"]),
                  "  servers (simulation): " + _shares(shares["simulation"]["rollout"])]
    d = r["decisions"]
    lines += ["", f"decisions: re-issued {d['reissued']} (handed back {d['handed_back']}, stale {d['dropped_stale']}), "
                  f"overdue {d['overdue_groups']}, requests aborted at the servers {d['aborted_requests']}, "
                  f"retractions {d['retractions']}, groups per server {d['groups_per_server']['mean']:.1f} mean / "
                  f"{d['groups_per_server']['max']} max"]
    if "ledger" in r:
        led = r["ledger"]
        lines.append(f"ledger: issued {led['issued']}, trained {led['trained']}, dropped {led['dropped']}, pending "
                     f"{led['pending']}, lost {led['lost']}, trained twice {led['twice']}")
    lines.append(f"result: {'OK' if r['ok'] else 'FAILED'}")
    return "\n".join(lines)


def _shares(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {100 * v:.1f} %" for k, v in d.items())


def parse_args(argv: Sequence[str] | None) -> tuple[Options, bool]:
    ap = argparse.ArgumentParser(prog="python -m tools.rehearse", description=__doc__.split("\n\n")[0])
    ap.add_argument("topology")
    ap.add_argument("overrides", nargs="*", help="key.sub=value, as tools.up takes them (before scaling)")
    ap.add_argument("--scale", type=parse_scale, required=True, help="fraction of the fan-out, e.g. 1/16")
    ap.add_argument("--time-scale", type=float, default=15.0, help="modelled seconds per real second (default 15)")
    ap.add_argument("--token-scale", type=int, default=32,
                    help="modelled tokens per token the actors see (default 32; it must divide gen.max_new_tokens)")
    ap.add_argument("--steps", type=int, default=10, help="training steps (the first is warm-up; default 10)")
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--fault-at-step", type=int, default=3, help="kill-node: after this many steps (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", type=Path, default=None, help="default: runs/rehearse/<timestamp>")
    ap.add_argument("--timeout", type=float, default=1200.0, help="stop the run after this many seconds")
    ap.add_argument("--health-timeout", type=float, default=120.0,
                    help="sglang.health_timeout_s of the servers (a server that never comes up is given up after it)")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object")
    a = ap.parse_intermixed_args(argv)
    if a.steps <= WARMUP_STEPS:
        ap.error(f"--steps must be more than {WARMUP_STEPS} (the first step is warm-up)")
    if a.time_scale <= 0 or a.token_scale < 1:
        ap.error("--time-scale must be positive and --token-scale at least 1")
    run_dir = a.run_dir or Path("runs") / "rehearse" / time.strftime("%Y%m%d-%H%M%S")
    return Options(a.topology, list(a.overrides), a.scale, a.time_scale, a.token_scale, a.steps, a.fault,
                   a.fault_at_step, a.seed, run_dir.resolve(), a.timeout, a.health_timeout, not a.json), a.json


def main(argv: Sequence[str] | None = None) -> int:
    opts, as_json = parse_args(argv)
    try:
        r = rehearse(opts)
    except (TopologyError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    print(json.dumps(r, indent=1, default=str) if as_json else render(r), flush=True)
    return EXIT_OK if r["ok"] else EXIT_FAILED
