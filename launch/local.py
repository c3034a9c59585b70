"""A run on this machine: every actor under one Supervisor (`run_local`), and the loop that starts them,
shows their progress and stops them (`supervise`), which each node agent of a multi-node run runs too."""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from launch.evaluation import catch_up_evaluations, evaluates_during_run, final_evaluation
from launch.options import EXIT_FAILED, EXIT_INVALID, EXIT_OK, LaunchRequest
from launch.progress import ProgressView, TrainingProgress, child_rows, launcher_logger, summary
from launch.readiness import supervisor_options
from launch.report import busy_ports, evaluation_notes, insecure_bus_warning
from launch.rundir import build_specs, checked_run_dir, recorded_ipc_dir, write_plan
from launch.watchdog import ProgressWatchdog
from actors.runtime.base import ActorSpec
from actors.runtime.recovery import run_finished
from actors.runtime.supervisor import NotReadyError, Supervisor, SupervisorError
from topology import Plan, TopologyError
from transport.files import atomic_write


def trains_steps(plan: Plan) -> bool:
    """Whether the plan has a trainer, whose run.total_steps end the run (demo topologies have none)."""
    return any(group.actor_package == "actors.trainer" for group in plan.topology.groups.values())


def use_trainer_threads(plan: Plan) -> int | None:
    """Give this process's own torch work (the warm start, the evaluations after the run) the trainer's thread
    count (its OMP_NUM_THREADS); the count set, or None without a trainer. The tiny models' operations are too
    short to split: with a thread per core each one waits for the slowest thread, so on a machine with any
    other work a step slows down tenfold or more, where one thread runs at full speed."""
    threads = next((i.env.get("OMP_NUM_THREADS") for i in plan.instances
                    if plan.topology.groups[i.group].actor_package == "actors.trainer"), None)
    if not threads:
        return None
    import torch

    torch.set_num_threads(int(threads))
    return int(threads)


def progress_watchdog(plan: Plan, run_dir: Path) -> ProgressWatchdog:
    """The run's progress watchdog (launch/watchdog.py), set by the experiment's run.watchdog."""
    return ProgressWatchdog(run_dir, plan.topology.config.run.watchdog)


async def supervise(specs: list[dict[str, Any]], run_dir: Path, options: dict[str, Any], *, title: str,
                    progress: bool, duration: float | None, node_of: dict[str, str],
                    status_file: Path | None = None, stop_file: Path | None = None,
                    training: TrainingProgress | None = None, watchdog: ProgressWatchdog | None = None,
                    finished: Callable[[], bool] | None = None, log_name: str = "launcher",
                    given_up_fails: bool = True) -> int:
    """Start actors under the Supervisor, show progress, stop on Ctrl-C/SIGTERM, on ``duration``, when
    ``stop_file`` appears (a multi-node launcher's stop request), when ``watchdog`` (launch/watchdog.py)
    finds the run stalled, or when every actor has finished by itself; print a summary. Returns the exit
    status: a stall fails the run, and a signal before ``finished()`` (the run's last step) exits 128 + its
    number. The supervisor's events go to RUN_DIR/logs/<log_name>.jsonl; with ``given_up_fails``, a run that
    ended with a member given up exits 1 (a node agent leaves that to its launcher, which sees every node's
    rows)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_reason: list[str] = []
    signalled: list[int] = []

    def on_signal(name: str) -> None:
        stop_reason.append(f"stopped by {name}")
        signalled.append(int(signal.Signals[name]))
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    sup = Supervisor([ActorSpec.from_dict(s) for s in specs], run_dir, run_over=lambda: run_finished(run_dir),
                     log=launcher_logger(run_dir, log_name), **options)
    view = ProgressView(title, progress)
    t0 = time.monotonic()
    outcome, code = "finished", EXIT_OK

    def publish(state: str) -> dict[str, dict[str, Any]]:
        rows = child_rows(sup, node_of)
        view.update(rows, time.monotonic() - t0, training.poll() if training is not None else None)
        if status_file is not None:
            atomic_write(status_file, json.dumps({"state": state, "actors": rows, "time": time.time()}, default=str),
                         durable=False)   # a live view, rewritten on every change
        return rows

    try:
        starting = asyncio.ensure_future(sup.start())
        while not starting.done():
            publish("starting")
            await asyncio.wait({starting, asyncio.ensure_future(stop.wait())}, timeout=0.25,
                               return_when=asyncio.FIRST_COMPLETED)
            if stop_file is not None and stop_file.exists():
                stop_reason.append(stop_file.read_text().strip() or "stop requested")
                stop.set()
            if stop.is_set() and not starting.done():
                starting.cancel()
                await sup.stop()
                raise asyncio.CancelledError
        starting.result()
        publish("running")
        running = asyncio.ensure_future(sup.run())
        deadline = None if duration is None else t0 + duration
        if watchdog is not None:
            watchdog.local_pids = sup.pids
            watchdog.start()
        while True:
            rows = publish("running")
            if running.done():
                running.result()  # raises SupervisorError when an actor could not be kept up
                break
            if watchdog is not None and (diagnosis := watchdog.check()) is not None:
                print(diagnosis, flush=True)
                outcome, code = f"failed: {diagnosis.splitlines()[0]} (diagnosis above and in {run_dir}/stall.txt)", \
                    EXIT_FAILED
                break
            if all(r["state"] in ("finished", "failed") for r in rows.values()):
                break
            if stop_file is not None and stop_file.exists() and not stop.is_set():
                stop_reason.append(stop_file.read_text().strip() or "stop requested")
                stop.set()
            if stop.is_set():
                outcome = stop_reason[0] if stop_reason else "stopped"
                break
            if deadline is not None and time.monotonic() >= deadline:
                outcome = f"stopped after --duration {duration:g} s"
                break
            await asyncio.wait({running, asyncio.ensure_future(stop.wait())}, timeout=0.25,
                               return_when=asyncio.FIRST_COMPLETED)
        await sup.stop()
    except asyncio.CancelledError:
        outcome = stop_reason[0] if stop_reason else "cancelled"
    except NotReadyError as exc:
        outcome, code = f"failed: actors not ready: {exc}", EXIT_FAILED
    except SupervisorError as exc:
        outcome, code = f"failed: {exc}", EXIT_FAILED
        await sup.stop()
    finally:
        rows = publish("failed" if code else "stopped")
        view.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if code == EXIT_OK and signalled and finished is not None and not finished():
        code = 128 + signalled[0]   # stopped before its last step: not a clean end
        outcome += f" before the run's last step (exit {code})"
    if given_up_fails and (given_up := [n for n, c in sup.children.items() if c.given_up]):
        code = code or EXIT_FAILED   # the run went on without them: not a clean end (a stop keeps its code)
        outcome += f"; {', '.join(given_up)} given up (left down after the restart limit; exit {code})"
    print(summary(title, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
    return code


def run_local(plan: Plan, request: LaunchRequest) -> int:
    """Every actor on this machine under one Supervisor."""
    if problems := busy_ports(plan):
        print(f"{plan.topology.source}: {len(problems)} problem(s)\n  " + "\n  ".join(problems), file=sys.stderr)
        return EXIT_INVALID
    from launch.prepare.stage import PrepareError, prepared   # it loads torch (model directories): only when launching

    use_trainer_threads(plan)
    try:
        # the run's plan is the one built from the prepared document (model.path at the warm start it made)
        plan = prepared(plan)
    except (PrepareError, TopologyError) as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    config = plan.topology.config
    if (run_dir := checked_run_dir(plan, request.run_dir)) is None:
        return EXIT_INVALID
    specs = build_specs(plan, run_dir, record=request.record)
    write_plan(plan, run_dir, specs, request.overrides)
    print(f"run {plan.topology.name}: {len(specs)} actor(s), run directory {run_dir}", flush=True)
    if warning := insecure_bus_warning(plan):
        print(warning, flush=True)
    print("\n".join(evaluation_notes(plan)), flush=True)
    node_of = {i.name: i.host for i in plan.instances}
    total = config.run.total_steps
    trains = trains_steps(plan)
    code = asyncio.run(supervise(specs, run_dir, supervisor_options(plan, request), title=plan.topology.name,
                                 progress=request.progress, duration=request.duration, node_of=node_of,
                                 training=TrainingProgress(run_dir, total, (config.algo.reward_wrong,
                                                                           config.algo.reward_correct)),
                                 watchdog=progress_watchdog(plan, run_dir) if trains else None,
                                 finished=(lambda: run_finished(run_dir)) if trains else None))
    if (ipc_dir := recorded_ipc_dir(run_dir)) is not None:
        shutil.rmtree(ipc_dir, ignore_errors=True)
    if code == EXIT_OK and config.eval.every_versions > 0 and evaluates_during_run(plan):
        catch_up_evaluations(config, run_dir)
    if code == EXIT_OK and config.run.final_eval:
        final_evaluation(config, run_dir)
    return code
