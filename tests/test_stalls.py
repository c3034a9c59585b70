"""Runs that stop making progress say so, and a frozen parameter server does not stop training (real launcher,
real actor processes; the small random model of tests/test_e2e_loop.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from testsupport.bounded import run_bounded, until
from tools.bench.chaos import (account, finish_run, frozen, launch, log_events, make_assets, ready_info, run_guard,
                               step_records, wait_for_step)

# A short watchdog for these runs: a step takes about a second here, so 20 s without one is a stall.
WATCHDOG = ("experiment.run.watchdog.min_s=20", "experiment.run.watchdog.after_steps=3")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_assets(tmp_path_factory.mktemp("stalls"), train_per_level=40)


def pid_of(run_dir: Path, name: str) -> int:
    return int(ready_info(run_dir, name)["pid"])


def test_a_buffer_that_finished_early_stalls_the_run_which_says_so_and_fails(assets: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    # The buffer stopped cleanly (exit 0: the supervisor counts it finished) while the trainer still needed
    # batches: the trainer waited for ever, and a SIGTERM then ended the run with exit 0.
    run_dir = tmp_path / "run"
    proc = launch(assets, run_dir, steps=40, ckpt_every=10, extra=WATCHDOG)
    with run_guard(proc, run_dir):
        wait_for_step(proc, run_dir, 2)
        os.kill(pid_of(run_dir, "buffer"), signal.SIGTERM)
        out = finish_run(proc, run_dir, timeout=240)
    assert proc.returncode == 1, out[-3000:]
    assert "NO PROGRESS: no trained step for" in out, out[-3000:]
    assert "buffer has stopped (signal SIGTERM), but others still wait on it" in out, out[-3000:]
    assert "waits on buffer for the answer to rl.batch_request" in out, out[-3000:]
    assert (run_dir / "stall.txt").read_text().startswith("NO PROGRESS")
    counts = account(run_dir)   # what the buffer had handed out is trained, pending or dropped: nothing lost
    assert counts["lost"] == 0 and counts["twice"] == 0, counts


def test_a_signal_before_the_last_step_exits_non_zero(assets: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch(assets, run_dir, steps=40, ckpt_every=10)
    with run_guard(proc, run_dir):
        wait_for_step(proc, run_dir, 1)
        proc.send_signal(signal.SIGTERM)
        out = finish_run(proc, run_dir, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM before the run's last step" in out, out[-3000:]


def test_a_frozen_parameter_server_does_not_stop_training(assets: dict[str, Path], tmp_path: Path) -> None:
    # SIGSTOP of the parameter server held every step in its publish for as long as the server was frozen, then
    # (a bounded wait for the publish) for 30 s of it. Now the trainer stops waiting once the server is silent
    # on the bus (its heartbeats), and goes on without a push while the rollouts' weights stay within eta (1
    # here) of its own.
    run_dir = tmp_path / "run"
    proc = launch(assets, run_dir, steps=12, ckpt_every=6)

    def went_on() -> list[dict]:
        return log_events(run_dir, "trainer", {"step_goes_on_without_its_publish"})

    with run_guard(proc, run_dir):
        wait_for_step(proc, run_dir, 3)
        with frozen(pid_of(run_dir, "param_server")):
            at = max(r["step"] for r in step_records(run_dir))
            wait_for_step(proc, run_dir, at + 1, timeout=120)   # a step while the server is frozen
            # the step whose publish met the frozen server went on without it (whichever step that was: a
            # freeze in the middle of a publish makes the next step's)
            run_bounded(until(lambda: bool(went_on()), 120, "a step going on without its publish", poll_s=0.2), 130)
            frozen_steps = max(r["step"] for r in step_records(run_dir)) - at
        out = finish_run(proc, run_dir, timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert frozen_steps >= 1
    assert {e.get("why") for e in went_on()} == {"the parameter server is silent (heartbeats)"}, went_on()
    assert sorted({r["step"] for r in step_records(run_dir)}) == list(range(1, 13))
    counts = account(run_dir)
    assert counts["lost"] == 0 and counts["twice"] == 0, counts
    assert max(r["staleness_max"] for r in step_records(run_dir)) <= 1
    pushes = [json.loads(line) for line in (run_dir / "logs" / "param_server.jsonl").read_text().splitlines()
              if '"weights_pushed"' in line]
    assert pushes and max(p["version"] for p in pushes) == 12, "the rollouts got the newest weights after the freeze"
