"""The OpenAI-compatible endpoint of a rollout: agents written with the `openai` package talk to a scripted text
model through it, and the conversation keeps exactly the tokens the model sampled.

The model is `ScriptedEngine` with a script over the embedded tokenizer's text: it writes a Qwen-format tool
call until the context holds a tool result, then boxes the result. Everything the tests check is read from
what the engine received and returned (`ScriptedEngine.requests`, the trajectories' per-token lists)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import sys

import aiohttp
import httpx
import pytest

from actors.engines.base import GenerationRequest
from actors.engines.tokenizer import load_tokenizer
from actors.rollout.agent import AgentClient, run_agent, shared_http_client
from actors.rollout.chat import (EMBEDDED_CHAT_TEMPLATE, ChatError, ChatTemplate, parse_tool_calls, template_of,
                                 validate_messages)
from actors.rollout.episode import ENV_VERSION
from actors.rollout.openai_server import AgentEndpoint, EndpointLimits
from testsupport.bounded import run_bounded
from testsupport.scripted_engine import ScriptedEngine, scripted_logprob
from testsupport.tiny_models import ARITH_TOKENIZER_DIR

run = functools.partial(run_bounded, timeout=60.0)
TOK = load_tokenizer(str(ARITH_TOKENIZER_DIR))
EOS = TOK.eos_token_id
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "37*48"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "one operation",
                                           "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]
TASK = {"prompt": "Compute: 37*48", "answer": "1776"}


def calc_script(call: str = CALL):
    """The model: a tool call while the context has no tool result ("T: "), then the boxed result."""
    def script(context, index):
        text = TOK.decode(context, skip_special_tokens=False)
        reply = call if "T: " not in text.split("U: ")[-1] else "\\boxed{1776}"
        return TOK.encode(reply) + [EOS]
    return script


async def calc_agent(client: AgentClient, task) -> float:
    """An agent as people write them: the openai package, tool calls answered, the final reply graded."""
    oa = client.openai()
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(4):
        completion = await oa.chat.completions.create(model="policy", messages=messages, tools=TOOLS, logprobs=True,
                                                      temperature=1.0, max_tokens=128)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return 1.0 if task["answer"] in (message.content or "") else 0.0
        for call in message.tool_calls:
            a, b = json.loads(call.function.arguments)["expr"].split("*")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(int(a) * int(b))})
    return 0.0


def endpoint_run(engine, body, template=None, **limits):
    """Start an endpoint on ``engine``, run ``body(endpoint)``, stop both."""
    async def main():
        await engine.start()
        endpoint = AgentEndpoint(engine, TOK, template or template_of(TOK),
                                 EndpointLimits(max_new_tokens=128, stop_token_ids=(EOS,), **limits))
        await endpoint.start()
        try:
            return await body(endpoint)
        finally:
            await endpoint.stop()
            await engine.stop()
    return run(main())


def test_openai_agent_keeps_the_models_exact_tokens():
    engine = ScriptedEngine(calc_script(), vocab_size=TOK.vocab_size)
    agent_run = endpoint_run(engine, lambda ep: run_agent(ep, calc_agent, TASK, "ep0", timeout_s=30, seed=7))
    assert agent_run.error == "" and agent_run.reward == 1.0
    assert agent_run.counters["drift"] == 0 and agent_run.counters["tool_calls"] == 1
    [trajectory] = agent_run.trajectories
    trajectory.check()
    first, second = engine.requests
    call_ids = TOK.encode(CALL) + [EOS]
    # The second request continues from the first one's exact tokens: its prompt, then what the model sampled.
    assert list(second.input_ids[:len(first.input_ids) + len(call_ids)]) == list(first.input_ids) + call_ids
    assert trajectory.prompt_ids == list(first.input_ids)
    # Trained tokens (mask 1) are exactly the two samples, with the engine's log-probs; the rest is masked.
    trained = [t for t, m in zip(trajectory.output_ids, trajectory.loss_mask) if m]
    assert trained == call_ids + TOK.encode("\\boxed{1776}") + [EOS]
    tail = len(second.input_ids) - len(first.input_ids) - len(call_ids)
    assert trajectory.loss_mask == [1] * len(call_ids) + [0] * tail + [1] * (len(trained) - len(call_ids))
    assert trajectory.logprobs[:len(call_ids)] == [scripted_logprob(len(first.input_ids), p) for p in range(len(call_ids))]
    assert set(trajectory.versions[len(call_ids):len(call_ids) + tail]) == {ENV_VERSION}
    assert TOK.decode(trajectory.output_ids[len(call_ids):len(call_ids) + tail]) == "\nT: 1776\nA: "
    assert trajectory.final_text == "\\boxed{1776}" and trajectory.end == "done"
    # Seeds are per episode and request, reproducible.
    assert first.sampling.seed is not None and first.sampling.seed != second.sampling.seed


def test_a_template_that_drifts_is_caught_counted_and_not_trained_on():
    # The model writes compact JSON; the template re-serialises the call with spaces (`tojson`): rendering the
    # history back gives text the model never wrote.
    compact = '<tool_call>{"name":"calc","arguments":{"expr":"37*48"}}</tool_call>'
    engine = ScriptedEngine(calc_script(compact), vocab_size=TOK.vocab_size)
    agent_run = endpoint_run(engine, lambda ep: run_agent(ep, calc_agent, TASK, "ep0", timeout_s=30, seed=7))
    assert agent_run.reward == 1.0 and agent_run.counters["drift"] == 1
    [trajectory] = agent_run.trajectories
    first, second = engine.requests
    compact_ids = TOK.encode(compact) + [EOS]
    # The model's own tokens are kept: the next context starts with them, not with the re-rendered call.
    assert list(second.input_ids[:len(first.input_ids) + len(compact_ids)]) == list(first.input_ids) + compact_ids
    respaced = TOK.encode(CALL)
    assert TOK.decode(second.input_ids).count('"name": "calc"') == 0
    trained = [t for t, m in zip(trajectory.output_ids, trajectory.loss_mask) if m]
    assert trained == compact_ids + TOK.encode("\\boxed{1776}") + [EOS]
    assert respaced != TOK.encode(compact)


def test_a_template_that_rewrites_history_starts_a_prompt_only_trajectory():
    # A template that drops earlier assistant turns' text once the conversation goes on (as thinking templates
    # drop earlier reasoning): no rendering isolates the new messages, so the request is a new trajectory whose
    # re-rendered history is prompt (mask 0) and the first trajectory keeps the model's own tokens.
    forgetful = EMBEDDED_CHAT_TEMPLATE.replace(
        "{%- if message.role == 'assistant' %}",
        "{%- if message.role == 'assistant' and not loop.last %}{{- 'A: (earlier)' + eos_token + '\\n' }}"
        "{%- elif message.role == 'assistant' %}")
    assert forgetful != EMBEDDED_CHAT_TEMPLATE
    template = ChatTemplate(forgetful, eos_token=TOK.decode([EOS], skip_special_tokens=False))
    engine = ScriptedEngine(calc_script(), vocab_size=TOK.vocab_size)
    agent_run = endpoint_run(engine, lambda ep: run_agent(ep, calc_agent, TASK, "ep0", timeout_s=30, seed=7),
                             template=template)
    assert agent_run.counters["drift"] == 1 and agent_run.counters["rerendered"] == 1
    first_t, second_t = agent_run.trajectories
    first, second = engine.requests
    assert first_t.output_ids == TOK.encode(CALL) + [EOS] and set(first_t.loss_mask) == {1}
    assert second_t.prompt_ids == list(second.input_ids) and "(earlier)" in TOK.decode(second_t.prompt_ids)
    assert second_t.output_ids == TOK.encode("\\boxed{1776}") + [EOS]   # only its own sample is trained


def test_branches_and_n_become_separate_trajectories():
    engine = ScriptedEngine(calc_script(), vocab_size=TOK.vocab_size)

    async def agent(client, task):
        oa = client.openai()
        messages = [{"role": "user", "content": task["prompt"]}]
        two = await oa.chat.completions.create(model="policy", messages=messages, tools=TOOLS, n=2)
        assert len(two.choices) == 2
        for choice in two.choices:   # each sample answered on its own: two branches continue
            history = messages + [choice.message.model_dump(exclude_none=True),
                                  {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "1776"}]
            done = await oa.chat.completions.create(model="policy", messages=history, tools=TOOLS)
            assert done.choices[0].message.content == "\\boxed{1776}"
        # Resubmitting the first state again forks a third branch from the first reply.
        history = messages + [two.choices[0].message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": "x", "content": "1776"}]
        await oa.chat.completions.create(model="policy", messages=history, tools=TOOLS)
        return None

    agent_run = endpoint_run(engine, lambda ep: run_agent(ep, agent, TASK, "ep0", timeout_s=30))
    assert agent_run.error == "" and agent_run.reward is None
    assert len(agent_run.trajectories) == 3 and agent_run.counters["drift"] == 0
    call_ids, answer_ids = TOK.encode(CALL) + [EOS], TOK.encode("\\boxed{1776}") + [EOS]
    for t in agent_run.trajectories:
        t.check()
        assert [x for x, m in zip(t.output_ids, t.loss_mask) if m] == call_ids + answer_ids
        assert t.prompt_ids == list(engine.requests[0].input_ids)
    assert agent_run.counters["forks"] == 2


def test_bad_requests_get_one_clear_error_and_the_endpoint_keeps_serving():
    engine = ScriptedEngine(calc_script(), vocab_size=TOK.vocab_size)

    async def body(endpoint):
        key = endpoint.open("ep0")
        url = endpoint.base_url
        answers = {}
        async with aiohttp.ClientSession() as http:
            async def post(name, payload, route="/chat/completions", token=key, raw=None):
                async with http.post(url + route, data=raw if raw is not None else json.dumps(payload),
                                     headers={"Authorization": f"Bearer {token}"}) as r:
                    answers[name] = (r.status, await r.json())
            good = {"messages": [{"role": "user", "content": "Compute: 37*48"}], "tools": TOOLS}
            await post("not_json", None, raw="{nope")
            await post("no_messages", {"messages": []})
            await post("bad_role", {"messages": [{"role": "robot", "content": "hi"}]})
            await post("unknown_tool", {**good, "tools": [{"type": "retrieval"}]})
            await post("unknown_field", {**good, "frobnicate": 1})
            await post("multi_token_stop", {**good, "stop": ["Compute"]})
            await post("stream", {**good, "stream": True})
            await post("bad_key", good, token="nope")
            await post("good", good)
            await endpoint.close(key, "agent finished")
            await post("after_end", good)
            other = endpoint.open("ep1")
            await post("other", {"prompt": "Compute: 1+1"}, route="/completions", token=other)
            conversation = await endpoint.close(other)
        return answers, conversation

    answers, conversation = endpoint_run(engine, body)
    expect = {"not_json": (400, "not JSON"), "no_messages": (400, "messages"), "bad_role": (400, "messages[0].role"),
              "unknown_tool": (400, "unknown tool format 'retrieval'"), "unknown_field": (400, "frobnicate"),
              "multi_token_stop": (400, "single tokens"), "stream": (400, "stream"), "bad_key": (401, "unknown key"),
              "after_end": (410, "agent finished")}
    for name, (status, words) in expect.items():
        got_status, got = answers[name]
        assert got_status == status and words in got["error"]["message"], (name, got)
    assert answers["good"][0] == 200 and answers["good"][1]["choices"][0]["finish_reason"] == "tool_calls"
    assert answers["other"][0] == 200 and conversation.trajectories()[0].generated_tokens > 0
    assert len(engine.requests) == 2   # nothing malformed reached the engine


def test_an_agent_that_raises_hangs_or_lies_ends_its_episode_with_the_cause():
    hold = TOK.encode("9")[0]   # a token the tool call does not contain

    def script(context, index):
        text = TOK.decode(context, skip_special_tokens=False)
        if "hang" in text:
            return TOK.encode("\\boxed{") + [hold] + [EOS]   # generates, then holds until aborted
        return calc_script()(context, index)

    engine = ScriptedEngine(script, vocab_size=TOK.vocab_size, hold_token=hold)

    async def raising(client, task):
        await client.openai().chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        raise RuntimeError("the agent's own bug")

    async def hanging(client, task):   # its request never finishes: the episode's timeout ends it
        await client.openai().chat.completions.create(model="policy", messages=[{"role": "user", "content": "hang"}])
        return 1.0

    async def lying(client, task):
        return "full marks"

    async def body(endpoint):
        runs = [await run_agent(endpoint, agent, TASK, name, timeout_s=t)
                for name, agent, t in (("r", raising, 20), ("h", hanging, 1.0), ("l", lying, 20))]
        after = await run_agent(endpoint, calc_agent, TASK, "after", timeout_s=20)
        return runs, after

    (raised, hung, lied), after = endpoint_run(engine, body)
    assert raised.error == "agent failed: RuntimeError: the agent's own bug" and raised.reward is None
    [t] = raised.trajectories
    assert t.end == "env_error" and t.error == raised.error and t.output_ids == TOK.encode(CALL) + [EOS]
    assert hung.error == "agent timed out after 1 s"
    [t] = hung.trajectories   # the tokens sampled before the abort are kept, marked aborted
    assert t.output_ids == TOK.encode("\\boxed{") and t.turns[-1].finish_reason == "abort" and t.end == "env_error"
    assert lied.error.startswith("agent failed: TypeError: the agent returned 'full marks'")
    assert after.error == "" and after.trajectories   # the endpoint still serves


def test_the_endpoint_accepts_a_whole_batch_of_connections_while_its_loop_is_busy():
    """A rollout starts a batch of episodes at once, hundreds of connections, on the event loop that accepts them:
    while the loop is busy, each must still connect (the listen queue holds them) and then be answered."""
    engine = ScriptedEngine(calc_script(), vocab_size=TOK.vocab_size)
    count = 300   # past aiohttp's default listen queue of 128

    async def body(endpoint):
        key = endpoint.open("many")
        host, port = endpoint.base_url.split("//")[1].split("/")[0].split(":")
        # The event loop does not run while these connect (as when it is busy starting other agents).
        sockets = [socket.create_connection((host, int(port)), timeout=20) for _ in range(count)]
        request = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n"
        for s in sockets:
            s.sendall(request.encode())

        def status_lines():
            with contextlib.ExitStack() as stack:
                for s in sockets:
                    stack.enter_context(s)
                return [s.makefile("rb").readline() for s in sockets]

        return await asyncio.to_thread(status_lines)

    lines = endpoint_run(engine, body)
    assert lines == [b"HTTP/1.1 200 OK\r\n"] * count


def test_an_agents_openai_client_waits_as_long_as_its_episode_on_the_shared_pool():
    """The openai package's own connect timeout (5 s) failed episodes with minutes left whose calls waited behind a
    busy loop; the client an agent makes has the episode's timeout, connect included, on the rollout's pool."""
    engine = ScriptedEngine(calc_script(), vocab_size=TOK.vocab_size)
    made = []

    async def agent(client, task):
        made.append(client.openai())
        return await calc_agent(client, task)

    async def body(endpoint):
        pool = shared_http_client()
        try:
            return [await run_agent(endpoint, agent, TASK, f"e{i}", timeout_s=240, http_client=pool)
                    for i in range(2)], pool
        finally:
            await pool.aclose()

    runs, pool = endpoint_run(engine, body)
    assert [r.error for r in runs] == ["", ""] and [r.reward for r in runs] == [1.0, 1.0]
    for oa in made:
        timeout = httpx.Timeout(oa.timeout)
        assert (timeout.connect, timeout.read, timeout.write, timeout.pool) == (240, 240, 240, 240)
        assert oa._client is pool


AGENT_PROGRAM = r'''
import json, os, urllib.request
task = json.loads(os.environ["AGENT_TASK"])
body = {"messages": [{"role": "user", "content": task["prompt"]}], "max_tokens": 128}
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                             headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                      "Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(req))["choices"][0]["message"]
print("0.5" if reply["tool_calls"] else "0")
'''


def test_an_external_program_is_an_agent(tmp_path):
    program = tmp_path / "agent.py"
    program.write_text(AGENT_PROGRAM)
    failing = tmp_path / "fails.py"
    failing.write_text("import sys; sys.exit('no task for me')")
    timed = tmp_path / "timed.py"   # its reward: the bound its HTTP client is given, the episode's
    timed.write_text("import os; print(os.environ['AGENT_TIMEOUT_S'])")
    engine = ScriptedEngine(calc_script(), vocab_size=TOK.vocab_size)

    async def body(endpoint):
        return (await run_agent(endpoint, [sys.executable, str(program)], TASK, "p", timeout_s=30),
                await run_agent(endpoint, [sys.executable, str(failing)], TASK, "f", timeout_s=30),
                await run_agent(endpoint, [sys.executable, str(timed)], TASK, "t", timeout_s=42.5))

    ok, failed, timed_run = endpoint_run(engine, body)
    assert timed_run.error == "" and timed_run.reward == 42.5
    assert ok.error == "" and ok.reward == 0.5 and ok.trajectories[0].output_ids == TOK.encode(CALL) + [EOS]
    assert failed.error == "agent failed: AgentProgramError: exit 1: no task for me" and failed.trajectories == []


def test_completions_extend_the_exact_tokens():
    engine = ScriptedEngine(lambda ctx, i: TOK.encode("12") + [EOS], vocab_size=TOK.vocab_size)

    async def body(endpoint):
        key = endpoint.open("c")
        oa = AgentClient(endpoint.base_url, key).openai()
        first = await oa.completions.create(model="policy", prompt="Compute: 5+7\n", logprobs=0)
        ids = list(engine.requests[0].input_ids) + first.choices[0].model_extra["token_ids"]
        await oa.completions.create(model="policy", prompt=ids + TOK.encode("\nok"))
        return await endpoint.close(key), first

    conversation, first = endpoint_run(engine, body)
    assert first.choices[0].text == "12" and first.choices[0].logprobs.token_logprobs[0] < 0
    [t] = conversation.trajectories()
    sample, tail = TOK.encode("12") + [EOS], TOK.encode("\nok")
    # One trajectory: the second prompt (token ids) extends the first context exactly; only its tail is new.
    assert t.output_ids == sample + tail + sample and t.loss_mask == [1] * 3 + [0] * len(tail) + [1] * 3
    assert list(engine.requests[1].input_ids) == t.prompt_ids + sample + tail


def test_templates_render_as_transformers_does_and_tool_calls_round_trip():
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=TOK.tokenizer, eos_token="<|endoftext|>")
    fast.chat_template = EMBEDDED_CHAT_TEMPLATE
    messages = validate_messages([
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "Compute: 37*48"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "37*48"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "1776"}])
    ours = template_of(TOK).render(messages, TOOLS)
    hf_messages = [dict(m) for m in messages]
    hf_messages[2] = {**hf_messages[2], "tool_calls": [{"type": "function", "function": {
        "name": "calc", "arguments": {"expr": "37*48"}}}]}
    assert ours == fast.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    content, calls = parse_tool_calls("thinking " + CALL + ' <tool_call>{"bad json</tool_call>')
    assert content == 'thinking  <tool_call>{"bad json</tool_call>'.strip() and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"expr": "37*48"}
    with pytest.raises(ChatError, match="tool format 'hermes2' is not one of"):
        parse_tool_calls(CALL, "hermes2")
    with pytest.raises(ChatError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        validate_messages([{"role": "assistant", "tool_calls": [{"type": "function",
                                                                  "function": {"name": "f", "arguments": "[1]"}}]}])
