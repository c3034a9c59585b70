"""The code task through the real launcher (topology/local_code.yaml): the code reward runs the answers'
programs against the hidden unit tests in the sandbox and its rewards reach the trainer. A small random
model writes no passing program, so what is checked is the flow, not learning (docs/reward-code.md has the
learning measurement)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from actors.reward.sandbox import probe_sandbox
from tools.bench.chaos import finish_run, launch, make_assets, step_records
from tools.bench.e2e import reward_share

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = "topology/local_code.yaml"


def stopped_counters(run_dir: Path, actor: str) -> dict:
    events = [json.loads(line) for line in (run_dir / "logs" / f"{actor}.jsonl").read_text().splitlines()]
    return next(e["counters"] for e in events if e.get("event") == "stopped")


def test_local_code_dry_run_swaps_only_the_reward():
    out = subprocess.run([sys.executable, "-m", "tools.up", TOPOLOGY, "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "actors.reward.code:CodeReward" in out.stdout and "MathReward" not in out.stdout
    import topology
    code, math = topology.load(ROOT / TOPOLOGY).topology, topology.load(ROOT / "topology/local.yaml").topology
    assert code.groups.keys() == math.groups.keys()
    for name in code.groups.keys() - {"reward"}:
        assert code.groups[name] == math.groups[name], name
    assert (code.links, code.bus, code.nodes) == (math.links, math.bus, math.nodes)
    assert code.groups["reward"].cls == "actors.reward.code:CodeReward"
    assert code.experiment["data"]["train"] == "data/code/train.jsonl"
    assert code.experiment["algo"] == math.experiment["algo"]


@pytest.mark.skipif(not probe_sandbox().available, reason=f"no bubblewrap sandbox here: {probe_sandbox().reason}")
def test_code_rewards_flow_through_the_loop(tmp_path):
    assets = make_assets(tmp_path / "assets", train_per_level=20, task="code")
    run_dir = tmp_path / "run"
    proc = launch(assets, run_dir, steps=2, ckpt_every=2, topology=TOPOLOGY)
    out = finish_run(proc, run_dir, timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert [m["step"] for m in step_records(run_dir)] == [1, 2]
    counters = stopped_counters(run_dir, "reward")
    # every answer of the trained groups went through the sandboxed grader, and none was refused. A program
    # the pool gave up on (its deadline passed: on a loaded machine a sandbox start can take seconds) is scored
    # wrong and counted as a failure, not lost: every sample has a verdict or is such a failure.
    assert counters["samples_scored"] >= 2 * 4 * 4
    verdicts = {k.removeprefix("verdict."): v for k, v in counters.items() if k.startswith("verdict.")}
    failures = counters.get("score_failures", 0)
    assert verdicts and "blocked" not in verdicts, verdicts
    assert sum(verdicts.values()) + failures == counters["samples_scored"], (verdicts, counters)
    assert counters["busy_seconds"] > 0
    # the final evaluation scored the code test split the same way
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["greedy_accuracy"]) == {"start", "final"}
    # what tools.bench e2e reports as the reward's share of the run
    share = reward_share(run_dir, summary["wall_seconds"], summary["steps"])
    assert share["busy_seconds"] == counters["busy_seconds"] and share["groups_scored"] == counters["groups_scored"]
    assert share["share_of_wall"] == counters["busy_seconds"] / summary["wall_seconds"]
