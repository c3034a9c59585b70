"""Agents in the RL loop: the rollout actor runs an agent (an `openai`-package function) for each sample of a
`GenerateGroup` against its OpenAI endpoint, over a scripted model. The answers carry the prompt the conversations
rendered, the model's exact tokens with tool results masked, per-token weight versions across a weight update
between calls, the endpoint's counters, and the agent's reward when it returns one."""
from __future__ import annotations

import pytest

from actors.rollout.agent import AgentGroupError, AgentRun, group_answers, load_agent
from actors.rollout.episode import ENV_VERSION, Trajectory
from tests.test_agent_endpoint import CALL, TOK, calc_script
from tests.test_rollout_episodes import rollout_with
from testsupport.bounded import until
from testsupport.scripted_engine import ScriptedEngine
from transport.protocol import GenerateGroup, GroupReturned, Task, Trajectories

EOS = TOK.eos_token_id
PROMPT = "Compute: 37*48\n"


async def graded_agent(client, task) -> float:
    """One call, graded by the agent itself: its reward passes through the reward actor."""
    completion = await client.openai().chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["prompt"]}])
    return 2.5 if task["answer"] in (completion.choices[0].message.content or "") else -1.0


async def silent_agent(client, task) -> None:
    """Makes no request: its group has nothing to train on."""
    return None


def group(n: int = 2) -> GenerateGroup:
    return GenerateGroup(group_id="g", prompt_ids=TOK.encode(PROMPT), n=n, task=Task(kind="math", answer="1776"),
                         temperature=1.0, max_new_tokens=64, stop_token_ids=[EOS], seed=5)


def agent_settings(function: str) -> dict:
    return {"agent": {"function": function, "timeout_s": 30.0}}


def test_the_rollout_runs_an_openai_agent_per_sample_and_sends_its_exact_tokens(tmp_path, random_model_dir, monkeypatch):
    engine = ScriptedEngine(None, vocab_size=TOK.vocab_size)
    model = calc_script()

    def script(context, sample):
        if "T: " in TOK.decode(context, skip_special_tokens=False):
            engine.set_version(3)   # a weight update lands between the agent's two calls
        return model(context, sample)
    engine.script = script
    traj, stats = rollout_with(tmp_path, random_model_dir, engine, {"max_new_tokens": 128, "max_context": 256},
                               [group()], monkeypatch, settings=agent_settings("tools.agents.calculator:agent"))
    assert isinstance(traj, Trajectories), traj
    first_call = engine.requests[0]
    # The group's prompt is the conversations' own first rendering (the chat template's), not the buffer's.
    assert traj.answers.prompt_ids == list(first_call.input_ids)
    assert TOK.decode(traj.answers.prompt_ids) == "tools: calc\nU: " + PROMPT + "\nA: "
    call_ids, answer_ids = TOK.encode(CALL) + [EOS], TOK.encode("\\boxed{1776}") + [EOS]
    for s in traj.answers.samples:
        trained = [t for t, v in zip(s.output_ids, s.versions) if v != ENV_VERSION]
        assert trained == call_ids + answer_ids   # exactly what the model sampled
        masked = [t for t, v in zip(s.output_ids, s.versions) if v == ENV_VERSION]
        assert TOK.decode(masked) == "\nT: 1776\nA: "   # the tool result and the next generation prompt
        # the first call's tokens at version 0, the second's at 3: staleness counts from the first token
        assert s.versions[:len(call_ids)] == [0] * len(call_ids) and s.versions[-len(answer_ids):] == [3] * len(answer_ids)
        assert s.agent_reward is None and s.finish_reason == "stop"
    assert stats["agent_endpoint"]["calls"] == 4 and stats["agent_endpoint"]["errors"] == 0
    assert stats["turns_per_episode"] == 2


def test_an_agents_reward_travels_with_its_sample(tmp_path, random_model_dir, monkeypatch):
    engine = ScriptedEngine(lambda context, sample: TOK.encode("\\boxed{1776}") + [EOS], vocab_size=TOK.vocab_size)
    traj, _ = rollout_with(tmp_path, random_model_dir, engine, {"max_new_tokens": 64}, [group(3)], monkeypatch,
                           settings=agent_settings("tests.test_agent_rollout:graded_agent"))
    assert isinstance(traj, Trajectories)
    assert [s.agent_reward for s in traj.answers.samples] == [2.5, 2.5, 2.5]


def test_an_agent_that_samples_nothing_hands_the_group_back_invalid(tmp_path, random_model_dir, monkeypatch):
    engine = ScriptedEngine(lambda context, sample: [EOS], vocab_size=TOK.vocab_size)
    returned, _ = rollout_with(tmp_path, random_model_dir, engine, {}, [group()], monkeypatch,
                               settings=agent_settings("tests.test_agent_rollout:silent_agent"))
    assert isinstance(returned, GroupReturned) and returned.reason.startswith("invalid: agent: sample 0")


def test_an_unknown_agent_function_is_refused_at_start(tmp_path, random_model_dir, monkeypatch):
    with pytest.raises(ValueError, match="agent.function 'tools.agents.calculator:nope': .*has no attribute 'nope'"):
        load_agent("tools.agents.calculator:nope")
    with pytest.raises(ValueError, match="expected 'module:function'"):
        load_agent("tools.agents.calculator")
    engine = ScriptedEngine(lambda context, sample: [EOS], vocab_size=TOK.vocab_size)
    with pytest.raises(AssertionError, match="the rollout stopped: 1"):   # it never serves a group
        rollout_with(tmp_path, random_model_dir, engine, {}, [group()], monkeypatch,
                     settings=agent_settings("tools.agents.calculator:nope"))
    assert not engine.requests


def test_a_drain_cancels_a_running_agent_group_and_hands_it_back(tmp_path, random_model_dir, monkeypatch):
    [hold] = TOK.encode("C")   # a token the calculator script never writes
    model = calc_script()
    # The agent's second call is a decode still running when the rollout is told to stop.
    engine = ScriptedEngine(lambda context, sample: [hold] if "T: " in TOK.decode(context) else model(context, sample),
                            vocab_size=TOK.vocab_size, hold_token=hold)
    seen = {}

    async def drive(buffer, next_message, actor):
        await buffer.send("rollout.0", group(n=2))
        await until(lambda: len(engine.requests) == 4, 30, "both agents' second calls")
        seen["open"] = len(actor.endpoint.episodes)
        actor.request_stop("test over")
        returned = await next_message()
        seen["after"] = len(actor.endpoint.episodes)
        return [returned]
    returned, stats = rollout_with(tmp_path, random_model_dir, engine, {"max_new_tokens": 128, "max_context": 256}, [],
                                   monkeypatch, drive, settings=agent_settings("tools.agents.calculator:agent"))
    assert returned == GroupReturned(group_id="g", reason="draining")
    assert seen == {"open": 2, "after": 0}   # both episodes were open, and the drain closed them
    assert stats["agent_endpoint"]["calls"] == 4   # the held calls ended too (aborted), none left hanging


def trajectory(prompt: list[int], output: list[int], version: int = 0) -> Trajectory:
    t = Trajectory(prompt)
    t.output_ids, t.loss_mask = list(output), [1] * len(output)
    t.logprobs, t.versions = [-0.5] * len(output), [version] * len(output)
    return t


def test_group_answers_share_the_longest_common_prompt_and_mask_the_rest():
    runs = [AgentRun([trajectory([1, 2, 3], [7, 8])]),
            AgentRun([trajectory([9], [6]), trajectory([1, 2, 4, 5], [8], version=2)])]   # its last branch answers
    prompt, answers = group_answers(runs)
    assert prompt == [1, 2]
    assert answers[0].output_ids == [3, 7, 8] and answers[0].loss_mask == [0, 1, 1]
    assert answers[1].output_ids == [4, 5, 8] and answers[1].versions == [ENV_VERSION, ENV_VERSION, 2]
    for a in answers:
        a.check()
    with pytest.raises(AgentGroupError, match="share no token"):
        group_answers([AgentRun([trajectory([1], [2])]), AgentRun([trajectory([3], [2])])])
    with pytest.raises(AgentGroupError, match="sample 1: the agent sampled nothing \\(agent timed out"):
        group_answers([AgentRun([trajectory([1], [2])]), AgentRun([], error="agent timed out after 1 s")])


AGENT = "actors.rollout.settings.agent"


@pytest.mark.parametrize("overrides, problem", [
    ([f"{AGENT}.function=tools.agents.calculator:nope"],
     "agent.function 'tools.agents.calculator:nope': module 'tools.agents.calculator' has no attribute 'nope'"),
    ([f"{AGENT}.function=no_such_module:agent"],
     "agent.function 'no_such_module:agent': No module named 'no_such_module'"),
    ([f"{AGENT}.function=tools.agents.calculator:calc"],   # a plain function, not a coroutine function
     "agent.function 'tools.agents.calculator:calc': not an async function (expected async def calc(client, task))"),
    ([f'{AGENT}.command=["no-such-agent-program","--fast"]'],
     "agent.command ['no-such-agent-program', '--fast']: 'no-such-agent-program': no such program (not a file, "
     "nor found on PATH)"),
    ([f'{AGENT}.command=["python3","-u","tools/agents/no_such_agent.py"]'],
     "agent.command ['python3', '-u', 'tools/agents/no_such_agent.py']: tools/agents/no_such_agent.py: no such file"),
    ([f'{AGENT}.command=["{{python}}","-I","{{files}}/calculator_program.py"]', f"{AGENT}.sandbox=true",
      f"{AGENT}.files=[tools/agents/calculator.py]"],
     "agent.command ['{python}', '-I', '{files}/calculator_program.py']: {files}/calculator_program.py is not one "
     "of agent.files ['calculator.py']"),
    ([f"{AGENT}.function=tools.agents.calculator:agent", f"{AGENT}.chat_template=tools/agents/nope.jinja"],
     "agent.chat_template: tools/agents/nope.jinja: no such file"),
])
def test_the_dry_run_refuses_an_agent_the_rollout_could_not_run(overrides, problem):
    import topology
    from launch.readiness import settings_problems

    plan = topology.load("topology/local.yaml", overrides, check_imports=False)
    assert settings_problems(plan) == [problem]


@pytest.mark.parametrize("overrides", [
    [f"{AGENT}.function=tools.agents.calculator:agent"],
    [f'{AGENT}.command=["python3","-m","tools.agents.calculator_program"]'],
    [f'{AGENT}.command=["{{python}}","-I","{{files}}/calculator_program.py"]', f"{AGENT}.sandbox=true",
     f"{AGENT}.files=[tools/agents/calculator_program.py]",
     f"{AGENT}.chat_template=tools/agents/calculator_chat.jinja"],
])
def test_the_shipped_agents_pass_the_dry_runs_check(overrides):
    import topology
    from launch.readiness import settings_problems

    assert settings_problems(topology.load("topology/local.yaml", overrides, check_imports=False)) == []


def test_a_dry_run_names_a_missing_agent_program_in_one_line(capsys):
    from tools import up

    assert up.main(["topology/local.yaml", f'{AGENT}.command=["python3","my_agent.py"]', "--dry-run",
                    "--no-import-check"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-2:] == ["topology/local.yaml: 1 problem(s)",
                        "  agent.command ['python3', 'my_agent.py']: my_agent.py: no such file"], err
