"""Before a run starts: make what the experiment needs and does not have yet.

The embedded default's first command must work on a fresh machine, where neither the dataset nor the
warm-start weights exist. The experiment config says how to make them (`configs/local.yaml`):

    prepare:
      data:                 # each dataset this run reads whose train/test files are missing: python -m tools.make_task
        - {out: data/arith, args: {max_operand: 9, ...}}        # the RL data (its train/test are data.*)
        - {out: data/arith-careful, args: {direct_fraction: 0}}  # more data, e.g. for a warm-start stage
      warm_start:           # when model.path has no weights: supervised stages, each to its plateau
        out: runs/warm_start/arith-tiny                          # reused while its inputs are unchanged
        stages:
          - {data: data/arith-careful, args: {until_plateau: true, ...}}   # launch.prepare.sft.SFTConfig fields
          - {data: data/arith, args: {until_plateau: true, ...}}

A stage's `data` is a folder with train.jsonl and test.jsonl (held-out accuracy decides its plateau);
each stage starts from the previous one's weights, the first from random weights or, with
`warm_start.upcycle: DENSE_DIR`, from a mixture of experts upcycled from that dense checkpoint (upcycle.py). The warm start is cached by a fingerprint of its
inputs (model config, tokenizer, the upcycled dense model's config and weights, every stage's training data
and arguments): a second run reuses it, a
changed recipe trains a new one. `prepare` returns the prepared experiment document, a copy whose
`model.path` points at the last stage's checkpoint (its argument is left as it was); the launcher builds
the run's plan from that document (`Plan.with_experiment`), so every actor starts from the warm start.

A recipe may ship its warm start (`prepare.warm_start.shipped: DIR`, a model directory in the repository) so
that a fresh machine need not train it: DIR's manifest (`warm_start.json`) records the fingerprint of the
recipe that made it and the sha256 of each weights file. It is used only while both match (the recipe is
unchanged, the files are the ones made); otherwise the launch says why in one line and trains the warm start
as above. `python -m tools.prepare TOPOLOGY --ship` trains it from scratch and writes DIR and its manifest.
"""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from actors.engines.checkpoint import has_weights
from topology import Plan
from topology.experiment import DatasetRecipe, PrepareSection, WarmStartSection, WarmStartStage
from topology.schema import problem_lines

FINGERPRINT = "prepare.json"
SHIPPED_MANIFEST = "warm_start.json"
# Not shipped: the per-step record of the training (in the cache) and the SFT optimizer (RL starts its own).
SHIPPED_LEAVES_OUT = {"sft_metrics.jsonl", "trainer_state.pt"}
# launch.prepare.sft.SFTConfig fields a stage's args may not set: the stage sets them itself.
STAGE_SETS = frozenset({"data", "out", "model", "eval_data"})


class PrepareError(ValueError):
    """The experiment's `prepare` section is malformed; the message names the key."""


def cli_args(args: dict[str, Any]) -> list[str]:
    """A prepare step's `args` as the tool's flags: `--key value`; true: the bare flag; false, null: left out."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


def prepare_data(recipe: DatasetRecipe, where: str, log: Callable[[str], None]) -> None:
    from launch.prepare.task import make_task

    out = Path(recipe.out)
    wanted = [out / "train.jsonl", out / "test.jsonl"]
    if all(p.exists() for p in wanted):
        return
    argv = ["--out", str(out), *cli_args(recipe.args)]
    log(f"prepare: generating {out} (python -m tools.make_task {' '.join(argv)})")
    code = make_task(argv)
    missing = [str(p) for p in wanted if not p.exists()]
    if code or missing:
        raise PrepareError(f"{where}: tools.make_task exited {code}; missing {missing or 'nothing'}")


def _fingerprint(model: Path, stages: list[WarmStartStage], upcycle: str | None = None) -> str:
    h = hashlib.sha256()
    for f in ("config.json", "tokenizer.json"):
        h.update((model / f).read_bytes())
    if upcycle is not None:   # the dense source's config and weights (a recipe without one keeps its fingerprint)
        source = Path(upcycle)
        for f in [source / "config.json", *sorted(source.glob("*.safetensors"))]:
            h.update(f"upcycle {f.name} {sha256_file(f)}".encode())
    for stage in stages:
        h.update((Path(stage.data) / "train.jsonl").read_bytes())
        h.update(json.dumps(stage.args, sort_keys=True).encode())
    return h.hexdigest()[:16]


def stage_problems(prepare: PrepareSection | None) -> list[str]:
    """One line per warm-start stage argument that tools.sft does not take or that the stage sets itself: the
    model checks the section's layout at load, this checks what only the tool knows (--dry-run runs it too)."""
    from launch.prepare.sft import SFTConfig

    spec = prepare.warm_start if prepare is not None else None
    if spec is None:
        return []
    named = ([("prepare.warm_start.args", spec.args or {})] if spec.stages is None else
             [(f"prepare.warm_start.stages[{i}].args", stage.args) for i, stage in enumerate(spec.stages)])
    return [f"{where}: unknown or reserved key(s) {', '.join(bad)}" for where, args in named
            if (bad := sorted(set(args) - set(SFTConfig.__dataclass_fields__) | (STAGE_SETS & set(args))))]


def _stages(experiment: dict[str, Any], spec: WarmStartSection) -> list[WarmStartStage]:
    if spec.stages is not None:
        return spec.stages
    train = (experiment.get("data") or {}).get("train")
    if not train:
        raise PrepareError("prepare.warm_start.stages: not set, and data.train (whose folder the one stage "
                           "would learn from) is not set either")
    return [WarmStartStage(data=str(Path(train).parent), args=spec.args or {})]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def shipped_problem(folder: Path, digest: str) -> str | None:
    """Why the shipped warm start in ``folder`` cannot stand for the recipe whose fingerprint is ``digest``; None
    when it can (its manifest names this recipe and every weights file has the manifest's sha256)."""
    manifest = folder / SHIPPED_MANIFEST
    if not manifest.is_file():
        return f"no {SHIPPED_MANIFEST} in it" if folder.is_dir() else "no such directory"
    try:
        info = json.loads(manifest.read_text())
        made_by, weights = str(info["fingerprint"]), dict(info["weights"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"{SHIPPED_MANIFEST} cannot be read ({exc!r})"
    if made_by != digest:
        return (f"made by another recipe (fingerprint {made_by}; this recipe's is {digest}: the model config, "
                f"tokenizer, a stage's data or its arguments changed)")
    present = sorted(p.name for p in folder.glob("*.safetensors"))
    if not weights or present != sorted(weights):
        return f"its weights files {present} are not the manifest's {sorted(weights)}"
    for name, want in sorted(weights.items()):
        if (got := sha256_file(folder / name)) != want:
            return f"{name} has sha256 {got[:16]}..., not the manifest's {want[:16]}..."
    return None


def ship(final: Path, folder: Path, digest: str, command: str, summaries: list[dict[str, Any]],
         upcycled_from: str | None = None) -> None:
    """Write the warm start in ``final`` to ``folder`` with its manifest (the recipe's fingerprint, each weights
    file's sha256, the command that made it, the dense model it was upcycled from and each stage's outcome)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    for f in sorted(final.iterdir()):
        if f.is_file() and f.name not in SHIPPED_LEAVES_OUT:
            shutil.copy2(f, folder / f.name)
    stages = [{k: summary.get(k) for k in ("data", "steps", "stop_reason", "kept_step", "kept_accuracy", "seconds")}
              for summary in summaries]
    manifest = {"fingerprint": digest, "command": command,
                "weights": {p.name: sha256_file(p) for p in sorted(folder.glob("*.safetensors"))},
                **({"upcycled_from": upcycled_from} if upcycled_from else {}), "stages": stages}
    (folder / SHIPPED_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def prepare_warm_start(experiment: dict[str, Any], spec: WarmStartSection, log: Callable[[str], None],
                       ship_command: str | None = None) -> str | None:
    """The warm start's checkpoint (reused while its inputs are unchanged, else the shipped one while it matches,
    else trained); None when model.path has weights already. ``ship_command``: train it from scratch and write it
    to ``spec.shipped`` with its manifest, naming that command. Reads `experiment`, never changes it."""
    from launch.prepare.sft import SFTConfig, run_sft
    from launch.prepare.upcycle import UpcycleError, upcycle

    path = (experiment.get("model") or {}).get("path")
    if not path:
        raise PrepareError("model.path: not set")
    if not (Path(path) / "config.json").is_file():
        raise PrepareError(f"model.path: {path}: " + ("no config.json (not a Hugging Face model directory)"
                                                      if Path(path).is_dir() else "no such directory"))
    if has_weights(path):
        return None
    if ship_command is not None and not spec.shipped:
        raise PrepareError("prepare.warm_start.shipped: not set (the folder --ship writes the warm start to)")
    out = spec.out
    stages = _stages(experiment, spec)
    if spec.upcycle is not None and not has_weights(spec.upcycle):
        raise PrepareError(f"prepare.warm_start.upcycle: {spec.upcycle}: no weights to upcycle")
    digest = _fingerprint(Path(path), stages, spec.upcycle)
    final = Path(out) / f"stage{len(stages)}"
    stamp = Path(out) / FINGERPRINT
    if (ship_command is None and has_weights(final) and stamp.exists()
            and json.loads(stamp.read_text()).get("fingerprint") == digest):
        log(f"prepare: reusing the warm start in {final}")
        return str(final)
    if ship_command is None and spec.shipped:
        if (why := shipped_problem(Path(spec.shipped), digest)) is None:
            log(f"prepare: using the shipped warm start {spec.shipped} (made by this recipe; sha256 checked)")
            return spec.shipped
        log(f"prepare: not using the shipped warm start {spec.shipped}: {why}; training it instead")
    log(f"prepare: {path} has no weights; training the warm start into {out} "
        f"({len(stages)} supervised stage(s), each to its plateau)")
    summaries, start = [], str(path)
    if spec.upcycle is not None:
        start = str(Path(out) / "upcycled")
        log(f"prepare: upcycling the dense {spec.upcycle} into {start} (launch/prepare/upcycle.py)")
        try:
            upcycle(spec.upcycle, str(path), start)
        except UpcycleError as exc:
            raise PrepareError(f"prepare.warm_start.{exc}") from None
    for i, stage in enumerate(stages, 1):
        data = Path(stage.data)
        log(f"prepare: warm-start stage {i}/{len(stages)} on {data / 'train.jsonl'}")
        cfg = SFTConfig(data=str(data / "train.jsonl"), out=str(Path(out) / f"stage{i}"), model=start,
                        eval_data=str(data / "test.jsonl") if stage.args.get("eval_every") else None,
                        **stage.args)
        summaries.append(run_sft(cfg, log=log))
        start = cfg.out
    stamp.write_text(json.dumps({"fingerprint": digest, "stages": summaries}, indent=1, default=str))
    if ship_command is not None and spec.shipped:
        ship(final, Path(spec.shipped), digest, ship_command, summaries, spec.upcycle)
        log(f"prepare: shipped the warm start to {spec.shipped} ({SHIPPED_MANIFEST}: fingerprint {digest})")
    return str(final)


def _needed_folders(experiment: dict[str, Any], spec: PrepareSection) -> set[Path]:
    """The dataset folders this run reads: those of data.train and data.test, and each warm-start stage's
    when the warm start must be made (model.path has no weights). A recipe for any other folder is left
    alone: with the data paths overridden, the shipped recipes must not write into the repository."""
    data = experiment.get("data") or {}
    folders = {Path(data[key]).resolve().parent for key in ("train", "test") if data.get(key)}
    path = (experiment.get("model") or {}).get("path")
    if spec.warm_start is not None and path and not has_weights(path):
        try:
            folders |= {Path(stage.data).resolve() for stage in _stages(experiment, spec.warm_start)}
        except PrepareError:
            pass   # prepare_warm_start says why
    return folders


def prepare(experiment: dict[str, Any], log: Callable[[str], None] = print,
            ship_command: str | None = None) -> dict[str, Any]:
    """Run the experiment's `prepare` steps (data first, then the warm start that reads it) and return the
    prepared document: a copy of `experiment` with `model.path` at the warm start where one was made.
    `experiment` itself is left as it was. ``ship_command``: see `prepare_warm_start`."""
    try:
        spec = PrepareSection.model_validate(experiment.get("prepare") or {})
    except ValidationError as exc:
        raise PrepareError("; ".join(problem_lines(exc, "prepare", PrepareSection))) from None
    if problems := stage_problems(spec):
        raise PrepareError("; ".join(problems))
    needed = _needed_folders(experiment, spec)
    for i, recipe in enumerate(spec.data):
        if Path(recipe.out).resolve() in needed:
            prepare_data(recipe, f"prepare.data[{i}]", log)
        elif not (Path(recipe.out) / "train.jsonl").exists():
            log(f"prepare: not making {recipe.out} (prepare.data[{i}]): neither data.train, data.test nor a "
                f"warm-start stage this run needs reads it")
    prepared = copy.deepcopy(experiment)
    if spec.warm_start is not None:
        start = prepare_warm_start(experiment, spec.warm_start, log, ship_command)
        if start is not None:
            prepared["model"] = {**prepared["model"], "path": start}
    return prepared


def prepared(plan: Plan) -> Plan:
    """The plan built from the experiment after its prepare stage ran (model.path at the warm start it made);
    a PrepareError naming the topology file and the experiment's key when the stage cannot run."""
    try:
        return plan.with_experiment(prepare(plan.topology.experiment))
    except PrepareError as exc:
        raise PrepareError(f"{plan.topology.source}: experiment.{exc}") from None


def prepare_problems(plan: Plan) -> list[str]:
    """What the prepare stage would refuse in the experiment's prepare section (the dry run's check)."""
    return [f"experiment.{line}" for line in stage_problems(plan.topology.config.prepare)]
