"""A run across the nodes of a SLURM allocation. The launcher (`run_slurm`) writes one plan per node,
``RUN_DIR/nodes/<host>.json`` (`write_node_plans`), starts one node agent per node through ``srun``
(``python -m tools.node_agent RUN_DIR``, which calls `run_node`), and follows the status each agent publishes
in ``RUN_DIR/nodes/<host>.status.json``; it stops the run by writing ``RUN_DIR/nodes/STOP``. `submit_sbatch`
submits a batch job that reruns the launcher inside an allocation of its own."""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import topology as topo_mod
from launch.local import progress_watchdog, supervise, trains_steps
from launch.options import EXIT_FAILED, EXIT_INVALID, EXIT_OK, LaunchRequest
from launch.progress import ProgressView, summary
from launch.readiness import node_supervisor_options, quorum_problem, ready_rules, supervisor_options
from launch.report import evaluation_notes, insecure_bus_warning
from launch.rundir import build_specs, checked_run_dir, write_plan
from launch.slurm import allocation_hosts, allocation_shortfall, read_allocation, slurm_resources
from actors.runtime.recovery import run_finished
from actors.runtime.run import keep_files_private
from topology import Plan, TopologyError


def node_plan_path(run_dir: Path, host: str) -> Path:
    return run_dir / "nodes" / f"{host}.json"


def write_node_plans(plan: Plan, run_dir: Path, specs: list[dict[str, Any]], options: dict[str, Any]) -> list[str]:
    """RUN_DIR/nodes/<host>.json for every node, what its node agent runs; returns the hosts in node order."""
    by_name = {s["name"]: s for s in specs}
    (run_dir / "nodes").mkdir(exist_ok=True)
    for node_idx, insts in plan.by_node().items():
        host = plan.topology.nodes[node_idx].name
        node_plan_path(run_dir, host).write_text(json.dumps({
            "host": host, "title": f"{plan.topology.name}@{host}",
            "supervisor": node_supervisor_options(options, [i.name for i in insts]),
            "specs": [by_name[i.name] for i in insts]}, indent=1))
    return [n.name for n in plan.topology.nodes]


def submit_sbatch(plan: Plan, request: LaunchRequest) -> int:
    """Submit a batch job that reruns this launcher inside its own allocation."""
    if (run_dir := checked_run_dir(plan, request.run_dir, inputs=False)) is None:
        return EXIT_INVALID
    n = len(plan.topology.nodes)
    argv = [sys.executable, "-m", "tools.up", str(Path(plan.topology.source).resolve()), *request.overrides,
            "--run-dir", str(run_dir), "--no-progress"]
    if request.ready_timeout is not None:
        argv += ["--ready-timeout", str(request.ready_timeout)]
    if request.duration is not None:
        argv += ["--duration", str(request.duration)]
    if request.record:
        argv.append("--record")
    script = run_dir / "sbatch.sh"
    script.write_text("\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={plan.topology.name}",
        f"#SBATCH --nodes={n}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",                      # the nodes are the run's alone
        *(f"#SBATCH {flag}" for flag in slurm_resources(plan)),
        f"#SBATCH --output={run_dir}/sbatch.out",
        f"cd {shlex.quote(str(topo_mod.REPO_ROOT))}",
        "exec " + " ".join(shlex.quote(a) for a in argv), ""]))
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        print(f"sbatch failed: {out.stderr.strip()}", file=sys.stderr)
        return EXIT_FAILED
    job = out.stdout.strip().split(";")[0]
    (run_dir / "slurm_job_id").write_text(job + "\n")
    print(f"submitted SLURM job {job} ({n} node(s)); output {run_dir}/sbatch.out", flush=True)
    if warning := insecure_bus_warning(plan):
        print(warning, flush=True)
    return EXIT_OK


def run_slurm(plan: Plan, request: LaunchRequest) -> int:
    """Inside an allocation: one node agent per node through srun; each runs its node's actors under the
    Supervisor. The run directory must be on a file system every node sees (it holds the plans, and the
    actors' status files the progress watchdog reads here)."""
    try:
        hosts = allocation_hosts()
        plan = plan.with_hosts(hosts)
    except TopologyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    allocation = read_allocation(dict(os.environ), hosts)
    if short := allocation_shortfall(plan, allocation):
        print(f"{plan.topology.source}: {short}", file=sys.stderr)
        return EXIT_INVALID
    node = plan.topology.nodes[0]
    if node.gpus and allocation.gpus is None:
        print(f"{plan.topology.source}: the allocation's GPUs could not be read ({allocation.source}); the "
              f"topology's nodes have {node.gpus} each", file=sys.stderr, flush=True)
    if (run_dir := checked_run_dir(plan, request.run_dir)) is None:
        return EXIT_INVALID
    specs = build_specs(plan, run_dir, record=request.record)
    write_plan(plan, run_dir, specs, request.overrides)
    options = supervisor_options(plan, request)
    hosts = write_node_plans(plan, run_dir, specs, options)
    rules = ready_rules(plan, options["ready_timeout"])
    cmd = ["srun", f"-N{len(hosts)}", f"-n{len(hosts)}", "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}",
           *slurm_resources(plan), "--kill-on-bad-exit=1", f"--chdir={topo_mod.REPO_ROOT}", "--overlap",
           sys.executable, "-m", "tools.node_agent", str(run_dir)]
    print(f"run {plan.topology.name}: {len(specs)} actor(s) on {len(hosts)} node(s), run directory {run_dir}\n"
          f"  {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    if warning := insecure_bus_warning(plan):
        print(warning, flush=True)
    print("\n".join(evaluation_notes(plan)), flush=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(topo_mod.REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.monotonic()
    with open(run_dir / "srun.out", "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    view = ProgressView(plan.topology.name, request.progress)
    node_of = {i.name: i.host for i in plan.instances}
    outcome = "finished"
    stopping = []

    stop_file = run_dir / "nodes" / "STOP"
    forced_at: list[float] = []

    def request_stop(reason: str) -> None:
        # srun answers SIGTERM by killing the step outright, so the clean way is a stop request on the
        # shared run directory that every node agent watches; srun is signalled only if that stalls.
        stopping.append(reason)
        stop_file.write_text(f"stopped by {reason}\n")
        forced_at.append(time.monotonic() + supervisor_options(plan, request)["stop_timeout"] + 15)

    signalled: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if stopping:  # a second Ctrl-C: do not wait for the clean stop
            proc.send_signal(signal.SIGTERM)
        else:
            signalled.append(signum)
            request_stop(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    deadline = None if request.duration is None else t0 + request.duration
    reached: set[str] = set()
    short: list[str] = []
    trains = trains_steps(plan)
    watchdog = progress_watchdog(plan, run_dir) if trains else None
    stalled: list[str] = []
    try:
        while proc.poll() is None:
            rows = _slurm_rows(run_dir, hosts, node_of)
            view.update(rows, time.monotonic() - t0)
            if not stopping and (problem := quorum_problem(rows, rules, time.monotonic() - t0, reached)):
                short.append(problem)
                print(f"{plan.topology.name}: {problem}; stopping the run", file=sys.stderr, flush=True)
                request_stop(problem)
            if watchdog is not None and not stopping:   # its clock starts once every node runs its actors
                if not watchdog.started and all(_node_status(run_dir, h).get("state") == "running"
                                                      for h in hosts):
                    watchdog.start()
                if (diagnosis := watchdog.check()) is not None:
                    print(diagnosis, flush=True)
                    stalled.append(diagnosis.splitlines()[0])
                    request_stop("the progress watchdog")
            if deadline is not None and time.monotonic() >= deadline and not stopping:
                request_stop(f"--duration {request.duration:g} s")
            if forced_at and time.monotonic() > forced_at[0] and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                forced_at[0] = float("inf")
            try:
                proc.wait(timeout=0.25)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        rows = _slurm_rows(run_dir, hosts, node_of)
        view.close()
    code = proc.returncode
    failed = [h for h in hosts if _node_status(run_dir, h).get("state") == "failed"]
    if stopping:
        outcome = f"stopped by {stopping[0]}"
    if short:
        print(summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, f"failed: {short[0]}"), flush=True)
        return EXIT_FAILED
    if stalled:
        outcome = f"failed: {stalled[0]} (diagnosis above and in {run_dir}/stall.txt)"
        print(summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
        return EXIT_FAILED
    if failed or (code != 0 and not stopping):
        reasons = "; ".join(_node_status(run_dir, h).get("reason", "") for h in failed)
        outcome = f"failed (srun exit {code}{', nodes ' + ', '.join(failed) if failed else ''})" + \
                  (f": {reasons}" if reasons.strip("; ") else f"; see {run_dir}/srun.out")
        print(summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
        return EXIT_FAILED
    if given_up := [name for name, row in rows.items() if row.get("state") == "failed"]:
        outcome += f"; {', '.join(given_up)} given up (left down after the restart limit; exit {EXIT_FAILED})"
        print(summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
        return EXIT_FAILED
    if signalled and trains and not run_finished(run_dir):
        outcome += f" before the run's last step (exit {128 + signalled[0]})"
        print(summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
        return 128 + signalled[0]
    print(summary(plan.topology.name, rows, time.monotonic() - t0, run_dir, outcome), flush=True)
    return EXIT_OK


def _node_status(run_dir: Path, host: str) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "nodes" / f"{host}.status.json").read_text())
    except (OSError, ValueError):
        return {}


def _slurm_rows(run_dir: Path, hosts: list[str], node_of: dict[str, str]) -> dict[str, dict[str, Any]]:
    rows = {name: {"node": host, "state": "pending", "restarts": 0} for name, host in node_of.items()}
    for host in hosts:
        rows.update(_node_status(run_dir, host).get("actors", {}))
    return rows


def node_name() -> str:
    """This node's SLURM name (fake nodes on one machine share a host name, so ``SLURMD_NODENAME`` comes first)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def run_node(run_dir: Path) -> int:
    """A node agent: this node's actors, from the plan the launcher wrote for it, under the Supervisor until
    they finish, the launcher asks for a stop (``RUN_DIR/nodes/STOP``; srun itself would kill the step rather
    than pass SIGTERM on) or SIGTERM comes (0); 1 when an actor cannot be kept up, which makes
    ``srun --kill-on-bad-exit`` stop the other nodes; 2 when its plan cannot be read."""
    keep_files_private()
    host = node_name()
    path = node_plan_path(run_dir, host)
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"node_agent on {host}: cannot read its plan {path}: {exc}", file=sys.stderr)
        return 2
    status = run_dir / "nodes" / f"{host}.status.json"
    if not plan["specs"]:
        status.write_text(json.dumps({"state": "stopped", "actors": {}}))
        return 0
    code = asyncio.run(supervise(plan["specs"], run_dir, plan["supervisor"], title=plan["title"], progress=False,
                                 duration=None, node_of={s["name"]: host for s in plan["specs"]},
                                 status_file=status, stop_file=run_dir / "nodes" / "STOP",
                                 log_name=f"launcher.{host}", given_up_fails=False))
    if code != 0:
        info = json.loads(status.read_text()) if status.exists() else {}
        info["reason"] = f"{host}: an actor could not be kept up (see {run_dir}/logs)"
        status.write_text(json.dumps(info, default=str))
    return code
