"""Capacity planning (`python -m tools.plan TOPOLOGY`): memory per GPU, and a discrete-event simulation of
the asynchronous run in virtual time, before a cluster is spent.

* launch/plan/: the memory estimate (hardware figures, model shapes, bytes per GPU of every trainer and rollout
  group), which `tools.up --dry-run` checks too.
* `sim`: the cost model and the simulation, driving the project's own staleness gate and packing; `setup`:
  the simulation of a topology's run.
"""
