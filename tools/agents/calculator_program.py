"""The calculator agent as an external program: the standard library only (it runs under the sandbox's system
Python, where no package of ours is installed), any OpenAI-compatible endpoint. It reads ``OPENAI_BASE_URL``,
``OPENAI_API_KEY``, ``AGENT_TASK`` and ``AGENT_TIMEOUT_S`` (its calls wait as long as the episode may) from its
environment, answers the model's ``calc`` calls until the model
writes an answer, and prints nothing: the task's reward actor grades the final reply.

Its HTTP is a plain HTTP/1.0 POST on a socket: ``urllib.request`` (``http.client``, ``email``, ``ssl``) takes
longer to import than the rest of an episode's CPU outside the model, once per episode (tools/bench/agent.py
--program), and a local endpoint needs none of it.

Sandboxed (actors/rollout/agent.py), with only the endpoint reachable::

    actors.rollout.settings.agent.command=["{python}","-I","{files}/calculator_program.py"]
    actors.rollout.settings.agent.sandbox=true
    actors.rollout.settings.agent.files=["tools/agents/calculator_program.py"]
"""
from __future__ import annotations

import json
import os
import re
import socket
from urllib.parse import urlsplit

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "one integer operation A op B, op one of + - *",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
MAX_CALLS = 4
# Self-contained on purpose (the program sees none of the project): the calculator environment's grammar.
_CALL = re.compile(r"(-?\d{1,9})([-+*])(\d{1,9})")


def calc(arguments: str) -> str:
    try:
        found = _CALL.fullmatch(str(json.loads(arguments).get("expr", "")))
    except (ValueError, AttributeError):
        found = None
    if found is None:
        return "error"
    a, op, b = int(found.group(1)), found.group(2), int(found.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def chat(messages: list[dict]) -> dict:
    """One chat completion (HTTP/1.0: the reply is the whole body, then the connection closes)."""
    url = urlsplit(os.environ["OPENAI_BASE_URL"])
    body = json.dumps({"model": "policy", "messages": messages, "tools": TOOLS}).encode()
    head = (f"POST {url.path.rstrip('/')}/chat/completions HTTP/1.0\r\nHost: {url.netloc}\r\n"
            f"Authorization: Bearer {os.environ['OPENAI_API_KEY']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    timeout = float(os.environ.get("AGENT_TIMEOUT_S", "120"))
    with socket.create_connection((url.hostname, url.port or 80), timeout=timeout) as connection:
        connection.sendall(head.encode() + body)
        reply = b"".join(iter(lambda: connection.recv(1 << 16), b""))
    status, _, rest = reply.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    if status.split(b" ")[1:2] != [b"200"]:
        raise RuntimeError(f"{status.decode(errors='replace')}: {payload[:300].decode(errors='replace')}")
    return json.loads(payload)["choices"][0]


def main() -> None:
    task = json.loads(os.environ["AGENT_TASK"])
    messages: list[dict] = [{"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_CALLS + 1):
        choice = chat(messages)
        message = choice["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        if not message.get("tool_calls") or choice["finish_reason"] == "length":
            return
        for call in message["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": calc(call["function"]["arguments"])})


if __name__ == "__main__":
    main()
