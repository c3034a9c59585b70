"""Supervised fine-tuning, the warm start of an RL run (a prepare stage runs it; `python -m tools.sft --data FILE
--out DIR` is its command line, each `SFTConfig` field a flag).

Data: a JSON-lines dataset in AReaL's layout (`actors/dataset.py`; every worked solution of a
record is one training target after its prompt; records without solutions are left out) or a file of
{"prompt": ..., "response": ...} lines (detected from the first line, or `--format pairs`). Each target
is followed by eos; the loss is the mean negative log-likelihood of the response tokens only
(`token_nll_loss` with a loss mask), on padding-free micro-batches of at most `--max-tokens-per-mb`.

Model: a Hugging Face-layout directory (`--model`, default configs/models/arith-tiny). Without weights
the model is initialised randomly from its config.json with `--seed` (and the run says so). The
checkpoint written to `--out` loads with `load_model` and with transformers, carries the tokenizer
files and `trainer_state.pt` (optimizer state), so it is a complete model directory.

Held-out checks: with `--eval-data FILE --eval-every N` the model's greedy accuracy per level is
measured every N steps through the math grader; records that name a tool (`tools.make_task --task agent`)
are answered by episodes of up to `--max-turns` turns against their environment (actors/evaluator/episode_eval.py).
Records with ``transcripts`` train on the model's segments only: observations get loss mask 0. Then `--out` keeps the BEST checkpoint by overall
held-out accuracy (not the last), and `--until-plateau` stops once accuracy has not risen by more than
`--min-delta` for `--patience` evaluations in a row (`--steps`/`--epochs` is then the upper bound).

Every step appends to OUT/sft_metrics.jsonl ({"kind": "train", step, loss, lr, grad_norm, tokens,
response_tokens, seqs, micro_batches, step_seconds, tokens_per_s, time}); every evaluation adds a
{"kind": "eval", step, accuracy, accuracy_by_level, ...} line. OUT/sft_summary.json holds the final
summary, which `--json` also prints as one line. A run is a pure function of its inputs and seed.

    python -m tools.make_task --out data/arith
    python -m tools.sft --data data/arith/train.jsonl --out runs/sft --eval-data data/arith/test.jsonl \\
        --eval-every 100 --until-plateau
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from actors.dataset import DatasetError, OnError, Record, load_dataset
from actors.engines.tokenizer import load_tokenizer
from actors.engines.torch_train import TorchTrainEngine, TrainConfig, token_nll_loss
from actors.evaluator.episode_eval import DEFAULT_MAX_TURNS, evaluate_model_episodes
from actors.evaluator.evaluation import EvalSettings, evaluate_model
from actors.evaluator.harness import copy_for_eval, load_eval_records
from actors.rollout.envs import is_agent
from launch.prepare.lm import (SFTExample, batch_stream, examples_from_records, is_pairs_file, load_or_init,
                               make_example, pack_examples, read_pairs)

DEFAULT_MODEL = "configs/models/arith-tiny"
METRICS_FILE = "sft_metrics.jsonl"
SUMMARY_FILE = "sft_summary.json"


class SFTError(ValueError):
    """A warm start that cannot run as configured; the message names the option or file at fault."""


def _levels(text: str | None) -> list[int] | None:
    if not text:
        return None
    from launch.prepare.task import parse_levels
    try:
        return parse_levels(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from None


def _opt(default: Any, help: str = "", **metadata: Any) -> Any:
    """A field with its default and its flag's help (tools.cli derives the command line from these)."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


@dataclasses.dataclass
class SFTConfig:
    data: str = dataclasses.field(metadata={"help": "JSON-lines records with solutions, or prompt/response pairs"})
    out: str = dataclasses.field(metadata={"help": "output model directory"})
    model: str = _opt(DEFAULT_MODEL, "model directory (randomly initialised without weights)")
    format: Literal["auto", "records", "pairs"] = _opt("auto", "dataset format (auto: from the first line)")
    levels: list[int] | None = _opt(None, "train only on these levels, e.g. 1-3", parse=_levels)
    on_error: OnError = _opt("fail", "malformed dataset lines: stop, or skip and count")
    steps: int | None = _opt(None, "optimizer steps (the upper bound with --until-plateau); not with --epochs")
    epochs: float | None = _opt(None, "passes over the examples (1 when neither --steps nor --epochs is given)")
    batch_size: int = _opt(64, "sequences per optimizer step")
    lr: float = _opt(1e-3, "peak learning rate")
    warmup_steps: int = _opt(20, "steps of linear warm-up")
    schedule: Literal["cosine", "constant", "linear"] = _opt("cosine", "learning-rate decay after the warm-up")
    min_lr_ratio: float = _opt(0.1, "floor of the decay, fraction of --lr")
    weight_decay: float = _opt(0.0, "decoupled weight decay")
    grad_clip: float = _opt(1.0, "gradient-norm clip")
    max_tokens_per_mb: int = _opt(4096, "tokens per packed micro-batch")
    seed: int = _opt(0, "seed of initialisation and data order")
    device: str = _opt("cpu", "cpu or cuda")
    eval_data: str | None = _opt(None, "held-out JSON-lines file with answers")
    eval_every: int = _opt(0, "steps between held-out evaluations; 0 is off")
    eval_max_per_level: int | None = _opt(100, "held-out prompts per level")
    eval_levels: list[int] | None = _opt(None, "held-out levels, e.g. 1-5 (unset: all)", parse=_levels)
    max_new_tokens: int = _opt(64, "answer length limit in evaluations (per turn in episodes)")
    max_turns: int = _opt(DEFAULT_MAX_TURNS, "turns per episode in evaluations of records that name a tool")
    until_plateau: bool = _opt(False, "stop when held-out accuracy stops improving")
    # "best": keep the checkpoint with the best held-out accuracy, stop when it stops rising. "last": keep the
    # final weights, stop when accuracy stops changing (the mean of the last `patience` evaluations is within
    # `min_delta` of the mean of the `patience` before) -- imitation that lowers accuracy still has a plateau.
    keep: Literal["best", "last"] = _opt("best", "checkpoint to keep: the best held-out accuracy, or the final "
                                                 "weights once accuracy stops changing")
    patience: int = _opt(3, "evaluations without enough improvement before stopping")
    min_delta: float = _opt(0.005, "accuracy gain (fraction) that counts as an improvement")
    max_seconds: float | None = _opt(None, "stop after this much training wall time (evaluations excluded); "
                                           "--steps stays the upper bound")
    log_every: int = _opt(0, "steps between progress lines; 0: one line per twentieth of the steps")

    def check(self) -> None:
        if self.steps is not None and self.epochs is not None:
            raise SFTError("give --steps or --epochs, not both")
        if self.steps is not None and self.steps < 1:
            raise SFTError(f"--steps must be >= 1, got {self.steps}")
        if self.epochs is not None and not self.epochs > 0:
            raise SFTError(f"--epochs must be > 0, got {self.epochs}")
        for name in ("batch_size", "max_tokens_per_mb", "max_new_tokens", "max_turns", "patience"):
            if getattr(self, name) < 1:
                raise SFTError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise SFTError(f"--lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.eval_every < 0 or self.min_delta < 0 or self.log_every < 0:
            raise SFTError("--warmup-steps, --eval-every, --min-delta and --log-every must not be negative")
        if self.format not in ("auto", "records", "pairs"):
            raise SFTError(f"--format must be auto, records or pairs, got {self.format!r}")
        if bool(self.eval_data) != bool(self.eval_every):
            raise SFTError("--eval-data and --eval-every go together")
        if self.keep not in ("best", "last"):
            raise SFTError(f"--keep must be best or last, got {self.keep!r}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise SFTError(f"--max-seconds must be > 0, got {self.max_seconds}")
        if self.until_plateau and not self.eval_data:
            raise SFTError("--until-plateau needs --eval-data and --eval-every")


class Plateau:
    """Stop when the metric has not risen by more than min_delta for `patience` checks in a row.

    `best` is the highest value seen (the checkpoint kept); the reference for "risen enough" moves
    only on a rise of more than min_delta, so a slow creep of tiny gains still ends the run.
    """

    def __init__(self, patience: int, min_delta: float) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.reference = -math.inf
        self.best = -math.inf
        self.stale = 0

    def update(self, value: float) -> tuple[bool, bool]:
        """(value is a new best, the run should stop)."""
        new_best = value > self.best
        if new_best:
            self.best = value
        if value > self.reference + self.min_delta:
            self.reference, self.stale = value, 0
        else:
            self.stale += 1
        return new_best, self.stale >= self.patience


def load_examples(cfg: SFTConfig, tokenizer: Any) -> tuple[list[SFTExample], dict[str, int]]:
    """The training examples and counts of what was read, skipped or left out."""
    fmt = cfg.format
    if fmt == "auto":
        if not Path(cfg.data).is_file():
            raise DatasetError(cfg.data, None, "no such file")
        fmt = "pairs" if is_pairs_file(cfg.data) else "records"
    if fmt == "pairs":
        pairs, skipped = read_pairs(cfg.data, cfg.on_error)
        if cfg.levels is not None:
            pairs = [p for p in pairs if p.level in cfg.levels]
        examples = [make_example(tokenizer, p.source, p.prompt, p.response, p.level) for p in pairs]
        counts = {"lines": len(pairs) + len(skipped), "skipped_lines": len(skipped), "without_solutions": 0}
    else:
        dataset = load_dataset(cfg.data, require="none", on_error=cfg.on_error)
        records: list[Record] = dataset.filter(cfg.levels).records
        with_solutions = [r for r in records if r.solutions]
        examples = examples_from_records(with_solutions, tokenizer)
        counts = {"lines": len(dataset) + dataset.n_skipped, "skipped_lines": dataset.n_skipped,
                  "without_solutions": len(records) - len(with_solutions)}
    if not examples:
        raise SFTError(f"{cfg.data}: no training examples (format {fmt}, levels {cfg.levels or 'all'}; records "
                       "need non-empty 'solutions')")
    counts["examples"] = len(examples)
    return examples, counts


def clock(seconds: float) -> str:
    """Seconds as m:ss (h:mm:ss past an hour)."""
    m, sec = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}" if m >= 60 else f"{m}:{sec:02d}"


def time_left(elapsed: float, step: int, steps: int, until_plateau: bool) -> str:
    """The progress line's estimate at the pace so far (evaluations included); with --until-plateau the steps
    are an upper bound, and so is the estimate."""
    if step >= steps:
        return ""
    left = elapsed / step * (steps - step)
    return f", {'at most ' if until_plateau else ''}{clock(left)} left"


def run_sft(cfg: SFTConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, write OUT (checkpoint, sft_metrics.jsonl, sft_summary.json); returns the summary."""
    cfg.check()
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model)
    examples, counts = load_examples(cfg, tokenizer)
    eval_records: list[Record] = []
    if cfg.eval_data:
        eval_records, _ = load_eval_records(cfg.eval_data, cfg.eval_levels, cfg.eval_max_per_level, cfg.on_error)
    model, initialised = load_or_init(cfg.model, cfg.seed, cfg.device)
    limit = model.config.max_position_embeddings
    longest = max(examples, key=len)
    if len(longest) > limit:
        raise SFTError(f"{longest.source}: {len(longest)} tokens exceed the model's max_position_embeddings ({limit})")
    n_params = sum(p.numel() for p in model.parameters())
    if initialised:
        log(f"sft: {cfg.model} has no weights: initialised {n_params:,} parameters randomly (seed {cfg.seed})")
    else:
        log(f"sft: loaded {n_params:,} parameters from {cfg.model}")

    steps = cfg.steps if cfg.steps is not None else max(1, math.ceil((cfg.epochs or 1.0) * len(examples) / cfg.batch_size))
    warmup = min(cfg.warmup_steps, steps - 1)
    train_cfg = TrainConfig(lr=cfg.lr, adam_eps=1e-8, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            grad_clip=cfg.grad_clip, schedule=cfg.schedule,
                            warmup_steps=warmup, total_steps=steps, min_lr_ratio=cfg.min_lr_ratio,
                            device=cfg.device, seed=cfg.seed)
    # The checkpoint is a complete model directory: it carries the tokenizer files of cfg.model.
    engine = TorchTrainEngine(model=model, config=train_cfg, tokenizer_dir=cfg.model)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / METRICS_FILE
    metrics_path.write_text("")
    log(f"sft: {counts['examples']} examples from {cfg.data} ({counts['skipped_lines']} bad lines skipped, "
        f"{counts['without_solutions']} records without solutions left out); {steps} steps of "
        f"{cfg.batch_size} sequences = {steps * cfg.batch_size / len(examples):.2f} epochs")

    eval_settings = EvalSettings(samples=0, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    episodes = any(is_agent(r.extra) for r in eval_records)
    plateau = Plateau(cfg.patience, cfg.min_delta)
    batches = batch_stream(len(examples), cfg.batch_size, cfg.seed)
    evals: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    stop_reason = "steps"
    train_seconds = eval_seconds = 0.0
    tokens_total = 0
    window: list[tuple[float, float, int]] = []   # (loss, seconds, tokens) since the last progress line
    last: dict[str, float] = {}

    with metrics_path.open("a", encoding="utf-8") as metrics:
        def record(entry: dict[str, Any]) -> None:
            metrics.write(json.dumps(entry) + "\n")
            metrics.flush()

        def held_out(step: int) -> bool:
            """Evaluate, keep the checkpoint if it is the best so far; True when the run should stop."""
            nonlocal best, eval_seconds
            t1 = time.perf_counter()
            if episodes:
                report = evaluate_model_episodes(copy_for_eval(engine.model), tokenizer, eval_records, eval_settings,
                                                 cfg.max_turns)
            else:
                report = evaluate_model(copy_for_eval(engine.model), tokenizer, eval_records, eval_settings)
            dt_eval = time.perf_counter() - t1
            eval_seconds += dt_eval
            acc = report["overall"]["greedy_accuracy"]
            by_level = {lvl: s["greedy_accuracy"] for lvl, s in report["by_level"].items()}
            new_best, stop = plateau.update(acc)
            entry = {"kind": "eval", "step": step, "accuracy": acc, "accuracy_by_level": by_level,
                     "answer_len": report["overall"]["greedy_len"],
                     "truncated": report["overall"]["greedy_truncated"], "n": report["n_prompts"],
                     "eval_seconds": dt_eval, "best": new_best, "time": time.time()}
            if episodes:
                entry["tool_calls"] = report["overall"]["greedy_tool_calls"]
            record(entry)
            evals.append(entry)
            if cfg.keep == "last":
                accs, k = [e["accuracy"] for e in evals], cfg.patience
                stop = len(accs) >= 2 * k and abs(sum(accs[-k:]) / k - sum(accs[-2 * k:-k]) / k) <= cfg.min_delta
            elif new_best:
                engine.save(str(out))
                best = entry
            levels_text = " ".join(f"L{lvl} {100 * a:.1f}" for lvl, a in by_level.items())
            calls = f"  tool calls {entry['tool_calls']:.2f}" if episodes else ""
            log(f"eval step {step}: accuracy {100 * acc:.1f}% ({levels_text})  "
                f"len {report['overall']['greedy_len']:.1f}{calls}  {dt_eval:.1f} s"
                f"{'  best, saved' if new_best else f'  (best {100 * plateau.best:.1f}%)'}")
            return cfg.until_plateau and stop

        # Continuing from weights: they are the baseline a kept checkpoint must beat.
        if cfg.eval_every and not initialised:
            held_out(0)
        t_loop = time.perf_counter()
        log_every = cfg.log_every or max(1, math.ceil(steps / 20))
        for step in range(1, steps + 1):
            chosen = [examples[i] for i in next(batches)]
            t0 = time.perf_counter()
            micro_batches = pack_examples(chosen, cfg.max_tokens_per_mb)
            last = engine.train_step(micro_batches, token_nll_loss)
            if cfg.device.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            train_seconds += dt
            n_tokens = sum(len(e) for e in chosen)
            tokens_total += n_tokens
            window.append((last["loss"], dt, n_tokens))
            record({"kind": "train", "step": step, "loss": last["loss"], "lr": last["lr"],
                    "grad_norm": last["grad_norm"], "tokens": n_tokens,
                    "response_tokens": sum(e.trained_tokens for e in chosen), "seqs": len(chosen),
                    "micro_batches": len(micro_batches), "step_seconds": dt, "tokens_per_s": n_tokens / dt,
                    "time": time.time()})
            if step % log_every == 0 or step == steps:
                w_loss = sum(x[0] for x in window) / len(window)
                w_tps = sum(x[2] for x in window) / max(sum(x[1] for x in window), 1e-9)
                elapsed = time.perf_counter() - t_loop
                log(f"step {step}/{steps}  loss {w_loss:.4f}  lr {last['lr']:.2e}  {w_tps:,.0f} tok/s  "
                    f"{clock(elapsed)} elapsed{time_left(elapsed, step, steps, cfg.until_plateau)}")
                window.clear()
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == steps):
                if held_out(step):
                    stop_reason = "plateau"
                    log(f"sft: held-out accuracy has not improved by more than {100 * cfg.min_delta:.2f} points "
                        f"for {cfg.patience} evaluations: stopping at step {step}")
                    break
            if cfg.max_seconds is not None and time.perf_counter() - t_loop - eval_seconds >= cfg.max_seconds:
                stop_reason = "time"
                log(f"sft: {cfg.max_seconds:.1f} s of training done (--max-seconds): stopping at step {step}")
                break
        steps_done = engine.step
    if not cfg.eval_every or cfg.keep == "last":
        engine.save(str(out))
        best = evals[-1] if evals and evals[-1]["step"] == steps_done else None
    summary: dict[str, Any] = {
        "out": str(out), "model": cfg.model, "initialised_randomly": initialised, "parameters": n_params,
        "data": cfg.data, **counts, "steps": steps_done, "max_steps": steps, "stop_reason": stop_reason,
        "epochs": steps_done * cfg.batch_size / len(examples), "final_loss": last.get("loss"),
        "tokens": tokens_total, "train_seconds": train_seconds, "eval_seconds": eval_seconds,
        "tokens_per_s": tokens_total / max(train_seconds, 1e-9), "seconds": time.perf_counter() - t_start,
        "seed": cfg.seed, "kept_step": best["step"] if best else steps_done,
        "kept_accuracy": best["accuracy"] if best else None,
        "kept_accuracy_by_level": best["accuracy_by_level"] if best else None,
        "evals": [{"step": e["step"], "accuracy": e["accuracy"]} for e in evals],
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    kept = (f"kept step {summary['kept_step']} (held-out accuracy {100 * best['accuracy']:.1f}%)" if best
            else f"saved step {steps_done}")
    log(f"sft: {steps_done} steps ({summary['epochs']:.2f} epochs, stop: {stop_reason}) in {summary['seconds']:.1f} s, "
        f"final loss {summary['final_loss']:.4f}, {summary['tokens_per_s']:,.0f} tok/s training; {kept} -> {out}")
    return summary
