"""What a run reads, checked before any actor starts: the starting model and the data files.

A missing, empty, binary or all-bad dataset used to be found only when the buffer died on it (restarts, pages
of tracebacks); a missing model directory surfaced as a traceback. `check_inputs` reads what the run's actors
will read, as they will read it (`actors.dataset` with the config's layout, `data.on_bad_line`,
`data.max_line_bytes`), and returns the report's lines and one problem line per thing that would fail:

* ``experiment.model.path``: set, a directory with a readable ``config.json`` and weights (or a
  ``prepare.warm_start`` that makes them); ``gen.max_new_tokens`` must leave room for a prompt in the model's
  context (``max_position_embeddings``).
* ``experiment.data.train`` (when the run has a buffer) and ``experiment.data.test`` (when the evaluator
  evaluates during the run, or the final evaluation reads it): present, not empty, not binary or
  compressed, with usable records; each malformed line skipped under ``data.on_bad_line: skip`` is listed
  with its file, line number and reason, and more than ``data.max_bad_share`` of them fails the check.

At launch every line of each file is read. The dry run reads a sample (the first `SAMPLE_LINES` lines),
and a file or model that is absent on this machine is reported as such, not as a problem (the dry run may run
where the data is not): a run of several nodes reads it on its nodes at launch; a one-machine run reads it on
the machine it is launched on, so the line says it is missing and that a launch there refuses it, unless a
`prepare.data` recipe makes it at launch.
"""
from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

from actors.dataset import DatasetError, Layout, iter_jsonl, resolve_data_path, sniff_file
from actors.engines.checkpoint import CheckpointError, ConfigError, check_checkpoint, has_weights
from actors.engines.lora import LoraSpec, adapter_problem, lora_problem
from actors.engines.megatron_lora import megatron_lora_problem
from actors.engines.model import FAMILIES, Qwen2Config, config_from_dict
from actors.engines.sglang_routes import ROUTED_EXPERTS_FLAG, ROUTED_EXPERTS_SINCE
from topology import Plan
from topology.experiment import ExperimentConfig
from topology.schema import expert_tensor_parallel

SAMPLE_LINES = 1000   # lines the dry run reads of each data file
SHOWN_BAD_LINES = 10  # malformed lines listed one by one; the rest are counted
# What the dry run says of an input absent on this machine, by where the run reads it.
ABSENT_HERE = "missing: no such file or directory on this machine, where a one-machine run reads it (a launch here " \
              "refuses it)"
ABSENT_ON_NODES = "absent on this machine; the run's nodes read it at launch"

# The actor classes that read each input (their modules): the checks run only for what the plan's actors read.
READS_MODEL = {"actors.buffer", "actors.rollout", "actors.trainer", "actors.param_server", "actors.evaluator"}


def check_inputs(plan: Plan, *, launch: bool) -> tuple[list[str], list[str]]:
    """(report lines, problems) for the plan's starting model and data files. ``launch``: read every line
    and treat an absent file as a problem; else (the dry run) read a sample and note an absent file."""
    config = plan.topology.config
    one_machine = len(plan.topology.nodes) == 1 and not plan.topology.nodes_from_allocation
    absent = ABSENT_HERE if one_machine else ABSENT_ON_NODES
    modules = {group.actor_package for group in plan.topology.groups.values()}
    lines: list[str] = []
    problems: list[str] = []
    if not modules & READS_MODEL:
        return lines, problems
    _check_model(config, launch, absent, lines, problems, _engines(plan))
    _check_expert_tensor_parallel(plan, launch, lines, problems)
    data = config.data
    layout_problem = None
    try:
        layout = Layout.from_settings(data)
    except ValueError as exc:
        layout, layout_problem = None, str(exc)
    wanted: list[tuple[str, str, str, bool]] = []   # (key, path, require, needed)
    if "actors.buffer" in modules:
        wanted.append(("data.train", data.train, data.require, True))
    evaluates = "actors.evaluator" in modules and config.eval.every_versions > 0
    if data.test and (evaluates or ("actors.trainer" in modules and config.run.final_eval)):
        wanted.append(("data.test", data.test, "answer", evaluates))
    for key, path, require, needed in wanted:
        if not path:
            problems.append(f"experiment.{key}: not set (the run's actors read it)")
            continue
        if layout is None:
            problems.append(f"experiment.{layout_problem}")
            break
        on_error = data.on_bad_line or ("skip" if key == "data.train" else "fail")
        recipes = config.prepare.data if config.prepare is not None else []
        made_by = next((f"prepare.data[{i}]" for i, recipe in enumerate(recipes)
                        if Path(recipe.out).resolve() == Path(path).resolve().parent), None)
        found, bad = _check_data(key, Path(path), layout, require, on_error, data.max_line_bytes, data.max_bad_share,
                                 None if launch else SAMPLE_LINES, launch, needed, made_by, absent)
        lines += [x for x in found if x not in lines]
        problems += [x for x in bad if x not in problems]   # an id2info both files read is named once
    return lines, problems


def _engines(plan: Plan) -> set[str]:
    """The engines the plan's groups run: "megatron" and "sglang" where a group names them."""
    settings = [group.settings for group in plan.topology.groups.values()]
    return ({"megatron"} & {s.get("backend") for s in settings}) | ({"sglang"} & {s.get("engine") for s in settings})


def _check_expert_tensor_parallel(plan: Plan, launch: bool, lines: list[str], problems: list[str]) -> None:
    """The megatron engine refuses experts split over tp > 1 together with ep > 1 (actors/engines/megatron.py;
    etp 1, the default with ep > 1, runs): a launch is refused here, before any node starts; the dry run says it and
    goes on, since the plan of such a layout still holds."""
    for name, group in plan.topology.groups.items():
        par = group.parallel or {}
        tp, ep = par.get("tp", 1), par.get("ep", 1)
        etp = expert_tensor_parallel(tp, ep, par.get("etp"))
        if group.settings.get("backend") != "megatron" or etp <= 1 or ep <= 1:
            continue
        line = (f"actors.{name}.parallel: etp {etp} with ep {ep}: the megatron engine does not split experts over "
                f"tensor-parallel ranks together with expert parallelism; set etp: 1 (experts whole on each rank; "
                f"docs/engines-megatron.md, \"Families\")")
        if launch:
            problems.append(line)
        else:
            lines.append(line + "; this layout can be planned, not launched")


# The model families each engine builds (the embedded torch engines build every family of model.FAMILIES; the
# megatron engine's list is actors/engines/megatron.py MEGATRON_FAMILIES, not imported: that module imports
# megatron-core).
ENGINE_FAMILIES = {"megatron": ("qwen2", "qwen3", "qwen3_moe"), "sglang": tuple(FAMILIES)}


def _check_model(config: ExperimentConfig, launch: bool, absent: str, lines: list[str], problems: list[str],
                 engines: set[str] = frozenset()) -> None:
    path = config.model.path
    if not path:
        problems.append("experiment.model.path: not set (the starting model's directory, Hugging Face layout)")
        return
    folder = Path(path)
    if not folder.is_dir():
        if launch:
            problems.append(f"experiment.model.path: {path}: no such directory")
        else:
            lines.append(f"model.path {path}: {absent}")
        return
    try:
        model_config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        problems.append(f"experiment.model.path: {path} has no config.json (not a Hugging Face model directory)")
        return
    except (OSError, ValueError) as exc:
        problems.append(f"experiment.model.path: {path}/config.json cannot be read: {exc}")
        return
    try:
        family = config_from_dict(model_config, f"{path}/config.json")
    except ConfigError as exc:
        problems.append(f"experiment.model.path: {exc}")
        return
    for engine in sorted(engines):
        if family.MODEL_TYPE not in ENGINE_FAMILIES[engine]:
            problems.append(f"experiment.model.path: {path} is {family.MODEL_TYPE} ({family.ARCHITECTURE}); the "
                            f"{engine} engine supports {', '.join(ENGINE_FAMILIES[engine])} (the torch engines: "
                            f"{', '.join(FAMILIES)})")
    if config.algo.routing_replay == "r3" and "sglang" in engines:
        problem = sglang_routing_problem(installed_version("sglang"))
        if problem:
            problems.append(f"experiment.algo.routing_replay: {problem}")
    if config.algo.routing_replay == "r2" and "megatron" in engines:
        problems.append("experiment.algo.routing_replay: r2 (the trainer records its own routing, then replays it) "
                        "is not built on the megatron engine; use r3 (replay the rollout's routing) or none")
    if config.model.lora is not None:
        _check_lora(config, family, engines, problems)
    context = model_config.get("max_position_embeddings")
    new = config.gen.max_new_tokens
    if isinstance(context, int) and new >= context:
        problems.append(f"experiment.gen.max_new_tokens: {new} leaves no room for a prompt in the model's context "
                        f"of {context} tokens (max_position_embeddings in {path}/config.json)")
    weights = has_weights(folder)
    makes = config.prepare is not None and config.prepare.warm_start is not None
    if not weights and not makes:
        problems.append(f"experiment.model.path: {path} has no weights (*.safetensors), and no "
                        f"prepare.warm_start makes them")
    if weights:
        try:
            check_checkpoint(str(folder))
        except (CheckpointError, ConfigError) as exc:
            problems.append(f"experiment.model.path: {exc}")
    sparse = (f", {family.num_experts} experts, top-{family.num_experts_per_tok}"
              if family.sparse_layers else "")
    lines.append(f"model.path {path}: config.json read ({family.MODEL_TYPE}{sparse}), context "
                 f"{context if context else '?'} tokens, "
                 + ("weights present" if weights else "no weights yet (prepare.warm_start makes them)"))


def _check_lora(config: ExperimentConfig, family: Qwen2Config, engines: set[str], problems: list[str]) -> None:
    """``model.lora`` against the model: targets that match a linear layer (on the megatron trainer: a decoder
    layer's projection), a rank each allows, and a start adapter made for this base."""
    lora = config.model.lora
    spec = LoraSpec.from_settings(lora)
    problem = megatron_lora_problem(family, spec) if "megatron" in engines else lora_problem(family, spec)
    if problem:
        problems.append(f"experiment.{problem}")
        return
    if lora.adapter is not None:
        if not Path(lora.adapter).is_dir():
            problems.append(f"experiment.model.lora.adapter: {lora.adapter}: no such directory")
        elif (problem := adapter_problem(lora.adapter, family, spec)) is not None:
            problems.append(f"experiment.model.lora.adapter: {problem}")


def _check_data(key: str, path: Path, layout: Layout, require: str, on_error: str, max_line_bytes: int,
                max_bad_share: float, sample: int | None, launch: bool, needed: bool,
                made_by: str | None = None, absent: str = ABSENT_ON_NODES) -> tuple[list[str], list[str]]:
    """One data file read as its actor reads it: (report lines, problems). ``made_by``: the prepare recipe
    that makes the file's folder when it is missing (the dry run says so)."""
    path = resolve_data_path(path)   # the tutorial's `wget ...?download=true` name, where only that exists
    where = f"experiment.{key}: {path}"
    if not path.is_file():
        if path.exists():
            return [], [f"{where}: not a file"]
        if not launch and made_by:
            return [f"{key} {path}: absent; {made_by} makes it at launch (tools.make_task)"], []
        if launch and needed:
            return [], [f"{where}: no such file"]
        if launch:
            return [f"{key} {path}: absent; the final evaluation is skipped"], []
        return [f"{key} {path}: {absent}"], []
    if layout.id2info and not Path(layout.id2info).is_file():
        if launch:
            return [], [f"experiment.data.id2info: {layout.id2info}: no such file (the answers of the data files)"]
        return [f"data.id2info {layout.id2info}: {absent}"], []
    try:
        if why := sniff_file(path):
            return [], [f"{where}: {why}"]
    except OSError as exc:
        return [], [f"{where}: cannot be read ({exc.strerror})"]
    bad: list[DatasetError] = []
    records = 0
    try:
        for _ in iter_jsonl(path, require=require, on_error="skip", on_skip=bad.append,  # type: ignore[arg-type]
                            max_line_bytes=max_line_bytes, layout=layout, max_lines=sample):
            records += 1
    except DatasetError as exc:   # the file itself (id2info) is unusable
        return [], [f"experiment.{key}: {exc}"]
    except OSError as exc:
        return [], [f"{where}: cannot be read ({exc.strerror})"]
    read = f"the first {sample} lines" if sample is not None else "every line"
    total = records + len(bad)
    shown = [f"    {err}" for err in bad[:SHOWN_BAD_LINES]]
    if len(bad) > SHOWN_BAD_LINES:
        shown.append(f"    ... and {len(bad) - SHOWN_BAD_LINES} more malformed lines")
    # A file refused is one line: its count and its first bad line, not a listing of every bad one first.
    if records == 0:
        what = f"none of its {total} lines is a usable record" if total else "it holds no records (blank lines only)"
        return [], [f"{where}: {what} ({read} read); first: {bad[0]}" if bad else f"{where}: {what}"]
    if bad and on_error == "fail":
        return [], [f"{where}: malformed line (data.on_bad_line: fail stops the run at it): {bad[0]}"]
    if len(bad) > max_bad_share * total:
        return [], [f"{where}: {len(bad)} of {total} lines ({100 * len(bad) / total:.1f}%, {read}) are malformed, "
                    f"more than data.max_bad_share ({max_bad_share:g}) allows; first: {bad[0]}"]
    head = f"{key} {path}: {records} records in {read}"
    if bad:
        head += f", {len(bad)} malformed lines skipped (data.on_bad_line: skip):"
    return [head, *shown], []


def installed_version(distribution: str) -> str | None:
    """The version of ``distribution`` installed where the launch runs; None when it is not installed here."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def sglang_routing_problem(installed: str | None) -> str | None:
    """Why r3 cannot run on the SGLang release installed here (``installed``), or None: a release before
    ROUTED_EXPERTS_SINCE is refused (0.5.6 returns no routing). Where SGLang is not installed (the launch runs
    off the GPU nodes) nothing is known here: the rollout refuses an answer that lacks the routing."""
    if installed is None:
        return None
    release = tuple(int(n) for n in re.findall(r"\d+", installed)[:3])
    if release >= tuple(int(n) for n in ROUTED_EXPERTS_SINCE.split(".")):
        return None
    return (f"r3 replays the routing the rollouts recorded; SGLang {installed}, installed here, returns none "
            f"({ROUTED_EXPERTS_FLAG} and /generate's return_routed_experts came after it; {ROUTED_EXPERTS_SINCE} "
            f"has them)")
