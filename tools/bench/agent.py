"""`python -m tools.bench agent [--episodes N] [--json]`: the agent endpoint's cost per call.

Runs N episodes of a calculator agent written with the ``openai`` package (one tool call, then the answer)
against the rollout's OpenAI-compatible endpoint over a scripted model on the embedded tokenizer, whose
engine time is nil: what is measured is the endpoint itself (HTTP, the prefix check, rendering the chat
template and tokenizing the tail, parsing tool calls) and the client's round trip. Reports calls, tool
calls, drift events (0 expected), the endpoint's time per call and the agent's wall time per call.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from actors.engines.tokenizer import load_tokenizer
from actors.rollout.agent import AgentClient, run_agent
from actors.rollout.chat import template_of
from actors.rollout.openai_server import AgentEndpoint, EndpointLimits
from testsupport.scripted_engine import ScriptedEngine
from testsupport.tiny_models import ARITH_TOKENIZER_DIR

CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "37*48"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


async def _agent(client: AgentClient, task: dict) -> float:
    oa = client.openai()
    messages = [{"role": "user", "content": task["prompt"]}]
    while True:
        message = (await oa.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                    max_tokens=128)).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(task["answer"] in (message.content or ""))
        for call in message.tool_calls:
            a, b = json.loads(call.function.arguments)["expr"].split("*")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(int(a) * int(b))})


async def measure(episodes: int) -> dict:
    tok = load_tokenizer(str(ARITH_TOKENIZER_DIR))
    eos = tok.eos_token_id

    def script(context, index):
        text = tok.decode(context, skip_special_tokens=False).split("U: ")[-1]
        return tok.encode(CALL if "T: " not in text else "\\boxed{1776}") + [eos]

    engine = ScriptedEngine(script, vocab_size=tok.vocab_size)
    await engine.start()
    endpoint = AgentEndpoint(engine, tok, template_of(tok), EndpointLimits(max_new_tokens=128, stop_token_ids=(eos,)))
    await endpoint.start()
    try:
        t0 = time.perf_counter()
        runs = [await run_agent(endpoint, _agent, {"prompt": "Compute: 37*48", "answer": "1776"}, f"ep{i}", 60.0, i)
                for i in range(episodes)]
        wall = time.perf_counter() - t0
    finally:
        await endpoint.stop()
        await engine.stop()
    stats = endpoint.stats()
    calls = int(stats["calls"])
    return {"episodes": episodes, "calls": calls, "reward_mean": sum(r.reward or 0 for r in runs) / episodes,
            "turns_per_episode": calls / episodes,
            "tool_calls": sum(r.counters["tool_calls"] for r in runs),
            "drift_events": sum(r.counters["drift"] for r in runs),
            "errors": sum(bool(r.error) for r in runs),
            "endpoint_ms_per_call": stats["overhead_ms_per_call"],
            "agent_wall_ms_per_call": round(1000 * wall / max(calls, 1), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    report = asyncio.run(measure(args.episodes))
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 0
