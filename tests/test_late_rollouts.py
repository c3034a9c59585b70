"""A run starts with the rollouts that are ready, takes in one whose SGLang server comes up late, and goes on
without one whose server never comes up, through the real launcher. Three rollouts drive stand-in SGLang
servers that stay 'starting' (/health 503, as SGLang's own does while it loads weights and captures CUDA
graphs) until the test says otherwise: rollout.0's is up at once, rollout.1's only once the run has trained
a step, rollout.2's never (its health wait runs out, the rollout fails, its restart fails too and it is
given up). Before, one late server made the whole run NotReady, and the given-up rollout stopped it."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tools.bench.chaos import finish_run, launch, make_assets, run_guard, wait_for_step

ROOT = Path(__file__).resolve().parents[1]


def events(run_dir: Path, actor: str, kind: str) -> list[dict]:
    path = run_dir / "logs" / f"{actor}.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [r for r in records if r.get("event") == kind]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_assets(tmp_path_factory.mktemp("late"), train_per_level=40)


def test_a_late_rollout_joins_and_one_that_never_comes_up_is_reported_without_stopping_the_run(
        assets: dict[str, Path], tmp_path: Path) -> None:
    gate = tmp_path / "servers_up"   # <random seed> files: experiment seed 1, rollout i's server seed 1000 + i
    gate.mkdir()
    (gate / "1000").write_text("")
    standin = {"engine": "sglang", "sglang": {
        "command": [sys.executable, "-m", "testsupport.sglang_standin", "--no-weights-hash",
                    "--standin-starting-until-dir", str(gate)],
        "health_timeout_s": 20.0, "env": {"OMP_NUM_THREADS": "1"}}}
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
    steps = 40
    proc = launch(assets, run_dir, steps=steps, ckpt_every=steps, topology=str(topology))
    with run_guard(proc, run_dir):
        wait_for_step(proc, run_dir, 1, timeout=400)          # the run began with rollout.0 alone
        assert not events(run_dir, "rollout.1", "engine_started")
        (gate / "1001").write_text("")                        # rollout.1's server is up now
        deadline = time.monotonic() + 300
        while not any(e.get("rollout") == "rollout.1" for e in events(run_dir, "param_server", "rollout_hello")):
            assert proc.poll() is None, "the run ended before rollout.1 joined"
            assert time.monotonic() < deadline, "rollout.1 never joined"
            time.sleep(0.2)   # polling logs another process writes
        out = finish_run(proc, run_dir, timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert "joined_late" in out and "rollout.1" in out
    # rollout.1 joined: it took work and weights once its server was up
    [stats] = [e for e in events(run_dir, "rollout.1", "rollout_stats")][-1:]
    assert stats["groups"] > 0, stats
    formed = events(run_dir, "param_server", "rollout_link_formed")
    assert formed[0]["left_out"] == ["rollout.1", "rollout.2"]           # the first group did not wait for them
    assert any("rollout.1" not in e["left_out"] for e in formed)         # a later one took rollout.1 in
    # rollout.2's server never came up: reported, left down, and the run finished its steps anyway
    given_up = [line for line in out.splitlines() if "actor_given_up" in line and "rollout.2" in line]
    assert given_up and "run_goes_on" in given_up[0]
    summary = [line.split() for line in out.splitlines() if line.split()[:1] == ["rollout.2"]]
    assert summary and summary[-1][2] == "failed", summary
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1] == steps
