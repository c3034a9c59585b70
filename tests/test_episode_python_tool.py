"""The python tool (actors/rollout/envs/python_tool.py): programs an episode's model writes run in the reward's sandbox,
and whatever they do (loop, fork bomb, read the host's files, kill their parent, flood the output), the
episode goes on with an observation saying what happened; a zygote killed between or during calls is
replaced; a call the sandbox does not answer in time, or no sandbox at all, is an error observation; and
the same through the rollout actor."""
from __future__ import annotations

import asyncio
import functools
import os
import signal

import pytest

from actors.engines.base import GenerationRequest, SamplingParams
from actors.engines.tokenizer import load_tokenizer
from actors.rollout.envs import ENVIRONMENTS, environment_for
from actors.rollout.envs.python_tool import (CodeRunner, PythonTool, ToolOutput, observation, program_of, python_tool,
                                     status_line)
from actors.rollout.episode import ENV_VERSION, EpisodeLimits, run_episodes
from actors.reward import sandbox as sandbox_module
from actors.reward import zygote
from actors.reward.sandbox import MiB, RunResult, SandboxLimits, SandboxStatus, probe_sandbox
from testsupport.bounded import run_bounded, until
from testsupport.scripted_engine import ScriptedEngine
from testsupport.tiny_models import ARITH_TOKENIZER_DIR
from topology.settings import PythonToolSettings
from transport.protocol import GenerateGroup, GroupReturned, Task, Trajectories

run = functools.partial(run_bounded, timeout=90.0)
ARITH = load_tokenizer(str(ARITH_TOKENIZER_DIR))
EOS = ARITH.eos_token_id
OPEN, END = "<python>", "`"   # "`" is one token of the arith tokenizer; the shipped default "</python>" is not
LIMITS = SandboxLimits(wall_time_s=2.0, cpu_time_s=2.0, memory_bytes=256 * MiB, file_size_bytes=1 * MiB,
                       tmpfs_bytes=8 * MiB, max_processes=16, output_bytes=64 * 1024)
ANSWER = "\\boxed{1}"

needs_sandbox = pytest.mark.skipif(not probe_sandbox().available,
                                   reason=f"no bubblewrap sandbox here: {probe_sandbox().reason}")

HOSTILE = {
    "infinite_loop": ("while True:\n    pass\n", "[killed: wall time limit of 2 s]"),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                  "[killed: wall time limit of 2 s]"),
    # the host's files are not there: not the project's source, not root's home, not the host's /tmp
    "read_outside": (f"print(open({os.path.abspath(__file__)!r}).read())\n", "FileNotFoundError"),
    "read_root": ("import os\nprint(os.listdir('/root'))\n", "FileNotFoundError"),
    # the program is PID 1 of its own namespace: its parent (the zygote) is not in it, nothing else is
    "kill_parent": ("import os, signal\nprint('parent', os.getppid())\nos.kill(os.getppid() or 1, signal.SIGKILL)\n"
                    "os.kill(-1, signal.SIGKILL)\n", "parent 0"),
    "flood_output": ("print('x' * 10**7)\n", "[killed: output past 65536 bytes]"),
    "memory": ("b = bytearray(1 << 30)\n", "MemoryError"),
}


@pytest.fixture(autouse=True)
def no_zygotes_left():
    """Every test leaves this process without idle zygotes (other test files count theirs)."""
    yield
    zygote.close_all()


def call(program: str) -> str:
    return f"{OPEN}{program}{END}"


def script_for(programs: list[str]):
    """The model: turn k writes programs[k] as a call; once every program has run, it boxes its answer."""
    def script(context, sample):
        done = ARITH.decode(context).count(END)
        return ARITH.encode(call(programs[done]) if done < len(programs) else ANSWER) + [EOS]
    return script


def request(n: int = 1) -> GenerationRequest:
    return GenerationRequest("g", tuple(ARITH.encode("Run it:\n")),
                             SamplingParams(max_new_tokens=400, stop_token_ids=(EOS,), seed=3), n)


def runner(**kwargs) -> CodeRunner:
    # A call's bound counts its wait behind other calls and the start of its worker's zygote, which take
    # seconds on a loaded machine (the default, wall time + 3 s, ran out there): tests of that bound set their own.
    kwargs.setdefault("timeout_s", 25.0)   # below the episodes' env_timeout_s (30 s)
    return CodeRunner(kwargs.pop("limits", LIMITS), output=ToolOutput(200), **kwargs)


def episode(programs: list[str], tool_runner: CodeRunner, n: int = 1, env_timeout_s: float = 30.0):
    async def main():
        engine = ScriptedEngine(script_for(programs), vocab_size=ARITH.vocab_size, context_limit=8192)
        await engine.start()
        make = functools.partial(PythonTool, tool_runner, call_open=OPEN, call_end=END)
        return await run_episodes(engine, request(n), make, ARITH,
                                  EpisodeLimits(max_turns=len(programs) + 1, env_timeout_s=env_timeout_s))
    return run(main())


# --- without a sandbox: the program, the observation -------------------------------------------------

def test_program_of_a_turn():
    assert program_of("think first <python>print(1)\n</python>", "<python>", "</python>") == "print(1)\n"
    assert program_of("<python>a<python>b`", "<python>", "`") == "b"      # the last call is the program
    assert program_of("print(2)`", "<python>", "`") == "print(2)"         # no opening: the whole turn


def test_observation_names_how_the_run_ended_and_clips_its_output():
    def result(**kw):
        base = dict(returncode=0, stdout=b"", stderr=b"", result=b"", timed_out=False, output_limited=False,
                    wall_s=0.1, sandboxed=True)
        return RunResult(**{**base, **kw})
    assert observation(result(stdout=b"42\n"), LIMITS) == "\n[exit 0]\n42\n"
    assert status_line(result(returncode=-9, timed_out=True), LIMITS) == "killed: wall time limit of 2 s"
    assert status_line(result(returncode=-9, cpu_limited=True), LIMITS) == "killed: CPU time limit of 2 s"
    assert status_line(result(returncode=-11), LIMITS) == "killed by SIGSEGV"
    text = observation(result(returncode=1, stdout=b"a" * 50, stderr=b"b" * 40 + b"Error: cause\n"), LIMITS,
                       ToolOutput(10))
    # stdout's head, stderr's tail (a traceback ends with its cause), each marked where it was cut
    assert text == "\n[exit 1]\naaaaaaaaaa...[40 more characters]\n[stderr]\n[43 characters before]...or: cause\n"


def test_the_python_tool_is_a_known_tool_and_its_timeout_fits_the_episodes():
    assert environment_for({"tool": "python"}) is ENVIRONMENTS["python"] is PythonTool
    tool_runner, make = python_tool(PythonToolSettings(sandbox={"wall_time_s": 2.0}), env_timeout_s=5.0)
    assert tool_runner.timeout_s == 4.5 and make().turn_end == ("</python>",)   # 90% of the episode's bound
    assert python_tool(PythonToolSettings(), env_timeout_s=30.0)[0].timeout_s == 5.0   # wall time + 3 s
    with pytest.raises(ValueError, match="python_tool.timeout_s .* below gen.env_timeout_s"):
        python_tool(PythonToolSettings(timeout_s=5.0), env_timeout_s=5.0)


def test_no_sandbox_is_an_error_observation_and_the_episode_goes_on(monkeypatch):
    monkeypatch.setattr(sandbox_module, "probe_sandbox", lambda python=None: SandboxStatus(False, "bwrap not found"))
    [t] = episode(["print(1)\n"], runner())
    t.check()
    assert t.end == "done" and t.final_text.startswith(ANSWER) and not t.error
    assert t.turns[0].observation.startswith("\n[error: refusing to run untrusted code: no working bubblewrap "
                                             "sandbox (bwrap not found)")


# --- in the sandbox ----------------------------------------------------------------------------------

@needs_sandbox
def test_a_program_runs_and_its_output_is_the_observation():
    [t] = episode(["import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)\n", "1/0\n"], runner())
    t.check()
    assert [turn.observation for turn in t.turns[:1]] == ["\n[exit 0]\n42\n[stderr]\noops\n"]
    assert t.turns[1].observation.startswith("\n[exit 1]\n[stderr]\nTraceback") and "ZeroDivisionError" in \
        t.turns[1].observation
    assert t.end == "done" and t.tool_calls == 2 and t.final_text.startswith(ANSWER)
    # the observation's tokens are the environment's: never trained, version -1
    env = [i for i, m in enumerate(t.loss_mask) if m == 0]
    assert ARITH.decode([t.output_ids[i] for i in env]) == "".join(turn.observation for turn in t.turns[:2])
    assert {t.versions[i] for i in env} == {ENV_VERSION}


@needs_sandbox
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_program_is_contained_and_the_episode_goes_on(name):
    program, expected = HOSTILE[name]
    tool_runner = runner()
    # the hostile program, then a check that the sandbox still runs programs as fresh
    [t] = episode([program, "import os\nprint(sorted(os.listdir('/tmp')), os.getuid() != 0)\n"], tool_runner)
    t.check()
    assert t.end == "done" and not t.error and t.final_text.startswith(ANSWER), (t.end, t.error)
    assert expected in t.turns[0].observation, t.turns[0].observation
    assert t.turns[1].observation == "\n[exit 0]\n[] True\n"
    assert tool_runner.counters["abandoned"] == 0


@needs_sandbox
def test_a_zygote_serves_many_calls_and_a_killed_one_is_replaced_between_and_during_calls():
    zygote.close_all()
    tool_runner = runner(workers=1)

    async def main():
        assert (await tool_runner.run("print('warm')")) == "\n[exit 0]\nwarm\n"
        [first] = zygote.idle_zygotes()
        # the zygote outlives the call (bwrap's --die-with-parent follows the thread that started it)
        assert (await tool_runner.run("print('again')")) == "\n[exit 0]\nagain\n"
        assert zygote.idle_zygotes() == [first] and first.alive()
        os.kill(first.server_pid, signal.SIGKILL)             # killed while idle
        assert (await tool_runner.run("print('after')")) == "\n[exit 0]\nafter\n"
        [second] = zygote.idle_zygotes()
        assert second.server_pid != first.server_pid
        # killed in the middle of a call: the call runs again on a fresh zygote
        running = asyncio.ensure_future(tool_runner.run("import time\ntime.sleep(0.5)\nprint('slept')"))
        await until(lambda: not zygote.idle_zygotes(), 30, "the zygote checked out for the call")
        os.kill(second.server_pid, signal.SIGKILL)
        assert (await running) == "\n[exit 0]\nslept\n"
        [third] = zygote.idle_zygotes()
        assert third.server_pid not in (first.server_pid, second.server_pid) and third.alive()
    run(main())


@needs_sandbox
def test_a_call_past_its_timeout_is_an_error_observation_and_the_episode_goes_on():
    zygote.close_all()
    slow = SandboxLimits(wall_time_s=8.0, cpu_time_s=8.0)
    tool_runner = runner(limits=slow, timeout_s=1.0, workers=1)   # the program outlives the call
    [t] = episode(["import time\ntime.sleep(4)\n"], tool_runner, env_timeout_s=5.0)
    t.check()
    assert t.turns[0].observation == "\n[error: the sandbox gave no result within 1 s]\n"
    assert t.end == "done" and t.turns[0].env_seconds < 5.0 and tool_runner.counters["abandoned"] == 1
    # the abandoned program ends on its own and its zygote goes back to serve the next call
    run(until(lambda: len(zygote.idle_zygotes()) == 1, 30, "the abandoned program's end"))


@needs_sandbox
def test_concurrent_episodes_each_get_their_own_program_run():
    programs = ["import os\nprint(len(os.listdir('/proc')) > 0, os.getpid())\n"]
    trajectories = episode(programs, runner(workers=2), n=4)
    for t in trajectories:
        assert t.end == "done" and t.turns[0].observation == "\n[exit 0]\nTrue 1\n"   # PID 1 of a fresh namespace


# --- through the rollout actor -----------------------------------------------------------------------

@needs_sandbox
def test_the_rollout_actor_runs_python_tool_episodes(tmp_path, random_model_dir, monkeypatch):
    from tests.test_rollout_episodes import rollout_with

    hostile, check = HOSTILE["fork_bomb"][0], "print(sum(range(10)))\n"
    engine = ScriptedEngine(script_for([hostile, check]), vocab_size=ARITH.vocab_size, context_limit=8192)
    group = GenerateGroup(group_id="g", prompt_ids=ARITH.encode("Run it:\n"), n=2,
                          task=Task(kind="math", answer="1", tool="python"), temperature=1.0, max_new_tokens=400,
                          stop_token_ids=[EOS], seed=5)
    settings = {"python_tool": {"call_open": OPEN, "call_end": END, "output_chars": 200, "timeout_s": 50.0,
                                "sandbox": {"wall_time_s": 2.0, "cpu_time_s": 2.0, "max_processes": 16}}}
    traj, stats = rollout_with(tmp_path, random_model_dir, engine, {"max_turns": 3, "env_timeout_s": 60.0},
                               [group], monkeypatch, settings=settings)
    assert isinstance(traj, Trajectories) and traj.task.tool == "python"
    for s in traj.answers.samples:
        env_text = ARITH.decode([t for t, v in zip(s.output_ids, s.versions) if v == ENV_VERSION])
        assert env_text == "\n[killed: wall time limit of 2 s]\n\n[exit 0]\n45\n"
        assert ARITH.decode(s.output_ids).endswith(ANSWER + ARITH.decode([EOS])) and s.finish_reason == "stop"
    assert stats["turns_per_episode"] == 3 and stats["tool_calls_per_episode"] == 2
    assert stats["python_tool"] == {"runs": 4, "abandoned": 0, "unavailable": 0, "failed": 0}



def test_a_call_marker_that_is_not_one_token_hands_the_group_back_invalid(tmp_path, random_model_dir, monkeypatch):
    from tests.test_rollout_episodes import rollout_with

    engine = ScriptedEngine(script_for(["print(1)\n"]), vocab_size=ARITH.vocab_size, context_limit=8192)
    group = GenerateGroup(group_id="g", prompt_ids=ARITH.encode("Run it:\n"), n=1,
                          task=Task(kind="math", answer="1", tool="python"), temperature=1.0, max_new_tokens=40,
                          stop_token_ids=[EOS], seed=5)
    # the default "</python>" is nine tokens of the arith tokenizer: no turn could end on it
    returned, _ = rollout_with(tmp_path, random_model_dir, engine, {"max_turns": 3}, [group], monkeypatch)
    assert isinstance(returned, GroupReturned) and returned.reason.startswith("invalid:")
    assert "'</python>' encodes to 9 tokens" in returned.reason and not engine.requests
