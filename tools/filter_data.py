"""`python -m tools.filter_data MODEL --data IN.jsonl --out OUT.jsonl --config RECIPE [--n 8]`: drop the prompts a
model already solves every time.

AReaL v0.2's offline difficulty filter: the current model answers each prompt n times (sampled), and a prompt
whose n answers are all correct teaches RL nothing (every group would be dropped by dynamic sampling) and is
left out. The other lines are copied to OUT unchanged, in input order, so OUT is read with the same layout
settings as IN (`--layout`, `--id2info`, `--prompt-template` or `--config`, as in `tools.eval`).

The answers are as long, and sampled as, the recipe's (`--config`: its gen.max_new_tokens, temperature, top_p;
a flag overrides one): a long-reasoning model cut at a short limit gets nothing right, so nothing would be
dropped. Without `--config`, `--max-new-tokens` is required. A chunk whose sampled answers are mostly cut at the
limit (more than `--max-cut`, half by default) stops the filter with an error before anything of it is written.

Answers come from the rollouts' engines (`tools.eval`'s `open_generator`): the embedded engine on MODEL here,
or SGLang servers (`--engine sglang`: `--servers` started on MODEL, or running ones at `--url`), and are graded
by `actors.evaluator.evaluation` (the code of `tools.eval`).

Resumable: prompts are done in chunks of `--chunk`; after each chunk the kept lines are appended to OUT and
`OUT.progress.json` records how far it got (and the size OUT had then). Run again with the same arguments
and it goes on after the last finished chunk (a chunk cut short is done again, its partial output cut off);
a finished filter is not redone. Each chunk's samples are seeded from `--seed` and the prompt's position,
so a resumed filter writes what an uninterrupted one would. A progress bar (tqdm) goes to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from actors.dataset import (AREAL, LAYOUTS, DatasetError, Layout, OnError, Record, detect_layout, load_dataset,
                            resolve_data_path)
from actors.engines.base import EngineError
from actors.engines.checkpoint import CheckpointError
from actors.engines.tokenizer import TokenizerError, load_tokenizer
from actors.evaluator.evaluation import EvalError, EvalSettings, aevaluate_with, level_key
from actors.evaluator.harness import ENGINES, default_engine, open_generator
from tools.eval import data_options
from actors.engines.checkpoint import has_weights
from launch.prepare.lm import LMToolError
from topology import load_experiment
from transport.files import atomic_write

PROGRESS_SUFFIX = ".progress.json"
# What a resumed filter must share with the one it continues (the rest of the progress file is its state).
IDENTITY_KEYS = ("data", "data_bytes", "model", "n", "seed", "temperature", "top_p", "max_new_tokens", "chunk",
                 "layout")
MAX_CUT = 0.5   # a chunk with a larger share of sampled answers cut at max_new_tokens stops the filter


class FilterError(ValueError):
    """A filter that cannot run as asked; the message names the file or setting at fault."""


def progress_path(out: str | Path) -> Path:
    return Path(str(out) + PROGRESS_SUFFIX)


def _write_progress(path: Path, state: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(state, indent=1))   # a kill leaves the old state or the new, never half of one


def resume_state(out: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The state to continue from: a fresh one, or the progress file's after checking it is the same job.
    OUT is cut back to the size it had when that progress was recorded."""
    progress = progress_path(out)
    fresh = {**identity, "done": 0, "kept": 0, "out_bytes": 0, "complete": False, "by_level": {}}
    if not progress.exists():
        if out.exists() and out.stat().st_size > 0:
            raise FilterError(f"{out} exists and has no {progress.name} beside it: not a filter to continue; "
                              f"remove it or choose another --out")
        return fresh
    try:
        state = json.loads(progress.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("done"), int):
            raise ValueError("no 'done' count")
    except (OSError, ValueError) as e:
        raise FilterError(f"{progress}: unreadable progress file ({e}); remove it and {out} to start again") from None
    for key in IDENTITY_KEYS:
        if state.get(key) != identity[key]:
            raise FilterError(f"{progress} was written with {key}={state.get(key)!r}, this run has "
                              f"{identity[key]!r}: run with the same settings to continue it, or remove "
                              f"{progress.name} and {out.name} to start again")
    size = out.stat().st_size if out.exists() else 0
    if size < state["out_bytes"]:
        raise FilterError(f"{out} is shorter ({size} bytes) than its progress file records ({state['out_bytes']}): "
                          f"it was changed; remove both to start again")
    if size > state["out_bytes"]:   # lines of a chunk whose progress was not recorded: that chunk is redone
        with open(out, "r+b") as f:
            f.truncate(state["out_bytes"])
    return state


def all_correct(row: dict[str, Any]) -> bool:
    """A prompt the model solves every time (its row from `aevaluate_model(..., details=True)`)."""
    return bool(row["sample_correct"]) and all(row["sample_correct"])


def cut_share(report: dict[str, Any]) -> float:
    """The share of a chunk's sampled answers cut at max_new_tokens (its `aevaluate_with` report with details)."""
    cut = [flag for row in report["prompts"] for flag in row["sample_truncated"]]
    return sum(cut) / len(cut) if cut else 0.0


async def afilter(model_dir: str, data_path: str, out_path: str, *, max_new_tokens: int, n: int = 8,
                  temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, chunk: int = 64,
                  layout: Layout = AREAL, on_error: OnError = "fail", workers: int = 1, device: str | None = None,
                  engine: str = "torch", url: str | None = None, servers: int | None = None, tp: int = 1,
                  server_command: Sequence[str] | None = None, max_cut: float = MAX_CUT, progress: bool = True,
                  stream: TextIO | None = None) -> dict[str, Any]:
    """Filter `data_path` into `out_path` (resuming a partial one); returns the summary."""
    if n < 1:
        raise FilterError(f"--n must be >= 1, got {n}")
    if chunk < 1:
        raise FilterError(f"--chunk must be >= 1, got {chunk}")
    if not 0 <= max_cut <= 1:
        raise FilterError(f"--max-cut must be in [0, 1], got {max_cut}")
    urls = [u.strip() for u in (url or "").split(",") if u.strip()]
    if engine == "auto":
        engine = "sglang" if urls else default_engine()
    if engine not in ENGINES:
        raise FilterError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
    if not urls and not has_weights(model_dir):
        raise FilterError(f"{model_dir}: no model weights (model.safetensors or an index) to answer with")
    data, out = resolve_data_path(data_path), Path(out_path)
    if not data.is_file():
        raise FilterError(f"{data}: no such file")
    if out.resolve() == data.resolve():
        raise FilterError(f"--out {out} is the input file")
    settings = EvalSettings(k=n, samples=n, greedy=False, temperature=temperature, top_p=top_p,
                            max_new_tokens=max_new_tokens, workers=workers)
    settings.check()
    identity = {"data": str(data.resolve()), "data_bytes": data.stat().st_size, "model": str(Path(model_dir).resolve()),
                "n": n, "seed": seed, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
                "chunk": chunk, "layout": repr(layout)}
    out.parent.mkdir(parents=True, exist_ok=True)
    state = resume_state(out, identity)
    dataset = load_dataset(data, require="answer", on_error=on_error, layout=layout)
    records = dataset.records
    t0 = time.perf_counter()
    if not state["complete"]:
        lines = data.read_bytes().split(b"\n")   # the kept records' lines are copied as they are
        tokenizer = load_tokenizer(model_dir)
        bar = _bar(len(records), state["done"], progress, stream)
        try:
            async with open_generator(model_dir, engine=engine, urls=urls, servers=servers, tp=tp,
                                      server_command=server_command, device=device,
                                      max_running=settings.max_running) as (generate, _):
                for start in range(state["done"], len(records), chunk):
                    part = records[start:start + chunk]
                    # seeded by the chunk's position: a resumed filter samples what an uninterrupted one did
                    report = await aevaluate_with(generate, tokenizer, part,
                                                  dataclasses.replace(settings, seed=seed * 1_000_003 + start),
                                                  details=True)
                    cut = cut_share(report)
                    if cut > max_cut:
                        raise FilterError(
                            f"{100 * cut:.0f}% of the answers to prompts {start + 1}-{start + len(part)} were cut at "
                            f"max_new_tokens {max_new_tokens} (more than --max-cut {max_cut:g}): a model cut short "
                            f"gets nothing right, so the filter would drop nothing. Give the recipe's length "
                            f"(--config) or a larger --max-new-tokens")
                    kept = [rec for rec, row in zip(part, report["prompts"]) if not all_correct(row)]
                    with open(out, "ab") as f:
                        for rec in kept:
                            f.write(_line_of(rec, lines, data).rstrip(b"\r") + b"\n")
                        f.flush()
                        os.fsync(f.fileno())
                    for rec, row in zip(part, report["prompts"]):
                        counts = state["by_level"].setdefault(level_key(rec), {"prompts": 0, "kept": 0})
                        counts["prompts"] += 1
                        counts["kept"] += int(not all_correct(row))
                    answers = sum(len(row["sample_truncated"]) for row in report["prompts"])
                    state["answers"] = state.get("answers", 0) + answers
                    state["answers_cut"] = state.get("answers_cut", 0) + round(cut * answers)
                    state.update(done=start + len(part), kept=state["kept"] + len(kept),
                                 out_bytes=out.stat().st_size)
                    _write_progress(progress_path(out), state)
                    bar.update(len(part))
        finally:
            bar.close()
        state["complete"] = True
        _write_progress(progress_path(out), state)
    return {"data": str(data), "out": str(out), "model_dir": str(model_dir), "n": n, "prompts": len(records),
            "kept": state["kept"], "dropped_all_correct": state["done"] - state["kept"],
            "max_new_tokens": max_new_tokens,
            "answers_cut": state.get("answers_cut", 0) / max(state.get("answers", 0), 1),
            "by_level": state["by_level"], "skipped_lines": dataset.n_skipped, "seconds": time.perf_counter() - t0}


def _line_of(rec: Record, lines: list[bytes], data: Path) -> bytes:
    if rec.line_no is None or not 0 < rec.line_no <= len(lines):
        raise FilterError(f"{data}: record {rec.query_id!r} has no line to copy")
    return lines[rec.line_no - 1]


class _PlainBar:
    """A progress line on stderr where tqdm is missing."""

    def __init__(self, total: int, done: int, stream: TextIO) -> None:
        self.total, self.done, self.stream, self.t0 = total, done, stream, time.monotonic()

    def update(self, k: int) -> None:
        self.done += k
        rate = self.done / max(time.monotonic() - self.t0, 1e-9)
        print(f"filter_data: {self.done}/{self.total} prompts ({rate:.1f}/s)", file=self.stream, flush=True)

    def close(self) -> None:
        pass


def _bar(total: int, done: int, enabled: bool, stream: TextIO | None) -> Any:
    out = stream or sys.stderr
    if not enabled:
        return _PlainBar(total, done, open(os.devnull, "w"))
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainBar(total, done, out)
    return tqdm(total=total, initial=done, unit="prompt", file=out, disable=not enabled, desc="filter_data")


def filter_data(model_dir: str, data_path: str, out_path: str, **kwargs: Any) -> dict[str, Any]:
    """Synchronous `afilter`."""
    return asyncio.run(afilter(model_dir, data_path, out_path, **kwargs))


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.filter_data", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="model directory (Hugging Face layout, with tokenizer.json): the current model")
    ap.add_argument("--data", required=True, help="JSON-lines prompts with answers (actors/dataset.py layouts)")
    ap.add_argument("--out", required=True, help="JSON-lines output: the input lines that are kept")
    ap.add_argument("--config", help="the recipe (experiment config): its gen.max_new_tokens, temperature and "
                                     "top_p, and its data layout, are the defaults")
    ap.add_argument("--n", type=int, default=8, help="answers per prompt; all n correct drops the prompt")
    ap.add_argument("--temperature", type=float, default=None, help="default: the recipe's, else 1.0")
    ap.add_argument("--top-p", type=float, default=None, help="default: the recipe's, else 1.0")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="answer length limit (default: the --config's gen.max_new_tokens; one of them is needed)")
    ap.add_argument("--max-cut", type=float, default=MAX_CUT,
                    help="stop when a chunk has a larger share of answers cut at the length limit")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default=None)
    ap.add_argument("--id2info", help="AReaL's answer file for a prompt file without answers")
    ap.add_argument("--prompt-template", help="wraps each prompt; {prompt} marks where it goes, or a template's name")
    ap.add_argument("--engine", choices=ENGINES, default="auto",
                    help="torch: the embedded engine on MODEL here; sglang: SGLang servers (started on MODEL, or "
                         "--url); auto: sglang on a machine with a GPU and SGLang, else torch")
    ap.add_argument("--url", help="running SGLang servers, comma-separated (MODEL then needs only the tokenizer)")
    ap.add_argument("--servers", type=int, default=None, help="SGLang servers to start on MODEL (default: one per "
                                                              "--tp GPUs of the machine)")
    ap.add_argument("--tp", type=int, default=1, help="GPUs per started SGLang server")
    ap.add_argument("--server-command", default=None,
                    help="the started servers' module runner (default: python -m sglang.launch_server)")
    ap.add_argument("--chunk", type=int, default=64, help="prompts per chunk (the unit of progress and resumption)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1, help="grader processes for answers the fast path leaves open")
    ap.add_argument("--on-error", choices=("fail", "skip"), default="fail", help="malformed dataset lines")
    ap.add_argument("--device", default=None, help="the torch engine's device (default: cuda if present, else cpu)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = ap.parse_args(argv)
    try:
        config = load_experiment(args.config) if args.config else None
        if config is None and args.max_new_tokens is None:
            raise ValueError("give --config (the recipe, whose gen.max_new_tokens the answers get) or "
                             "--max-new-tokens: answers cut short get nothing right and nothing would be dropped")
        layout, max_new_tokens = data_options(args)
    except ValueError as e:
        ap.error(str(e))
    temperature = args.temperature if args.temperature is not None else config.gen.temperature if config else 1.0
    top_p = args.top_p if args.top_p is not None else config.gen.top_p if config else 1.0
    try:
        summary = filter_data(args.model, args.data, args.out, n=args.n, temperature=temperature, top_p=top_p,
                              max_new_tokens=max_new_tokens, seed=args.seed, chunk=args.chunk,
                              layout=layout or detect_layout(args.data), on_error=args.on_error, workers=args.workers,
                              device=args.device, engine=args.engine, url=args.url, servers=args.servers,
                              tp=args.tp, server_command=args.server_command.split() if args.server_command else None,
                              max_cut=args.max_cut, progress=not args.no_progress)
    except (FilterError, EvalError, DatasetError, CheckpointError, TokenizerError, LMToolError, EngineError) as e:
        print(f"filter_data: error: {e}", file=sys.stderr)
        return 2
    out = stdout or sys.stdout
    if args.json:
        print(json.dumps(summary), file=out)
    else:
        print(f"{summary['prompts']} prompts, {summary['kept']} kept, {summary['dropped_all_correct']} dropped "
              f"(all {summary['n']} answers correct) -> {summary['out']}; {100 * summary['answers_cut']:.1f}% of "
              f"answers cut at {summary['max_new_tokens']} tokens", file=out)
        for level, c in sorted(summary["by_level"].items()):
            print(f"  level {level}: {c['kept']}/{c['prompts']} kept", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
