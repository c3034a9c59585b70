"""Agent programs in the bubblewrap sandbox: the endpoint's unix socket bound in, served by the relay at
``OPENAI_BASE_URL`` inside, is the program's only way out. The calculator program works there over a scripted
model; a program that tries another loopback port of the host is refused by the network namespace, and the same
program run without the sandbox reaches that port (so the refusal is the sandbox's)."""
from __future__ import annotations

import asyncio
import os
import socket
import tempfile
from pathlib import Path

import pytest

from actors.reward.sandbox import probe_sandbox
from actors.rollout.agent import AgentSandbox, run_agent
from actors.rollout.episode import ENV_VERSION
from tests.test_agent_endpoint import CALL, EOS, TASK, TOK, calc_script, endpoint_run
from tests.test_agent_rollout import group
from tests.test_rollout_episodes import rollout_with
from testsupport.scripted_engine import ScriptedEngine
from topology.settings import AgentSettings
from transport.protocol import Trajectories

pytestmark = pytest.mark.skipif(not probe_sandbox().available,
                                reason=f"no bubblewrap sandbox here: {probe_sandbox().reason}")

ROOT = Path(__file__).resolve().parents[1]
CALCULATOR = ROOT / "tools" / "agents" / "calculator_program.py"
# Tries the host's loopback port PORT (a listener of the test's), then asks the endpoint for its models.
PROBE = """
import json, os, socket, sys, urllib.request
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
    sys.exit("reached the host port")
except OSError as exc:
    print("refused:", exc)
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
                                 headers={{"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}})
with urllib.request.build_opener(urllib.request.ProxyHandler({{}})).open(request, timeout=30) as response:
    print(json.load(response)["data"][0]["id"])
print(1)
"""


def sandboxed_run(agent_argv, files, host_tcp=False):
    """One agent episode of ``agent_argv`` against a calculator-scripted model: in the sandbox behind a unix
    socket, or (``host_tcp``) unsandboxed on the endpoint's loopback TCP port."""
    engine = ScriptedEngine(calc_script(), vocab_size=TOK.vocab_size)
    folder = tempfile.mkdtemp(prefix="agent-endpoint-")
    os.chmod(folder, 0o711)
    socket_path = os.path.join(folder, "endpoint.sock")

    async def body(endpoint):
        if host_tcp:
            return await run_agent(endpoint, agent_argv, TASK, "ep", timeout_s=60)
        await endpoint.serve_unix(socket_path)
        os.chmod(socket_path, 0o666)
        return await run_agent(endpoint, agent_argv, TASK, "ep", timeout_s=60,
                               sandbox=AgentSandbox(socket_path, files))
    try:
        return endpoint_run(engine, body), engine
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


def test_the_calculator_program_runs_in_the_sandbox_through_the_endpoint():
    run, engine = sandboxed_run(["{python}", "-I", "{files}/calculator_program.py"],
                                {"calculator_program.py": CALCULATOR.read_bytes()})
    assert run.error == "" and run.reward is None   # it leaves the grading to the reward actor
    assert run.counters["tool_calls"] == 1 and len(engine.requests) == 2
    assert run.final_text == "\\boxed{1776}"
    trained = [t for t, m in zip(run.trajectories[0].output_ids, run.trajectories[0].loss_mask) if m]
    assert trained == TOK.encode(CALL) + [EOS] + TOK.encode("\\boxed{1776}") + [EOS]   # the model's exact tokens

@pytest.mark.parametrize("argv, source, reward, error", [
    # A Python file runs in the relay's own interpreter: its exit status and stdout are still the program's.
    (["{python}", "-I", "{files}/p.py"], "import sys\nprint('noise')\nprint(sys.argv[1:] == [] and 0.25)", 0.25, ""),
    (["{python}", "-I", "{files}/p.py"], "raise ValueError('no tool')", None, "ValueError: no tool"),
    (["{python}", "-I", "{files}/p.py"], "import sys\nsys.exit('gave up')", None, "exit 1: gave up"),
    (["{python}", "-I", "{files}/p.py"], "import sys\nsys.exit(3)", None, "exit 3"),
    # Anything else runs as its own process, as before.
    (["{python}", "-I", "-B", "{files}/p.py"], "print(0.5)", 0.5, ""),
    (["/bin/sh", "{files}/p.py"], "echo 0.75", 0.75, ""),
])
def test_a_sandboxed_programs_outcome_is_its_own(argv, source, reward, error):
    run, _ = sandboxed_run(argv, {"p.py": source.encode()})
    assert run.reward == reward
    assert error in run.error and bool(run.error) == bool(error)
    assert "exit " in run.error or not error


@pytest.mark.parametrize("sandboxed", [True, False])
def test_a_sandboxed_program_reaches_only_the_endpoint(sandboxed):
    listener = socket.create_server(("127.0.0.1", 0))   # something else on the host's loopback
    try:
        port = listener.getsockname()[1]
        probe = PROBE.format(port=port).encode()
        if sandboxed:
            run, _ = sandboxed_run(["{python}", "-I", "{files}/probe.py"], {"probe.py": probe})
            assert run.error == "" and run.reward == 1.0   # refused the host port, reached the endpoint
        else:
            with tempfile.NamedTemporaryFile("wb", suffix=".py") as f:
                f.write(probe)
                f.flush()
                run, _ = sandboxed_run(["python3", "-I", f.name], {}, host_tcp=True)
            assert "reached the host port" in run.error   # the same program, unsandboxed, gets there
    finally:
        listener.close()


def test_the_rollout_runs_a_sandboxed_agent_program_for_each_sample(tmp_path, random_model_dir, monkeypatch):
    engine = ScriptedEngine(calc_script(), vocab_size=TOK.vocab_size)
    settings = {"agent": {"command": ["{python}", "-I", "{files}/calculator_program.py"], "sandbox": True,
                          "files": [str(CALCULATOR)], "timeout_s": 60.0}}
    traj, stats = rollout_with(tmp_path, random_model_dir, engine, {"max_new_tokens": 128, "max_context": 256},
                               [group(n=8)], monkeypatch, settings=settings)
    assert isinstance(traj, Trajectories), traj
    # A group's 8 programs run at once, each in its own sandbox: all of them answer.
    assert stats["agent_endpoint"]["calls"] == 16 and stats["agent_endpoint"]["errors"] == 0
    for s in traj.answers.samples:
        trained = [t for t, v in zip(s.output_ids, s.versions) if v != ENV_VERSION]
        assert trained == TOK.encode(CALL) + [EOS] + TOK.encode("\\boxed{1776}") + [EOS]


def test_only_an_agent_program_is_sandboxed():
    with pytest.raises(ValueError, match="only an agent command"):
        AgentSettings(function="tools.agents.calculator:agent", sandbox=True)
    with pytest.raises(ValueError, match="only a sandboxed agent gets files"):
        AgentSettings(command=["true"], files=["x.py"])


def test_the_program_benchmark_runs_both_arms():
    from tools.bench.agent import measure_program
    report = asyncio.run(measure_program(episodes=4, concurrency=4, decode_s=0.0))
    for arm in ("function", "program"):
        assert report[arm]["answered"] == 4 and report[arm]["errors"] == 0 and report[arm]["calls"] == 8
        assert report[arm]["cpu_ms_per_episode"] > 0
    assert report["program_over_function_cpu"] > 0


def test_more_sandboxed_episodes_run_at_once_than_the_default_executor_has_threads():
    # Each episode's first call waits until every episode has made one: with the programs on asyncio's default
    # executor (CPUs + 4 threads) the rest never start and the first ones give up; on their own threads all go on.
    episodes = min(32, (os.cpu_count() or 1) + 4) + 2
    first_calls: set[str] = set()
    all_in = asyncio.Event()

    class Gathering(ScriptedEngine):
        async def generate(self, request):
            first_calls.add(request.rid.split("/")[0])
            if len(first_calls) == episodes:
                all_in.set()
            await asyncio.wait_for(all_in.wait(), 240)
            return await super().generate(request)

    engine = Gathering(calc_script(), vocab_size=TOK.vocab_size)
    folder = tempfile.mkdtemp(prefix="agent-endpoint-")
    os.chmod(folder, 0o711)
    socket_path = os.path.join(folder, "endpoint.sock")

    async def body(endpoint):
        await endpoint.serve_unix(socket_path)
        os.chmod(socket_path, 0o666)
        sandbox = AgentSandbox(socket_path, {"calculator_program.py": CALCULATOR.read_bytes()})
        return await asyncio.gather(*[run_agent(endpoint, ["{python}", "-I", "{files}/calculator_program.py"], TASK,
                                                f"ep{i}", timeout_s=300, sandbox=sandbox) for i in range(episodes)])
    try:
        runs = endpoint_run(engine, body)
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    assert [r.error for r in runs] == [""] * episodes
    assert all(r.final_text == "\\boxed{1776}" for r in runs)
