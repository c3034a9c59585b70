"""The messages the RL actors exchange: prompts out, trajectories back, batches to the trainer, weights out.

    buffer --GenerateGroup--> rollout --Trajectories--> reward --ScoredGroup--> buffer
    trainer --BatchRequest--> buffer (replies BatchTensors)
    trainer.0 ==BatchTensors (its share)==> each other trainer rank (over the ranks' gloo group, actors/runtime/rank_group.py)
    trainer --WeightsPublished--> param_server (replies WeightsStored once the buckets arrived on the bulk link)
    param_server --WeightsReady--> rollout (then the buckets on the bulk link; rollout replies WeightsAck)
    trainer --VersionUpdate--> buffer            (opens the staleness gate for the new version)
    trainer --CheckpointRequest--> buffer        (buffer saves its state for that step; replies CheckpointDone)
    rollout --GroupReturned--> buffer            (work handed back on drain: re-issued, never lost)
    buffer --AbortGroup--> rollout               (a request: stop a group whose time ran out before it is
                                                  issued again; replies GroupAborted once it stopped)
    rollout --RolloutHello--> param_server       (a new or restarted rollout asks for the current weights)
    rollout --ServerDown--> param_server         (its SGLang server died: form no group with it until hello)
    rollout, reward --WorkerHello--> buffer      (a new or restarted worker: what it held before is re-issued)
    param_server --LinkReform--> rollout         (re-form the bulk link after a member restarted)
    trainer --RunFinished--> everyone            (the run is over: stop cleanly)
    trainer, tools --WeightsStatusRequest--> param_server (replies WeightsStatus: per-rollout versions, acks)
    evaluator --EvalWeightsRequest--> param_server        (replies EvalWeights: one bucket of a kept version)
    evaluator --EvalGenerate--> rollout          (a request: one held-out prompt answered greedily on the rollout's
                                                  engine, or only its version; replies EvalGenerated)

Direct weights (a GPU topology's link of [trainer.0, rollout], no parameter-server link): the trainer keeps
its exported version and broadcasts it itself; the parameter server only coordinates. The sequence of
every weights path is drawn in docs/rl-actors.md (actors/weight_sync/ implements them).
    trainer --WeightsPublished--> param_server   (replies WeightsStored at once: no buckets travel to it)
    param_server --LinkReform--> trainer         (a request: the trainer joins the new group as rank 0,
                                                  replies LinkFormed)
    param_server --WeightsBroadcast--> trainer   (broadcast that stored version on the formed group while the
                                                  rollouts receive it after WeightsReady; replies
                                                  WeightsBroadcastDone)

A training batch travels as `BatchTensors`: columns, its token data as tensor frames (actors/batch.py lays
it out: the frames, each trainer rank's share, the list form the buffer assembles). Weights never travel
here (transport/bulk.py carries them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from transport.bulk import TensorMeta   # a field type of the weights messages: one bucket format
from transport.messages import Message, message, upgrade


@dataclass
class Task:
    """What a group's answers are checked against; travels with the group to its reward actor.

    kind "math": `answer` holds the reference answer, and `answers` every answer accepted when there are
    several (AReaL's data list several solutions and accept a response matching any; empty: `answer` alone).
    kind "code": `tests` holds the unit tests (the code checker's format) and `mode` optionally "stdio" or
    "functional".
    """

    kind: str = "math"
    answer: str = ""
    tests: list[dict[str, Any]] = field(default_factory=list)
    mode: str = ""
    answers: list[str] = field(default_factory=list)
    tool: str = ""  # the environment the answers are episodes in (actors/envs); "": one turn, no environment

    @property
    def references(self) -> list[str]:
        """The answers a response is checked against."""
        return list(self.answers) or ([self.answer] if self.answer else [])


@dataclass
class Sample:
    """One answer to a prompt. Per-token lists are aligned with `output_ids`. An episode's answer
    (actors/rollout/episode.py) also holds the environment's tokens; their `versions` entry is -1 (ENV_VERSION), as a
    prompt's tokens have in training: that is its loss mask, and those tokens are never trained or graded."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    reward: float = 0.0
    correct: bool = False
    score_detail: str = ""
    agent_reward: float | None = None  # what an agent (actors/rollout/agent.py) returned as its episode's reward,
                                       # which the reward actor passes on; None: the reward actor grades it
    # A mixture-of-experts model's routing, when the engine records it (algo.routing_replay: r3): the experts each
    # sparse layer routed each token fed to the model to, prompt first, [tokens, sparse layers, top-k], uint8
    # (int16 past 256 experts). It may cover fewer tokens than prompt + answer; the rest are routed natively.
    routed_experts: torch.Tensor | None = None


# A group's messages carry only what their receiver lacks: the prompt goes to the rollout and, in the Batch,
# to the trainer; the task to the rollout, which passes it to the reward actor; the answers (`Answers`)
# travel from the rollout through the reward actor, which scores them, to the buffer, which knows each
# group's prompt and task by its group id.


@message("rl.generate_group", senders=("buffer",))
class GenerateGroup(Message):
    """buffer -> rollout: generate `n` answers to one prompt. `task` is for the reward actor that scores them."""

    group_id: str
    prompt_ids: list[int]
    n: int
    task: Task
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    reward: str = ""  # the reward actor that scores this group (chosen by the buffer); "" = rollout's choice


@dataclass
class Answers:
    """The answers a rollout generated to one prompt, with its clocks. Unscored in Trajectories; the reward
    actor fills in each sample's reward, correct and score_detail and sends them on in ScoredGroup."""

    VOLATILE: ClassVar[tuple[str, ...]] = ("gen_seconds", "busy_seconds", "up_seconds")

    samples: list[Sample]
    rollout: str
    gen_seconds: float = 0.0
    busy_seconds: float = 0.0  # the rollout's clocks since its start, when it sent this group: time with work
    up_seconds: float = 0.0    # in hand, and time up (the buffer turns them into rollout utilisation)
    # The prompt the samples continue, as the rollout rendered it: an agent's conversation starts from its own
    # first chat rendering, not the prompt the buffer issued. Empty: the group's prompt as issued. The buffer's
    # batch takes this one when it is set.
    prompt_ids: list[int] = field(default_factory=list)


@message("rl.trajectories", senders=("rollout",))
class Trajectories(Message):
    """rollout -> reward: one group's answers, unscored, and the task they are checked against."""

    group_id: str
    task: Task
    answers: Answers


@message("rl.scored_group", senders=("reward",))
class ScoredGroup(Message):
    """reward -> buffer: the group's answers, scored."""

    VOLATILE: ClassVar[tuple[str, ...]] = ("score_seconds",)

    group_id: str
    answers: Answers
    score_seconds: float = 0.0
    score_failures: int = 0


@message("rl.group_returned", senders=("rollout",))
class GroupReturned(Message):
    """rollout -> buffer: a group handed back unfinished (drain, engine failure); the buffer re-issues it."""

    group_id: str
    reason: str


@message("rl.abort_group", senders=("buffer",))
class AbortGroup(Message):
    """buffer -> rollout, a request: the group's time ran out; stop generating it (the SGLang engine sends
    /abort_request for each of its samples). The buffer issues it again only once the reply says the copy
    stopped (or the rollout cannot answer), so a server never generates two copies of a group at once."""

    group_id: str
    reason: str = ""


@message("rl.group_aborted", senders=("rollout",))
class GroupAborted(Message):
    """rollout -> buffer, the reply to AbortGroup: whether the rollout held the group (`held`; false: it never
    reached it, or it was done) and whether its generation has stopped (`stopped`)."""

    group_id: str
    held: bool = False
    stopped: bool = True


@message("rl.batch_request", senders=("trainer",))
class BatchRequest(Message):
    """trainer -> buffer: the batch for training step `step` (the reply is a BatchTensors)."""

    step: int


@dataclass
class BufferStats:
    depth: int = 0
    running: int = 0
    accepted: int = 0
    dropped_stale: int = 0
    dropped_uniform: int = 0
    returned: int = 0
    data_pass: int = 0   # passes over the dataset begun before this one (the first pass is 0)
    rollout_utilisation: float = -1.0   # rollouts' time with work / time up since the previous batch (-1: unknown)


@message("rl.batch")
class BatchTensors(Message):
    """buffer -> trainer (reply to BatchRequest), and trainer.0 -> each other trainer rank (its share).

    Columns, samples in group order. Per group: `levels`, `group_sizes` (answers), `prompt_lens`; per sample:
    `output_lens`, `rewards`, `correct`, `finish_reasons`, `score_details`. Token data as tensors, each a list
    of 1-D chunks (one frame each, so no frame nears the bus's limit whatever the batch's size; actors/batch.py
    splits them): `prompt_ids` (int32, every group's prompt, concatenated), and for the samples named by
    `carried` (ascending sample indices; None: every sample), concatenated in that order, `output_ids`
    (int32), `logprobs` (float32: the behaviour log-probs, as the trainer computes in float32) and
    `versions` (int32, the weight version of each token). The scalar columns are always whole: a trainer
    rank needs every sequence's length, group and reward to split the batch and normalise advantages, and
    only its own sequences' tokens.
    """

    # The queue snapshot taken when the batch was cut depends on how many in-flight messages the event loop
    # had taken by then, which a replay schedules differently; the batch's content is compared in full.
    VOLATILE: ClassVar[tuple[str, ...]] = ("stats",)

    step: int
    stats: BufferStats
    levels: list[int]
    group_sizes: list[int]
    prompt_lens: list[int]
    output_lens: list[int]
    rewards: list[float]
    correct: list[bool]
    finish_reasons: list[str]
    score_details: list[str]
    prompt_ids: list[torch.Tensor]
    output_ids: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    versions: list[torch.Tensor]
    carried: list[int] | None = None
    # Per carried sample, its Sample.routed_experts (an empty 1-D tensor where it has none); empty: no sample has any.
    routed_experts: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        # What arrives must add up before a trainer rank indexes with it: a message whose columns disagree is
        # refused at decoding (a TypeError here is a FieldError there), naming the column.
        n_groups, n = len(self.group_sizes), len(self.output_lens)
        for name in ("levels", "prompt_lens"):
            if len(getattr(self, name)) != n_groups:
                raise TypeError(f"batch column {name}: {len(getattr(self, name))} values for {n_groups} groups")
        if any(x < 0 for x in self.group_sizes) or sum(self.group_sizes) != n:
            raise TypeError(f"batch column group_sizes: groups of {self.group_sizes[:8]}... hold "
                            f"{sum(self.group_sizes)} answers, output_lens has {n}")
        for name in ("rewards", "correct", "finish_reasons", "score_details"):
            if len(getattr(self, name)) != n:
                raise TypeError(f"batch column {name}: {len(getattr(self, name))} values for {n} answers")
        if any(x < 0 for x in self.output_lens) or any(x < 0 for x in self.prompt_lens):
            raise TypeError("batch columns output_lens, prompt_lens: lengths must not be negative")
        carried = range(n) if self.carried is None else self.carried
        if self.carried is not None and (any(not 0 <= s < n for s in carried)
                                         or any(a >= b for a, b in zip(carried, carried[1:]))):
            raise TypeError(f"batch column carried: must be ascending sample indices below {n}")
        answer_tokens = sum(self.output_lens[s] for s in carried)
        for name, dtype, want in (("prompt_ids", torch.int32, sum(self.prompt_lens)),
                                  ("output_ids", torch.int32, answer_tokens), ("logprobs", torch.float32, answer_tokens),
                                  ("versions", torch.int32, answer_tokens)):
            chunks = getattr(self, name)
            if any(c.dtype != dtype or c.dim() != 1 for c in chunks):
                raise TypeError(f"batch column {name}: chunks must be 1-D {str(dtype).removeprefix('torch.')}")
            if sum(c.numel() for c in chunks) != want:
                raise TypeError(f"batch column {name}: {sum(c.numel() for c in chunks)} tokens, the "
                                f"{'prompts' if name == 'prompt_ids' else 'carried answers'} have {want}")
        if self.routed_experts:
            if len(self.routed_experts) != len(carried):
                raise TypeError(f"batch column routed_experts: {len(self.routed_experts)} entries for "
                                f"{len(carried)} carried answers")
            group_of = [g for g, size in enumerate(self.group_sizes) for _ in range(size)]
            for s, routes in zip(carried, self.routed_experts):
                tokens = self.prompt_lens[group_of[s]] + self.output_lens[s]
                if routes.dtype not in (torch.uint8, torch.int16) or routes.dim() not in (1, 3) or (
                        routes.dim() == 1 and routes.numel()) or (routes.dim() == 3 and routes.shape[0] > tokens):
                    raise TypeError(f"batch column routed_experts: answer {s} has a {str(routes.dtype)[6:]} tensor of "
                                    f"shape {tuple(routes.shape)}; expected uint8/int16 [at most {tokens} tokens, "
                                    "sparse layers, top-k] or empty")


@message("rl.version_update", senders=("trainer",))
class VersionUpdate(Message):
    """trainer -> buffer: the trainer finished step `version` (versions count training steps)."""

    version: int


@message("rl.weights_published", senders=("trainer",))
class WeightsPublished(Message):
    """trainer -> param_server: the buckets of `version` follow on the train_to_ps bulk link (relay), or
    are kept by the trainer (direct weights). `specs`: per bucket, its tensors (direct weights only).
    `stage_buckets`: with a pipeline-parallel trainer, how many of the buckets each stage sends, in stage
    order (each stage broadcasts its own layers on its own group); empty: one sender. `link_epoch` (relay):
    the train link's epoch the buckets come on; the parameter server joins it first if it is elsewhere (it
    restarted, or the trainer moved to a fresh epoch after a failed transfer)."""

    VOLATILE: ClassVar[tuple[str, ...]] = ("incarnation",)

    version: int
    n_buckets: int
    weights_hash: str
    specs: list[list[TensorMeta]] = field(default_factory=list)
    stage_buckets: list[int] = field(default_factory=list)
    link_epoch: int = 0
    incarnation: str = ""   # of the trainer process: a restarted trainer counts its epochs from 0 again


@message("rl.weights_stored")
class WeightsStored(Message):
    VOLATILE: ClassVar[tuple[str, ...]] = ("receive_seconds",)
    version: int
    receive_seconds: float


@message("rl.weights_ready", senders=("param_server",))
class WeightsReady(Message):
    """param_server -> rollout: the buckets of `version` follow on the weights link: sent to each rollout on
    its own (`point_to_point`, the relay: a late member holds up nobody else) or broadcast (the trainer's
    direct weights)."""

    version: int
    n_buckets: int
    weights_hash: str
    epoch: int
    specs: list[list[TensorMeta]] = field(default_factory=list)   # direct weights: for servers that receive
    stage_buckets: list[int] = field(default_factory=list)        # as in WeightsPublished
    point_to_point: bool = False


@message("rl.weights_ack")
class WeightsAck(Message):
    """rollout -> param_server: `version` is live. `verified` says how the rollout knows: "hash" (the
    engine's own hash of the weights it samples with is `weights_hash`) or "version" (a server that cannot
    read its weights back, such as SGLang, reports `version` after a successful update; `weights_hash` "")."""

    VOLATILE: ClassVar[tuple[str, ...]] = ("receive_seconds", "stall_seconds")

    version: int
    weights_hash: str
    receive_seconds: float
    stall_seconds: float = 0.0
    verified: str = "hash"


@message("rl.rollout_hello", senders=("rollout",))
class RolloutHello(Message):
    """rollout -> param_server: a (re)started rollout at `version` joins; it needs the current weights.
    `weight_ranks` > 0: its server joins the direct weights group itself, as that many ranks (an SGLang
    server, one per tensor-parallel rank); 0: the actor receives on the bulk link."""

    VOLATILE: ClassVar[tuple[str, ...]] = ("incarnation",)

    version: int
    weight_ranks: int = 0
    incarnation: str = ""   # one per process start: a repeated hello of the same process changes nothing


@message("rl.hello_request", senders=("param_server", "buffer"))
class HelloRequest(Message):
    """param_server -> rollout, or buffer -> rollout and reward, when it starts: say RolloutHello (to the
    parameter server) or WorkerHello (to the buffer) again. One restarted in place knows nothing of the
    workers, and one restarted faster than the heartbeat timeout is never missed."""


@message("rl.server_down", senders=("rollout",))
class ServerDown(Message):
    """rollout -> param_server: the server that receives this rollout's weights died and is being restarted
    (its ``restarts`` so far). A group formed meanwhile would wait its whole link timeout for the missing
    ranks; the parameter server forms none with this rollout until it says RolloutHello again."""

    restarts: int = 0


@message("rl.worker_hello", senders=("rollout", "reward"))
class WorkerHello(Message):
    """rollout/reward -> buffer, on every start: groups the buffer had assigned to an earlier incarnation
    of this worker died with it and are issued again (a restart can be faster than heartbeats notice).
    `kv_tokens`: the KV pool of a rollout's server in tokens (0: not known), which caps its groups."""

    role: str
    kv_tokens: int = 0


@message("rl.link_reform", senders=("param_server",))
class LinkReform(Message):
    """param_server -> rollout (and, with direct weights, -> trainer as a request): re-form the weights link at
    `epoch` (a member restarted, or one that hung is left out: `members` names who forms it, the link's
    master first). Direct weights to servers that join themselves: the trainer gets
    `world_size` and hosts the group (replies LinkFormed with its address and port); each rollout gets them,
    its `rank_offset` and `world_size`. A pipeline-parallel trainer hosts one group per stage, each stage's
    sender as its rank 0: one address and port per stage, in stage order, and the servers join every one."""

    epoch: int
    master_addrs: list[str] = field(default_factory=list)
    master_ports: list[int] = field(default_factory=list)
    rank_offset: int = -1
    world_size: int = 0
    members: list[str] = field(default_factory=list)   # who forms this epoch (empty: every member)


@message("rl.link_formed")
class LinkFormed(Message):
    """trainer -> param_server (direct weights): the trainer joined the group of `epoch` (or, for a
    group of servers, is hosting it, one group per pipeline stage, and joins while they do)."""

    VOLATILE: ClassVar[tuple[str, ...]] = ("seconds",)

    epoch: int
    seconds: float
    master_addrs: list[str] = field(default_factory=list)
    master_ports: list[int] = field(default_factory=list)


@message("rl.weights_broadcast", senders=("param_server",))
class WeightsBroadcast(Message):
    """param_server -> trainer (direct weights): broadcast stored `version` on the group of `epoch`."""

    version: int
    epoch: int


@message("rl.weights_broadcast_done")
class WeightsBroadcastDone(Message):
    VOLATILE: ClassVar[tuple[str, ...]] = ("seconds",)
    version: int
    seconds: float


@dataclass
class RolloutWeights:
    version: int = -1
    weight_ranks: int = 0     # > 0: its server joins the direct weights group itself, as this many ranks
    weights_hash: str = ""
    verified: str = ""        # how its last ack was checked: "hash" or "version" (WeightsAck.verified)
    ack_ok: bool = False      # the last ack passed that check for the version pushed
    alive: bool = True
    hello: bool = False
    incarnation: str = ""     # of the process that said hello last
    hello_at: float = 0.0     # time.monotonic() of that hello
    receive_seconds: float = 0.0
    stall_seconds: float = 0.0

    VOLATILE: ClassVar[tuple[str, ...]] = ("incarnation", "hello_at", "receive_seconds", "stall_seconds")


@message("ps.weights_status_request", senders=("trainer",))
class WeightsStatusRequest(Message):
    """Ask the parameter server for its state. With ``min_version`` >= 0 and ``timeout_s`` > 0 the reply
    waits (up to ``timeout_s``; ``reached`` says whether it happened) until every rollout is alive, has
    said hello and acked at least that version, the ack passing its check (the hash, or the version an
    SGLang server reports; a rollout still at the start version has nothing to ack), on a link epoch
    >= ``min_epoch``."""

    min_version: int = -1
    min_epoch: int = -1
    timeout_s: float = 0.0


@message("ps.weights_status")
class WeightsStatus(Message):
    VOLATILE: ClassVar[tuple[str, ...]] = ("last_sync_seconds",)

    version: int
    weights_hash: str
    epoch: int
    rollouts: dict[str, RolloutWeights]
    pushes: int
    hash_mismatches: int
    last_sync_seconds: float
    reached: bool


@message("ps.eval_weights_request", senders=("evaluator",))
class EvalWeightsRequest(Message):
    """The evaluator's request for bucket ``bucket`` of the weights kept for evaluation. With ``version``
    -1: of the newest kept version newer than ``after``, waiting up to ``timeout_s`` for one; otherwise of
    that version (if it is no longer kept, the reply's version is -1 and the evaluator starts again)."""

    after: int = -1
    version: int = -1
    bucket: int = 0
    timeout_s: float = 0.0


@message("ps.eval_weights")
class EvalWeights(Message):
    """One bucket of a kept version (``version`` -1: none to give; ``flat`` is then empty). ``newest`` is
    the newest version stored here when it was sent: how far training has got beyond the one evaluated."""

    version: int
    newest: int
    weights_hash: str
    n_buckets: int
    bucket: int
    header: dict[str, Any]
    flat: torch.Tensor
    unavailable: str = ""    # why this server can never give any (then version is -1)


@message("rl.eval_generate", senders=("evaluator",))
class EvalGenerate(Message):
    """evaluator -> rollout, a request: answer one held-out prompt greedily (temperature 0, one answer) on the
    rollout's engine, beside its groups and through the same generation path (a weight update mid-answer shows
    in the reply's per-token versions). Empty ``prompt_ids``: generate nothing, reply with the engine's version
    only (how the evaluator follows the run's versions)."""

    prompt_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)


@message("rl.eval_generated", senders=("rollout",))
class EvalGenerated(Message):
    """rollout -> evaluator, the reply to EvalGenerate: the answer with the weight version of each token, and the
    engine's version when it replied. ``error`` (then no answer): why it could not; starting with ``invalid:``,
    no rollout can answer that prompt."""

    version: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""


@message("rl.checkpoint_request", senders=("trainer",))
class CheckpointRequest(Message):
    """trainer -> buffer: save your state for training step `step` (reply CheckpointDone). No path: the
    buffer writes into its own run directory's checkpoint of that step, so no sender can make it write
    anywhere else."""

    step: int


@message("rl.checkpoint_done")
class CheckpointDone(Message):
    step: int


@message("rl.run_finished", senders=("trainer",))
class RunFinished(Message):
    """trainer -> every actor: the run reached its last step; stop cleanly."""

    step: int
    reason: str = "done"


# ------------------------------------------------------------------------------------ older schema versions
# How versions 5 to 8 changed these kinds, so that a message log written before them still decodes and replays
# (transport/messages.py: upgraded_body). Versions 3 and 4 reshaped whole bodies and are not upgraded.

@upgrade(5, "rl.generate_group", "rl.trajectories")
def _task_without_level(body: dict) -> dict:
    # The buffer holds each prompt's level; the task no longer carries it.
    task = body.get("task")
    if type(task) is dict and "level" in task:
        body = {**body, "task": {k: v for k, v in task.items() if k != "level"}}
    return body


_EPOCH_NAMES = {"generation": "epoch", "min_generation": "min_epoch"}


@upgrade(6, "rl.link_reform", "rl.link_formed", "rl.weights_ready", "rl.weights_broadcast",
         "ps.weights_status_request", "ps.weights_status")
def _link_epoch(body: dict) -> dict:
    # "generation" also named the rollouts' text generation: a link's re-formation count is its epoch.
    return {_EPOCH_NAMES.get(k, k): v for k, v in body.items()}


@upgrade(7, "rl.batch")
def _data_pass(body: dict) -> dict:
    # "epoch" also named the weights link's re-formation count: the stats' count of data passes is data_pass.
    stats = body.get("stats")
    if type(stats) is dict and "epoch" in stats:
        body = {**body, "stats": {("data_pass" if k == "epoch" else k): v for k, v in stats.items()}}
    return body


@upgrade(8, "rl.trajectories", "rl.scored_group")
def _answers_prompt(body: dict) -> dict:
    # Answers carry the prompt the rollout rendered (empty before: the buffer's) and samples an agent's reward.
    answers = body.get("answers")
    if type(answers) is dict and "prompt_ids" not in answers:
        body = {**body, "answers": {**answers, "prompt_ids": []}}
    return body
