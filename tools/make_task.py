"""`python -m tools.make_task [--task math|code|agent] [--out DIR] ...`: the embedded tasks' train.jsonl and
test.jsonl (launch/prepare/task.py, which a prepare recipe's data step runs with the same flags)."""
from __future__ import annotations

import sys

from launch.prepare.task import make_task


def main(argv: list[str] | None = None) -> int:
    return make_task(argv)


if __name__ == "__main__":
    sys.exit(main())
