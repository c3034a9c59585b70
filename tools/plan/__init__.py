"""Capacity planning (`python -m tools.plan TOPOLOGY`): memory per GPU, and a discrete-event simulation of
the asynchronous run in virtual time, before a cluster is spent.

* `hardware`: datasheet figures and the utilisations the cost model assumes, each with its source.
* `shapes`: a model's shape from its Hugging Face config.json, or a built-in table of Qwen2.5 shapes.
* `memory`: bytes per GPU of every trainer and rollout group (`group_memory`), checked by `tools.up --dry-run`.
* `sim`: the cost model and the simulation, driving the project's own staleness gate and packing.
"""
