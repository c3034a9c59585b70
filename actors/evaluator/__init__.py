"""The evaluator actor (actor.py), the one held-out evaluation tools and the actor share
(evaluation.py), and its episode form (episode_eval.py). A topology names the actor
`actors.evaluator:EvalActor`."""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # The actor is imported when a topology's class path asks for it, not with the package: its parts
    # (the state, the step, the episodes) are imported by other actors, tools and the planner, and
    # importing the actor with them would pull in its engines and make import cycles.
    if name == "EvalActor":
        from actors.evaluator.actor import EvalActor
        return EvalActor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
