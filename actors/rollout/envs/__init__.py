"""Environments that episodes act on (actors/rollout/episode.py), and which one a dataset record asks for.

A record names its tool in ``"tool"`` (an extra field of AReaL's layout); records without one are
single-turn tasks. Environments here run in the caller's process: they must be cheap and never block the
event loop. One that runs untrusted code goes through the reward sandbox's worker pool instead
(actors/reward/pool.py), which has its own hard limits.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from actors.rollout.envs.calculator import Calculator
from actors.rollout.episode import Environment, SingleTurn

ENVIRONMENTS: dict[str, Callable[[], Environment]] = {"calculator": Calculator}


class UnknownTool(ValueError):
    """A record names a tool no environment implements."""


def environment_for(extra: Mapping[str, Any]) -> Callable[[], Environment]:
    """The environment factory of a record (its ``extra`` fields): its ``"tool"``, or `SingleTurn`."""
    tool = extra.get("tool")
    if tool is None:
        return SingleTurn
    factory = ENVIRONMENTS.get(tool) if isinstance(tool, str) else None
    if factory is None:
        raise UnknownTool(f"tool {tool!r} is not one of {sorted(ENVIRONMENTS)}")
    return factory


def is_agent(extra: Mapping[str, Any]) -> bool:
    """Whether a record's episode uses an environment (several turns), by its extra fields."""
    return extra.get("tool") is not None
