"""The planner's simulation as a timeline in the same format as a real run's: the simulation keeps the records
its actors would have written (`tools.plan.sim.Simulation(cfg, trace=True)`: the buffer's issued, scored, stale
and served groups, the trainer's steps and publishes, the parameter server's pushes), and `timeline.build`
reads them as it reads a run directory's. Times are the simulation's seconds from its start, so a predicted and
a real run open side by side in Perfetto on the same scale (each from its own start)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.trace import timeline
from tools.trace.records import RunRecords


def records_of(result: Any, label: str = "simulation") -> RunRecords:
    """RunRecords of a `tools.plan.sim.Result` simulated with ``trace=True``."""
    rec = RunRecords(Path(label))
    for actor, record in result.records:
        if "ev" in record:
            rec.trace.setdefault(actor, []).append(record)
        else:
            rec.logs.setdefault(actor, []).append(record)
    if not result.records:
        rec.notes.append("the simulation kept no records (simulate(..., trace=True))")
    for step in result.steps:
        rec.metrics.append({"step": step.version, "time": step.end, "staleness_mean":
                            sum(step.staleness) / max(len(step.staleness), 1),
                            "staleness_max": max(step.staleness, default=0)})
    return rec


def write_simulated(result: Any, path: str | Path, label: str = "simulation") -> Path:
    doc = timeline.build(records_of(result, label))
    doc["metadata"]["simulated"] = True
    return timeline.write(doc, path)
