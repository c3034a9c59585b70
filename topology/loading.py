"""Loading a topology: its YAML file, the experiment config it names, and `key.sub=value` overrides, all checked
by the models of topology.schema, topology.experiment and topology.settings; and the resolved configuration with
where each value came from (`python -m tools.up --show-config`).

Override grammar: ``KEY=VALUE``. KEY is a dotted path into the topology file (``actors.rollout.count``) or, under
``experiment.``, into the experiment config (``experiment.algo.eta``); VALUE is read as YAML (``3``, ``2.0e-5``,
``true``, ``[0, 1]``, ``{tp: 2}``). The override is set into the document and the whole document is then validated
by the models, so an override is checked exactly like the same key in a file: an unknown key is refused with its
full path and the nearest declared key, a wrong type or bound names the key and the value.

Why not pydantic-settings' CLI source: it parses ``--a.b value`` flags into one model, but an override here lands
in one of two YAML documents (the topology, or the experiment config it names) that are merged per actor group
before their models see them, and --show-config must say which layer each value came from. Setting the dotted path
into the document and validating the result gives both with the models as the only authority on keys and types.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticCustomError

from topology.experiment import AREAL_ALIASES, ExperimentConfig, experiment_problems, with_our_names
from topology.placement import REPO_ROOT, Plan, TopologyError, place, validate
from topology.schema import RESERVED_SETTINGS, GroupSection, TopologyDocument
from topology.settings import settings_model

__all__ = ["load", "load_document", "parse_override", "apply_overrides", "resolved_config", "show_config"]

EXPERIMENT = "experiment"


def load_document(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a syntax error becomes a TopologyError naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TopologyError([f"cannot read {path}: {exc.strerror}"], str(path)) from exc
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise TopologyError([f"line {line}: not a YAML text file (byte {exc.start} is not UTF-8)"], str(path)) from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise TopologyError([f"{where}YAML syntax error: {getattr(exc, 'problem', exc)}"], str(path)) from exc
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise TopologyError([f"top level: expected a mapping, got {type(doc).__name__}"], str(path))
    return doc


def load_experiment(path: str | Path) -> ExperimentConfig:
    """An experiment config file on its own (configs/*.yaml, a tool's --config), typed; a TopologyError naming
    the file and each bad key's path."""
    doc = load_document(path)
    problems = experiment_problems(doc, prefix="")
    if problems:
        raise TopologyError(problems, str(path))
    return ExperimentConfig.model_validate(doc)


def parse_override(text: str, prefix: str = "") -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value read as YAML). ``prefix``: what the user typed before
    ``text`` (``experiment.``), which every problem repeats so that it names the override as written."""
    key, eq, raw = text.partition("=")
    shown = prefix + text
    if not eq:
        raise TopologyError([f"override {shown!r}: expected key.sub=value"], "command line")
    if key.startswith("+"):
        raise TopologyError([f"override {shown!r}: drop the leading +: every key the schema declares can be set, "
                             f"and an undeclared one is refused either way"], "command line")
    parts = key.strip().split(".")
    if not all(parts):
        raise TopologyError([f"override {shown!r}: bad key {prefix + key!r}"], "command line")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at column {mark.column + 1}" if mark is not None else ""
        raise TopologyError([f"override {shown!r}: value is not valid YAML ({getattr(exc, 'problem', None) or exc}"
                             f"{where})"], "command line") from None
    return parts, value


def apply_overrides(doc: dict[str, Any], overrides: Iterable[str], prefix: str = "") -> list[str]:
    """Set each override into ``doc`` (creating mappings on the way); the models check the result. Returns the
    problems of overrides that cannot be set (a path through a value that is not a mapping)."""
    problems = []
    for text in overrides:
        parts, value = parse_override(text, prefix)
        node = doc
        for depth, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                problems.append(f"{prefix}{'.'.join(parts[:depth + 1])}: override {text!r} sets a key inside "
                                f"{nxt!r}, which is not a mapping")
                break
            node = nxt
        else:
            node[parts[-1]] = value
    return problems


def _split(overrides: Iterable[str]) -> tuple[list[str], list[str]]:
    """(topology overrides, experiment overrides with the `experiment.` prefix removed). An experiment override
    may name a key by AReaL's name (`experiment.dataset.train_bs_n_seqs=256`): it overrides our key it stands for
    (`AREAL_ALIASES`), whichever name the config file used."""
    topo, exp = [], []
    for text in overrides:
        if text.startswith(EXPERIMENT + "."):
            key, eq, value = text[len(EXPERIMENT) + 1:].partition("=")
            exp.append(f"{AREAL_ALIASES.get(key.strip(), key)}{eq}{value}")
        else:
            topo.append(text)
    return topo, exp


def _documents(path: Path, overrides: Iterable[str]) -> tuple[dict, dict, Path | None, list[str]]:
    """(topology document, experiment document, config path, problems), overrides applied."""
    doc = load_document(path)
    topo_overrides, exp_overrides = _split(overrides)
    problems = apply_overrides(doc, topo_overrides)
    experiment, config_path = {}, None
    if doc.get("config") is not None:
        if not isinstance(doc["config"], str):
            problems.append(f"config: expected a path to a YAML file under configs/, got {doc['config']!r}")
        else:
            config_path = _resolve_config(doc["config"], path)
            if config_path is None:
                problems.append(f"config: {doc['config']!r} not found (looked next to {path} and in {REPO_ROOT})")
            else:
                try:
                    experiment = load_document(config_path)
                except TopologyError as exc:
                    problems.extend(f"config ({config_path}): {p}" for p in exc.problems)
    # AReaL's key names become ours before the overrides (which are in our names: _split), so an override wins
    # whichever name the file used and every actor group's settings merge over one spelling of each key. An
    # AReaL name that cannot be read as ours is left for validate() to report with its path.
    try:
        experiment = with_our_names(experiment)
    except PydanticCustomError:
        pass
    problems += apply_overrides(experiment, exp_overrides, prefix=EXPERIMENT + ".")
    return doc, experiment, config_path, problems  # validate() adds the experiment's own problems


def load(path: str | Path, overrides: Iterable[str] = (), *, check_imports: bool = True) -> Plan:
    """Load, override, validate and place a topology. Raises TopologyError listing every problem."""
    path = Path(path)
    doc, experiment, config_path, problems = _documents(path, list(overrides))
    topo = validate(doc, source=str(path), experiment=experiment,
                    config_path=str(config_path) if config_path else None, check_imports=check_imports,
                    prior_problems=problems)
    return place(topo)


def _resolve_config(ref: str, topology_path: Path) -> Path | None:
    for base in (topology_path.parent, REPO_ROOT, Path.cwd()):
        candidate = (base / ref).resolve()
        if candidate.is_file():
            return candidate
    return None


# ---------------------------------------------------------------------------------------------
# the resolved configuration, with where each value came from
# ---------------------------------------------------------------------------------------------

def _leaves(value: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, value


def _has(doc: Any, path: str) -> bool:
    for part in path.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return False
        doc = doc[part]
    return True


def resolved_config(path: str | Path, overrides: Iterable[str] = (), *,
                    check_imports: bool = True) -> list[tuple[str, Any, str]]:
    """Every key of the resolved configuration as (key path, value, source); source is "default", "topology
    file", "config file" or "override". Actor groups' settings list their class's own keys and the experiment
    keys the group sets. Raises TopologyError as :func:`load` does."""
    path = Path(path)
    overrides = list(overrides)
    plan = load(path, overrides, check_imports=check_imports)
    topo_overrides, exp_overrides = _split(overrides)
    file_doc = load_document(path)
    exp_file = with_our_names(load_document(plan.topology.config_path)) if plan.topology.config_path else {}
    over_topo: dict[str, Any] = {}
    over_exp: dict[str, Any] = {}
    apply_overrides(over_topo, topo_overrides)
    apply_overrides(over_exp, exp_overrides, prefix=EXPERIMENT + ".")

    def source(key: str, over: dict, file: dict, file_name: str) -> str:
        return "override" if _has(over, key) else file_name if _has(file, key) else "default"

    rows: list[tuple[str, Any, str]] = []
    doc = plan.topology.document
    resolved = TopologyDocument.model_validate(doc).model_dump(by_alias=True, exclude={"actors"})
    resolved["bus"]["curve"] = plan.topology.bus.curve
    resolved["name"] = plan.topology.name
    for key, value in _leaves(resolved, ""):
        rows.append((key, value, source(key, over_topo, file_doc, "topology file")))
    for gname, gdoc in doc["actors"].items():
        group = GroupSection.model_validate(gdoc)
        dumped = group.model_dump(by_alias=True, exclude={"settings"})
        for key, value in _leaves(dumped, f"actors.{gname}"):
            rows.append((key, value, source(key, over_topo, file_doc, "topology file")))
        # Without importing the class its model is unknown: the settings as the file gives them.
        settings = (_group_model(group.class_).model_validate(group.settings).model_dump(exclude=set(RESERVED_SETTINGS))
                    if check_imports else group.settings)
        for key, value in _leaves(settings, f"actors.{gname}.settings"):
            top = key.split(".")[3]
            if top in ExperimentConfig.model_fields and not _has(doc, key):
                continue  # the experiment's value, listed under experiment.*
            rows.append((key, value, source(key, over_topo, file_doc, "topology file")))
    experiment = plan.topology.config.model_dump()
    for key, value in _leaves(experiment, ""):
        rows.append((f"{EXPERIMENT}.{key}", value, source(key, over_exp, exp_file, "config file")))
    return rows


def _group_model(cls_path: str) -> type[BaseModel]:
    """The settings model of the actor class a group names (validation has imported it already)."""
    module, _, attr = cls_path.partition(":")
    return settings_model(getattr(importlib.import_module(module), attr))


def show_config(path: str | Path, overrides: Iterable[str] = (), *, check_imports: bool = True) -> str:
    """The text `python -m tools.up --show-config` prints: one `key = value  # source` line per key."""
    rows = resolved_config(path, overrides, check_imports=check_imports)
    width = max((n for n in (len(f"{k} = {v!r}") for k, v, _ in rows) if n <= 72), default=0)
    return "\n".join(f"{f'{k} = {v!r}':<{width}}  # {s}" for k, v, s in rows)
