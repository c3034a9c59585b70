"""What a SLURM allocation holds: its hosts (`allocation_hosts`), the cores and GPUs of each node as the
controller or the environment says (`read_allocation`), whether the topology's nodes fit in them
(`allocation_shortfall`), and the srun/sbatch flags that claim a whole node (`slurm_resources`)."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess

from topology import Plan


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


def allocation_hosts() -> list[str]:
    """Host names of the current SLURM allocation, in SLURM node order."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return out.stdout.split()
