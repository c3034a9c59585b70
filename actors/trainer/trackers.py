"""Where a run's training metrics go besides metrics.jsonl: the trackers of `run.trackers`.

TensorBoard (the default), Weights & Biases and SwanLab, each fed every step's scalars under the names
metrics.jsonl uses (AReaL's: task_reward, n_tokens, importance_weight, ...), at the step as its x-axis, as
AReaL's StatsLogger does (areal/utils/stats_logger.py). `run.tracker_mode: offline` (the default) writes
their files into the run directory and needs no network or account: `wandb sync RUN_DIR/wandb/offline-run-*`
and `swanlab sync RUN_DIR/swanlog/run-*` upload them later; `online` streams to the services (the user's
own login). wandb and swanlab are optional packages: a run that names one that is not installed is refused
at load (topology/experiment.py). A tracker that fails, at its start or at a step, never stops the run: the
failure is logged once and that tracker is left out from then on.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

class Tracker(Protocol):
    name: str

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path, project: str, mode: str, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, project: str, mode: str, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=config,
                              mode="offline" if mode == "offline" else "online", resume="allow",
                              id=f"{project}-{run_dir.name}")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class SwanLabTracker:
    name = "swanlab"

    def __init__(self, run_dir: Path, project: str, mode: str, config: dict[str, Any]) -> None:
        import swanlab

        self.swanlab = swanlab
        self.run = swanlab.init(project=project, experiment_name=run_dir.name, logdir=str(run_dir / "swanlog"),
                                config=config, mode="offline" if mode == "offline" else "cloud")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.swanlab.finish()


MAKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "swanlab": SwanLabTracker}


class Trackers:
    """The run's trackers; each one that fails is logged once (`tracker_failed`) and left out from then on."""

    def __init__(self, names: list[str], run_dir: Path, project: str, mode: str, config: dict[str, Any],
                 log: Any) -> None:
        self.log = log
        self.active: list[Tracker] = []
        for name in names:
            try:
                self.active.append(MAKERS[name](run_dir, project, mode, config))
            except Exception as exc:   # any failure of a tracker's own code: the run goes on without it
                self._failed(name, "start", exc)

    def _failed(self, name: str, when: str, exc: BaseException) -> None:
        self.log.warning("tracker_failed", tracker=name, when=when, error=repr(exc), disabled=True)

    def log_step(self, stats: dict[str, Any], step: int) -> None:
        scalars = {k: v for k, v in stats.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "time"}
        for tracker in list(self.active):
            try:
                tracker.log(scalars, step)
            except Exception as exc:
                self.active.remove(tracker)
                self._failed(tracker.name, f"step {step}", exc)

    def close(self) -> None:
        for tracker in self.active:
            try:
                tracker.close()
            except Exception as exc:
                self._failed(tracker.name, "close", exc)
        self.active = []
