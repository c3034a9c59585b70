"""A stop (SIGTERM to the launcher) while the trainer's batch request still waits for groups being generated
finishes within the supervisor's stop budget: every actor drains, writes its final state and logs `stopped`;
nothing handed out is lost or trained twice."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tools.bench import chaos

WAIT_S = 300.0   # bound of each wait for the run to reach a state (a loaded machine is slow, never this slow)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return chaos.make_assets(tmp_path_factory.mktemp("stop-assets"))


def status(run_dir: Path, name: str) -> dict:
    try:
        return json.loads((run_dir / "status" / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_stop_while_the_batch_request_waits_for_groups_finishes_before_any_kill(assets: dict[str, Path],
                                                                                 tmp_path: Path) -> None:
    # The buffer's drain waited its whole drain_timeout for the trainer's batch request, which equalled the
    # supervisor's stop_timeout: the buffer was SIGKILLed, never logged `stopped`, and its final state was written
    # a millisecond before the kill.
    run_dir = tmp_path / "run"
    proc = chaos.launch(assets, run_dir, steps=200, ckpt_every=2, extra=(
        "experiment.algo.eta=0", "experiment.algo.batch_size=8", "experiment.gen.max_new_tokens=96",
        "actors.buffer.settings.status_every_s=0.2"))
    with chaos.run_guard(proc, run_dir):
        chaos.wait_for_step(proc, run_dir, 1, timeout=WAIT_S)
        rollouts = [int(chaos.ready_info(run_dir, f"rollout.{i}")["pid"]) for i in range(2)]
        # Rollouts stopped mid-generation: no group can arrive, so the request the buffer reports waiting on, in a
        # status written after the freeze, is still waiting when the stop comes.
        for pid in rollouts:
            os.kill(pid, signal.SIGSTOP)
        frozen_at = time.time()
        try:
            deadline = time.monotonic() + WAIT_S
            while not (status(run_dir, "buffer").get("time", 0) > frozen_at
                       and status(run_dir, "buffer")["progress"].get("batch_waited_for") is not None):
                assert time.monotonic() < deadline, "the buffer never reported a waiting batch request"
                time.sleep(0.05)   # polling a file another process writes
        finally:
            for pid in rollouts:
                os.kill(pid, signal.SIGCONT)
        os.kill(proc.pid, signal.SIGTERM)
        output = chaos.finish_run(proc, run_dir, timeout=WAIT_S)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]   # stopped before its last step
    # the supervisor SIGKILLed nobody (its events go to the launcher's log, the console only shows some)
    launcher_log = (run_dir / "logs" / "launcher.jsonl").read_text()
    assert "actor_killed" not in output and "actor_killed" not in launcher_log, output[-3000:]
    for log in sorted((run_dir / "logs").glob("*.jsonl")):
        if log.name.startswith("launcher"):   # the supervisor's own events, not an actor's
            continue
        events = [json.loads(x).get("event") for x in log.read_text().splitlines() if x.startswith("{")]
        assert "stopped" in events, f"{log.name} never logged stopped:\n{output[-3000:]}"
    got = chaos.account(run_dir)
    assert got["lost"] == 0 and got["twice"] == 0 and got["issued"] > 0, got
