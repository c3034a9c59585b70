"""When a run may start: each group's actor class and typed settings (`group_classes`), what the classes
would refuse of any instance's settings (`settings_problems`), how long each
instance may take to report ready and how many the run needs (`ready_rules`), the Supervisor's options that
carry them (`supervisor_options`, a node agent's share), and the check a multi-node launcher makes that a
late-joining group reached its number (`quorum_problem`)."""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

from launch.options import LaunchRequest
from topology import Plan
from topology.schema import SupervisorSection
from topology.settings import read_settings


def group_classes(plan: Plan) -> dict[str, tuple[type, Any]]:
    """Group -> (its actor class, the settings its first instance will get, typed by that class)."""
    first: dict[str, dict[str, Any]] = {}
    for spec in plan.specs("RUN_DIR"):
        first.setdefault(spec["name"].split(".")[0], spec)
    out = {}
    for gname, group in plan.topology.groups.items():
        module, _, name = group.cls.partition(":")
        klass = getattr(importlib.import_module(module), name)
        if gname in first:
            out[gname] = (klass, read_settings(klass, first[gname]["settings"], first[gname]["name"]))
    return out


def settings_problems(plan: Plan) -> list[str]:
    """What any instance's actor class would refuse of its settings at start (``Actor.check_settings``), one
    line each, the same line of several instances once: the dry run and every launch check it before any
    actor starts."""
    classes: dict[str, type] = {}
    out: dict[str, None] = {}
    for spec in plan.specs("RUN_DIR"):
        if spec["cls"] not in classes:
            module, _, name = spec["cls"].partition(":")
            classes[spec["cls"]] = getattr(importlib.import_module(module), name)
        klass = classes[spec["cls"]]
        out.update(dict.fromkeys(klass.check_settings(read_settings(klass, spec["settings"], spec["name"]))))
    return list(out)


@dataclasses.dataclass(frozen=True)
class ReadyRule:
    """How long a group's instances may take to report ready (each from its first start), where that comes
    from, and how many must be ready for the run to start (the others join when they are)."""

    group: str
    count: int
    budget_s: float
    source: str
    needed: int

    @property
    def joins_late(self) -> bool:
        return self.needed < self.count


def ready_rules(plan: Plan, base_s: float) -> dict[str, ReadyRule]:
    """Every group's ReadyRule: `actors.<group>.ready_timeout_s` when set; else `base_s`
    (supervisor.ready_timeout) plus what its class starts (`ready_budget`: an SGLang rollout waits for its
    server's own start budget, sglang.health_timeout_s). The run needs `min_ready` instances, or all; a class
    of interchangeable workers (`joins_late`: the rollouts) half of them, rounded up."""
    out = {}
    for gname, (klass, cfg) in group_classes(plan).items():
        group = plan.topology.groups[gname]
        if group.ready_timeout_s is not None:
            budget, source = group.ready_timeout_s, f"actors.{gname}.ready_timeout_s"
        else:
            extra = klass.ready_budget(cfg) if getattr(klass, "ready_budget", None) is not None else None
            budget, source = (base_s, "supervisor.ready_timeout") if extra is None else \
                (base_s + extra[0], f"supervisor.ready_timeout {base_s:g} + {extra[1]} {extra[0]:g}")
        needed = group.min_ready if group.min_ready is not None else \
            math.ceil(group.count / 2) if getattr(klass, "joins_late", False) else group.count
        out[gname] = ReadyRule(gname, group.count, budget, source, needed)
    return out


def supervisor_options(plan: Plan, request: LaunchRequest) -> dict[str, Any]:
    """Keyword arguments for actors.runtime.supervisor.Supervisor: the topology's `supervisor:` section over its defaults;
    --ready-timeout where the file does not say; every actor's ready budget and, for late-joining groups, how
    many instances the run needs (ready_rules)."""
    opts = SupervisorSection.model_validate(plan.topology.supervisor).model_dump()
    if request.ready_timeout is not None and "ready_timeout" not in plan.topology.supervisor:
        opts["ready_timeout"] = request.ready_timeout
    rules = ready_rules(plan, opts["ready_timeout"])
    opts["ready_budgets"] = {i.name: rules[i.group].budget_s for i in plan.instances}
    opts["late_joiners"] = {g: r.needed for g, r in rules.items() if r.joins_late}
    return opts


def node_supervisor_options(opts: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A node agent's share of `supervisor_options`: its own actors' budgets, and no number of late joiners
    of its own (the launcher counts them across the nodes: `quorum_problem`), so a node whose rollouts cannot
    come up never exits non-zero, which would make srun --kill-on-bad-exit stop every node."""
    return {**opts, "ready_budgets": {n: b for n, b in opts["ready_budgets"].items() if n in names},
            "late_joiners": {g: 0 for g in opts["late_joiners"]}}


# Seconds past a late-joining group's ready budget before the launcher says the group fell short.
QUORUM_GRACE_S = 30.0


def quorum_problem(rows: dict[str, dict[str, Any]], rules: dict[str, ReadyRule], elapsed: float,
                   reached: set[str]) -> str | None:
    """Why a multi-node run cannot go on (None: it can): a late-joining group whose instances never reached
    the number the run needs within their budget, or of which too many could not be kept up. `reached`:
    the groups that had their number ready once (updated here; a restart later is not a shortfall)."""
    from actors.runtime.supervisor import Supervisor

    for g, r in rules.items():
        if not r.joins_late:
            continue
        members = [row for name, row in rows.items() if Supervisor.group_of(name) == g]
        ready = sum(1 for row in members if row.get("state") in ("ready", "finished"))
        down = sum(1 for row in members if row.get("state") == "failed")
        if ready >= r.needed:
            reached.add(g)
        if r.count - down < r.needed:
            return (f"actors.{g}: {down} of {r.count} instances could not be kept up; the run needs {r.needed} "
                    f"(min_ready)")
        if g not in reached and elapsed > r.budget_s + QUORUM_GRACE_S:
            return (f"actors.{g}: {ready} of {r.count} instances ready after their ready budget ({r.budget_s:g} s: "
                    f"{r.source}); the run needs {r.needed} (min_ready)")
    return None
