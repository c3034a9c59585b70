"""The experiment config's schema (configs/*.yaml and `experiment.*` overrides), checked before anything runs.

Every key an actor reads from the experiment is declared here once with its type, bounds and one line of
doc; an unknown or misplaced key is refused with its full path (`experiment.algo.kl_coeff: unknown key`), as
is a value out of bounds (`experiment.algo.eta: must be >= 0, got -1`). A key left out of the file takes
the default its actor states (the `default` named in each description).

`prepare` is free-form here: `tools.prepare` checks it against the tools it runs.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["ExperimentConfig", "experiment_problems"]


class _Section(BaseModel):
    # Unknown keys are errors: a misspelt key would otherwise be silently ignored. Floats must be finite.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ModelSection(_Section):
    path: str | None = Field(None, description="starting model: a Hugging Face directory (config, tokenizer, weights)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="engine dtype (default float32)")


class DataFields(_Section):
    query_id: str | None = Field(None, description="field holding the unique id; null numbers the lines")
    prompt: str | None = Field(None, min_length=1, description="field holding the question")
    answer: str | None = Field(None, description="field holding the final answer")
    solutions: str | None = Field(None, description="field holding a list of worked solutions")
    solution: str | None = Field(None, description="field holding one worked solution (a string)")
    level: str | None = Field(None, description="field holding the difficulty level")


class DataSection(_Section):
    train: str | None = Field(None, description="JSON-lines prompts the buffer serves")
    test: str | None = Field(None, description="held-out JSON-lines file for the final evaluation")
    layout: Literal["areal", "gsm8k", "math"] | None = Field(
        None, description="field layout of train and test (actors/dataset.py): areal (boba/orz and ours), gsm8k "
                          "(question/answer after ####), math (problem/solution with \\boxed{}) (default areal)")
    fields: DataFields | None = Field(None, description="field names that differ from the layout's")
    answer_after: str | None = Field(None, min_length=1, description="the answer is the text after this marker (gsm8k: ####)")
    id2info: str | None = Field(None, description="AReaL's answer file {query_id: {solutions: [...]}} for prompt files without answers")
    prompt_template: str | None = Field(None, pattern=r"\{prompt\}", description="wraps each prompt; {prompt} marks where it goes")
    on_bad_line: Literal["skip", "fail"] | None = Field(None, description="a malformed line: skip it or stop (default skip)")
    require: Literal["answer", "solutions", "none"] | None = Field(None, description="what each record must carry (default answer)")
    max_line_bytes: int | None = Field(None, ge=1, description="longer lines are refused at load (default 1 MiB)")


class AlgoSection(_Section):
    batch_size: int | None = Field(None, ge=1, description="prompts per training step, B (default 32)")
    group_size: int | None = Field(None, ge=1, description="answers sampled per prompt (default 8)")
    eta: int | None = Field(None, ge=0, description="maximum staleness in versions; 0 is synchronous (default 4)")
    ppo_minibatches: int | None = Field(None, ge=1, description="optimizer steps per training step (default 1)")
    max_tokens_per_mb: int | None = Field(None, ge=1, description="tokens per packed micro-batch (default 4096)")
    lr: float | None = Field(None, gt=0, description="Adam learning rate (default 2e-5)")
    adam_eps: float | None = Field(None, gt=0, description="Adam epsilon (default 1e-5)")
    adam_beta1: float | None = Field(None, ge=0, lt=1, description="Adam beta1 (default 0.9)")
    adam_beta2: float | None = Field(None, ge=0, lt=1, description="Adam beta2 (default 0.999)")
    weight_decay: float | None = Field(None, ge=0, description="decoupled weight decay (default 0)")
    grad_clip: float | None = Field(None, ge=0, description="gradient-norm clip; 0 disables (default 1.0)")
    eps_clip: float | None = Field(None, gt=0, description="PPO clip, lower side (default 0.2)")
    eps_clip_high: float | None = Field(None, gt=0, description="PPO clip, upper side (default: eps_clip)")
    dual_clip: float | None = Field(None, gt=1, description="dual-clip bound on negative advantages (default off)")
    behav_imp_weight_cap: float | None = Field(None, ge=0, description="cap of the behaviour importance weight; 0 disables (default 5)")
    decoupled: bool | None = Field(None, description="decoupled PPO objective; false is plain PPO (default true)")
    group_std: bool | None = Field(None, description="divide group-relative advantages by the group's std (default true)")
    adv_norm: Literal["batch", "group", "none"] | None = Field(
        None, description="advantage normalisation: over all tokens of the batch, within each group, or none (default batch)")
    dynamic_sampling: bool | None = Field(None, description="drop groups whose answers all got one reward (default false)")
    reward_correct: float | None = Field(None, description="reward of a correct answer (default 5)")
    reward_wrong: float | None = Field(None, description="reward of a wrong answer (default -5)")
    kl_coef: float | None = Field(None, ge=0, description="KL penalty to the frozen starting weights (model.path) in the token rewards; 0 is off (default 0)")
    kl_estimator: Literal["k1", "k2", "k3"] | None = Field(None, description="per-token KL estimator of the penalty (default k1)")


class GenSection(_Section):
    max_new_tokens: int | None = Field(None, ge=1, description="answer length limit (default 64)")
    temperature: float | None = Field(None, ge=0, description="sampling temperature; 0 is greedy (default 1.0)")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling (default 1.0: off)")
    top_k: int | None = Field(None, ge=-1, description="top-k sampling; -1 or 0 is off (default -1)")
    interruptible: bool | None = Field(None, description="weights swap mid-answer; false pauses and resumes (default true)")


class EvalSection(_Section):
    max_per_level: int | None = Field(None, ge=1, description="held-out problems per level in the final evaluation (default all)")
    every_versions: int | None = Field(None, ge=0, description="evaluate on data.test every N weight versions during the run, in the evaluator actor; 0 is off (default 0)")
    max_problems: int | None = Field(None, ge=1, description="held-out problems of each evaluation during the run, spread over the levels (default 64)")
    wait_s: float | None = Field(None, gt=0, description="how long the evaluator's request waits for a new version (default 30)")


class RunSection(_Section):
    total_steps: int | None = Field(None, ge=1, description="training steps of the run (default 100)")
    checkpoint_every_steps: int | None = Field(None, ge=1, description="steps between checkpoints (default 20)")
    keep_checkpoints: int | None = Field(None, ge=0, description="complete checkpoints kept; 0 keeps all (default 2)")
    recover: Literal["auto", "off"] | None = Field(None, description="resume from the last checkpoint (default auto)")
    final_eval: bool | None = Field(None, description="evaluate the last checkpoint on data.test at the end (default true)")

    @field_validator("recover", mode="before")
    @classmethod
    def _yaml_boolean(cls, value: Any) -> Any:
        # YAML reads a bare `off` (in a file, or in `experiment.run.recover=off`) as false; actors.recovery
        # reads false as off too.
        return {False: "off", True: "auto"}[value] if isinstance(value, bool) else value


class BufferSection(_Section):
    max_groups_per_rollout: int | None = Field(None, ge=1, description="groups in flight on one rollout (default 8)")
    max_concurrent_groups: int | None = Field(None, ge=1, description="groups in flight in all (default: no limit)")
    group_timeout_s: float | None = Field(None, gt=0, description="a group with no result after this is issued again")


class ExperimentConfig(_Section):
    seed: int | None = Field(None, description="seed of sampling, data order and initialisation (default 1)")
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    prepare: dict[str, Any] | None = Field(None, description="data and warm start made before the run (tools.prepare)")
    algo: AlgoSection = Field(default_factory=AlgoSection)
    gen: GenSection = Field(default_factory=GenSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    run: RunSection = Field(default_factory=RunSection)
    buffer: BufferSection = Field(default_factory=BufferSection)


def experiment_problems(doc: dict[str, Any], prefix: str = "experiment") -> list[str]:
    """One line per problem of an experiment document, each naming the key's full path."""
    try:
        ExperimentConfig.model_validate(doc)
    except ValidationError as exc:
        return [_line(err, prefix) for err in exc.errors()]
    return []


def _line(err: Any, prefix: str) -> str:
    path = ".".join([prefix, *(str(p) for p in err["loc"])])
    if err["type"] == "extra_forbidden":
        return f"{path}: unknown key"
    got = err.get("input")
    return f"{path}: {err['msg'][0].lower() + err['msg'][1:]} (value: {got!r})"
