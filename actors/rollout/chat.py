"""Chat templates and tool calls: OpenAI chat messages <-> the text a model reads and writes.

Templates are the Hugging Face ones (``chat_template`` in ``tokenizer_config.json``): jinja source rendered
with jinja2 in an immutable sandbox, with the globals and the ``tojson`` filter transformers gives them
(``transformers/utils/chat_template_utils.py``), so a real model's template renders here exactly as
``tokenizer.apply_chat_template(..., tokenize=False)`` renders it. Tool calls are written in the Qwen format
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen2.5's template renders them and as
SGLang's and verl's "hermes"/"qwen" parsers read them): `parse_tool_calls` turns a model's text into OpenAI
``tool_calls``, and the template renders them back.

The ``brackets`` format is the compact one of a model whose context is too short for Qwen's: a turn that ends
on ``[ARGUMENT]`` calls the request's one function tool with ARGUMENT as its one parameter, and the turn stops
at the ``]`` (`TOOL_CALL_STOPS`). The reply's content keeps the text up to ARGUMENT, ``[`` included. With a
template that renders a call back as its content, ARGUMENT and ``]``, and a tool result as ``=RESULT`` and a
newline (tools/agents/calculator_chat.jinja), an agent's conversation is the text
of the calculator episode (actors/rollout/envs/calculator.py), token for token.

`EMBEDDED_CHAT_TEMPLATE` is the template of the embedded tiny tokenizer, whose only special token is its
eos: Qwen2.5's layout with plain-text role lines, so its turns stay short in a 256-token context.
"""
from __future__ import annotations

import datetime
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")
TOOL_FORMATS = ("qwen", "brackets")
# Stop strings (one token each) a format's call ends on: the endpoint stops there whenever tools are offered, and
# they stay in the reply's text, which they close.
TOOL_CALL_STOPS: dict[str, tuple[str, ...]] = {"qwen": (), "brackets": ("]",)}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)

# The embedded tokenizer's template: Qwen2.5's structure (tools described in the system turn, tool results as
# their own turn, each turn closed by the end-of-turn token) with short plain-text role markers.
EMBEDDED_CHAT_TEMPLATE = (
    "{%- if tools %}{{- 'tools: ' }}{%- for tool in tools %}{{- tool.function.name if tool.function is defined "
    "else tool.name }}{{- ' ' if not loop.last }}{%- endfor %}{{- '\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- 'A: ' }}{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{- '<tool_call>' }}{{- {'name': call.name, 'arguments': call.arguments} | tojson }}{{- '</tool_call>' }}"
    "{%- endfor %}{{- eos_token + '\\n' }}"
    "{%- elif message.role == 'tool' %}{{- 'T: ' + message.content + '\\n' }}"
    "{%- else %}{{- message.role[0] | upper }}{{- ': ' + message.content + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'A: ' }}{%- endif %}")


class ChatError(ValueError):
    """A request the chat layer cannot take (malformed messages or tools, a template that fails); the message
    names the field at fault."""


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' filter: jinja's own escapes HTML and sorts keys, which a model's template never expects.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """One compiled chat template with its special tokens (what the template's variables name)."""

    def __init__(self, source: str, eos_token: str = "", bos_token: str = "") -> None:
        try:
            self.template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatError(f"chat template: syntax error at line {exc.lineno}: {exc.message}") from None
        self.source, self.eos_token, self.bos_token = source, eos_token, bos_token

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The text of ``messages`` (tool-call arguments as objects, as Hugging Face templates take them)."""
        try:
            return self.template.render(messages=[template_message(m) for m in messages], tools=list(tools or []) or None,
                                        add_generation_prompt=add_generation_prompt, eos_token=self.eos_token,
                                        bos_token=self.bos_token)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatError(f"chat template: {exc}") from None


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates read it: tool-call ``arguments`` decoded from the OpenAI JSON string."""
    out = dict(message)
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            function = dict(call["function"])
            function["arguments"] = json.loads(function["arguments"])
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    return out


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's ``messages`` checked and normalised (content parts joined into text, tool-call arguments
    checked to be JSON objects); ChatError names the first message at fault."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages: expected a non-empty list of message objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatError(f"{where}: expected an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ChatError(f"{where}.role: {role!r} is not one of {list(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatError(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are served")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ChatError(f"{where}.content: expected a string, a list of text parts or null")
        normal: dict[str, Any] = {"role": role, "content": content}
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant":
                raise ChatError(f"{where}.tool_calls: only assistant messages carry tool calls")
            normal["tool_calls"] = [_checked_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                normal[key] = message[key]
        out.append(normal)
    return out


def _checked_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping) or call.get("type", "function") != "function":
        raise ChatError(f"{where}: unknown tool call format (expected {{'type': 'function', 'function': ...}})")
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ChatError(f"{where}.function: expected an object with a string 'name'")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, Mapping):
        arguments = json.dumps(arguments, ensure_ascii=False)
    try:
        if not isinstance(arguments, str) or not isinstance(json.loads(arguments), dict):
            raise ValueError
    except ValueError:
        raise ChatError(f"{where}.function.arguments: expected a JSON object (as a string)") from None
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools``: function tools only; ChatError names an entry of another format."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatError("tools: expected a list of tool objects")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
            raise ChatError(f"tools[{i}]: unknown tool format {kind!r} (only 'function' tools are served)")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatError(f"tools[{i}].function: expected an object with a string 'name'")
    return [dict(t) for t in tools]


def parse_tool_calls(text: str, tool_format: str = "qwen",
                     tools: Sequence[Mapping[str, Any]] = ()) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) of a model's turn in ``tool_format`` (``tools``: the request's, which the brackets
    format needs). Qwen: each well-formed ``<tool_call>{json}</tool_call>`` becomes an OpenAI tool call and
    leaves the content; a call whose JSON is not an object with a ``name`` stays in the content as text (the
    agent sees what the model wrote). Brackets: see the module docstring."""
    if tool_format not in TOOL_FORMATS:
        raise ChatError(f"tool format {tool_format!r} is not one of {list(TOOL_FORMATS)}")
    if tool_format == "brackets":
        return _parse_brackets(text, tools)
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for found in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(found.group(1))
            if not isinstance(body, dict) or not isinstance(body.get("name"), str):
                raise ValueError
            arguments = body.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                raise ValueError
        except ValueError:
            continue
        kept.append(text[last:found.start()])
        last = found.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": body["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    kept.append(text[last:])
    content = "".join(kept)
    return (content.strip() if calls else content), calls


def _parse_brackets(text: str, tools: Sequence[Mapping[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """A turn ending on ``]``: a call of the only function tool, its only parameter the text after the last
    ``[`` (empty when there is none: a call the tool refuses, as the calculator episode refuses it). The content
    is the text before the argument, that ``[`` included, so that content, argument and ``]`` are the model's
    text exactly (the template renders them so)."""
    functions = [t["function"] for t in tools]
    properties = (functions[0].get("parameters") or {}).get("properties") or {} if len(functions) == 1 else {}
    if not text.endswith("]") or len(properties) != 1:
        return text, []
    opened = text.rfind("[")
    content, argument = (text[:-1], "") if opened < 0 else (text[:opened + 1], text[opened + 1:-1])
    arguments = json.dumps({next(iter(properties)): argument}, ensure_ascii=False)
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": functions[0]["name"], "arguments": arguments}}]


def same_message(sent: Mapping[str, Any], kept: Mapping[str, Any]) -> bool:
    """Whether a message an agent sends back is the one a conversation holds: the same role, the same content
    up to surrounding whitespace, the same tool calls (names and decoded arguments; ids are the agent's)."""
    if sent["role"] != kept["role"] or sent["content"].strip() != kept["content"].strip():
        return False
    mine, theirs = sent.get("tool_calls") or [], kept.get("tool_calls") or []
    return len(mine) == len(theirs) and all(
        a["function"]["name"] == b["function"]["name"]
        and json.loads(a["function"]["arguments"]) == json.loads(b["function"]["arguments"])
        for a, b in zip(mine, theirs))


def template_of(tokenizer: Any) -> ChatTemplate | None:
    """The chat template a loaded tokenizer (`actors.engines.tokenizer.LoadedTokenizer`) names, or None."""
    source = getattr(tokenizer, "chat_template", None)
    if not source:
        return None
    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id
    text = lambda i: tokenizer.decode([i], skip_special_tokens=False) if i is not None else ""
    return ChatTemplate(source, eos_token=text(eos), bos_token=text(bos))
