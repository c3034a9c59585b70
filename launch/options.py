"""What a launch is asked to do (`LaunchRequest`) and its exit statuses."""
from __future__ import annotations

import dataclasses
from typing import Sequence

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


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
