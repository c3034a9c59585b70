"""The planner's estimates a dry run checks a plan against, and `python -m tools.plan` prints and simulates on.

* sizing.py: the trainer and rollout groups a plan places, with their first instance's settings, and their
  memory per GPU (`memory_problems`, refused by the dry run; `memory_report`, its lines in the report)
* memory.py: bytes per GPU of every term of a trainer or rollout group
* shapes.py: a model's shape from its Hugging Face config.json, or a built-in table of Qwen2.5 shapes
* hardware.py, decode_fit.py: datasheet and published figures, each with its source
* report.py: the memory table
"""
