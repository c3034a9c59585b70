"""A run starts with the rollouts that are ready, takes in one whose SGLang server comes up late, and goes on
without one whose server never comes up, through the real launcher. Three rollouts drive stand-in SGLang
servers that stay 'starting' (/health 503, as SGLang's own does while it loads weights and captures CUDA
graphs) until the test says otherwise: rollout.0's is up at once, rollout.1's only once the run has trained
a step, rollout.2's never (it exits at start, as a server that cannot load its model does: the rollout fails,
its restart fails too and it is given up), and the run trains on until the test stops it. Before, one late
server made the whole run NotReady, and the given-up rollout stopped it. (A server whose health wait runs out:
test_engine_sglang.py::test_a_launched_server_never_healthy_is_killed_and_named.)"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from tools.bench.chaos import launch, make_assets, run_guard, step_records

ROOT = Path(__file__).resolve().parents[1]


def events(run_dir: Path, actor: str, kind: str) -> list[dict]:
    path = run_dir / "logs" / f"{actor}.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [r for r in records if r.get("event") == kind]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_assets(tmp_path_factory.mktemp("late"), train_per_level=40)


# Its own waits allow 400 s for each stage (servers that start late, on a loaded machine): the suite's 300 s
# limit stopped it first at load 50-80, where it took 230-300 s in all.
@pytest.mark.timeout(900)
def test_a_late_rollout_joins_and_one_that_never_comes_up_is_reported_without_stopping_the_run(
        assets: dict[str, Path], tmp_path: Path) -> None:
    gate = tmp_path / "servers_up"   # <random seed> files: experiment seed 1, rollout i's server seed 1000 + i
    gate.mkdir()
    (gate / "1000").write_text("")
    (gate / "1002.fail").write_text("")
    # rollout.1's health wait must outlast the run's first step however slowly a loaded machine gets there: with
    # 60 s (and one restart) it once ran out first, and rollout.1 was given up instead of joining late
    standin = {"engine": "sglang", "sglang": {
        "command": [sys.executable, "-m", "testsupport.sglang_standin", "--no-weights-hash",
                    "--standin-starting-until-dir", str(gate)],
        "health_timeout_s": 600.0, "env": {"OMP_NUM_THREADS": "1"}}}
    local = (ROOT / "topology" / "local.yaml").read_text()
    links = local[local.index("\nlinks:"):local.index("\nactors:")]
    text = local.replace(links, "\nlinks:\n  weights: {backend: gloo, members: [trainer.0, rollout], port: auto, "
                                "timeout_s: 30}\n")
    text = text.replace("    count: 2\n    cpus: [0]                        # generation on core 0 ...",
                        "    count: 3\n    min_ready: 1\n    cpus: [0]")
    text = text.replace("settings: {engine: torch}", f"settings: {json.dumps(standin)}")
    topology = tmp_path / "late.yaml"
    topology.write_text(text + "\nsupervisor: {max_restarts: 1, backoff_initial: 0.5}\n")
    run_dir = tmp_path / "run"
    # The run is long enough never to end on its own: a finite one ended before a slow machine had started
    # rollout.1's server. It is stopped (SIGINT) once everything below has been seen.
    proc = launch(assets, run_dir, steps=100_000, ckpt_every=100_000, topology=str(topology))
    lines: list[str] = []   # the launcher's output, as it comes

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait(what: str, done: Callable[[], bool], timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert proc.poll() is None, f"the run ended before {what}:\n{''.join(lines)[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
            time.sleep(0.2)   # polling logs another process writes

    def last_step() -> int:
        return max((r["step"] for r in step_records(run_dir)), default=0)

    def formed_with_rollout_1() -> bool:
        return any("rollout.1" not in e["left_out"] for e in events(run_dir, "param_server", "rollout_link_formed"))

    with run_guard(proc, run_dir):
        wait("step 1", lambda: last_step() >= 1)                   # the run began with rollout.0 alone
        assert not events(run_dir, "rollout.1", "engine_started")
        (gate / "1001").write_text("")                              # rollout.1's server is up now
        wait("link formed with rollout.1", formed_with_rollout_1)
        joined_at = last_step()
        wait("rollout.2 given up", lambda: any("actor_given_up" in line and "rollout.2" in line for line in lines))
        wait("5 steps after rollout.1 joined", lambda: last_step() >= joined_at + 5)
        os.kill(proc.pid, signal.SIGINT)                            # the launcher alone: it stops its actors
        proc.wait(timeout=300)
    reader.join(timeout=60)
    out = "".join(lines)
    assert proc.returncode == 128 + signal.SIGINT, out[-4000:]    # stopped before its last step
    assert "joined_late" in out and "rollout.1" in out
    # rollout.1 joined: it took work and weights once its server was up
    [stats] = [e for e in events(run_dir, "rollout.1", "rollout_stats")][-1:]
    assert stats["groups"] > 0, stats
    formed = events(run_dir, "param_server", "rollout_link_formed")
    assert formed[0]["left_out"] == ["rollout.1", "rollout.2"]           # the first group did not wait for them
    # rollout.2's server never came up: reported, left down, and the run trained on
    given_up = [line for line in out.splitlines() if "actor_given_up" in line and "rollout.2" in line]
    assert given_up and "run_goes_on" in given_up[0]
    summary = [line.split() for line in out.splitlines() if line.split()[:1] == ["rollout.2"]]
    assert summary and summary[-1][2] == "failed", summary
    assert last_step() >= joined_at + 5
