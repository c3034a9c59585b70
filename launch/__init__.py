"""Launching a run: what `python -m tools.up` and each SLURM node's `python -m tools.node_agent` call.

* launcher.py: `dry_run` (the report) and `launch` (on this machine, inside a SLURM allocation, or --sbatch)
* options.py: what a launch is asked (`LaunchRequest`) and its exit codes
* report.py: the dry run's report, also written to RUN_DIR/plan.txt; ports taken on this machine
* readiness.py: each group's ready budget and how many instances the run needs; the Supervisor's options
* rundir.py: the run directory, the inputs checked, the ActorSpecs and the plan written before any start
* inputs.py: the starting model and data files read as the actors will read them
* local.py: every actor on this machine under one Supervisor, and the loop each node agent runs too
* nodes.py: a run across a SLURM allocation's nodes (srun, node plans, the node agent) and --sbatch
* slurm.py: what an allocation holds (hosts, cores and GPUs per node) and the flags that claim a node
* progress.py: the live view, the training progress line and the summary at the end
* watchdog.py: the progress watchdog that stops a run that stopped making progress, with a diagnosis
* evaluation.py: after the run, the evaluations the evaluator missed and the final held-out comparison
  (actors/evaluator/harness.py evaluates each model directory)
* prepare/: before the run, what its experiment's prepare section makes: the task's data (task.py, with
  agent_task.py and code_task.py) and the supervised warm start (sft.py, lm.py); stage.py runs them
* plan/: the planner's memory estimate per GPU, which the dry run checks (tools.plan prints it too)

Nothing here imports tools/: the command lines (tools/up.py, tools/node_agent.py, tools/prepare.py,
tools/sft.py, tools/make_task.py, tools/plan/) parse and call this package.
"""
