"""What a launch is asked to do (`LaunchRequest`), what it takes from the tools (`ToolHooks`), and its exit
statuses."""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from topology import Plan

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


class PrepareRefused(ValueError):
    """The experiment's prepare stage cannot run; the message names the key and why (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    """What the command line asks of one launch (`python -m tools.up`'s flags)."""

    overrides: Sequence[str] = ()       # key.sub=value, as given (written to the plan and passed on by --sbatch)
    run_dir: str | None = None          # --run-dir
    ready_timeout: float | None = None  # --ready-timeout, where the topology's supervisor section does not say
    duration: float | None = None       # --duration: stop the run after this many seconds
    progress: bool = True               # a live display on a terminal (not --no-progress)
    record: bool = False                # --record: message logs for every actor
    sbatch: bool = False                # --sbatch: submit an allocation and launch inside it


@dataclasses.dataclass(frozen=True)
class ToolHooks:
    """What launching takes from tools/, which the library does not import: the entry point passes them in
    (tools/up.py's `HOOKS`)."""

    # The plan built from the experiment after its prepare stage ran (tools.prepare: data generated, warm
    # start trained); PrepareRefused (or TopologyError) naming the problem when the stage fails.
    prepare: Callable[[Plan], Plan]
    # One line per thing in the experiment's prepare section that stage would refuse (the dry run's check).
    prepare_problems: Callable[[Plan], list[str]]
