"""The calculator example's chat template and tool format (tools/agents/calculator_chat.jinja, tool format
``brackets``): the `openai`-package calculator agent, through the endpoint, holds exactly the tokens, masks and
log-probs of the native calculator episode of the same model, so the two train on the same sequences."""
from __future__ import annotations

from pathlib import Path

import pytest

from actors.engines.base import GenerationRequest, SamplingParams
from actors.rollout.agent import run_agent
from actors.rollout.chat import ChatError, ChatTemplate, parse_tool_calls
from actors.rollout.envs.calculator import Calculator
from actors.rollout.episode import EpisodeLimits, run_episodes
from actors.rollout.openai_server import AgentEndpoint, EndpointLimits
from tests.test_agent_endpoint import EOS, TOK, run
from testsupport.scripted_engine import ScriptedEngine
from tools.agents.calculator import TOOLS, agent, calc

TEMPLATE = Path(__file__).resolve().parents[1] / "tools" / "agents" / "calculator_chat.jinja"
PROMPT = "Compute: 37*48+56\n"


def careful_model(context, index):
    """The careful teacher's transcript from where the context stands (one call per "=" already answered)."""
    answered = TOK.decode(list(context)).count("=")
    return TOK.encode(["[37*48]", "[1776+56]", "\\boxed{1832}"][answered]) + [EOS]


def sloppy_model(context, index):
    """A call without its "[" (the calculator refuses it: "=error"), then a boxed guess."""
    return TOK.encode("\\boxed{1800}" if "=" in TOK.decode(list(context)) else "37*48]") + [EOS]


def template() -> ChatTemplate:
    return ChatTemplate(TEMPLATE.read_text(), eos_token=TOK.decode([EOS], skip_special_tokens=False))


@pytest.mark.parametrize("model, text, calls", [
    (careful_model, "[37*48]=1776\n[1776+56]=1832\n\\boxed{1832}", 2),
    (sloppy_model, "37*48]=error\n\\boxed{1800}", 1)])
def test_the_chat_agent_holds_the_native_episodes_tokens(model, text, calls):
    async def both():
        engine = ScriptedEngine(model, vocab_size=TOK.vocab_size)
        await engine.start()
        request = GenerationRequest("native", tuple(TOK.encode(PROMPT)),
                                    SamplingParams(max_new_tokens=16, stop_token_ids=(EOS,)), n=1)
        native = await run_episodes(engine, request, Calculator, TOK, EpisodeLimits(max_turns=5, max_tokens=256))
        endpoint = AgentEndpoint(engine, TOK, template(), EndpointLimits(max_new_tokens=16, max_context=256,
                                                                         stop_token_ids=(EOS,)), tool_format="brackets")
        await endpoint.start()
        try:
            runs = [await run_agent(endpoint, agent, {"prompt": PROMPT}, "s0", timeout_s=30)]
        finally:
            await endpoint.stop()
            await engine.stop()
        return native, runs, endpoint.stats()

    native, runs, stats = run(both())
    assert TOK.decode(native[0].context) == PROMPT + text
    for episode, agent_run in zip(native, runs):
        [conversation] = agent_run.trajectories
        assert agent_run.error == "" and agent_run.counters["drift"] == 0 and agent_run.counters["rerendered"] == 0
        assert conversation.prompt_ids == episode.prompt_ids
        assert conversation.output_ids == episode.output_ids and conversation.loss_mask == episode.loss_mask
        assert conversation.logprobs == episode.logprobs and conversation.versions == episode.versions
        assert conversation.tool_calls == episode.tool_calls and len(conversation.turns) == len(episode.turns)
    assert runs[0].counters["tool_calls"] == calls and runs[0].final_text == text.rsplit("\n", 1)[-1]
    assert stats["errors"] == 0 and stats["calls"] == calls + 1


def test_brackets_calls_name_the_one_tool_and_render_back_as_the_model_wrote_them():
    content, [call] = parse_tool_calls("so [12*3]", "brackets", TOOLS)
    assert content == "so [" and call["function"] == {"name": "calc", "arguments": '{"expr": "12*3"}'}
    assert template().render([{"role": "user", "content": "Q\n"}, {"role": "assistant", "content": content,
                                                                   "tool_calls": [call]},
                              {"role": "tool", "content": "36"}]) == "Q\nso [12*3]=36\n"
    # A turn ending on "]" with no "[": an empty call, which the tool refuses as the calculator episode does.
    content, [call] = parse_tool_calls("12*3]", "brackets", TOOLS)
    assert content == "12*3" and call["function"]["arguments"] == '{"expr": ""}'
    assert calc(call["function"]["arguments"]) == "error"
    assert template().render([{"role": "assistant", "content": content, "tool_calls": [call]},
                              {"role": "tool", "content": "error"}]) == "12*3]=error\n"
    assert parse_tool_calls("\\boxed{36}", "brackets", TOOLS) == ("\\boxed{36}", [])
    two = [TOOLS[0], {**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "other"}}]
    assert parse_tool_calls("[1+2]", "brackets", two) == ("[1+2]", [])   # which tool? none is called
    with pytest.raises(ChatError, match="tool format 'xml' is not one of"):
        parse_tool_calls("[1+2]", "xml", TOOLS)
    with pytest.raises(ValueError, match="tool format 'xml' is not one of"):
        AgentEndpoint(ScriptedEngine(careful_model), TOK, template(), tool_format="xml")
