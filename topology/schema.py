"""The topology file's schema: every key of every section declared once, with its type, default, bounds and one
line of doc, as pydantic models (on topology.section's `Section`, whose `problem_lines` reports each problem on
one line naming the key's full path: `actors.trainer.cout: unknown key (did you mean 'count'?)`).

Values whose meaning depends on other sections (a group's `nodes:` against the cluster's host names, `cpus:`
against the node's cores, a rendezvous port that may be "auto") are typed `Any` here, documented in their
description, and read by `topology.placement`, which names the same key paths.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from topology.section import Section, key_path, model_at, problem_lines, when_missing

__all__ = ["Section", "SupervisorSection", "NicsSection", "NodeSection", "ClusterSection", "BusSection",
           "LinkSection", "ParallelSection", "GroupSection", "TopologyDocument", "RESERVED_SETTINGS",
           "expert_tensor_parallel", "expert_data_parallel", "problem_lines", "model_at", "key_path"]

# Keys the launcher writes into every actor's settings; a topology may not set them.
RESERVED_SETTINGS = ("instance", "groups", "links", "drain_timeout")
# An actor's drain (handing back the work in flight) gets this share of supervisor.stop_timeout; the rest is for
# cancelling what did not finish, writing its final state and closing its bus before the supervisor's SIGKILL.
DRAIN_SHARE = 0.5


def drain_budget_s(stop_timeout: float) -> float:
    """The drain_timeout the launcher gives every actor under a supervisor whose stop_timeout this is."""
    return stop_timeout * DRAIN_SHARE


class SupervisorSection(Section):
    """Restart policy and timeouts of actors.runtime.supervisor.Supervisor (locally and on every node agent)."""

    max_restarts: int = Field(3, ge=0, description="restarts of one actor within restart_window before the run fails")
    restart_window: float = Field(300.0, gt=0, description="seconds over which restarts are counted")
    backoff_initial: float = Field(0.5, gt=0, description="first wait before a restart, doubled on each one")
    backoff_max: float = Field(30.0, gt=0, description="longest wait before a restart")
    ready_timeout: float = Field(120.0, gt=0, description="seconds an actor has to report ready, beyond what its "
                                                          "class starts (actors.<group>.ready_timeout_s sets a group's)")
    stop_timeout: float = Field(30.0, gt=0, description="seconds an actor has to stop before it is killed; its drain "
                                                        "(work in flight handed back) gets half, the rest is for "
                                                        "its final state and close")
    fork_start: bool = Field(True, description="start each actor by forking a template process that imported torch "
                                               "and the runtime once (copy-on-write) instead of a fresh interpreter; "
                                               "actors whose environment sets load-time variables (PYTHON*, LD_*, "
                                               "OMP_*, TORCH_*, ...) start fresh either way")


class NicsSection(Section):
    ib: list[str] | None = Field(None, description="InfiniBand/RoCE HCAs (NCCL_IB_HCA)")
    socket: str | None = Field(None, description="the socket interface of NCCL's bootstrap and gloo")


class NodeSection(Section):
    """Every node of the cluster is alike."""

    gpus: int = Field(0, ge=0, description="GPUs per node")
    gpu_kind: str | None = Field(None, description="GPU model, e.g. H800 (reports and memory plans)")
    gpu_memory_gb: float | None = Field(None, gt=0, description="memory of one GPU")
    cpus: int = Field(1, ge=1, description="CPU cores per node")
    memory_gb: float | None = Field(None, gt=0, description="host memory per node")
    nics: NicsSection = Field(default_factory=NicsSection, description="network interfaces")


class ClusterSection(Section):
    nodes: Any = Field(1, description="a count (>1: host names from the SLURM allocation), a node list pattern "
                                      "such as node[01-04], or a list of host names")
    node: NodeSection = Field(default_factory=NodeSection, description="what one node has")
    interconnect: dict[str, Any] | None = Field(None, description="free-form description of the fabric")


class BusSection(Section):
    transport: Literal["tcp", "ipc"] = Field("tcp", description="tcp, or ipc (one node only)")
    host: str | None = Field(None, description="bind address for a one-node tcp bus (unset: 127.0.0.1)")
    base_port: int = Field(20000, ge=1024, le=65535, description="first port of the bus: one per actor instance")
    port_range: int = Field(1000, ge=1, description="ports the bus may use from base_port")
    # Any user of a machine can connect to a tcp port: a tcp bus always has CurveZMQ (the run's keys), unless
    # insecure_tcp says otherwise in so many words. ipc sockets live in a directory only the run's user can enter.
    curve: bool | None = Field(None, description="CurveZMQ encryption and authentication (unset: on for tcp, off for "
                                                 "ipc; a tcp bus cannot turn it off, see insecure_tcp)")
    insecure_tcp: bool = Field(False, description="run a tcp bus without CurveZMQ: messages travel in clear and "
                                                  "anyone who can sniff the network or reach a port before an actor "
                                                  "binds it can learn the run's tokens and command the run")
    heartbeat_s: float | None = Field(None, gt=0, description="ZeroMQ heartbeat interval (unset: the bus's)")


class LinkSection(Section):
    """A bulk (torch.distributed) group between actor instances."""

    backend: Literal["gloo", "nccl"] = Field(
        description="gloo (CPU) or nccl (GPU)",
        json_schema_extra=when_missing("missing: gloo (CPU) or nccl (GPU)"))
    members: list[str] = Field(
        min_length=1, description="actor groups or instances (group.index) in rank order; rank 0 hosts the rendezvous",
        json_schema_extra=when_missing("missing: the actor groups or instances of the link"))
    port: Any = Field(description="the rendezvous port on the first member's node, or auto (one-node topologies)",
                      json_schema_extra=when_missing("missing: the rendezvous port on the first member's node (or auto "
                                                 "on one node)"))
    gdr: bool = Field(False, description="GPUDirect RDMA (nccl over InfiniBand/RoCE)")
    env: dict[str, Any] = Field(default_factory=dict, description="environment variables of the link's members")
    timeout_s: float = Field(300.0, gt=0, description="how long forming the group and one transfer may take")


class ParallelSection(Section):
    dp: int | None = Field(None, ge=1, description="data-parallel degree")
    tp: int | None = Field(None, ge=1, description="tensor-parallel degree (inside a node)")
    pp: int | None = Field(None, ge=1, description="pipeline-parallel degree")
    ep: int | None = Field(None, ge=1, description="expert-parallel degree of a mixture-of-experts trainer: each "
                           "sparse layer's experts split over ep ranks (Megatron's expert_model_parallel_size); "
                           "ep x etp x pp must divide the group's ranks")
    etp: int | None = Field(None, ge=1, description="expert tensor-parallel degree of a mixture-of-experts trainer "
                            "(Megatron's expert_tensor_parallel_size): 1 (experts whole on each rank, MoE parallel "
                            "folding) or tp; unset: 1 when ep > 1, else tp")


def expert_tensor_parallel(tp: int, ep: int, etp: int | None = None) -> int:
    """The experts' tensor-parallel degree: ``etp`` as set, else 1 with expert parallelism and tp without.

    With ep > 1 the experts are whole on each rank and the expert-parallel group folds over the attention's TP
    ranks (megatron-core's MoE parallel folding): its alltoall dispatcher then gathers nothing over a TP group,
    and an expert's matrices are not cut into tp slivers. With ep = 1 the experts split over tp as the dense
    layers do, so that a rank does not hold every expert whole.
    """
    if etp is not None:
        return etp
    return 1 if ep > 1 else tp


def expert_data_parallel(dp: int, tp: int, ep: int, etp: int | None = None) -> int:
    """The experts' data-parallel degree: the ranks of one pipeline stage (dp x tp) over the etp x ep that hold
    one copy of every expert; the experts' gradients and optimizer state are reduced and sharded over it."""
    return dp * tp // (expert_tensor_parallel(tp, ep, etp) * ep)


class GroupSection(Section):
    """A group of identical actor instances."""

    class_: str = Field(alias="class", description="the actor class as module.path:ClassName",
                        json_schema_extra=when_missing("missing: the actor class as module.path:ClassName"))
    count: int = Field(1, ge=1, description="instances of the group")
    nodes: Any = Field(None, description="node indices, a-b index ranges, host names or a node list pattern (unset: every node)")
    per_node: int | None = Field(None, ge=1, description="instances per node (unset: spread evenly)")
    gpus: int = Field(0, ge=0, description="GPUs of each instance")
    cpus: Any = Field(None, description="core ids of every instance, or one list per instance (CPU affinity)")
    threads: int | None = Field(None, ge=1, description="OMP_NUM_THREADS (unset: the number of cores, or 1)")
    cpu_workers: int = Field(0, ge=0, description="worker processes of each instance (reward pools), counted against the node's cores")
    parallel: ParallelSection = Field(default_factory=ParallelSection, description="dp x tp x pp of the group")
    world_port: Any = Field(None, description="the instances form one torch.distributed world rendezvousing here (auto: a free port at launch)")
    settings: dict[str, Any] = Field(default_factory=dict, description="the actor's settings (its class's Settings model), merged over the experiment")
    env: dict[str, Any] = Field(default_factory=dict, description="environment variables of the instances")
    ready_timeout_s: float | None = Field(
        None, gt=0, description="seconds each instance has to report ready (unset: supervisor.ready_timeout plus "
                                "what its class starts: an SGLang rollout adds its server's sglang.health_timeout_s)")
    min_ready: int | None = Field(
        None, ge=1, description="instances that must be ready for the run to start; the rest join when ready "
                                "(unset: all; a rollout group: half, rounded up)")


class TopologyDocument(Section):
    name: str | None = Field(None, description="the run's name (unset: the file's stem)")
    description: str = Field("", description="one line for reports")
    config: str | None = Field(None, description="the experiment config, a YAML file under configs/")
    run_root: str = Field("runs", description="run directories go under runs/<name>/<timestamp>")
    cluster: ClusterSection = Field(description="the nodes", json_schema_extra=when_missing("missing (say at least `nodes:`)"))
    bus: BusSection = Field(default_factory=BusSection, description="the message bus")
    links: dict[str, LinkSection] = Field(default_factory=dict, description="bulk links by name")
    actors: dict[str, GroupSection] = Field(
        description="actor groups by name (at least one; topology.placement says so when there is none)",
        json_schema_extra=when_missing("missing or empty: name at least one actor group"))
    supervisor: SupervisorSection = Field(default_factory=SupervisorSection, description="restart policy")
