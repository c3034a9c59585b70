"""`python -m tools.sft --data FILE --out DIR`: supervised fine-tuning, and the warm start of an RL run. The
training, its options (`SFTConfig`, each a flag here) and its files are launch/prepare/sft.py's."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TextIO

from actors.dataset import DatasetError
from actors.engines.checkpoint import CheckpointError
from actors.engines.tokenizer import TokenizerError
from actors.evaluator.evaluation import EvalError
from launch.prepare.lm import LMToolError
from launch.prepare.sft import SFTConfig, SFTError, run_sft
from tools.cli import add_dataclass_arguments, dataclass_from_args


def parse_args(argv: Sequence[str] | None) -> tuple[SFTConfig, bool]:
    """(the configuration, whether --json was given)."""
    ap = argparse.ArgumentParser(prog="python -m tools.sft", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_dataclass_arguments(ap, SFTConfig)
    ap.add_argument("--json", action="store_true", help="progress to stderr, one JSON summary line to stdout")
    args = ap.parse_args(argv)
    if args.steps is not None and args.epochs is not None:
        ap.error("argument --epochs: not allowed with argument --steps")
    return dataclass_from_args(SFTConfig, args), args.json


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    cfg, as_json = parse_args(argv)
    stream = stdout or sys.stdout
    progress = sys.stderr if as_json else stream

    def log(line: str) -> None:
        print(line, file=progress, flush=True)

    try:
        summary = run_sft(cfg, log)
    except (SFTError, DatasetError, CheckpointError, TokenizerError, LMToolError, EvalError) as e:
        print(f"sft: error: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(summary), file=stream, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
