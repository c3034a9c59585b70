"""The experiment config's schema (configs/*.yaml, and `experiment.*` overrides), checked before anything runs.

Every key an actor reads from the experiment is declared here once with its type, default, bounds and one line
of doc; the actors read the typed values (``actor.cfg.algo.eta``), so a default lives nowhere else. An unknown
or misplaced key is refused with its full path (`experiment.algo.kl_coeff: unknown key`), as is a value out of
bounds (`experiment.algo.eta: input should be greater than or equal to 0`).

A default of None means the key has no single default: its description says what happens when it is left out.
`prepare`'s layout is declared here; the `args` of its steps are the flags of `make_task` and the fields of
`SFTConfig` (launch/prepare/), which the prepare stage checks against them, since this package imports nothing above it.
"""
from __future__ import annotations

import importlib.util

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from topology.section import Section, problem_lines, when_missing

__all__ = ["Section", "LoraSection", "ModelSection", "DataFields", "DataSection", "PROMPT_TEMPLATES", "DataLayout",
           "prompt_template_text", "AREAL_ALIASES", "AREAL_NOT_ALIASED", "with_our_names", "DatasetRecipe", "WarmStartStage",
           "WarmStartSection", "PrepareSection", "when_missing", "LOSS_SETTINGS", "LOSS_SOURCES", "switched_loss", "AlgoSection", "GenSection", "EvalSection", "RunSection",
           "WatchdogSection",
           "BufferSection", "ExperimentConfig", "experiment_problems", "DEFAULT_MAX_LINE_BYTES"]

DEFAULT_MAX_LINE_BYTES = 1 << 20


class LoraSection(Section):
    rank: int = Field(8, ge=1, le=1024, description="rank of each adapter (at most the smaller dimension of every targeted layer)")
    alpha: float = Field(16.0, gt=0, description="the adapter's output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: list[Annotated[str, Field(min_length=1)]] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
        description="linear layers adapted, by their Hugging Face names (q_proj, k_proj, v_proj, o_proj, gate_proj, "
                    "up_proj, down_proj, lm_head), as PEFT's target_modules")
    adapter: str | None = Field(None, description="a PEFT-layout adapter directory to start from (unset: a new adapter "
                                                  "that leaves the model unchanged)")


class ModelSection(Section):
    path: str | None = Field(None, description="starting model: a Hugging Face directory (config, tokenizer, weights)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="engine dtype (unset: float32 in the torch engines, the checkpoint's own in SGLang)")
    lora: LoraSection | None = Field(
        None, description="train LoRA adapters on the frozen model.path instead of all weights; each weight version "
                          "is the adapter alone (unset: full fine-tuning)")


class DataFields(Section):
    query_id: str | None = Field(None, description="field holding the unique id; null numbers the lines")
    prompt: str | None = Field(None, min_length=1, description="field holding the question")
    answer: str | None = Field(None, description="field holding the final answer")
    solutions: str | None = Field(None, description="field holding a list of worked solutions")
    solution: str | None = Field(None, description="field holding one worked solution (a string)")
    level: str | None = Field(None, description="field holding the difficulty level")


# Prompt templates a config (data.prompt_template) or tools.eval (--template) may name: AReaL's evaluation
# templates, as its evaluation/utils.py (tag v0.2.0, PROMPT_TEMPLATES) writes them, with {prompt} for its {input}.
# The R1 templates end the prompt with "<think>\n", so the answer starts after it (the tutorial's protocol).
_R1_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
PROMPT_TEMPLATES: dict[str, str] = {
    # "r1-distilled-qwen" (line 156): DeepSeek-R1-Distill-Qwen's chat turn, the tutorial's evaluation default
    "r1-distilled-qwen": "<｜begin▁of▁sentence｜><｜User｜>{prompt}" + _R1_INSTRUCTION + "<｜Assistant｜><think>\n",
    # "AReaL-boba" (line 151): the same turn without the begin-of-sentence token
    "boba": "<｜User｜>{prompt}" + _R1_INSTRUCTION + "<｜Assistant｜><think>\n",
    # "orz" (line 182): Open-Reasoner-Zero's template for base models (Qwen2.5-7B-Zero)
    "orz": ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it."
            "The assistant first thinks about the reasoning process in the mind and then provides the user with the "
            "answer.The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> "
            "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>. "
            "User: You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
            "And your final answer will be extracted automatically by the \\boxed{} tag. This is the problem: "
            "{prompt}\nAssistant: <think>\n"),
}
DataLayout = Literal["areal", "areal_eval", "gsm8k", "math"]
_LAYOUT_DOC = ("areal (query_id, prompt, solutions or answer: boba, orz, prompts_for_r1_distilled + id2info, ours), "
               "areal_eval (AReaL's evaluation/data/<name>/test.jsonl: question or problem, answer or solution), "
               "gsm8k (question/answer after ####), math (problem/solution with \\boxed{})")


def prompt_template_text(value: str) -> str:
    """The template a `data.prompt_template` value names: one of `PROMPT_TEMPLATES`, or a text with {prompt}."""
    if value in PROMPT_TEMPLATES:
        return PROMPT_TEMPLATES[value]
    if "{prompt}" in value:
        return value
    import difflib
    close = difflib.get_close_matches(value, list(PROMPT_TEMPLATES), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"must contain {{prompt}} or name a template of {sorted(PROMPT_TEMPLATES)}, got "
                     f"{value[:60]!r}{hint}")


class DataSection(Section):
    train: str | None = Field(None, description="JSON-lines prompts the buffer serves (a wget download's "
                                                "'NAME?download=true' is found under NAME too)")
    test: str | None = Field(None, description="held-out JSON-lines file for the evaluations during and after the run")
    layout: DataLayout = Field(
        "areal", description="field layout of train (and of test unless test_layout): " + _LAYOUT_DOC)
    test_layout: DataLayout | None = Field(
        None, description="field layout of test when it differs from train's (unset: layout, with fields and id2info)")
    fields: DataFields | None = Field(None, description="field names that differ from the layout's")
    answer_after: str | None = Field(None, min_length=1, description="the answer is the text after this marker (gsm8k: ####)")
    id2info: str | None = Field(None, description="AReaL's answer file {query_id: {solutions: [...]}} for prompt files without answers")
    prompt_template: str | None = Field(
        None, description="wraps each prompt ({prompt} marks where it goes) unless the prompt already carries a "
                          "template; or the name of one: " + ", ".join(PROMPT_TEMPLATES))
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="prompts longer than this many tokens are left out of training, as AReaL's "
                                "dataset.max_prompt_len does (unset: no cap)")
    on_bad_line: Literal["skip", "fail"] | None = Field(
        None, description="a malformed line: skip it or stop (unset: the buffer skips in data.train, the evaluator "
                          "stops in data.test)")
    require: Literal["answer", "solutions", "none"] = Field("answer", description="what each training record must carry")
    max_line_bytes: int = Field(DEFAULT_MAX_LINE_BYTES, ge=1, description="longer lines are refused at load")
    max_bad_share: float = Field(
        0.05, ge=0, le=1, description="with on_bad_line: skip, the largest share of a file's lines that may be "
                                      "malformed; more fails the launch (and the load)")

    @field_validator("prompt_template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        if value is not None:
            prompt_template_text(value)
        return value


def _command_line_value(value: Any) -> Any:
    if isinstance(value, (dict, list)):
        raise ValueError(f"expected a scalar command-line value, got {type(value).__name__}")
    return value


# A prepare step's `args`: `key: value` becomes the tool's `--key value` (true: the bare flag; false, null: left out).
ToolArgs = dict[str, Annotated[Any, AfterValidator(_command_line_value)]]


class DatasetRecipe(Section):
    out: str = Field(min_length=1, description="dataset folder (train.jsonl, test.jsonl), made when either is missing",
                     json_schema_extra=when_missing("missing: the dataset folder to make"))
    args: ToolArgs = Field(default_factory=dict, description="python -m tools.make_task flags")


class WarmStartStage(Section):
    data: str = Field(min_length=1, description="dataset folder: train.jsonl to learn, test.jsonl to find the plateau",
                      json_schema_extra=when_missing("missing: the stage's dataset folder (train.jsonl, test.jsonl)"))
    args: ToolArgs = Field(default_factory=dict, description="launch.prepare.sft.SFTConfig fields (data, out, model are set here)")


class WarmStartSection(Section):
    out: str = Field(min_length=1, description="where the stages' checkpoints go; reused while their inputs are unchanged",
                     json_schema_extra=when_missing("missing: where to write the warm-start checkpoints"))
    stages: list[WarmStartStage] | None = Field(
        None, description="supervised stages in order, each from the previous one's weights (unset: one stage on "
                          "data.train's folder with `args`)")
    args: ToolArgs | None = Field(None, description="the single stage's tools.sft args when `stages` is unset")
    upcycle: str | None = Field(
        None, description="a dense model directory with weights whose attention, embeddings and MLPs seed a "
                          "mixture-of-experts model.path before the first stage (each expert a slice of the dense "
                          "MLP, routers random; launch/prepare/upcycle.py); unset: the first stage starts from "
                          "random weights")
    shipped: str | None = Field(
        None, description="a model directory holding this recipe's warm start, made by `python -m tools.prepare "
                          "TOPOLOGY --ship` (its manifest warm_start.json: the recipe's fingerprint and the weights' "
                          "sha256); used instead of training while both match, else refused and the warm start "
                          "trained")


class PrepareSection(Section):
    data: list[DatasetRecipe] = Field(default_factory=list, description="datasets made by tools.make_task when missing")
    warm_start: WarmStartSection | None = Field(
        None, description="supervised training when model.path has no weights (unset: the model must have them)")


LossName = Literal["ppo", "grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "cispo",
                   "sapo", "lite_ppo"]
_GROUP = {"group_norm": True, "group_std": True, "baseline": "mean", "std_level": "group", "adv_norm": "none"}
# What each loss name fixes, from its paper (LOSS_SOURCES; docs/algo.md has the table). algo/losses.py's
# POLICY_LOSSES gives each name its surrogate; tests/test_algo_losses.py checks both name the same losses.
LOSS_SETTINGS: dict[str, dict[str, Any]] = {
    "ppo": {},
    "grpo": {**_GROUP, "loss_agg_mode": "seq-mean-token-mean"},
    "dr_grpo": {**_GROUP, "group_std": False, "loss_agg_mode": "seq-mean-token-sum-norm"},
    "dapo": {**_GROUP, "loss_agg_mode": "token-mean", "eps_clip": 0.2, "eps_clip_high": 0.28, "overlong_buffer": 0.2,
             "dynamic_sampling": True},
    "gspo": {**_GROUP, "loss_agg_mode": "seq-mean-token-mean", "eps_clip": 3e-4, "eps_clip_high": 4e-4},
    "rloo": {**_GROUP, "group_std": False, "baseline": "leave_one_out", "loss_agg_mode": "seq-mean-token-sum"},
    "reinforce_pp": {"group_norm": False, "adv_norm": "batch", "loss_agg_mode": "token-mean"},
    "reinforce_pp_baseline": {"group_norm": True, "group_std": False, "baseline": "mean", "adv_norm": "batch",
                              "loss_agg_mode": "token-mean"},
    "cispo": {**_GROUP, "loss_agg_mode": "token-mean", "eps_clip": 1.0, "eps_clip_high": 4.0},
    "sapo": {**_GROUP, "loss_agg_mode": "seq-mean-token-mean"},
    "lite_ppo": {**_GROUP, "std_level": "batch", "loss_agg_mode": "token-mean"},
}
LOSS_SOURCES: dict[str, str] = {
    "ppo": "AReaL's decoupled PPO, arXiv 2505.24298",
    "grpo": "GRPO, DeepSeekMath arXiv 2402.03300 eq. 3",
    "dr_grpo": "Dr.GRPO, arXiv 2503.20783 eq. 3",
    "dapo": "DAPO, arXiv 2503.14476 eq. 8-13",
    "gspo": "GSPO, arXiv 2507.18071 eq. 5-7 and section 5.1",
    "rloo": "RLOO, arXiv 2402.14740 eq. 6",
    "reinforce_pp": "REINFORCE++, arXiv 2501.03262 section 3",
    "reinforce_pp_baseline": "REINFORCE++-baseline, arXiv 2501.03262 section 3",
    "cispo": "CISPO, MiniMax-M1 arXiv 2506.13585 eq. 4-5; AReaL's cispo_loss_fn bounds",
    "sapo": "SAPO, arXiv 2511.20347 eq. 5-7",
    "lite_ppo": "LitePPO, arXiv 2508.08221 section 5",
}


def switched_loss(algo: dict[str, Any], kept: set[str]) -> dict[str, Any]:
    """An `algo` document switched to the loss it names: the values of the keys that loss fixes give way to the
    loss's own (a recorded run's eps_clip: 0.2 does not refuse GSPO's), except the keys in `kept` (those the user
    set for the switch). For replaying a run into another loss (tools.replay --set algo.loss=NAME)."""
    fixed = LOSS_SETTINGS.get(algo.get("loss", "ppo"), {})
    return {k: v for k, v in algo.items() if k not in fixed or k in kept}


class AlgoSection(Section):
    batch_size: int = Field(32, ge=1, description="prompts per training step, B")
    group_size: int = Field(8, ge=1, description="answers sampled per prompt")
    eta: int = Field(4, ge=0, description="maximum staleness in versions; 0 is synchronous")
    ppo_minibatches: int = Field(1, ge=1, description="optimizer steps per training step")
    max_tokens_per_mb: int = Field(4096, ge=1, description="tokens per packed micro-batch")
    lr: float = Field(2e-5, gt=0, description="Adam learning rate")
    adam_eps: float = Field(1e-5, gt=0, description="Adam epsilon")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    grad_clip: float = Field(1.0, ge=0, description="gradient-norm clip; 0 disables")
    eps_clip: float = Field(0.2, gt=0, description="PPO clip, lower side")
    eps_clip_high: float | None = Field(None, gt=0, description="PPO clip, upper side (unset: eps_clip)")
    dual_clip: float | None = Field(None, gt=1, description="dual-clip bound on negative advantages (unset: off)")
    behav_imp_weight_cap: float = Field(5.0, ge=0, description="cap of the behaviour importance weight; 0 disables")
    decoupled: bool = Field(True, description="decoupled PPO objective; false is plain PPO")
    group_norm: bool = Field(
        False, description="subtract each group's mean reward before GAE (the group form, GRPO's); false is AReaL's "
                           "form: GAE on the raw rewards, normalised by adv_norm (docs/algo.md)")
    group_std: bool = Field(True, description="with group_norm, also divide by the group's std")
    adv_norm: Literal["batch", "group", "none"] = Field(
        "batch", description="advantage normalisation: over all tokens of the batch, within each group, or none")
    dynamic_sampling: bool = Field(False, description="drop groups whose answers all got one reward")
    reward_correct: float = Field(5.0, description="reward of a correct answer")
    reward_wrong: float = Field(-5.0, description="reward of a wrong answer")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the frozen starting weights (model.path) in the token rewards; 0 is off")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="per-token KL estimator of the penalty")
    # Mixture-of-experts models (docs/engines.md, "Mixture of experts"), named as verl and slime name them.
    routing_replay: Literal["none", "r2", "r3"] = Field(
        "none", description="MoE routing replay: r2 replays the routing of the trainer's proximal forward in its "
                            "training forwards; r3 replays the rollout engine's routing in both; none routes natively")
    moe_aux_loss_coef: float = Field(0.0, ge=0, description="MoE load-balancing loss weight in training; 0 is off")
    # The loss menu (algo/losses.py, algo/corrections.py; docs/algo.md cites each to its paper and source).
    loss: LossName = Field(
        "ppo", description="policy loss by name; ppo is AReaL's decoupled PPO. Each other name sets the keys of "
                           "LOSS_SETTINGS its paper fixes (advantages, aggregation, clip range): left out they take "
                           "those values, set to another value they are refused")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how per-token losses become one (verl's names): mean over the minibatch's trained "
                                  "tokens; sum per answer, mean over answers; mean per answer, mean over answers; sum "
                                  "per answer over answers x gen.max_new_tokens (Dr.GRPO)")
    baseline: Literal["mean", "leave_one_out"] = Field(
        "mean", description="with group_norm, the baseline subtracted from a reward: its group's mean, or the mean "
                            "of the group's other answers (RLOO)")
    std_level: Literal["group", "batch"] = Field(
        "group", description="with group_norm and group_std, the std rewards are divided by: the group's (GRPO) or "
                             "the whole batch's (LitePPO)")
    sapo_tau_pos: float = Field(1.0, gt=0, description="SAPO's gate temperature for positive advantages (loss sapo)")
    sapo_tau_neg: float = Field(1.05, gt=0, description="SAPO's gate temperature for negative advantages (loss sapo)")
    overlong_buffer: float | None = Field(
        None, gt=0, le=1, description="DAPO's soft overlong punishment: the last this fraction of gen.max_new_tokens "
                                      "lowers an answer's reward linearly to -overlong_penalty (unset: off)")
    overlong_penalty: float = Field(1.0, ge=0, description="reward lost by an answer that reaches gen.max_new_tokens, "
                                                           "with overlong_buffer (DAPO: 1 at rewards of +-1)")
    tis_cap: float | None = Field(
        None, gt=1, description="truncated importance sampling: the behaviour weight exp(logp_prox - logp_behav) is "
                                "truncated at this value, the token kept (unset: off)")
    tis_level: Literal["token", "sequence"] = Field(
        "token", description="with tis_cap: truncate each token's weight, or each answer's product of weights")
    rejection: Literal["none", "token", "sequence", "geometric", "icepop"] = Field(
        "none", description="mask tokens whose behaviour weight is out of [rejection_lower, rejection_upper]: per "
                            "token, per answer (product of weights), per answer (geometric mean); icepop is token with "
                            "IcePop's bounds [0.5, 5] unless set")
    rejection_lower: float | None = Field(None, gt=0, description="lower bound of rejection (unset: 1 / rejection_upper)")
    rejection_upper: float | None = Field(None, gt=0, description="upper bound of rejection (required by token, "
                                                                  "sequence and geometric)")
    m2po_tau: float | None = Field(
        None, gt=0, description="M2PO: mask the tokens of largest squared log behaviour weight until their mean over "
                                "the rest is at most this (the paper's 0.04; unset: off)")
    mismatch_warn_kl: float = Field(
        1e-3, ge=0, description="warn (log and live view) when the k3 KL between engine and trainer log-probs, on "
                                "tokens sampled by the trainer's current weights, exceeds this; 0 is off")

    @model_validator(mode="before")
    @classmethod
    def _loss_settings(cls, data: Any) -> Any:
        # A loss name carries the settings its paper fixes: they fill the keys left out, and a key set to another
        # value is refused (the run would not be that loss).
        if not isinstance(data, dict) or data.get("loss") not in LOSS_SETTINGS:
            return data
        fixed = LOSS_SETTINGS[data["loss"]]
        clash = [k for k, v in fixed.items() if k in data and data[k] != v]
        if clash:
            raise ValueError(f"loss {data['loss']} sets " + ", ".join(f"{k}: {fixed[k]!r}" for k in clash) +
                             " (" + LOSS_SOURCES[data["loss"]] + "), but the config sets " +
                             ", ".join(f"{k}: {data[k]!r}" for k in clash) + ": leave them out or use loss ppo")
        return {**fixed, **data}

    @model_validator(mode="after")
    def _meaningful(self) -> "AlgoSection":
        set_ = self.model_fields_set
        if self.baseline == "leave_one_out" and (not self.group_norm or self.group_std):
            raise ValueError("baseline leave_one_out (RLOO) needs group_norm: true and group_std: false")
        if self.std_level == "batch" and not (self.group_norm and self.group_std):
            raise ValueError("std_level batch needs group_norm: true and group_std: true")
        if self.loss != "sapo" and {"sapo_tau_pos", "sapo_tau_neg"} & set_:
            raise ValueError(f"sapo_tau_pos/sapo_tau_neg: only loss sapo has a gate temperature (loss is {self.loss})")
        if self.loss in ("sapo", "cispo") and self.dual_clip is not None:
            raise ValueError(f"dual_clip: loss {self.loss} has no clipped branch to bound")
        if "overlong_penalty" in set_ and self.overlong_buffer is None:
            raise ValueError("overlong_penalty: set overlong_buffer too (the penalty applies within that buffer)")
        if self.rejection in ("token", "sequence", "geometric") and self.rejection_upper is None:
            raise ValueError(f"rejection {self.rejection} needs rejection_upper")
        if self.rejection == "none" and (self.rejection_lower is not None or self.rejection_upper is not None):
            raise ValueError("rejection_lower/rejection_upper: set rejection (token, sequence, geometric or icepop)")
        lower, upper = self.rejection_bounds
        if self.rejection != "none" and not lower < upper:
            raise ValueError(f"rejection_lower ({lower}) must be below rejection_upper ({upper})")
        if "tis_level" in set_ and self.tis_cap is None:
            raise ValueError("tis_level: set tis_cap too (truncated importance sampling is off without it)")
        corrections = [k for k in ("tis_cap", "m2po_tau") if getattr(self, k) is not None]
        corrections += ["rejection"] if self.rejection != "none" else []
        if not self.decoupled and corrections:
            raise ValueError(f"{', '.join(corrections)}: with decoupled: false the proximal log-probs are the "
                             f"engine's, every behaviour weight is 1 and there is nothing to correct")
        return self

    @property
    def rejection_bounds(self) -> tuple[float, float]:
        """(lower, upper) of the rejection, IcePop's [0.5, 5] filling what icepop leaves unset."""
        upper = self.rejection_upper if self.rejection_upper is not None else (5.0 if self.rejection == "icepop" else 0.0)
        if self.rejection_lower is not None:
            return self.rejection_lower, upper
        if self.rejection == "icepop":
            return 0.5, upper
        return (1.0 / upper if upper else 0.0), upper

    @field_validator("group_size")
    @classmethod
    def _groups_give_a_signal(cls, value: int) -> int:
        # Rewards are normalised within each prompt's group of answers (algo/advantages.py): a group of one
        # answer has advantage 0 on every token, so the run would train on nothing.
        if value == 1:
            raise ValueError("1 answer per prompt gives every answer advantage 0 (rewards are normalised within "
                             "each prompt's group): nothing would be learned; use 2 or more")
        return value


class GenSection(Section):
    max_new_tokens: int = Field(64, ge=1, description="answer length limit")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1 is off")
    top_k: int = Field(-1, ge=-1, description="top-k sampling; -1 or 0 is off")
    interruptible: bool = Field(True, description="weights swap mid-answer; false pauses and resumes")
    # Episodes (actors/rollout/episode.py): a record that names a tool ("tool" in its line) is answered in several turns
    # with that environment; every other record is the one-turn case of the same loop.
    max_turns: int = Field(1, ge=1, description="generations per episode at most; 1 never consults a record's tool")
    max_context: int | None = Field(
        None, ge=2, description="tokens of a whole episode, prompt included (unset: only the engine's context limit); "
                                "each turn generates at most max_new_tokens")
    env_timeout_s: float = Field(30.0, gt=0, description="bound on one environment step (a tool call) of an episode")
    # How long a generation may take (algo/serving.py): a group, and one SGLang request, time out after
    # timeout_slack x its token budget at the slowest pace of recent answers, and never before timeout_floor_s.
    assumed_tokens_per_s: float = Field(
        5.0, gt=0, description="decode speed of one answer assumed until one is measured (sets the first timeouts)")
    timeout_slack: float = Field(
        3.0, ge=1, description="a generation times out after this many times what its length takes at the slowest "
                               "measured pace")
    timeout_floor_s: float = Field(60.0, ge=0, description="no generation times out sooner than this")


class EvalSection(Section):
    max_per_level: int | None = Field(None, ge=1, description="held-out problems per level in the final evaluation (unset: all)")
    samples: int = Field(8, ge=0, description="sampled answers per held-out problem in the final evaluation, for pass@1, "
                                              "pass@8 and maj@8 beside the greedy accuracy; 0: greedy only (a ninth of the work)")
    every_versions: int = Field(0, ge=0, description="evaluate on data.test every N weight versions during the run, in the evaluator actor; 0 is off")
    max_problems: int = Field(64, ge=1, description="held-out problems of each evaluation during the run, spread over the levels")
    wait_s: float = Field(30.0, gt=0, description="how long the evaluator's request waits for a new version")

    @field_validator("samples")
    @classmethod
    def _enough_samples_for_pass_at_8(cls, value: int) -> int:
        if 0 < value < 8:
            raise ValueError(f"{value} samples cannot give pass@8 and maj@8: use 0 (greedy only) or 8 or more")
        return value


class WatchdogSection(Section):
    """The launcher's progress watchdog (launch/watchdog.py): a run that stops making progress is stopped with a
    diagnosis and a non-zero exit instead of waiting for ever."""

    after_steps: float = Field(5.0, ge=0, description="no trained step for this many times the longest step so far "
                                                      "stops the run with a diagnosis; 0 is off")
    min_s: float = Field(600.0, gt=0, description="the shortest wait before a stall is declared, whatever the step time")
    first_step_s: float = Field(3600.0, gt=0, description="before the first trained step: how long the run may go "
                                                          "without a step and without a newly accepted group")


class RunSection(Section):
    total_steps: int = Field(100, ge=1, description="training steps of the run")
    checkpoint_every_steps: int = Field(20, ge=1, description="steps between checkpoints")
    checkpoint_every_s: float | None = Field(
        None, gt=0, description="also checkpoint after a step that ends this many seconds after the last checkpoint "
                                "(or the start), as AReaL's exp_ctrl.ckpt_freq_secs; unset: by steps only")
    keep_checkpoints: int = Field(2, ge=0, description="complete checkpoints kept; 0 keeps all")
    checkpoint_lease_s: float = Field(
        600.0, gt=0, description="seconds retention keeps an older checkpoint that a starting actor is loading "
                                 "(its lease); a lease this old is ignored, so a reader killed mid-load pins nothing")
    recover: Literal["auto", "off"] = Field("auto", description="resume from the last checkpoint")
    final_eval: bool = Field(True, description="evaluate the last checkpoint on data.test at the end")
    trace: bool = Field(True, description="the buffer and trainer write RUN_DIR/trace/<actor>.jsonl, what "
                                          "python -m tools.trace reads besides the logs (a line per group and "
                                          "per step: docs/tools.md has its measured cost)")
    watchdog: WatchdogSection = Field(default_factory=WatchdogSection,
                                      description="stop a run that makes no progress, with a diagnosis")
    trackers: list[Literal["tensorboard", "wandb", "swanlab"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="where the training metrics go besides metrics.jsonl, under AReaL's names: tensorboard, wandb, "
                    "swanlab (the last two optional packages; actors/trainer/trackers.py)")
    tracker_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: the trackers write into the run directory, no network or account (wandb "
                               "mode=offline, swanlab mode=offline; `wandb sync` / `swanlab sync` upload later); "
                               "online: to the services, with the user's own login")
    tracker_project: str = Field("areal-lite", min_length=1, description="the wandb / swanlab project name")

    @field_validator("trackers")
    @classmethod
    def _installed(cls, names: list[str]) -> list[str]:
        # refused at load, before anything starts: a run that asks for a tracker must be able to start it
        missing = [name for name in dict.fromkeys(names) if importlib.util.find_spec(name) is None]
        if missing:
            raise ValueError("; ".join(f"{name} is not installed (pip install {name})" for name in missing))
        return list(dict.fromkeys(names))

    @field_validator("recover", mode="before")
    @classmethod
    def _yaml_boolean(cls, value: Any) -> Any:
        # YAML reads a bare `off` (in a file, or in `experiment.run.recover=off`) as false; actors.runtime.recovery
        # reads false as off too.
        return {False: "off", True: "auto"}[value] if isinstance(value, bool) else value


class BufferSection(Section):
    max_groups_per_rollout: int = Field(
        8, ge=1, description="groups in flight on one rollout; fewer where its server's KV pool holds fewer "
                             "(algo.serving.groups_in_kv)")
    max_concurrent_groups: int | None = Field(None, ge=1, description="groups in flight in all (unset: no limit)")
    group_timeout_s: float | None = Field(
        None, gt=0, description="a group with no result after this is aborted on its rollout and issued again "
                                "(unset: derived from gen.max_new_tokens and the measured pace, gen.timeout_*)")
    worker_lost_after_s: float | None = Field(
        None, gt=0, description="a rollout or reward actor unheard this long loses its groups, which are issued "
                                "again (one that restarts loses them at its new process's first ping; unset: 6 of "
                                "the buffer's bus heartbeat timeouts, 30 s at the defaults)")


# AReaL's configuration keys (its v0.1/v0.2 quickstart options and v0.3 configs: realhf/api/cli_args.py at v0.2.0)
# that mean exactly one of ours: a config or an `experiment.` override may use either name (docs/topology.md has
# the whole table, with the keys that have no single equivalent).
AREAL_ALIASES: dict[str, str] = {
    "dataset.path": "data.train",
    "dataset.max_prompt_len": "data.max_prompt_tokens",
    "dataset.train_bs_n_seqs": "algo.batch_size",
    "group_size": "algo.group_size",
    "max_head_offpolicyness": "algo.eta",
    "ppo.ppo_n_minibatches": "algo.ppo_minibatches",
    "actor_train.mb_spec.max_tokens_per_mb": "algo.max_tokens_per_mb",
    "ppo.eps_clip": "algo.eps_clip",
    "ppo.c_clip": "algo.dual_clip",
    "ppo.behav_imp_weight_cap": "algo.behav_imp_weight_cap",
    "ppo.kl_ctl": "algo.kl_coef",
    "actor.path": "model.path",
    "actor.optimizer.lr": "algo.lr",
    "actor.optimizer.eps": "algo.adam_eps",
    "actor.optimizer.beta1": "algo.adam_beta1",
    "actor.optimizer.beta2": "algo.adam_beta2",
    "actor.optimizer.weight_decay": "algo.weight_decay",
    "actor.optimizer.gradient_clipping": "algo.grad_clip",
    "ppo.gen.max_new_tokens": "gen.max_new_tokens",
    "ppo.gen.temperature": "gen.temperature",
    "ppo.gen.top_p": "gen.top_p",
    "exp_ctrl.ckpt_freq_steps": "run.checkpoint_every_steps",
    "exp_ctrl.ckpt_freq_secs": "run.checkpoint_every_s",
}
# AReaL keys with no single equivalent: what to set instead.
AREAL_NOT_ALIASED: dict[str, str] = {
    "ppo.adv_norm": "set algo.adv_norm (AReaL's adv_norm: true with group_adv_norm: false is algo.adv_norm: batch; "
                    "group_adv_norm: true is algo.adv_norm: group; adv_norm: false is none)",
    "group_adv_norm": "set algo.adv_norm (group_adv_norm: true is algo.adv_norm: group, false with adv_norm: true "
                      "is batch)",
    "ppo.reward_output_scaling": "set algo.reward_correct and algo.reward_wrong: AReaL's reward is (score - bias) * "
                                 "scaling with score 1 right and -1 wrong",
    "ppo.reward_output_bias": "set algo.reward_correct and algo.reward_wrong: AReaL's reward is (score - bias) * "
                              "scaling with score 1 right and -1 wrong",
    "ppo.discount": "GAE runs with discount and lambda 1 and no critic (AReaL's recipes' values), not a setting",
    "ppo.gae_lambda": "GAE runs with discount and lambda 1 and no critic (AReaL's recipes' values), not a setting",
    "ppo.gen.top_k": "set gen.top_k (-1 is off; AReaL writes off as 1000000)",
    "exp_ctrl.total_train_epochs": "set run.total_steps (epochs x prompts / algo.batch_size)",
}


def _pop_path(doc: dict[str, Any], parts: list[str]) -> tuple[bool, Any]:
    """Remove the value at `parts` from the nested mapping `doc` (and mappings it leaves empty)."""
    node = doc
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return False, None
    if parts[-1] not in node:
        return False, None
    value = node.pop(parts[-1])
    for depth in range(len(parts) - 1, 0, -1):   # drop parents the move emptied
        parent = doc
        for part in parts[:depth - 1]:
            parent = parent[part]
        if parent[parts[depth - 1]] == {}:
            del parent[parts[depth - 1]]
    return True, value


def with_our_names(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of an experiment document with AReaL's key names (`AREAL_ALIASES`) moved to ours. Raises pydantic's
    custom error "areal_key" (ctx: key, why) for an AReaL name whose key is also set to another value, or one with
    no single equivalent."""
    import copy
    out = copy.deepcopy(doc)
    for key, why in AREAL_NOT_ALIASED.items():
        found, _ = _pop_path(copy.deepcopy(out), key.split("."))
        if found:
            raise PydanticCustomError("areal_key", "{why}", {"key": key, "why": f"AReaL's key has no single "
                                                                              f"equivalent here: {why}"})
    for key, ours in AREAL_ALIASES.items():
        found, value = _pop_path(out, key.split("."))
        if not found:
            continue
        section, name = ours.split(".")
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            raise PydanticCustomError("areal_key", "{why}", {"key": key, "why": f"AReaL's name for {ours}, but "
                                                                              f"{section} is not a mapping"})
        if name in target and target[name] != value:
            raise PydanticCustomError("areal_key", "{why}", {
                "key": key, "why": f"AReaL's name for {ours}, which is also set, to {target[name]!r}: keep one"})
        target[name] = value
    return out


class ExperimentConfig(Section):
    seed: int = Field(1, description="seed of sampling, data order and initialisation")
    model: ModelSection = Field(default_factory=ModelSection, description="the starting model")
    data: DataSection = Field(default_factory=DataSection, description="training and held-out data")
    prepare: PrepareSection | None = Field(None, description="data and warm start made before the run (tools.prepare)")
    algo: AlgoSection = Field(default_factory=AlgoSection, description="the RL algorithm")
    gen: GenSection = Field(default_factory=GenSection, description="sampling of the answers")
    eval: EvalSection = Field(default_factory=EvalSection, description="evaluation during and after the run")
    run: RunSection = Field(default_factory=RunSection, description="length, checkpoints and recovery")
    buffer: BufferSection = Field(default_factory=BufferSection, description="the buffer's flow control")

    @model_validator(mode="before")
    @classmethod
    def _areal_names(cls, data: Any) -> Any:
        # AReaL's names for our keys are read as ours wherever a config is validated (files, overrides, tools).
        return with_our_names(data) if isinstance(data, dict) else data


def experiment_problems(doc: dict[str, Any], prefix: str = "experiment") -> list[str]:
    """One line per problem of an experiment document, each naming the key's full path."""
    try:
        ExperimentConfig.model_validate(doc)
    except ValidationError as exc:
        return problem_lines(exc, prefix, ExperimentConfig)
    return []
