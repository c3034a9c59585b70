"""What a run needs before it starts, made when its experiment's prepare section says how (docs/task.md).

* stage.py: the prepare stage every launch runs first (`prepared`), and its dry-run check (`prepare_problems`)
* task.py: the embedded tasks' train/test files (`make_task`, whose flags a recipe's data step names), with
  agent_task.py (arithmetic with a calculator tool) and code_task.py (programs with hidden unit tests)
* sft.py: supervised fine-tuning to a plateau, the warm start (`SFTConfig`, `run_sft`); lm.py: its examples,
  their packing and the model directory it starts from
"""
