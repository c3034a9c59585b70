"""The trainer actor (actor.py), one training step for one rank (step.py), the step's metrics
(metrics.py), and the loop ranks > 0 follow rank 0 by (followers.py; the channel is actors/runtime/rank_group.py). A topology names the actor
`actors.trainer:TrainerActor`."""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # The actor is imported when a topology's class path asks for it, not with the package: its parts
    # (the state, the step, the episodes) are imported by other actors, tools and the planner, and
    # importing the actor with them would pull in its engines and make import cycles.
    if name == "TrainerActor":
        from actors.trainer.actor import TrainerActor
        return TrainerActor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
