"""A pocket calculator as a tool: one integer operation per call.

The model writes the operation in square brackets and stops at the closing bracket; the calculator answers
with ``=`` and the value on its own line, and the model goes on::

    Compute: 37*48+56          (prompt)
    [37*48]                    model turn 1, ends on "]"
    =1776                      observation
    [1776+56]                  model turn 2
    =1832                      observation
    \\boxed{1832}               model turn 3, ends on eos: the answer

A call is ``A op B`` with integers A (a leading minus allowed) and B of at most `MAX_DIGITS` digits and op one
of ``+ - *``; anything else is answered ``=error``, which the model sees as it would a real tool's refusal.
Parsing is a regular expression, never ``eval``. A turn that ends on eos is the answer: the episode is over.
"""
from __future__ import annotations

import re

from actors.rollout.episode import Environment

MAX_DIGITS = 9
CALL_OPEN, CALL_CLOSE = "[", "]"
ERROR = "error"
_CALL = re.compile(rf"(-?\d{{1,{MAX_DIGITS}}})([-+*])(\d{{1,{MAX_DIGITS}}})")


class CalculatorError(ValueError):
    """A call the calculator cannot evaluate; the message names it."""


def calculate(call: str) -> int:
    """The value of one operation ``A op B`` (no spaces, no brackets)."""
    found = _CALL.fullmatch(call)
    if found is None:
        raise CalculatorError(f"not one operation 'A op B' on integers of at most {MAX_DIGITS} digits: {call[:40]!r}")
    a, op, b = int(found.group(1)), found.group(2), int(found.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


def observation(value: int | None) -> str:
    """What the calculator appends after a call: ``=VALUE`` (or ``=error``) and a newline."""
    return f"={ERROR if value is None else value}\n"


def call_of(turn_text: str) -> str:
    """The operation a turn asked for: the text after its last ``[``, without the closing ``]``."""
    if not turn_text.endswith(CALL_CLOSE):
        raise CalculatorError(f"the turn does not end with {CALL_CLOSE!r}")
    start = turn_text.rfind(CALL_OPEN)
    if start < 0:
        raise CalculatorError(f"no {CALL_OPEN!r} opens the call")
    return turn_text[start + 1:-1]


class Calculator(Environment):
    """The calculator tool (see the module docstring). Stateless: every call stands alone."""

    turn_end = (CALL_CLOSE,)

    async def step(self, turn_text: str, ended_by: str) -> str | None:
        if ended_by != CALL_CLOSE:
            return None   # the turn ended on eos: it is the answer
        try:
            return observation(calculate(call_of(turn_text)))
        except CalculatorError:
            return observation(None)
