"""Before a run starts: make what the experiment needs and does not have yet.

The embedded default's first command must work on a fresh machine, where neither the dataset nor the
warm-start weights exist. The experiment config says how to make them (`configs/local.yaml`):

    prepare:
      data:                 # each dataset whose train/test files are missing: python -m tools.make_task
        - {out: data/arith, args: {max_operand: 9, ...}}        # the RL data (its train/test are data.*)
        - {out: data/arith-careful, args: {direct_fraction: 0}}  # more data, e.g. for a warm-start stage
      warm_start:           # when model.path has no weights: supervised stages, each to its plateau
        out: runs/warm_start/arith-tiny                          # reused while its inputs are unchanged
        stages:
          - {data: data/arith-careful, args: {until_plateau: true, ...}}   # tools.sft.SFTConfig fields
          - {data: data/arith, args: {until_plateau: true, ...}}

A stage's `data` is a folder with train.jsonl and test.jsonl (held-out accuracy decides its plateau);
each stage starts from the previous one's weights. The warm start is cached by a fingerprint of its
inputs (model config, tokenizer, every stage's training data and arguments): a second run reuses it, a
changed recipe trains a new one. `prepare` returns the prepared experiment document, a copy whose
`model.path` points at the last stage's checkpoint (its argument is left as it was); the launcher builds
the run's plan from that document (`Plan.with_experiment`), so every actor starts from the warm start.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from tools.lm import has_weights

PREPARE_KEYS = {"data", "warm_start"}
FINGERPRINT = "prepare.json"


class PrepareError(ValueError):
    """The experiment's `prepare` section is malformed; the message names the key."""


def _cli_args(args: dict[str, Any], where: str) -> list[str]:
    out: list[str] = []
    for key, value in args.items():
        if isinstance(value, (dict, list)):
            raise PrepareError(f"{where}.{key}: expected a scalar command-line value, got {type(value).__name__}")
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


def prepare_data(spec: dict[str, Any], where: str, log: Callable[[str], None]) -> None:
    from tools import make_task

    out = spec.get("out")
    if not out:
        raise PrepareError(f"{where}.out: the dataset folder is not set")
    out = Path(out)
    wanted = [out / "train.jsonl", out / "test.jsonl"]
    if all(p.exists() for p in wanted):
        return
    argv = ["--out", str(out), *_cli_args(spec.get("args") or {}, f"{where}.args")]
    log(f"prepare: generating {out} (python -m tools.make_task {' '.join(argv)})")
    code = make_task.main(argv)
    missing = [str(p) for p in wanted if not p.exists()]
    if code or missing:
        raise PrepareError(f"{where}: tools.make_task exited {code}; missing {missing or 'nothing'}")


def _fingerprint(model: Path, stages: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for f in ("config.json", "tokenizer.json"):
        h.update((model / f).read_bytes())
    for stage in stages:
        h.update((Path(stage["data"]) / "train.jsonl").read_bytes())
        h.update(json.dumps(stage.get("args") or {}, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _stages(experiment: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    from tools.sft import SFTConfig

    train = (experiment.get("data") or {}).get("train")
    stages = spec.get("stages") or [{"data": str(Path(train).parent) if train else None, "args": spec.get("args")}]
    if not isinstance(stages, list):
        raise PrepareError("prepare.warm_start.stages: expected a list of {data, args}")
    for i, stage in enumerate(stages):
        where = f"prepare.warm_start.stages[{i}]"
        if not isinstance(stage, dict) or not stage.get("data"):
            raise PrepareError(f"{where}.data: the stage's dataset folder (train.jsonl, test.jsonl) is not set")
        unknown = sorted(set(stage) - {"data", "args"})
        if unknown:
            raise PrepareError(f"{where}: unknown key(s) {', '.join(unknown)}")
        bad = sorted(set(stage.get("args") or {}) - set(SFTConfig.__dataclass_fields__)
                     | ({"data", "out", "model", "eval_data"} & set(stage.get("args") or {})))
        if bad:
            raise PrepareError(f"{where}.args: unknown or reserved key(s) {', '.join(bad)}")
    return stages


def prepare_warm_start(experiment: dict[str, Any], spec: dict[str, Any], log: Callable[[str], None]) -> str | None:
    """The warm start's checkpoint (made, or reused while its inputs are unchanged); None when model.path has
    weights already. Reads `experiment`, never changes it."""
    from tools.sft import SFTConfig, run_sft

    path = (experiment.get("model") or {}).get("path")
    if not path:
        raise PrepareError("model.path: not set")
    if has_weights(path):
        return None
    out = spec.get("out")
    if not out:
        raise PrepareError("prepare.warm_start.out: where to write the warm-start checkpoint is not set")
    stages = _stages(experiment, spec)
    digest = _fingerprint(Path(path), stages)
    final = Path(out) / f"stage{len(stages)}"
    stamp = Path(out) / FINGERPRINT
    if has_weights(final) and stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == digest:
        log(f"prepare: reusing the warm start in {final}")
    else:
        log(f"prepare: {path} has no weights; training the warm start into {out} "
            f"({len(stages)} supervised stage(s), each to its plateau)")
        summaries, start = [], str(path)
        for i, stage in enumerate(stages, 1):
            data = Path(stage["data"])
            log(f"prepare: warm-start stage {i}/{len(stages)} on {data / 'train.jsonl'}")
            args = stage.get("args") or {}
            cfg = SFTConfig(data=str(data / "train.jsonl"), out=str(Path(out) / f"stage{i}"), model=start,
                            eval_data=str(data / "test.jsonl") if args.get("eval_every") else None, **args)
            summaries.append(run_sft(cfg, log=log))
            start = cfg.out
        stamp.write_text(json.dumps({"fingerprint": digest, "stages": summaries}, indent=1, default=str))
    return str(final)


def prepare(experiment: dict[str, Any], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the experiment's `prepare` steps (data first, then the warm start that reads it) and return the
    prepared document: a copy of `experiment` with `model.path` at the warm start where one was made.
    `experiment` itself is left as it was."""
    spec = experiment.get("prepare") or {}
    if not isinstance(spec, dict):
        raise PrepareError(f"prepare: expected a mapping, got {type(spec).__name__}")
    unknown = sorted(set(spec) - PREPARE_KEYS)
    if unknown:
        raise PrepareError(f"prepare: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(PREPARE_KEYS))})")
    if "data" in spec:
        datasets = spec["data"] if isinstance(spec["data"], list) else [spec["data"]]
        for i, item in enumerate(datasets):
            if not isinstance(item, dict):
                raise PrepareError(f"prepare.data[{i}]: expected a mapping with out and args")
            prepare_data(item, f"prepare.data[{i}]", log)
    prepared = copy.deepcopy(experiment)
    if "warm_start" in spec:
        start = prepare_warm_start(experiment, spec["warm_start"] or {}, log)
        if start is not None:
            prepared["model"] = {**prepared["model"], "path": start}
    return prepared
