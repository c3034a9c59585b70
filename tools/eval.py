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
is reproducible. Other tools call `evaluate(model_dir, data_path, ...) -> dict`, `evaluate_many` for several
files (or `aevaluate`/`aevaluate_many` from an event loop); `evaluate_model` does the same for a model already
in memory (the warm start's held-out checks).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import importlib.util
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from actors.dataset import (AREAL, DOWNLOAD_SUFFIX, LAYOUTS, DatasetError, Dataset, Layout, OnError, Record,
                            detect_layout, load_dataset, resolve_data_path)
from actors.engines.base import EngineError
from actors.engines.checkpoint import CheckpointError, load_model
from actors.engines.model import Qwen2ForCausalLM
from actors.engines.tokenizer import TokenizerError, load_tokenizer
from actors.rollout.envs import is_agent
from actors.evaluator.episode_eval import aevaluate_model_episodes
from actors.evaluator.evaluation import (DEFAULT_MAX_NEW_TOKENS, NO_LEVEL, EvalError, EvalSettings, Generate,  # noqa: F401
                               aevaluate_model, aevaluate_with, agenerate, engine_generator, evaluate_model,
                               level_key, select_records)
from tools.lm import LMToolError, has_weights
from topology.experiment import PROMPT_TEMPLATES, ExperimentConfig, experiment_problems, prompt_template_text

ENGINES = ("auto", "torch", "sglang")

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


def load_eval_records(data_path: str, levels: Sequence[int] | None = None, max_per_level: int | None = None,
                      on_error: OnError = "fail", layout: Layout = AREAL) -> tuple[list[Record], Dataset]:
    dataset = load_dataset(data_path, require="answer", on_error=on_error, layout=layout)
    records = select_records(dataset.records, levels, max_per_level)
    if not records:
        raise EvalError(f"{data_path}: no records of levels {list(levels or [])}")
    return records, dataset


def benchmark_name(path: str | Path) -> str:
    """The name a benchmark's row carries: AReaL's evaluation/data/<name>/test.jsonl is <name>, any other file
    its name without .jsonl (and without a download's ?download=true)."""
    path = Path(str(path).removesuffix(DOWNLOAD_SUFFIX))
    return path.parent.name if path.name == "test.jsonl" and path.parent.name else path.name.removesuffix(".jsonl")


def resolve_benchmarks(spec: str | Sequence[str], data_dir: str | None = None) -> list[str]:
    """The files of `--data`: comma-separated (or a list of) files, directories holding test.jsonl (AReaL's
    evaluation layout), or, with `data_dir`, bare names of directories under it (math_500 ->
    DATA_DIR/math_500/test.jsonl). A path that names nothing is returned as it is, for the loader to report."""
    items = [x.strip() for x in (spec.split(",") if isinstance(spec, str) else spec) if x.strip()]
    if not items:
        raise EvalError("--data: no file given")
    out = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            path = path / "test.jsonl"
        elif data_dir is not None and not resolve_data_path(path).exists() and (Path(data_dir) / item).is_dir():
            path = Path(data_dir) / item / "test.jsonl"
        out.append(str(path))
    return out


def default_device() -> str:
    """Where the torch engine runs when --device is not given: the machine's GPU if it has one."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_engine() -> str:
    """`auto`'s choice: SGLang servers on a machine with a GPU and SGLang installed, else the embedded engine."""
    import torch

    return "sglang" if torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None else "torch"


@contextlib.asynccontextmanager
async def open_generator(model_dir: str, *, engine: str = "torch", urls: Sequence[str] = (), servers: int | None = None,
                         tp: int = 1, server_command: Sequence[str] | None = None, device: str | None = None,
                         max_running: int = 256) -> AsyncIterator[tuple[Generate, str]]:
    """(a `Generate` for `actors.evaluator.evaluation.aevaluate_with`, what answers) for the evaluation's engine, started
    once for every benchmark and stopped after: the embedded engine on the checkpoint, running SGLang servers
    (`urls`), or `servers` SGLang servers started on the checkpoint (`tp` GPUs each, the i-th on GPUs
    [i*tp, (i+1)*tp); `server_command`: the server's module runner, python -m sglang.launch_server)."""
    if engine == "torch":
        device = device or default_device()
        model = await asyncio.to_thread(load_model, model_dir, None, device)

        async def gen(prompts: Sequence[Sequence[int]], sampling: Sequence[Any], n: int) -> list[list[Any]]:
            return await agenerate(model, prompts, sampling, n, max_running)
        yield gen, f"torch {device}"
        return
    from actors.engines.sglang import SGLangEngine
    from actors.engines.sglang_server import LaunchConfig

    if urls:   # version None: read each server's label, do not change it
        engines = [SGLangEngine(url=u, version=None) for u in urls]
        what = "sglang " + ",".join(urls)
    else:
        import torch

        gpus = torch.cuda.device_count()
        count = servers or max(1, gpus // max(tp, 1))
        if gpus and count * tp > gpus:
            raise EvalError(f"--servers {count} x --tp {tp} needs {count * tp} GPUs, this machine has {gpus}")
        command = list(server_command or [sys.executable, "-m", "sglang.launch_server"])
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        engines = [SGLangEngine(launch=LaunchConfig(
            model_path=model_dir, command=command, tp=tp, seed=i,
            env={"CUDA_VISIBLE_DEVICES": ",".join(ids[i * tp:(i + 1) * tp])} if gpus else {}), version=0)
            for i in range(count)]
        what = f"sglang {count} server(s) x tp {tp} on {model_dir}"
    started: list[Any] = []
    try:
        for result in await asyncio.gather(*(e.start() for e in engines), return_exceptions=True):
            if isinstance(result, BaseException):
                raise result
        started = engines
        yield engine_generator(*engines), what
    finally:
        await asyncio.gather(*(e.stop() for e in (started or engines)), return_exceptions=True)


async def aevaluate_many(model_dir: str, data_paths: Sequence[str], *, k: int = 8, samples: int | None = None,
                         greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0,
                         max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, pass_ks: Sequence[int] = (), seed: int = 0,
                         levels: Sequence[int] | None = None, max_per_level: int | None = None,
                         device: str | None = None, workers: int = 1, on_error: OnError = "fail",
                         details: bool = False, layout: Layout | None = AREAL, prompt_template: str | None = None,
                         engine: str = "torch", url: str | Sequence[str] | None = None, servers: int | None = None,
                         tp: int = 1, server_command: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Evaluate the checkpoint on each file; one report per file, in order (see `aevaluate_model`). ``layout``
    None reads each file's layout from its first line (`detect_layout`); ``prompt_template`` (a name of
    `PROMPT_TEMPLATES` or a text with {prompt}) wraps prompts that carry none, unless the layout has its own.
    With engine "sglang" the answers come from SGLang servers: running ones at ``url`` (one or several, a list
    or comma-separated; `model_dir` then needs only the tokenizer), or ``servers`` started on the checkpoint.

    Each report also names "dataset" (`benchmark_name`), "model_dir", "data", "skipped_lines",
    "templated_as_is", "engine" and the total "seconds.total"."""
    settings = EvalSettings(k=k, samples=samples, greedy=greedy, temperature=temperature, top_p=top_p,
                            max_new_tokens=max_new_tokens, pass_ks=tuple(pass_ks), seed=seed, workers=workers)
    settings.check()
    urls = [u.strip() for u in (url.split(",") if isinstance(url, str) else url or []) if u.strip()]
    if engine == "auto":
        engine = "sglang" if urls else default_engine()
    if engine not in ENGINES:
        raise EvalError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
    if engine == "torch" and urls:
        raise EvalError("--url is for --engine sglang (the torch engine runs here, on the checkpoint)")
    if not urls and not has_weights(model_dir):
        raise EvalError(f"{model_dir}: no model weights (model.safetensors or an index) to evaluate")
    template = prompt_template_text(prompt_template) if prompt_template else None
    loaded = []
    for path in data_paths:   # every file checked before the model loads or a server starts
        file_layout = layout if layout is not None else detect_layout(path)
        if template and file_layout.prompt_template is None:
            file_layout = dataclasses.replace(file_layout, prompt_template=template)
        loaded.append((path, *load_eval_records(path, levels, max_per_level, on_error, file_layout)))
    tokenizer = load_tokenizer(model_dir)
    reports = []
    async with open_generator(model_dir, engine=engine, urls=urls, servers=servers, tp=tp,
                              server_command=server_command, device=device,
                              max_running=settings.max_running) as (generate, what):
        for path, records, dataset in loaded:
            t0 = time.perf_counter()
            report = await aevaluate_with(generate, tokenizer, records, settings, details=details)
            report["seconds"]["total"] = time.perf_counter() - t0
            reports.append({"dataset": benchmark_name(path), "model_dir": str(model_dir), "data": str(path),
                            "skipped_lines": dataset.n_skipped, "templated_as_is": dataset.templated_as_is,
                            "engine": what, **report})
    return reports


async def aevaluate(model_dir: str, data_path: str, **kwargs: Any) -> dict[str, Any]:
    """`aevaluate_many` on one file: its report."""
    return (await aevaluate_many(model_dir, [data_path], **kwargs))[0]


def evaluate(model_dir: str, data_path: str, **kwargs: Any) -> dict[str, Any]:
    """Synchronous `aevaluate` (tools, the launcher's summary, benchmarks)."""
    return asyncio.run(aevaluate(model_dir, data_path, **kwargs))


def evaluate_many(model_dir: str, data_paths: Sequence[str], **kwargs: Any) -> list[dict[str, Any]]:
    """Synchronous `aevaluate_many`."""
    return asyncio.run(aevaluate_many(model_dir, data_paths, **kwargs))


def evaluate_held_out(model_dir: str, config: ExperimentConfig, data_path: str | None = None) -> dict[str, Any]:
    """Greedy accuracy of a model on the run's held-out file (``data.test`` unless ``data_path``) as a run's final
    evaluation reads it: the config's test layout and template, ``eval.max_per_level``, ``eval.samples`` and
    ``gen.max_new_tokens``, on SGLang servers on a machine with a GPU and SGLang (the run's GPUs are free by
    then), else here."""
    test = data_path or config.data.test
    if not test:
        raise EvalError("data.test: the experiment config names no held-out file")
    records, _ = load_eval_records(test, None, config.eval.max_per_level)
    if any(is_agent(r.extra) for r in records):
        # Records that name a tool are answered as the run's rollouts answer them: episodes of gen.max_turns.
        if not has_weights(model_dir):
            raise EvalError(f"{model_dir}: no model weights (model.safetensors or an index) to evaluate")
        settings = EvalSettings(samples=0, max_new_tokens=config.gen.max_new_tokens)
        return asyncio.run(aevaluate_model_episodes(load_model(model_dir), load_tokenizer(model_dir), records,
                                                    settings, config.gen.max_turns))
    return evaluate(model_dir, test, samples=config.eval.samples, max_per_level=config.eval.max_per_level,
                    max_new_tokens=config.gen.max_new_tokens, layout=Layout.from_settings(config.data, test=True),
                    engine="auto")


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


def _from_config(path: str | None) -> ExperimentConfig | None:
    """The experiment config of --config, typed (None without one)."""
    if not path:
        return None
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


def data_options(args: argparse.Namespace, default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
                 ) -> tuple[Layout | None, int]:
    """The dataset layout and max_new_tokens from --config, --layout/--id2info/--prompt-template and
    --max-new-tokens (shared with tools.filter_data). Command-line layout options replace the config's data
    mapping as a whole; with neither the layout is None (each file's own: `detect_layout`). Raises ValueError
    naming the bad option."""
    config = _from_config(args.config)
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
    from tools.make_task import parse_levels
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
        config = _from_config(args.config)
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
