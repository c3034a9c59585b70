"""`python -m tools.eval_agent CHECKPOINT --data FILE [--max-turns 5,1] [--samples N] [--json]`: held-out
accuracy of episodes.

Each record is answered by an episode (actors/rollout/episode.py) in the environment it names (its ``"tool"``;
records without one are single-turn), driven on the embedded engine: greedy accuracy, pass@k and maj@k per
level as `tools.eval` reports them (actors/evaluator/evaluation.py grades the model's own tokens), plus the mean turns
and tool calls per episode and how the episodes ended. ``--max-turns`` takes several budgets, evaluated one
after the other on the same model: ``--max-turns 5,1`` compares the task with its tool against the same model
restricted to one turn, where the tool is never consulted.

    python -m tools.make_task --task agent --out data/agent
    python -m tools.eval_agent runs/warm_start --data data/agent/test.jsonl --max-turns 5,1 --samples 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from actors.dataset import DatasetError
from actors.engines.base import EngineError
from actors.engines.checkpoint import CheckpointError, load_model
from actors.engines.tokenizer import TokenizerError, load_tokenizer
from actors.rollout.episode import EpisodeError
from actors.evaluator.episode_eval import DEFAULT_MAX_TURNS, aevaluate_model_episodes
from actors.evaluator.evaluation import EvalError, EvalSettings
from actors.evaluator.harness import load_eval_records
from tools.eval import render_table
from actors.engines.checkpoint import has_weights
from launch.prepare.lm import LMToolError


def _turns(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected turn budgets separated by commas, e.g. 5,1; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"turn budgets must be >= 1, got {text!r}")
    return values


def _levels(text: str | None) -> list[int] | None:
    if not text:
        return None
    from launch.prepare.task import parse_levels
    try:
        return parse_levels(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


async def aevaluate_agent(model_dir: str, data_path: str, max_turns: Sequence[int] = (DEFAULT_MAX_TURNS,),
                          settings: EvalSettings = EvalSettings(samples=0), levels: Sequence[int] | None = None,
                          max_per_level: int | None = None, device: str = "cpu",
                          details: bool = False) -> dict[str, Any]:
    """One report per turn budget (`actors.evaluator.episode_eval.aevaluate_episodes`), under "reports"."""
    settings.check()
    if not has_weights(model_dir):
        raise EvalError(f"{model_dir}: no model weights (model.safetensors or an index) to evaluate")
    t0 = time.perf_counter()
    records, dataset = load_eval_records(data_path, levels, max_per_level)
    tokenizer = load_tokenizer(model_dir)
    model = await asyncio.to_thread(load_model, model_dir, None, device)
    reports = [await aevaluate_model_episodes(model, tokenizer, records, settings, turns, details=details)
               for turns in max_turns]
    return {"model_dir": str(model_dir), "data": str(data_path), "skipped_lines": dataset.n_skipped,
            "seconds": time.perf_counter() - t0, "reports": reports}


def render(result: dict[str, Any], out: TextIO) -> None:
    for report in result["reports"]:
        report = {**report, "model_dir": result["model_dir"], "data": f"{result['data']}, at most "
                                                                      f"{report['max_turns']} turns"}
        render_table(report, out)
        overall = report["overall"]
        for phase in ("greedy", "sample"):
            if f"{phase}_turns" in overall:
                print(f"{phase} episodes: {overall[f'{phase}_turns']:.2f} turns, {overall[f'{phase}_tool_calls']:.2f} "
                      f"tool calls per episode; ended {overall[f'{phase}_ends']}", file=out)


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.eval_agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="model directory (Hugging Face layout, with tokenizer.json)")
    ap.add_argument("--data", required=True, help="JSON-lines dataset with answers (records may name a tool)")
    ap.add_argument("--max-turns", type=_turns, default=[DEFAULT_MAX_TURNS],
                    help=f"turn budgets, evaluated one after the other, e.g. 5,1 (default {DEFAULT_MAX_TURNS})")
    ap.add_argument("--k", type=int, default=8, help="k of pass@k and maj@k")
    ap.add_argument("--samples", type=int, default=0, help="sampled episodes per prompt (0: greedy only)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per turn")
    ap.add_argument("--levels", type=_levels, help="only these levels, e.g. 1-3")
    ap.add_argument("--max-per-level", type=int, help="the first N prompts of each level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--details", metavar="FILE", help="write per-prompt rows (transcripts included) as JSON lines")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args(argv)
    settings = EvalSettings(k=args.k, samples=args.samples, temperature=args.temperature,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    try:
        result = asyncio.run(aevaluate_agent(args.checkpoint, args.data, args.max_turns, settings, args.levels,
                                             args.max_per_level, args.device, bool(args.details)))
    except (EvalError, EpisodeError, DatasetError, CheckpointError, TokenizerError, LMToolError, EngineError) as e:
        print(f"eval_agent: error: {e}", file=sys.stderr)
        return 2
    if args.details:
        with open(args.details, "w", encoding="utf-8") as f:
            for report in result["reports"]:
                for row in report.pop("prompts"):
                    f.write(json.dumps({"max_turns": report["max_turns"], **row}) + "\n")
    out = stdout or sys.stdout
    if args.json:
        print(json.dumps(result), file=out)
    else:
        render(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
