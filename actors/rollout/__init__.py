"""The rollout actor (actor.py), the episodes it runs (episode.py: generate, act, observe, generate
again) and the environments they act on (envs/). A topology names the actor `actors.rollout:RolloutActor`."""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # The actor is imported when a topology's class path asks for it, not with the package: its parts
    # (the state, the step, the episodes) are imported by other actors, tools and the planner, and
    # importing the actor with them would pull in its engines and make import cycles.
    if name == "RolloutActor":
        from actors.rollout.actor import RolloutActor
        return RolloutActor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
