"""Before a run starts: make what the experiment needs and does not have yet.

The embedded default's first command must work on a fresh machine, where neither the dataset nor the
warm-start weights exist. The experiment config says how to make them (`configs/local.yaml`):

    prepare:
      data:                 # when data.train or data.test is missing
        args: {levels: "1-4", max_operand: 99, ...}          # python -m tools.make_task arguments
      warm_start:           # when model.path has no weights: supervised training to its plateau
        out: runs/warm_start/arith-tiny                       # reused while its inputs are unchanged
        args: {until_plateau: true, lr: 1.0e-3, ...}          # tools.sft.SFTConfig fields

The warm start is cached by a fingerprint of its inputs (model config, tokenizer, training data, SFT
arguments): a second run reuses it, a changed recipe trains a new one. After preparation
`model.path` points at the warm-start checkpoint, so every actor starts from it.
"""
from __future__ import annotations

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


def prepare_data(experiment: dict[str, Any], spec: dict[str, Any], log: Callable[[str], None]) -> None:
    from tools import make_task

    data = experiment.get("data") or {}
    train, test = data.get("train"), data.get("test")
    if not train:
        raise PrepareError("data.train: not set")
    wanted = [Path(p) for p in (train, test) if p]
    if all(p.exists() for p in wanted):
        return
    out = Path(train).parent
    if test and Path(test).parent != out:
        raise PrepareError(f"data.train and data.test must share a folder to be generated ({train}, {test})")
    argv = ["--out", str(out), *_cli_args(spec.get("args") or {}, "prepare.data.args")]
    log(f"prepare: generating the dataset into {out} (python -m tools.make_task {' '.join(argv)})")
    code = make_task.main(argv)
    missing = [str(p) for p in wanted if not p.exists()]
    if code or missing:
        raise PrepareError(f"prepare.data: tools.make_task exited {code}; missing {missing or 'nothing'}")


def _fingerprint(model: Path, train: str, args: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for f in ("config.json", "tokenizer.json"):
        h.update((model / f).read_bytes())
    h.update(Path(train).read_bytes())
    h.update(json.dumps(args, sort_keys=True).encode())
    return h.hexdigest()[:16]


def prepare_warm_start(experiment: dict[str, Any], spec: dict[str, Any], log: Callable[[str], None]) -> None:
    from tools.sft import SFTConfig, run_sft

    model = experiment.get("model") or {}
    path = model.get("path")
    if not path:
        raise PrepareError("model.path: not set")
    if has_weights(path):
        return
    out = spec.get("out")
    if not out:
        raise PrepareError("prepare.warm_start.out: where to write the warm-start checkpoint is not set")
    data = experiment.get("data") or {}
    args = dict(spec.get("args") or {})
    unknown = sorted(set(args) - set(SFTConfig.__dataclass_fields__) | ({"data", "out", "model"} & set(args)))
    if unknown:
        raise PrepareError(f"prepare.warm_start.args: unknown or reserved key(s) {', '.join(unknown)}")
    digest = _fingerprint(Path(path), data["train"], args)
    stamp = Path(out) / FINGERPRINT
    if has_weights(out) and stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == digest:
        log(f"prepare: reusing the warm start in {out}")
    else:
        log(f"prepare: {path} has no weights; training the warm start into {out} (tools.sft, to its plateau)")
        cfg = SFTConfig(data=data["train"], out=str(out), model=str(path),
                        eval_data=args.pop("eval_data", data.get("test")), **args)
        summary = run_sft(cfg, log=log)
        stamp.write_text(json.dumps({"fingerprint": digest, "summary": summary}, indent=1, default=str))
    model["path"] = str(out)
    experiment["model"] = model


def prepare(experiment: dict[str, Any], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the experiment's `prepare` steps in place (data first, then the warm start that reads it)."""
    spec = experiment.get("prepare") or {}
    if not isinstance(spec, dict):
        raise PrepareError(f"prepare: expected a mapping, got {type(spec).__name__}")
    unknown = sorted(set(spec) - PREPARE_KEYS)
    if unknown:
        raise PrepareError(f"prepare: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(PREPARE_KEYS))})")
    if "data" in spec:
        prepare_data(experiment, spec["data"] or {}, log)
    if "warm_start" in spec:
        prepare_warm_start(experiment, spec["warm_start"] or {}, log)
    return experiment
