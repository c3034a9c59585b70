"""The buffer actor (actor.py) and its decisions as plain state (state.py: cursor, staleness gate,
batches, re-issue). A topology names the actor `actors.buffer:BufferActor`."""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # The actor is imported when a topology's class path asks for it, not with the package: its parts
    # (the state, the step, the episodes) are imported by other actors, tools and the planner, and
    # importing the actor with them would pull in its engines and make import cycles.
    if name == "BufferActor":
        from actors.buffer.actor import BufferActor
        return BufferActor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
