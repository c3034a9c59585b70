"""`python -m tools.bench agent [--episodes N] [--json]`: the agent endpoint's cost per call.

Runs N episodes of a calculator agent written with the ``openai`` package (one tool call, then the answer)
against the rollout's OpenAI-compatible endpoint over a scripted model on the embedded tokenizer, whose
engine time is nil: what is measured is the endpoint itself (HTTP, the prefix check, rendering the chat
template and tokenizing the tail, parsing tool calls) and the client's round trip. Reports calls, tool
calls, drift events (0 expected), the endpoint's time per call and the agent's wall time per call.

`--program` compares, in one run, that agent with the same calculator as a sandboxed external program
(tools/agents/calculator_program.py behind the relay, as ``agent.sandbox`` runs it), ``--concurrency`` episodes
started at once as a training step starts its groups', over a scripted model that takes ``--decode-s`` seconds
a call (a sleep: it holds no CPU, as a decode on another core would not). Reports each arm's wall and CPU
(this process and its children) per episode, and the program's over the function's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import tempfile
import time
from pathlib import Path

from actors.engines.tokenizer import load_tokenizer
from actors.rollout.agent import AgentClient, AgentSandbox, run_agent, shared_http_client
from actors.rollout.chat import template_of
from actors.rollout.openai_server import AgentEndpoint, EndpointLimits
from testsupport.scripted_engine import ScriptedEngine
from testsupport.tiny_models import ARITH_TOKENIZER_DIR

PROGRAM = Path(__file__).resolve().parents[1] / "agents" / "calculator_program.py"
TASK = {"prompt": "Compute: 37*48", "answer": "1776"}
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


def _calculator_engine(decode_s: float = 0.0) -> tuple[ScriptedEngine, AgentEndpoint]:
    """A scripted model that calls the tool once, then answers (``decode_s`` seconds a call), and its endpoint."""
    tok = load_tokenizer(str(ARITH_TOKENIZER_DIR))
    eos = tok.eos_token_id

    def script(context, index):
        text = tok.decode(context, skip_special_tokens=False).split("U: ")[-1]
        return tok.encode(CALL if "T: " not in text else "\\boxed{1776}") + [eos]

    class Decoding(ScriptedEngine):
        async def generate(self, request):
            await asyncio.sleep(decode_s)
            return await super().generate(request)

    engine = Decoding(script, vocab_size=tok.vocab_size)
    return engine, AgentEndpoint(engine, tok, template_of(tok),
                                 EndpointLimits(max_new_tokens=128, stop_token_ids=(eos,)))


async def measure(episodes: int) -> dict:
    engine, endpoint = _calculator_engine()
    await engine.start()
    await endpoint.start()
    try:
        t0 = time.perf_counter()
        runs = [await run_agent(endpoint, _agent, TASK, f"ep{i}", 60.0, i) for i in range(episodes)]
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


def _cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (the sandboxes)."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


async def _arm(agent, episodes: int, concurrency: int, decode_s: float, sandbox_files: dict | None) -> dict:
    """``episodes`` episodes of ``agent``, ``concurrency`` at a time; with ``sandbox_files`` in the sandbox."""
    engine, endpoint = _calculator_engine(decode_s)
    await engine.start()
    await endpoint.start()
    folder = tempfile.mkdtemp(prefix="agent-endpoint-")
    sandbox = None
    http = shared_http_client() if sandbox_files is None else None   # the rollout's agents share one pool
    try:
        if sandbox_files is not None:   # as the rollout serves sandboxes (actors/rollout/actor.py)
            os.chmod(folder, 0o711)
            sandbox = AgentSandbox(os.path.join(folder, "endpoint.sock"), sandbox_files)
            await endpoint.serve_unix(sandbox.socket_path)
            os.chmod(sandbox.socket_path, 0o666)
        runs = []
        cpu0, t0 = _cpu_s(), time.perf_counter()
        for first in range(0, episodes, concurrency):
            runs += await asyncio.gather(*[run_agent(endpoint, agent, TASK, f"ep{i}", 120.0, i, sandbox, http)
                                           for i in range(first, min(first + concurrency, episodes))])
        wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    finally:
        await endpoint.stop()
        await engine.stop()
        if http is not None:
            await http.aclose()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    return {"episodes": episodes, "errors": sum(bool(r.error) for r in runs),
            "answered": sum(r.final_text == "\\boxed{1776}" for r in runs),
            "calls": int(endpoint.stats()["calls"]), "drift_events": sum(r.counters["drift"] for r in runs),
            "endpoint_ms_per_call": endpoint.stats()["overhead_ms_per_call"],
            "wall_ms_per_episode": round(1000 * wall / episodes, 1), "cpu_ms_per_episode": round(1000 * cpu / episodes, 1)}


async def measure_program(episodes: int, concurrency: int, decode_s: float) -> dict:
    """The function agent and the sandboxed program, one after the other, and the program's cost over the function's."""
    function = await _arm(_agent, episodes, concurrency, decode_s, None)
    program = await _arm(["{python}", "-I", "{files}/calculator_program.py"], episodes, concurrency, decode_s,
                         {"calculator_program.py": PROGRAM.read_bytes()})
    return {"concurrency": concurrency, "decode_s": decode_s, "function": function, "program": program,
            "program_over_function_wall": round(program["wall_ms_per_episode"] / function["wall_ms_per_episode"], 2),
            "program_over_function_cpu": round(program["cpu_ms_per_episode"] / function["cpu_ms_per_episode"], 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=50)
    ap.add_argument("--program", action="store_true",
                    help="compare the function agent with the calculator as a sandboxed program")
    ap.add_argument("--concurrency", type=int, default=32, help="with --program: episodes started at once")
    ap.add_argument("--decode-s", type=float, default=0.5, help="with --program: the model's seconds per call")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    report = asyncio.run(measure_program(args.episodes, args.concurrency, args.decode_s) if args.program
                         else measure(args.episodes))
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 0
