"""The settings every actor receives, typed: the experiment config (topology.experiment), the keys the launcher
fills in (``instance``, ``groups``, ``links``), the keys the actor runtime reads, and each actor class's own keys.

An actor class names its model in ``Settings`` (a subclass of :class:`ActorSettings`); ``actors.runtime.base.Actor``
validates ``spec.settings`` into ``actor.cfg`` with it, and the topology loader checks every group's
``settings:`` against the same model before anything starts, so a misspelt or misplaced key is refused at
launch with its full path (`actors.rollout.settings.mem_fraction_static: unknown key (did you mean
'sglang.mem_fraction_static'?)`).

This module sits below actors/ in the import direction (tools -> actors -> (topology, transport, algo)): it
imports nothing of ours but topology.experiment, and finds an actor class's model through the class's own
``Settings`` attribute, never by importing actors.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from topology.experiment import ExperimentConfig, Section
from topology.schema import SupervisorSection, drain_budget_s, problem_lines

__all__ = ["InstanceSettings", "WorldSettings", "LinkSettings", "ActorSettings", "RewardSettings", "CodeRewardSettings",
           "EngineSettings", "GenerationSettings", "EvaluatorSettings", "TrainerSettings", "SGLangSettings", "RolloutSettings",
           "ParamServerSettings",
           "BufferSettings", "SandboxSettings", "BusSettings", "MessageLogSettings", "SettingsError", "settings_model", "read_settings"]


class WorldSettings(Section):
    """The torch.distributed world of a group with `world_port` (torchrun's variables, also in the environment)."""

    master_addr: str = Field("", description="address of rank 0")
    master_port: int = Field(0, ge=0, le=65535, description="rendezvous port at rank 0")
    rank: int = Field(0, ge=0, description="this instance's rank")
    world_size: int = Field(1, ge=1, description="ranks of the world")


class LinkSettings(Section):
    """One bulk link this instance is a member of, as the launcher writes it (topology/placement.py,
    ``Plan.link_config``); the fields of transport.bulk.LinkConfig, which the instance builds from it (a test
    keeps the two field lists the same)."""

    name: str = Field(description="the link's name in the topology")
    backend: Literal["gloo", "nccl"] = Field(description="torch.distributed backend: gloo (CPU) or nccl (GPU)")
    master_addr: str = Field(description="address of the link's rank 0, where its rendezvous store listens")
    master_port: int = Field(ge=0, le=65535, description="the rendezvous store's port (0: auto, a free one the launcher picks)")
    rank: int = Field(ge=0, description="this instance's rank on the link")
    world_size: int = Field(ge=1, description="members of the link")
    members: list[str] = Field(default_factory=list, description="instance names, in rank order")
    bind_addr: str = Field("", description="address gloo binds on this member (fake nodes use 127.0.0.x)")
    timeout_s: float = Field(300.0, gt=0, description="seconds a rendezvous or collective may take")
    env: dict[str, str] = Field(default_factory=dict, description="NCCL_* / GLOO_* variables for this process")
    secret_file: str = Field("", description="the run's rendezvous secret file (empty: store values unsigned)")

    @model_validator(mode="after")
    def _rank_inside_world(self) -> "LinkSettings":
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        return self


class InstanceSettings(Section):
    """Where this instance runs; the launcher writes it (a topology may not)."""

    group: str = Field("", description="the actor group")
    index: int = Field(0, ge=0, description="index of the instance in its group")
    count: int = Field(1, ge=1, description="instances of the group")
    node: str = Field("localhost", description="host name of the node")
    address: str = Field("", description="the node's address")
    node_index: int = Field(0, ge=0, description="index of the node in the cluster")
    gpus: list[int] = Field(default_factory=list, description="GPU ids of the instance on its node")
    cpus: list[int] = Field(default_factory=list, description="cores of the instance (CPU affinity)")
    cpu_workers: int = Field(0, ge=0, description="worker processes of the instance")
    parallel: dict[Literal["dp", "tp", "pp", "ep", "etp"], int] = Field(default_factory=dict,
                                                                 description="the group's dp x tp x pp (and ep, etp)")
    world: WorldSettings | None = Field(None, description="the group's torch.distributed world, if it has one")


class MessageLogSettings(Section):
    """RUN_DIR/msglog/<name>.msglog (transport.msglog)."""

    outbound: bool = Field(False, description="record outbound messages too (tools.replay --into compares them)")
    tensors: Literal["store", "checksum"] = Field("store", description="store tensors, or only their checksums")
    flush_every: int = Field(1, ge=1, description="records between flushes")


class BusSettings(Section):
    """Keyword arguments of the actor's ``transport.bus.Bus``; a key left out keeps the Bus's own default."""

    hwm: int | None = Field(None, ge=1, description="ZeroMQ high-water mark of each socket (messages)")
    max_frame_bytes: int | None = Field(None, ge=1024, description="largest frame accepted without complaint")
    hard_max_frame_bytes: int | None = Field(None, ge=1024, description="largest frame accepted at all")
    max_inflight: int | None = Field(None, ge=1, description="coroutine handlers running at once")
    heartbeat_interval: float | None = Field(None, gt=0, description="seconds between heartbeats (null: none)")
    heartbeat_timeout: float | None = Field(None, gt=0, description="seconds of silence before a peer is dead")
    reply_timeout: float | None = Field(None, gt=0, description="default seconds a request waits for its reply")
    coalesce: bool | None = Field(None, description="send queued small messages in one batch")

    def bus_kwargs(self) -> dict[str, Any]:
        """The keys the settings set (an explicit null heartbeat_interval turns heartbeats off)."""
        return self.model_dump(exclude_unset=True)


class ActorSettings(ExperimentConfig):
    """What every actor may be given. Actor classes with keys of their own subclass it."""

    instance: InstanceSettings = Field(default_factory=InstanceSettings, description="placement (launcher)")
    groups: dict[str, list[str]] = Field(default_factory=dict, description="instance names of every group (launcher)")
    links: dict[str, LinkSettings] = Field(
        default_factory=dict, description="every bulk link the instance is in, by name (launcher)")
    log_console: bool = Field(True, description="false silences the console copy of the log")
    bus: BusSettings = Field(default_factory=BusSettings, description="the actor's bus (transport.bus.Bus)")
    message_log: MessageLogSettings | None = Field(
        None, description="record the actor's messages: true (the recording's defaults), or its settings")
    drain_timeout: float = Field(
        drain_budget_s(SupervisorSection().stop_timeout), gt=0,
        description="seconds the drain on stop may take, on_drain and running handlers together (the launcher "
                    "sets it from supervisor.stop_timeout: topology.schema.drain_budget_s)")
    close_linger: float = Field(2.0, ge=0, description="seconds the bus may take to send what is queued on close")
    status_every_s: float = Field(
        5.0, ge=0, description="seconds between writes of RUN_DIR/status/<name>.json (what it waits on, the last "
                               "message of each kind), which the launcher's progress watchdog reads; 0 is off")

    @field_validator("message_log", mode="before")
    @classmethod
    def _message_log_switch(cls, value: Any) -> Any:
        # `message_log: true` records with the defaults; false is off, like leaving it out.
        return {True: {}, False: None}[value] if isinstance(value, bool) else value


class EngineSettings(ActorSettings):
    """Actors that run a model in their own process."""

    device: Literal["cpu", "cuda"] | None = Field(
        None, description="cpu or cuda (unset: cuda if the topology gave the instance GPUs, else cpu)")

    @property
    def engine_device(self) -> str:
        """Where the engine runs: ``device`` if set, else the GPU the topology gave the instance (``instance.gpus``;
        CUDA_VISIBLE_DEVICES narrows each instance to its own), else the CPU."""
        return self.device or ("cuda" if self.instance.gpus else "cpu")


class RewardSettings(ActorSettings):
    grader: str | None = Field(None, description="module:function that checks an answer (unset: the class's own)")
    score_timeout_s: float | None = Field(
        None, gt=0, description="hard limit of checking one answer (unset: the class's own: 10 s for math)")


class SandboxSettings(Section):
    """``actors.reward.sandbox.SandboxLimits`` of every program run (sizes in bytes, times in seconds); a key
    left out keeps that class's default."""

    wall_time_s: float | None = Field(None, gt=0, description="wall-clock time of one run")
    cpu_time_s: float | None = Field(None, gt=0, description="CPU time of one run (RLIMIT_CPU)")
    memory_bytes: int | None = Field(None, gt=0, description="address space of every process inside (RLIMIT_AS)")
    file_size_bytes: int | None = Field(None, gt=0, description="largest single file written (RLIMIT_FSIZE)")
    tmpfs_bytes: int | None = Field(None, gt=0, description="total size of the writable /tmp")
    max_processes: int | None = Field(None, gt=0, description="processes of the run's uid (RLIMIT_NPROC)")
    max_open_files: int | None = Field(None, gt=0, description="open files of each process (RLIMIT_NOFILE)")
    output_bytes: int | None = Field(None, gt=0, description="bytes kept of each output stream")


class CodeRewardSettings(RewardSettings):
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings, description="limits of every program run")
    allow_unsandboxed: bool = Field(False, description="run programs without a working sandbox (never on shared machines)")




class TrainerSettings(EngineSettings):
    backend: Literal["torch", "megatron"] = Field("torch", description="training engine")
    bf16: bool | None = Field(None, description="bfloat16 weights and compute (unset: on cuda)")
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism (with tp > 1)")
    recompute: str = Field("none", description="Megatron activation recomputation: none, selective or full")
    logprob_chunk_tokens: int = Field(0, ge=0, description="tokens per chunk of the log-prob computation; 0 is off")
    weight_bucket_mb: int = Field(64, ge=1, description="size of one bucket of published weights, MiB")
    weights_kept_mb: int | None = Field(
        None, ge=0, description="direct weights: host memory (MiB, page-locked on a GPU) the trainer's senders keep "
                                "exported versions in for the parameter server to push; older versions are dropped "
                                "first, the newest never (unset: the newest while the next one is exported)")


class SGLangSettings(Section):
    """The SGLang server a rollout starts (actors/engines/sglang.py)."""

    command: str | list[str] | None = Field(None, description="server command (unset: python -m sglang.launch_server)")
    host: str = Field("127.0.0.1", description="address the server binds")
    port: int = Field(0, ge=0, le=65535, description="server port; 0 picks a free one")
    mem_fraction_static: float | None = Field(None, gt=0, le=1, description="GPU memory fraction for weights and KV cache")
    ep_size: int = Field(1, ge=1, description="expert-parallel ranks among the server's parallel.tp ranks (a MoE "
                                              "model's experts split between them; must divide tp)")
    dtype: str | None = Field(None, description="server dtype (unset: model.dtype, else the checkpoint's)")
    extra_args: list[str] = Field(default_factory=list, description="further server arguments")
    env: dict[str, Any] = Field(default_factory=dict, description="environment of the server")
    health_timeout_s: float = Field(600.0, gt=0, description="how long the server may take to become healthy")
    max_restarts: int = Field(5, ge=0, description="restarts of a dead server before the rollout fails")
    backoff_s: float = Field(1.0, gt=0, description="first wait before a restart")
    backoff_max_s: float = Field(30.0, gt=0, description="longest wait before a restart")
    request_timeout_s: float | None = Field(
        None, gt=0, description="bound on one generate request (unset: gen.timeout_slack x the tokens it may still "
                                "generate at the slowest pace measured on this server, gen.timeout_floor_s at least)")
    control_timeout_s: float = Field(600.0, gt=0, description="bound on one control request (weights, pause)")
    weights_dir: str | None = Field(None, description="where weights go through disk (unset: RUN_DIR/sglang_weights/<name>)")
    log_path: str | None = Field(None, description="server log (unset: RUN_DIR/logs/<name>.sglang.log)")


class GenerationSettings(EngineSettings):
    """Actors that generate answers: the engine and, for SGLang, its server (actors/engines/sglang.py)."""

    engine: Literal["torch", "sglang"] = Field("torch", description="generation engine")
    max_running: int = Field(256, ge=1, description="most sequences the embedded engine decodes at once")
    sglang: SGLangSettings = Field(default_factory=SGLangSettings, description="the SGLang server (engine: sglang)")
    sglang_url: str | None = Field(None, description="attach to this running SGLang server instead of starting one")


class EvaluatorSettings(GenerationSettings):
    weights_from: Literal["param_server", "checkpoints", "rollouts"] = Field(
        "param_server", description="which versions are evaluated: those the parameter server keeps for evaluation "
                                    "(a run whose weights pass through it), each complete checkpoint (any run; "
                                    "a GPU run's direct weights keep no copy in the parameter server), or the "
                                    "rollouts' own (their engines answer the prompts: no GPU of its own)")
    rollout_concurrency: int = Field(2, ge=1, description="weights_from rollouts: most held-out prompts in flight on "
                                                          "one rollout, so its training groups are not starved")
    rollout_timeout_s: float = Field(1200.0, gt=0, description="weights_from rollouts: how long one prompt may take "
                                                               "on a rollout before it is given to another")


class PythonToolSettings(Section):
    """The ``python`` tool of episodes (actors/envs/python_tool.py): programs the model writes, run in the
    reward's bubblewrap sandbox in the rollout's process."""

    sandbox: SandboxSettings = Field(default_factory=SandboxSettings, description="limits of every program run")
    allow_unsandboxed: bool = Field(False, description="run programs without a working sandbox (never on shared machines)")
    workers: int = Field(2, ge=1, le=64, description="programs run at once (each its own sandbox uid and zygote)")
    timeout_s: float | None = Field(None, gt=0, description="bound on one call as the episode sees it (unset: the "
                                                          "sandbox's wall time + 3 s); below gen.env_timeout_s")
    output_chars: int = Field(1000, ge=1, description="characters of stdout and of stderr an observation keeps")
    call_open: str = Field("<python>", description="text that opens a call: the program follows it")
    call_end: str = Field("</python>", min_length=1, description="text that ends a call and the turn; must be one "
                                                                "token of the model's tokenizer")


class AgentSettings(Section):
    """An agent that runs every group's episodes against the rollout's OpenAI endpoint
    (actors/rollout/agent.py): an async function or an external program; neither set: episodes as the task names."""

    function: str | None = Field(None, description="module:function, an async agent(client, task) -> reward or None")
    command: list[str] | None = Field(None, min_length=1, description="argv of an agent program (OPENAI_BASE_URL, "
                                                                      "OPENAI_API_KEY, AGENT_TASK in its environment)")
    timeout_s: float = Field(60.0, gt=0, description="bound on one episode of the agent")
    chat_template: str | None = Field(None, description="a jinja chat template file used instead of the "
                                                        "tokenizer's (unset: tokenizer_config.json's chat_template)")
    tool_format: Literal["qwen", "brackets"] = Field("qwen", description="how tool calls are written in the model's "
                                                                         "text (actors/rollout/chat.py)")
    sandbox: bool = Field(False, description="run the command in the bubblewrap sandbox (actors/reward/sandbox.py) "
                                             "with only the endpoint reachable; its argv may name {files} and {python}")
    files: list[str] = Field(default_factory=list, description="files placed read-only in the sandbox's {files} "
                                                               "folder (the program's own), by their names")
    memory_mb: int = Field(512, ge=64, description="address-space limit of each sandboxed agent process")

    @model_validator(mode="after")
    def _one_agent(self) -> "AgentSettings":
        if self.function is not None and self.command is not None:
            raise ValueError("set function or command, not both")
        if self.sandbox and self.command is None:
            raise ValueError("sandbox: only an agent command (a program) runs in the sandbox")
        if self.files and not self.sandbox:
            raise ValueError("files: only a sandboxed agent gets files (set sandbox: true)")
        return self

    @property
    def enabled(self) -> bool:
        return self.function is not None or self.command is not None


class RolloutSettings(GenerationSettings):
    link: str | None = Field(None, description="the weights link (unset: ps_to_rollout, or the only link listed)")
    weights_timeout_s: float | None = Field(None, gt=0, description="bound on waiting for the weights link (unset: its timeout_s)")
    weights_via_server: bool = Field(True, description="with direct weights and SGLang, the server joins the trainer's group")
    stats_every_s: float = Field(30.0, ge=0, description="period of the rollout_stats log line; 0 disables it")
    python_tool: PythonToolSettings = Field(default_factory=PythonToolSettings,
                                            description="the python tool of episodes whose task names it")
    agent: AgentSettings = Field(default_factory=AgentSettings, description="an agent that runs every group "
                                                                            "through the OpenAI endpoint")


class ParamServerSettings(ActorSettings):
    ack_timeout_s: float = Field(120.0, gt=0, description="how long a rollout has to acknowledge new weights")
    retry_s: float = Field(2.0, gt=0, description="wait between attempts to reach a rollout")
    probation_s: float = Field(30.0, ge=0, description="how long a rollout that missed a version is left out")
    late_s: float = Field(2.0, ge=0, description="an acknowledgement later than this counts as late")
    train_link: str | None = Field(None, description="link from the trainer (unset: train_to_ps)")
    rollout_link: str | None = Field(None, description="link to the rollouts (unset: ps_to_rollout)")
    bucket_bytes: int = Field(64 << 20, ge=1, description="size of one bucket of weights sent to the rollouts")


class BufferSettings(ActorSettings):
    pass


def settings_model(cls: type) -> type[ActorSettings]:
    """The settings model of an actor class: the nearest ``Settings`` its class or a base declares."""
    for klass in cls.__mro__:
        if "Settings" in vars(klass):
            return vars(klass)["Settings"]
    return ActorSettings


class SettingsError(ValueError):
    """An actor's settings do not fit its class's model; one line per problem, each naming the key."""


def read_settings(cls: type, settings: dict[str, Any], who: str) -> ActorSettings:
    """``settings`` validated by the settings model of actor class ``cls``."""
    model = settings_model(cls)
    try:
        return model.model_validate(settings)
    except ValidationError as exc:
        raise SettingsError(f"{who}: " + "; ".join(problem_lines(exc, "settings", model))) from None
