"""tools.bench e2e --task agent's figures from a run's rollout logs: turns, tool calls and the tool's share."""
from __future__ import annotations

import json

import pytest

from tools.bench.e2e import DEFAULT_MODES, MODES, TOPOLOGIES, compare_turns, episode_share


def write_log(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + "{torn")


def test_episode_share_sums_the_rollouts_last_stats(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    write_log(logs / "rollout.0.jsonl", [
        {"event": "rollout_stats", "env_seconds": 1.0, "gen_seconds": 10.0},
        {"event": "rollout_stats", "env_seconds": 2.0, "gen_seconds": 20.0},   # the last one counts
        {"event": "stopped", "counters": {"episodes": 10, "turns": 25, "tool_calls": 15}}])
    write_log(logs / "rollout.1.jsonl", [
        {"event": "rollout_stats", "env_seconds": 1.0, "gen_seconds": 20.0},
        {"event": "stopped", "counters": {"episodes": 30, "turns": 35, "tool_calls": 5}}])
    share = episode_share(tmp_path, steps=6)
    assert share["episodes"] == 40 and share["turns_per_episode"] == 1.5 and share["tool_calls_per_episode"] == 0.5
    assert share["env_seconds"] == 3.0 and share["tool_share_of_generation"] == pytest.approx(3.0 / 40.0)
    assert share["env_seconds_per_step"] == 0.5
    (logs / "rollout.1.jsonl").unlink()
    write_log(logs / "rollout.0.jsonl", [{"event": "stopped", "counters": {}}])
    assert episode_share(tmp_path, steps=6) is None   # no episode counted: nothing to report


def test_agent_task_compares_multi_turn_with_one_turn_rl():
    assert TOPOLOGIES["agent"] == "topology/local_agent.yaml" and DEFAULT_MODES["agent"] == "async,one_turn"
    assert MODES["one_turn"] == ["experiment.gen.max_turns=1", "experiment.algo.dynamic_sampling=false"]
    out = compare_turns({"async": {"greedy_accuracy": {"start": 0.0, "final": 0.6}},
                         "one_turn": {"greedy_accuracy": {"start": 0.0, "final": 0.1}}})
    assert out["multi_turn_gain_points"] == pytest.approx(60.0)
    assert out["multi_turn_over_one_turn_points"] == pytest.approx(50.0)


def test_run_local_passes_the_warm_starts_progress_on_and_keeps_the_tail_for_errors(tmp_path, monkeypatch):
    import subprocess
    import sys

    from tools.bench import e2e

    real_popen = subprocess.Popen
    script = ("import sys; print('prepare: warm-start stage 1/2'); print('an actor line'); "
              "print('step 50/2500  loss 1.0', flush=True); print('the cause', file=sys.stderr); sys.exit(3)")
    monkeypatch.setattr(e2e.subprocess, "Popen", lambda cmd, **kw: real_popen([sys.executable, "-c", script], **kw))
    lines: list[str] = []
    with pytest.raises(RuntimeError, match="exit 3") as failed:
        e2e.run_local("async", 1, [], tmp_path, lines.append, topology=TOPOLOGIES["agent"])
    assert lines[1:] == ["bench e2e: async: prepare: warm-start stage 1/2", "bench e2e: async: step 50/2500  loss 1.0"]
    assert "an actor line" in str(failed.value) and "the cause" in str(failed.value)


def test_agent_chat_compares_the_openai_agent_with_the_native_episodes(tmp_path):
    from tools.bench.e2e import agent_share, compare_agent

    assert TOPOLOGIES["agent_chat"] == TOPOLOGIES["agent"] and DEFAULT_MODES["agent_chat"] == "native,openai_agent"
    assert "actors.rollout.settings.agent.tool_format=brackets" in MODES["openai_agent"] and MODES["native"] == []
    logs = tmp_path / "logs"
    logs.mkdir()
    for i, (calls, overhead) in enumerate(((30, 0.09), (10, 0.01))):
        write_log(logs / f"rollout.{i}.jsonl", [
            {"event": "rollout_stats", "agent_endpoint": {"calls": calls, "overhead_s": overhead, "engine_s": 1.0}},
            {"event": "stopped", "counters": {"episodes": 8, "turns": 20, "tool_calls": 12, "agent_drift": i,
                                              "agent_errors": 1, "agent_requests": calls}}])
    agents = agent_share(tmp_path)
    assert agents["drift"] == 1 and agents["errors"] == 2 and agents["requests"] == 40
    assert agents["endpoint_calls"] == 40 and agents["endpoint_overhead_ms_per_call"] == pytest.approx(2.5)
    assert agents["engine_ms_per_call"] == pytest.approx(50.0)
    out = compare_agent({"native": {"greedy_accuracy": {"start": 0.1, "final": 0.9}, "episodes": episode_share(tmp_path, 2)},
                         "openai_agent": {"greedy_accuracy": {"start": 0.1, "final": 0.8}, "agents": agents}})
    assert out["native_gain_points"] == pytest.approx(80.0) and out["agent_gain_points"] == pytest.approx(70.0)
    assert out["agent_minus_native_points"] == pytest.approx(-10.0) and out["drift_events"] == 1
    assert out["native_turns_per_episode"] == 2.5 and out["openai_agent_turns_per_episode"] is None
    write_log(logs / "rollout.0.jsonl", [{"event": "rollout_stats"}, {"event": "stopped", "counters": {}}])
    (logs / "rollout.1.jsonl").unlink()
    assert agent_share(tmp_path) is None   # no rollout served an agent


def test_agent_program_is_a_third_arm_reported_under_its_own_names():
    import os

    from tools.bench.e2e import build_report, report_lines

    args = dict(a.split("=", 1) for a in MODES["agent_program"])
    assert args["actors.rollout.settings.agent.sandbox"] == "true"
    assert os.path.isfile(args["actors.rollout.settings.agent.files"].strip("[]"))
    assert args["actors.rollout.settings.agent.tool_format"] == "brackets"
    agents = {"drift": 0, "rerendered": 0, "errors": 0, "endpoint_calls": 12.0, "endpoint_overhead_ms_per_call": 3.0}
    runs = {"native": {"greedy_accuracy": {"start": 0.1, "final": 0.5}},
            "agent_program": {"greedy_accuracy": {"start": 0.1, "final": 0.4}, "agents": agents}}
    report = build_report("agent_chat", "topology/local_agent.yaml", 4, runs)
    assert report["program_agent_gain_points"] == pytest.approx(30.0)
    assert report["program_agent_minus_native_points"] == pytest.approx(-10.0)
    assert report["program_agent_errors"] == 0 and "agent_accuracy" not in report   # no openai_agent run
    for run in runs.values():
        run.update(steps=4, tokens_trained=100, wall_seconds=10.0, effective_throughput=10.0, staleness_max=1)
    assert any(line.startswith("held-out accuracy: agent program 40.0% (+30.0 points")
               for line in report_lines(report))
