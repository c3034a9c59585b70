"""``python -m tools.rehearse.server --rehearsal RUN_DIR/rehearsal.json [SGLang server arguments]``: the stand-in
SGLang server (testsupport/sglang_standin.py: SGLang's routes and semantics) serving the cost-model engine
(tools/rehearse/engine.py) in place of the embedded one. The rehearsal names it as the rollouts' server command
(``sglang.command``), so each rollout launches, watches and restarts it as it would a real server.

The server is the rollout's by its ``--random-seed`` (the SGLang client passes ``seed * 1000 + instance
index``): a straggler or a server that never comes up is chosen by that index in the cost file.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from testsupport import sglang_standin
from tools.rehearse.costs import RehearsalCosts
from tools.rehearse.engine import CostModelEngine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.rehearse.server", add_help=False)
    ap.add_argument("--rehearsal", required=True, help="the rehearsal's cost file (RUN_DIR/rehearsal.json)")
    ours, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    path = Path(ours.rehearsal)
    costs = RehearsalCosts.load(path)
    seed = _seed(rest)
    index = seed % 1000
    stats_dir = path.parent / "servers"
    stats_dir.mkdir(exist_ok=True)
    if index in costs.never_up:
        # The stand-in's own 'starting' state (/health 503, as SGLang's while it loads): the file it waits
        # for is never made.
        rest += ["--standin-starting-until-dir", tempfile.mkdtemp(prefix="never-up-")]
    # The modelled server's own waits run on its clock: SGLang checks once a second whether a pause has
    # drained (the stand-in's PAUSE_POLL_S), one modelled second here.
    sglang_standin.PAUSE_POLL_S = sglang_standin.PAUSE_POLL_S / costs.time_scale
    rest += ["--max-total-tokens", str(int(costs.sim.kv_tokens_per_server) // costs.token_scale)]

    def make_engine(args: argparse.Namespace) -> CostModelEngine:
        import os
        return CostModelEngine(costs, index, stats_path=stats_dir / f"{index}-{os.getpid()}.jsonl")

    return sglang_standin.main(rest, make_engine=make_engine)


def _seed(args: list[str]) -> int:
    for i, a in enumerate(args):
        if a == "--random-seed" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--random-seed="):
            return int(a.split("=", 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
