"""Environments that episodes act on (actors/rollout/episode.py), and which one a dataset record asks for.

A record names its tool in ``"tool"`` (an extra field of AReaL's layout); records without one are
single-turn tasks. Environments here run in the caller's process and never block its event loop: the
calculator is a regular expression; the python tool runs each program in the reward's bubblewrap sandbox on
a thread of its own, under the sandbox's limits and a per-call timeout (actors/rollout/envs/python_tool.py).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from actors.rollout.envs.calculator import Calculator
from actors.rollout.envs.python_tool import PythonTool
from actors.rollout.episode import Environment, SingleTurn

# Each tool's factory with its defaults; an actor with settings for a tool passes its own factories.
ENVIRONMENTS: dict[str, Callable[[], Environment]] = {"calculator": Calculator, "python": PythonTool}


class UnknownTool(ValueError):
    """A record names a tool no environment implements."""


def environment_for(extra: Mapping[str, Any],
                    environments: Mapping[str, Callable[[], Environment]] = ENVIRONMENTS) -> Callable[[], Environment]:
    """The environment factory of a record (its ``extra`` fields): its ``"tool"`` among ``environments``, or
    `SingleTurn`."""
    tool = extra.get("tool")
    if tool is None:
        return SingleTurn
    factory = environments.get(tool) if isinstance(tool, str) else None
    if factory is None:
        raise UnknownTool(f"tool {tool!r} is not one of {sorted(environments)}")
    return factory


def is_agent(extra: Mapping[str, Any]) -> bool:
    """Whether a record's episode uses an environment (several turns), by its extra fields."""
    return extra.get("tool") is not None
