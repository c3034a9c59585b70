"""The two things `python -m tools.up` does with a plan: report it (`dry_run`) or launch it (`launch`): on
this machine, inside a SLURM allocation across its nodes, or by submitting one (--sbatch)."""
from __future__ import annotations

import os
import sys
from typing import Sequence

from launch.local import run_local
from launch.nodes import run_slurm, submit_sbatch
from launch.options import EXIT_INVALID, EXIT_OK, LaunchRequest
from launch.progress import see_the_run
from launch.readiness import settings_problems
from launch.report import busy_ports, describe
from topology import Plan


def dry_run(plan: Plan, overrides: Sequence[str], full: bool = False) -> int:
    """Print the report and a sample of the inputs; EXIT_INVALID (problems on stderr) when an actor class
    would refuse an instance's settings, a port is taken, a GPU group does not fit, the prepare section or an
    input would be refused."""
    from launch.inputs import check_inputs   # it loads torch (model directories): only when checking

    print(describe(plan, overrides, full))
    inputs, input_problems = check_inputs(plan, launch=False)
    print("\ninputs (a sample of each data file; launch/inputs.py)"
          + "".join(f"\n  {line}" for line in inputs))
    print("\n" + "\n".join(see_the_run("RUN_DIR")))
    from launch.plan.sizing import memory_problems   # the actor classes it reads load torch: only when checking
    from launch.prepare.stage import prepare_problems

    problems = (settings_problems(plan) + busy_ports(plan) + memory_problems(plan)
                + prepare_problems(plan) + input_problems)
    if problems:
        print(f"{plan.topology.source}: {len(problems)} problem(s)\n  " + "\n  ".join(problems), file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def launch(plan: Plan, request: LaunchRequest) -> int:
    """Start the run and wait for its end; the exit status of tools/up.py."""
    if request.sbatch:
        return submit_sbatch(plan, request)
    several = len(plan.topology.nodes) > 1 or plan.topology.nodes_from_allocation
    if os.environ.get("SLURM_JOB_ID") and several:
        return run_slurm(plan, request)
    if several:
        print(f"{plan.topology.source}: {len(plan.topology.nodes)} nodes need a SLURM allocation: run inside "
              f"`salloc -N{len(plan.topology.nodes)}` or add --sbatch", file=sys.stderr)
        return EXIT_INVALID
    return run_local(plan, request)
