"""`python -m tools.eval CHECKPOINT --data FILE [--k 8] [--samples N] [--json]`: how good is a model?

Per level and overall, on a JSON-lines dataset with answers (`actors/dataset.py`):

* greedy accuracy (temperature 0, one answer per prompt);
* pass@1 and pass@k from `--samples` answers per prompt at `--temperature` (1.0 by default), with the
  unbiased estimator of `algo.eval_stats` (pass@1 is the mean sampled accuracy), and maj@k;
* average answer lengths in tokens (without the eos), greedy and sampled, and the share of answers cut
  off by `--max-new-tokens`.

pass@1 is the mean accuracy over the sampled answers (avg@n): AReaL's "Pass@1 averaged over 32 samples at
temperature 0.6" is `--samples 32 --temperature 0.6 --top-p 0.95`. `--pass-k 8,16` adds more pass@k columns,
`--table tutorial` prints the tutorial's table (dataset, num_questions, greedy_length, sample_length,
greedy_acc, sample_pass@1, pass@k...), and `--config` takes `gen.max_new_tokens` and the dataset layout from
an experiment config.

All prompts go to one `TorchGenerationEngine` at once (continuous batching); answers are checked by the
math grader, its undecided cases in a `RewardPool`; answers to code records (``"task": "code"``, e.g.
`tools.make_task --task code`) by running their program against the record's unit tests in the sandbox, so
greedy accuracy is then the pass rate (every test passes). Sampling is seeded per prompt, so a run is
reproducible. Other tools call `evaluate(model_dir, data_path, ...) -> dict` (or `aevaluate` from an
event loop); `evaluate_model` does the same for a model already in memory (the warm start's held-out
checks).
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from actors.dataset import AREAL, LAYOUTS, DatasetError, Dataset, Layout, OnError, Record, load_dataset
from actors.engines.base import EngineError
from actors.engines.checkpoint import CheckpointError, load_model
from actors.engines.model import Qwen2ForCausalLM
from actors.engines.tokenizer import TokenizerError, load_tokenizer
from actors.evaluation import (DEFAULT_MAX_NEW_TOKENS, NO_LEVEL, EvalError, EvalSettings, aevaluate_model,  # noqa: F401
                               aevaluate_with, engine_generator, evaluate_model, level_key, select_records)
from tools.lm import LMToolError, has_weights
from topology.experiment import ExperimentConfig, experiment_problems

ENGINES = ("torch", "sglang")


def load_eval_records(data_path: str, levels: Sequence[int] | None = None, max_per_level: int | None = None,
                      on_error: OnError = "fail", layout: Layout = AREAL) -> tuple[list[Record], Dataset]:
    dataset = load_dataset(data_path, require="answer", on_error=on_error, layout=layout)
    records = select_records(dataset.records, levels, max_per_level)
    if not records:
        raise EvalError(f"{data_path}: no records of levels {list(levels or [])}")
    return records, dataset


async def aevaluate(model_dir: str, data_path: str, *, k: int = 8, samples: int | None = None,
                    greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0,
                    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, pass_ks: Sequence[int] = (), seed: int = 0, levels: Sequence[int] | None = None, max_per_level: int | None = None,
                    device: str = "cpu", workers: int = 1, on_error: OnError = "fail",
                    details: bool = False, layout: Layout = AREAL, engine: str = "torch",
                    url: str | None = None) -> dict[str, Any]:
    """Load the checkpoint and its tokenizer, evaluate on the dataset; see `aevaluate_model`. With
    engine "sglang" the answers come from the SGLang server at `url` (its /generate), and `model_dir` need
    only hold the tokenizer of the model it serves.

    The report also names "model_dir", "data", "skipped_lines", "engine" and the total "seconds.total".
    """
    settings = EvalSettings(k=k, samples=samples, greedy=greedy, temperature=temperature, top_p=top_p,
                            max_new_tokens=max_new_tokens, pass_ks=tuple(pass_ks), seed=seed, workers=workers)
    settings.check()
    t0 = time.perf_counter()
    if engine not in ENGINES:
        raise EvalError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
    if engine == "sglang" and not url:
        raise EvalError("--engine sglang needs the server's --url")
    if engine == "torch" and url:
        raise EvalError("--url is for --engine sglang (the torch engine runs here, on the checkpoint)")
    if engine == "torch" and not has_weights(model_dir):
        raise EvalError(f"{model_dir}: no model weights (model.safetensors or an index) to evaluate")
    records, dataset = load_eval_records(data_path, levels, max_per_level, on_error, layout)
    tokenizer = load_tokenizer(model_dir)
    if engine == "sglang":
        from actors.engines.sglang import SGLangEngine
        server = SGLangEngine(url=url, version=None)   # version None: read the server's label, do not change it
        await server.start()
        try:
            report = await aevaluate_with(engine_generator(server), tokenizer, records, settings, details=details)
        finally:
            await server.stop()
    else:
        model = await asyncio.to_thread(load_model, model_dir, None, device)
        report = await aevaluate_model(model, tokenizer, records, settings, details=details)
    report["seconds"]["total"] = time.perf_counter() - t0
    return {"model_dir": str(model_dir), "data": str(data_path), "skipped_lines": dataset.n_skipped,
            "engine": engine if engine == "torch" else f"sglang {url}", **report}


def evaluate(model_dir: str, data_path: str, **kwargs: Any) -> dict[str, Any]:
    """Synchronous `aevaluate` (tools, the launcher's summary, benchmarks)."""
    return asyncio.run(aevaluate(model_dir, data_path, **kwargs))


def evaluate_held_out(model_dir: str, config: ExperimentConfig, data_path: str | None = None) -> dict[str, Any]:
    """Greedy accuracy of a model on the run's held-out file (``data.test`` unless ``data_path``) as a run's final
    evaluation reads it: the config's layout, ``eval.max_per_level`` and ``gen.max_new_tokens``."""
    test = data_path or config.data.test
    if not test:
        raise EvalError("data.test: the experiment config names no held-out file")
    return evaluate(model_dir, test, samples=None, max_per_level=config.eval.max_per_level,
                    max_new_tokens=config.gen.max_new_tokens, layout=Layout.from_settings(config.data, test=True))


def copy_for_eval(model: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    """A detached copy of a model in training, for `evaluate_model` (the engine freezes what it gets)."""
    return copy.deepcopy(model)


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


def render_tutorial_table(report: dict[str, Any], stream: TextIO | None = None) -> None:
    """The AReaL tutorial's table (its eval_and_aggregate.py): one row for the dataset, accuracies in %."""
    from rich.console import Console
    from rich.table import Table

    overall = report["overall"]
    columns = [("num_questions", str(overall["n"])),
               ("greedy_length", _fmt(overall.get("greedy_len"), False)),
               ("sample_length", _fmt(overall.get("sample_len"), False)),
               ("greedy_acc", _fmt(overall.get("greedy_accuracy"))),
               ("sample_pass@1", _fmt(overall.get("pass@1")))]
    columns += [(f"pass@{k}", _fmt(overall.get(f"pass@{k}"))) for k in report["pass_ks"] if k > 1]
    table = Table()
    table.add_column("dataset")
    for title, _ in columns:
        table.add_column(title, justify="center")
    table.add_row(Path(str(report.get("data", "data"))).stem, *[cell for _, cell in columns])
    out = stream or sys.stdout
    Console(file=out, width=None if out.isatty() else 160).print(table)


def _ks(text: str | None) -> list[int]:
    try:
        return [int(x) for x in text.split(",")] if text else []
    except ValueError:
        raise ValueError(f"--pass-k: expected integers separated by commas, got {text!r}") from None


def _from_config(path: str | None) -> ExperimentConfig:
    """The experiment config of --config, typed (its defaults without one)."""
    if not path:
        return ExperimentConfig()
    import yaml
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--config {path}: expected a mapping, got {type(doc).__name__}")
    problems = experiment_problems(doc, prefix="")
    if problems:
        raise ValueError(f"--config {path}: " + "; ".join(problems))
    return ExperimentConfig.model_validate(doc)


def data_options(args: argparse.Namespace) -> tuple[Layout, int]:
    """The dataset layout and max_new_tokens from --config, --layout/--id2info/--prompt-template and
    --max-new-tokens (shared with tools.filter_data). Command-line layout options replace the config's data
    mapping as a whole. Raises ValueError naming the bad option."""
    config = _from_config(args.config)
    explicit = {"layout": args.layout, "id2info": args.id2info, "prompt_template": args.prompt_template}
    data = {k: v for k, v in explicit.items() if v is not None} \
        if any(v is not None for v in explicit.values()) else config.data
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else config.gen.max_new_tokens
    return Layout.from_settings(data), max_new_tokens


def _levels(text: str | None) -> list[int] | None:
    if not text:
        return None
    from tools.make_task import parse_levels
    return parse_levels(text)


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="model directory (Hugging Face layout, with tokenizer.json)")
    ap.add_argument("--data", required=True, help="JSON-lines dataset with answers")
    ap.add_argument("--k", type=int, default=8, help="k of pass@k and maj@k")
    ap.add_argument("--samples", type=int, default=None, help="sampled answers per prompt (default k; 0: greedy only)")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of the sampled answers")
    ap.add_argument("--pass-k", help="more pass@k values, e.g. 8,16 (each at most --samples)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"answer length limit (default: the --config's gen.max_new_tokens, else {DEFAULT_MAX_NEW_TOKENS})")
    ap.add_argument("--config", help="experiment config: its gen.max_new_tokens and data layout are the defaults")
    ap.add_argument("--levels", help="only these levels, e.g. 1-3,5")
    ap.add_argument("--max-per-level", type=int, help="the first N prompts of each level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine", choices=ENGINES, default="torch",
                    help="torch: the embedded engine on CHECKPOINT here; sglang: the server at --url answers "
                         "(CHECKPOINT then needs only the tokenizer)")
    ap.add_argument("--url", help="the SGLang server, e.g. http://127.0.0.1:30000 (with --engine sglang)")
    ap.add_argument("--workers", type=int, default=1, help="grader processes for answers the fast path leaves open")
    ap.add_argument("--on-error", choices=("fail", "skip"), default="fail", help="malformed dataset lines")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default=None,
                    help="the dataset's field layout (actors/dataset.py): areal (default), gsm8k or math")
    ap.add_argument("--id2info", help="AReaL's answer file for a prompt file without answers")
    ap.add_argument("--prompt-template", help="wraps each prompt; {prompt} marks where it goes")
    ap.add_argument("--details", metavar="FILE", help="write per-prompt rows (responses included) as JSON lines")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--table", choices=("levels", "tutorial"), default="levels",
                    help="per-level rows, or the AReaL tutorial's table (one row, its columns)")
    args = ap.parse_args(argv)
    try:
        levels = _levels(args.levels)
        pass_ks = _ks(args.pass_k)
        layout, max_new_tokens = data_options(args)
    except ValueError as e:
        ap.error(str(e))
    try:
        report = evaluate(args.checkpoint, args.data, k=args.k, samples=args.samples, greedy=not args.no_greedy,
                          temperature=args.temperature, top_p=args.top_p, max_new_tokens=max_new_tokens,
                          pass_ks=pass_ks, seed=args.seed,
                          levels=levels, max_per_level=args.max_per_level, device=args.device,
                          workers=args.workers, on_error=args.on_error, details=bool(args.details), layout=layout,
                          engine=args.engine, url=args.url)
    except (EvalError, DatasetError, CheckpointError, TokenizerError, LMToolError, EngineError) as e:
        print(f"eval: error: {e}", file=sys.stderr)
        return 2
    if args.details:
        with open(args.details, "w", encoding="utf-8") as f:
            for row in report.pop("prompts"):
                f.write(json.dumps(row) + "\n")
    out = stdout or sys.stdout
    if args.json:
        print(json.dumps(report), file=out)
    elif args.table == "tutorial":
        render_tutorial_table(report, out)
    else:
        render_table(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
