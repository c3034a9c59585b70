"""`python -m tools.eval CHECKPOINT --data A.jsonl[,B.jsonl,...] [--protocol areal|plain] [--json]`: how good is a model?

By default AReaL's evaluation protocol (`--protocol areal`, the tutorial's: AReaL's evaluation/eval_and_aggregate.py
at tag v0.2.0 and its README's "average of 32 samples with temperature 0.6"): a greedy answer and 32 sampled
answers per prompt at temperature 0.6, top-p 0.95, up to 32,768 new tokens, each prompt in the DeepSeek-R1 turn
("Please reason step by step, and put your final answer within \\boxed{}", the answer starting after
``<think>\n``: the `r1-distilled-qwen` template), and the tutorial's table: one row per benchmark with
num_questions, greedy_length, sample_length, greedy_acc, sample_pass@1, pass@8, pass@16. `--protocol plain`
is ours for small models (8 samples at temperature 1.0, 64 new tokens, no template, a table per level). Every
flag overrides its protocol's value; `--config` gives the answer length and the data layout and template.

Several benchmarks in one call: `--data a.jsonl,b.jsonl`, or AReaL's evaluation layout
(`evaluation/data/<name>/test.jsonl`: a directory holding test.jsonl, or a bare name with `--data-dir DIR`);
each file's layout is read from its first line unless `--layout`/`--config` say it (actors/dataset.py,
`detect_layout`), and the model is loaded (or its servers started) once for all of them.

Per level and overall: greedy accuracy; pass@1 and pass@k from `--samples` answers per prompt (the unbiased
estimator of `algo.eval_stats`; pass@1 is the mean sampled accuracy, AReaL's avg@n) and maj@k; average answer
lengths in tokens (without the eos), greedy and sampled; the share of answers cut at `--max-new-tokens`.

Engines (the rollouts' `GenerationEngine` interface): `--engine torch` loads the checkpoint here (on the GPU
when the machine has one, else the CPU; `--device`); `--engine sglang` starts `--servers` SGLang servers on
the checkpoint (`--tp` GPUs each) and spreads the prompts over them, or sends them to running servers
(`--url A[,B]`; CHECKPOINT then needs only the tokenizer). The default, `auto`, is sglang on a machine with a
GPU and SGLang installed, else torch. Answers are checked by the math grader (a response matching any of a
record's answers is right), its undecided cases in a `RewardPool`; code records (``"task": "code"``) by
running their program against the record's unit tests in the sandbox. Sampling is seeded per prompt, so a run
is reproducible. This module parses and prints; the evaluating is the library's: other code calls
`actors.evaluator.harness.evaluate(model_dir, data_path, ...) -> dict`, `evaluate_many` for several files (or
`aevaluate`/`aevaluate_many` from an event loop); `actors.evaluator.evaluation.evaluate_model` does the same
for a model already in memory (the warm start's held-out checks).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from actors.dataset import LAYOUTS, DatasetError, Layout, detect_layout
from actors.engines.base import EngineError
from actors.engines.checkpoint import CheckpointError
from actors.engines.tokenizer import TokenizerError
from actors.evaluator.evaluation import DEFAULT_MAX_NEW_TOKENS, EvalError
from actors.evaluator.harness import ENGINES, evaluate_many, resolve_benchmarks
from launch.prepare.lm import LMToolError
from topology import load_experiment
from topology.experiment import PROMPT_TEMPLATES

# Evaluation protocols: the values every flag left out takes.
PROTOCOLS: dict[str, dict[str, Any]] = {
    # AReaL's, as its evaluation/eval_and_aggregate.py (tag v0.2.0) defaults them (--n_sampling 32, --temperature
    # 0.6, --top_p 0.95, --max_gen_tokens 32768, --prompt_type r1-distilled-qwen, a greedy pass beside) and its
    # table prints them (pass@1 of the samples, pass@8, pass@16)
    "areal": {"k": 8, "samples": 32, "pass_ks": (16,), "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 32768,
              "prompt_template": "r1-distilled-qwen", "table": "tutorial"},
    # ours, for small models such as the embedded task's: 8 samples at temperature 1.0, 64 new tokens, no template
    "plain": {"k": 8, "samples": None, "pass_ks": (), "temperature": 1.0, "top_p": 1.0,
              "max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "prompt_template": None, "table": "levels"},
}


# --- command line --------------------------------------------------------------------------------

def _fmt(value: Any, pct: bool = True) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}" if pct else f"{value:.1f}"


def render_table(report: dict[str, Any], stream: TextIO | None = None) -> None:
    """Per-level rows and an "all" row; columns only for what was measured (accuracies in %)."""
    from rich.console import Console
    from rich.table import Table

    k = report["k"]
    columns = [("n", "n", None), ("greedy %", "greedy_accuracy", True), ("pass@1 %", "pass@1", True),
               (f"pass@{k} %", f"pass@{k}", True), (f"maj@{k} %", f"maj@{k}", True),
               ("greedy len", "greedy_len", False), ("sample len", "sample_len", False),
               ("greedy cut %", "greedy_truncated", True), ("sample cut %", "sample_truncated", True)]
    columns = [c for c in columns if c[1] in report["overall"]]
    table = Table(title=f"{report.get('model_dir', 'model')} on {report.get('data', 'data')}: {report['n_prompts']} "
                        f"prompts, {report['samples']} samples per prompt at T={report['temperature']}")
    table.add_column("level")
    for title, _, _ in columns:
        table.add_column(title, justify="right")
    lines = list(report["by_level"].items()) + [("all", report["overall"])]
    for i, (name, summary) in enumerate(lines):
        cells = [str(summary["n"]) if key == "n" else _fmt(summary.get(key), bool(pct)) for _, key, pct in columns]
        table.add_row(name, *cells, end_section=i == len(lines) - 2)
    out = stream or sys.stdout
    console = Console(file=out, width=None if out.isatty() else 140)
    console.print(table)
    console.print("seconds: " + ", ".join(f"{name} {v:.1f}" for name, v in report["seconds"].items()))


def render_tutorial_table(reports: dict[str, Any] | Sequence[dict[str, Any]], stream: TextIO | None = None) -> None:
    """The AReaL tutorial's table (its eval_and_aggregate.py): one row per benchmark, accuracies in %."""
    from rich.console import Console
    from rich.table import Table

    reports = [reports] if isinstance(reports, dict) else list(reports)
    pass_ks = sorted({k for r in reports for k in r["pass_ks"] if k > 1})
    titles = ["num_questions", "greedy_length", "sample_length", "greedy_acc", "sample_pass@1",
              *[f"pass@{k}" for k in pass_ks]]
    table = Table()
    table.add_column("dataset")
    for title in titles:
        table.add_column(title, justify="center")
    for report in reports:
        overall = report["overall"]
        table.add_row(report.get("dataset") or benchmark_name(report.get("data", "data")), str(overall["n"]),
                      _fmt(overall.get("greedy_len"), False), _fmt(overall.get("sample_len"), False),
                      _fmt(overall.get("greedy_accuracy")), _fmt(overall.get("pass@1")),
                      *[_fmt(overall.get(f"pass@{k}")) for k in pass_ks])
    out = stream or sys.stdout
    console = Console(file=out, width=None if out.isatty() else 160)
    console.print(table)
    first = reports[0]
    console.print(f"{first.get('engine', '')}: {first['samples']} samples at temperature {first['temperature']}, "
                  f"top-p {first['top_p']}, up to {first['max_new_tokens']} new tokens, and a greedy answer")


def _ks(text: str | None) -> list[int] | None:
    try:
        return [int(x) for x in text.split(",")] if text else None
    except ValueError:
        raise ValueError(f"--pass-k: expected integers separated by commas, got {text!r}") from None


def data_options(args: argparse.Namespace, default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
                 ) -> tuple[Layout | None, int]:
    """The dataset layout and max_new_tokens from --config, --layout/--id2info/--prompt-template and
    --max-new-tokens (shared with tools.filter_data). Command-line layout options replace the config's data
    mapping as a whole; with neither the layout is None (each file's own: `detect_layout`). Raises ValueError
    naming the bad option."""
    config = load_experiment(args.config) if args.config else None
    explicit = {"layout": args.layout, "id2info": args.id2info, "prompt_template": args.prompt_template}
    if any(v is not None for v in explicit.values()):
        data: Any = {k: v for k, v in explicit.items() if v is not None}
        if args.layout is None and args.id2info is None:   # a template alone: each file's own layout, wrapped
            data = None
    else:
        data = config.data if config is not None else None
    if args.max_new_tokens is not None:
        max_new_tokens = args.max_new_tokens
    elif config is not None:
        max_new_tokens = config.gen.max_new_tokens
    else:
        max_new_tokens = default_max_new_tokens
    return (Layout.from_settings(data) if data is not None else None), max_new_tokens


def _levels(text: str | None) -> list[int] | None:
    if not text:
        return None
    from launch.prepare.task import parse_levels
    return parse_levels(text)


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="model directory (Hugging Face layout, with tokenizer.json)")
    ap.add_argument("--data", required=True,
                    help="JSON-lines benchmarks with answers, comma-separated: files, directories holding test.jsonl "
                         "(AReaL's evaluation/data/<name>/), or names under --data-dir")
    ap.add_argument("--data-dir", help="where bare --data names are: DIR/<name>/test.jsonl (AReaL's evaluation/data)")
    ap.add_argument("--protocol", choices=sorted(PROTOCOLS), default="areal",
                    help="what every flag left out takes: areal (the tutorial's: 32 samples at temperature 0.6, "
                         "top-p 0.95, 32768 new tokens, the r1-distilled-qwen prompt, its table; the default) or "
                         "plain (8 samples at temperature 1.0, 64 new tokens, no template, a table per level)")
    ap.add_argument("--k", type=int, default=None, help="k of pass@k and maj@k")
    ap.add_argument("--samples", type=int, default=None, help="sampled answers per prompt (0: greedy only)")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--top-p", type=float, default=None, help="nucleus sampling of the sampled answers")
    ap.add_argument("--pass-k", help="more pass@k values, e.g. 8,16 (each at most --samples)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="answer length limit (default: the --config's gen.max_new_tokens, else the protocol's)")
    ap.add_argument("--config", help="experiment config: its gen.max_new_tokens and data layout are the defaults")
    ap.add_argument("--levels", help="only these levels, e.g. 1-3,5")
    ap.add_argument("--max-per-level", type=int, help="the first N prompts of each level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", choices=ENGINES, default="auto",
                    help="torch: the embedded engine on CHECKPOINT here; sglang: SGLang servers (started on "
                         "CHECKPOINT, or --url); auto: sglang on a machine with a GPU and SGLang, else torch")
    ap.add_argument("--device", default=None, help="the torch engine's device (default: cuda if present, else cpu)")
    ap.add_argument("--url", help="running SGLang servers, comma-separated, e.g. http://127.0.0.1:30000 "
                                  "(CHECKPOINT then needs only the tokenizer)")
    ap.add_argument("--servers", type=int, default=None,
                    help="SGLang servers to start on CHECKPOINT (default: one per --tp GPUs of the machine)")
    ap.add_argument("--tp", type=int, default=1, help="GPUs per started SGLang server")
    ap.add_argument("--server-command", default=None,
                    help="the started servers' module runner (default: python -m sglang.launch_server)")
    ap.add_argument("--workers", type=int, default=1, help="grader processes for answers the fast path leaves open")
    ap.add_argument("--on-error", choices=("fail", "skip"), default="fail", help="malformed dataset lines")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default=None,
                    help="the files' field layout (actors/dataset.py; default: read from each file's first line)")
    ap.add_argument("--id2info", help="AReaL's answer file for a prompt file without answers")
    ap.add_argument("--prompt-template",
                    help=f"wraps each prompt that carries no template: a text with {{prompt}}, or one of "
                         f"{', '.join(PROMPT_TEMPLATES)} (default: the protocol's)")
    ap.add_argument("--details", metavar="FILE", help="write per-prompt rows (responses included) as JSON lines")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object instead of a table (several benchmarks: {\"datasets\": [...]})")
    ap.add_argument("--table", choices=("levels", "tutorial"), default=None,
                    help="per-level rows, or the AReaL tutorial's table (one row per benchmark; the protocol's)")
    args = ap.parse_args(argv)
    proto = PROTOCOLS[args.protocol]
    try:
        levels = _levels(args.levels)
        pass_ks = _ks(args.pass_k)
        layout, max_new_tokens = data_options(args, proto["max_new_tokens"])
        paths = resolve_benchmarks(args.data, args.data_dir)
        config = load_experiment(args.config) if args.config else None
    except (ValueError, EvalError) as e:
        ap.error(str(e))
    # A template configured for the data (--config's data.prompt_template, --prompt-template) is in the layout;
    # the protocol's wraps what nothing else wraps.
    template = None if (layout is not None and layout.prompt_template) or \
        (config is not None and config.data.prompt_template) else proto["prompt_template"]
    k = args.k if args.k is not None else proto["k"]
    samples = args.samples if args.samples is not None else proto["samples"]
    try:
        reports = evaluate_many(
            args.checkpoint, paths, k=k, samples=samples, greedy=not args.no_greedy,
            temperature=args.temperature if args.temperature is not None else proto["temperature"],
            top_p=args.top_p if args.top_p is not None else proto["top_p"], max_new_tokens=max_new_tokens,
            pass_ks=pass_ks if pass_ks is not None else [x for x in proto["pass_ks"] if x <= (samples or k)],
            seed=args.seed, levels=levels, max_per_level=args.max_per_level, device=args.device,
            workers=args.workers, on_error=args.on_error, details=bool(args.details), layout=layout,
            prompt_template=template, engine=args.engine, url=args.url, servers=args.servers, tp=args.tp,
            server_command=args.server_command.split() if args.server_command else None)
    except (EvalError, DatasetError, CheckpointError, TokenizerError, LMToolError, EngineError) as e:
        print(f"eval: error: {e}", file=sys.stderr)
        return 2
    if args.details:
        with open(args.details, "w", encoding="utf-8") as f:
            for report in reports:
                for row in report.pop("prompts"):
                    f.write(json.dumps({"dataset": report["dataset"], **row}) + "\n")
    out = stdout or sys.stdout
    table = args.table or proto["table"]
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else {"datasets": reports}), file=out)
    elif table == "tutorial":
        render_tutorial_table(reports, out)
    else:
        for report in reports:
            render_table(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
