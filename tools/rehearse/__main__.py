"""``python -m tools.rehearse TOPOLOGY --scale S [KEY=VALUE ...]``: the topology's control plane for real at a
fraction S of its fan-out, on fake nodes of this machine, against the simulation of the same run.

    python -m tools.rehearse topology/64node.yaml --scale 1/16                  # 3 rollout nodes + 1 trainer node
    python -m tools.rehearse topology/64node.yaml --scale 1/16 --fault kill-node
    python -m tools.rehearse topology/64node.yaml --scale 1/16 --fault straggler --json

Exit status: 0 the run ended, agreed within 15 % and (with a fault) lost nothing and trained nothing twice;
1 it did not; 2 bad arguments or topology.
"""
from __future__ import annotations

import sys

from tools.rehearse.rehearsal import main

if __name__ == "__main__":
    sys.exit(main())
