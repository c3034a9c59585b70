"""Evaluating a model directory on held-out files, the library behind `python -m tools.eval` and the launcher's
final held-out comparison (launch/evaluation.py): each file's records read in its layout, the evaluation's engine
opened once for every file (the embedded engine on the checkpoint, or SGLang servers, running or started on it),
and `actors.evaluator.evaluation`'s report per file. `evaluate_held_out` is a run's final evaluation: the
experiment's data.test as the run's evaluator reads it."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import importlib.util
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from actors.dataset import AREAL, DOWNLOAD_SUFFIX, Dataset, Layout, OnError, Record, detect_layout, load_dataset, resolve_data_path
from actors.engines.checkpoint import has_weights, load_model
from actors.engines.model import Qwen2ForCausalLM
from actors.engines.tokenizer import load_tokenizer
from actors.evaluator.episode_eval import aevaluate_model_episodes
from actors.evaluator.evaluation import (DEFAULT_MAX_NEW_TOKENS, EvalError, EvalSettings, Generate, aevaluate_with,
                                         agenerate, engine_generator, select_records)
from actors.rollout.envs import is_agent
from topology.experiment import ExperimentConfig, prompt_template_text

ENGINES = ("auto", "torch", "sglang")


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
