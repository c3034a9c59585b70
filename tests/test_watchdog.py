"""The launcher's progress watchdog (launch/watchdog.py): a run that stops making progress is named stalled after
a limit derived from its step time, with a diagnosis of who waits on whom and the last message of each kind.
The unit tests drive it with status files and a clock of their own; the runs in tests/test_stalls.py drive it
with real actors."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from actors.buffer.actor import BufferActor
from actors.buffer.state import BufferState
from launch.watchdog import ProgressWatchdog
from topology.experiment import WatchdogSection
from transport.protocol import Answers, Sample


WALL = 1.8e9   # the time of day the status files are stamped with, and the watchdog's: ages are exact


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watchdog(run_dir: Path, clock: Clock, **settings: float) -> ProgressWatchdog:
    return ProgressWatchdog(run_dir, WatchdogSection(**settings), clock=clock, wall=lambda: WALL)


def write_status(run_dir: Path, name: str, progress: dict[str, Any], *, state: str = "running", age: float = 0.0,
                 asking: list | None = None, serving: list | None = None, last_out: dict | None = None,
                 **extra: Any) -> None:
    (run_dir / "status").mkdir(parents=True, exist_ok=True)
    status = {"actor": name, "pid": 4242, "time": WALL - age, "state": state, "progress": progress,
              "asking": asking or [], "serving": serving or [], "last_in": {}, "last_out": last_out or {}, **extra}
    (run_dir / "status" / f"{name}.json").write_text(json.dumps(status))


def trainer(run_dir: Path, version: int, longest: float = 2.0, total: int = 16, **kw: Any) -> None:
    write_status(run_dir, "trainer", {"version": version, "total_steps": total, "step_seconds_max": longest,
                                      "phase": f"waiting for the batch of step {version + 1} from the buffer",
                                      "phase_for_s": 1.0}, **kw)


def test_a_run_that_trains_is_never_stalled_and_one_that_stops_is_after_the_derived_limit(tmp_path: Path) -> None:
    clock = Clock()
    dog = watchdog(tmp_path, clock, after_steps=5, min_s=20)
    dog.start()
    for version in range(1, 20):   # a step every 3 s
        trainer(tmp_path, version, longest=4.0, total=40)
        clock.now += 3
        assert dog.check() is None
    assert dog.limit() == 20.0                        # 5 x 4 s is below min_s
    trainer(tmp_path, 19, longest=8.0, total=40)
    assert dog.limit() == 20.0 and dog.check() is None and dog.limit() == 40.0   # 5 x the longest step
    clock.now += 39
    assert dog.check() is None
    clock.now += 5
    report = dog.check()
    assert report is not None and report.startswith("NO PROGRESS: no trained step for 44 s (limit 40 s: 5 x the "
                                                    "longest step so far, 8.0 s")
    assert (tmp_path / "stall.txt").read_text().startswith("NO PROGRESS")


def test_before_the_first_step_kept_groups_are_progress_but_not_after(tmp_path: Path) -> None:
    clock = Clock()
    dog = watchdog(tmp_path, clock, after_steps=5, min_s=20, first_step_s=100)
    dog.start()
    trainer(tmp_path, 0)
    for kept in range(1, 6):   # a first long generation: a group now and then, no step yet
        write_status(tmp_path, "buffer", {"groups_kept": kept})
        clock.now += 90
        assert dog.check() is None
    clock.now += 101
    assert "no trained step and no newly accepted group for 101 s" in dog.check()
    # after the first step, groups alone do not hold a stall off: groups that are accepted then dropped as stale
    # (a version out of reach) must not look like progress
    dog = watchdog(tmp_path, clock, after_steps=5, min_s=20)
    dog.start()
    trainer(tmp_path, 1)
    dog.check()
    trainer(tmp_path, 2)
    dog.check()
    for kept in range(6, 20):
        write_status(tmp_path, "buffer", {"groups_kept": kept})
        clock.now += 2
        stalled = dog.check()
    assert stalled is not None and "no trained step for 28 s" in stalled


def test_the_diagnosis_names_who_waits_on_whom_a_stopped_buffer_and_the_last_message_of_each_kind(
        tmp_path: Path) -> None:
    clock = Clock()
    dog = watchdog(tmp_path, clock, after_steps=5, min_s=10, first_step_s=10)
    dog.start()
    trainer(tmp_path, 3)
    dog.check()
    trainer(tmp_path, 4, asking=[{"peer": "buffer", "kind": "rl.batch_request", "for_s": 31.0}],
            last_out={"rl.batch_request": {"peer": "buffer", "time": WALL - 31},
                      "rl.version_update": {"peer": "buffer", "time": WALL - 32}})
    dog.check()
    write_status(tmp_path, "buffer", {"version": 4, "groups_kept": 20}, state="stopped", age=30, exit_code=0,
                 reason="signal SIGTERM", last_out={"rl.generate_group": {"peer": "rollout.0", "time": WALL - 40}})
    write_status(tmp_path, "rollout.0", {"weights_version": 4, "groups": 0})
    clock.now += 31
    report = dog.check()
    assert report is not None, "31 s without a step is past the limit of 10 s"
    assert "trainer: pid 4242; running; waiting for the batch of step 5 from the buffer" in report, report
    assert "waits on buffer for the answer to rl.batch_request (31 s, since " in report, report
    assert "buffer: pid 4242; STOPPED 30 s ago (exit 0: signal SIGTERM)" in report, report
    assert "buffer has stopped (signal SIGTERM), but others still wait on it" in report, report
    kinds = [line.split()[0] for line in report.split("last message of each kind (newest first):")[1].splitlines()
             if line.strip()]
    assert kinds == ["rl.batch_request", "rl.version_update", "rl.generate_group"], report
    assert "trainer -> buffer" in report and "buffer -> rollout.0" in report


def test_a_version_out_of_the_rollouts_reach_is_named_from_the_buffers_own_status(tmp_path: Path) -> None:
    # The buffer's real status (BufferActor.progress over a BufferState) after a version jump: the groups the
    # rollouts make with version 3 are dropped as stale against version 1,000,000.
    state = BufferState(n_records=10, rollouts=["rollout.0"], rewards=["reward.0"], batch_size=2, eta=1, seed=7)
    state.worker_hello("rollout.0")
    state.worker_hello("reward.0")
    issue = state.issue_next(lambda _: True, 0.0)
    sample = Sample(output_ids=[1], logprobs=[0.0], versions=[3], finish_reason="stop", reward=5.0)
    state.scored(issue.group_id, Answers(samples=[sample, sample], rollout="rollout.0"))
    state.set_version(1_000_000)
    state.drop_stale()
    buffer = SimpleNamespace(state=state, _batch_waited_for=5, finished=False)
    write_status(tmp_path, "buffer", BufferActor.progress(buffer))   # type: ignore[arg-type]
    clock = Clock()
    dog = watchdog(tmp_path, clock, after_steps=5, min_s=10, first_step_s=10)
    dog.start()
    trainer(tmp_path, 4)
    dog.check()
    clock.now += 11
    report = dog.check()
    assert "the buffer's version (1000000) is ahead of the trainer's (4)" in report, report
    assert "the buffer's version 1000000 is more than eta=1 versions ahead of every rollout's weights (newest 3)" \
        in report, report


def test_a_silent_actor_is_named(tmp_path: Path) -> None:
    clock = Clock()
    dog = watchdog(tmp_path, clock, after_steps=5, min_s=10, first_step_s=10)
    dog.start()
    trainer(tmp_path, 2)
    write_status(tmp_path, "param_server", {"version": 2}, age=45)
    dog.check()
    clock.now += 11
    report = dog.check()
    assert "param_server: pid 4242; running; SILENT: its status has not changed for 45 s" in report, report
    assert "param_server has not written its status for 45 s" in report, report


def test_off_and_finished_runs_are_never_stalled(tmp_path: Path) -> None:
    clock = Clock()
    off = watchdog(tmp_path, clock, after_steps=0)
    on = watchdog(tmp_path, clock, after_steps=5, min_s=10, first_step_s=10)
    off.start()
    on.start()
    clock.now += 100
    assert off.check() is None and on.check() is not None
    trainer(tmp_path, 16)              # its last step trained: the run is finishing, not stalled
    assert on.check() is None
    trainer(tmp_path, 15)
    assert on.check() is not None
    (tmp_path / "FINISHED").write_text("{}")
    assert on.check() is None
