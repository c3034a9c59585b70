"""The parameter server actor (actor.py) and its push decisions as plain state (push_policy.py).
A topology names the actor `actors.param_server:ParamServerActor`."""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # The actor is imported when a topology's class path asks for it, not with the package: its parts
    # (the state, the step, the episodes) are imported by other actors, tools and the planner, and
    # importing the actor with them would pull in its engines and make import cycles.
    if name == "ParamServerActor":
        from actors.param_server.actor import ParamServerActor
        return ParamServerActor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
