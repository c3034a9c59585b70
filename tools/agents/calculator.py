"""The calculator task as an agent people would write: the `openai` package, one function tool, its calls answered
until the model writes an answer. The rollout runs it for each sample of a group
(``actors.rollout.settings.agent.function=tools.agents.calculator:agent``); it returns None, so the task's reward
actor grades the final reply as it grades an episode's answer."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from actors.rollout.agent import AgentClient
from actors.rollout.envs.calculator import CalculatorError, calculate

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "one integer operation A op B, op one of + - *",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
MAX_CALLS = 4


def calc(arguments: str) -> str:
    """The tool: the value of ``{"expr": "A op B"}``, or ``error`` (as the calculator environment answers)."""
    try:
        return str(calculate(str(json.loads(arguments).get("expr", ""))))
    except (CalculatorError, ValueError, AttributeError):
        return "error"


async def agent(client: AgentClient, task: Mapping[str, Any]) -> float | None:
    oa = client.openai()
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_CALLS + 1):
        completion = await oa.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or completion.choices[0].finish_reason == "length":
            return None
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(call.function.arguments)})
    return None
