"""Evaluation after a run ends: the periodic evaluations the evaluator missed, caught up from the checkpoints
left (`catch_up_evaluations`), and the final held-out comparison of the start model with the last checkpoint
(`final_evaluation`, through the tools' evaluation that the entry point passes in)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launch.report import table_lines
from topology import Plan
from topology.experiment import ExperimentConfig


def evaluates_during_run(plan: Plan) -> bool:
    """Whether the plan's evaluator can evaluate during the run: it has one, and the parameter server holds the
    weights (the relay: it sits in a link; with direct weights it holds none, and the evaluator idles), and the
    evaluator takes them from there (``weights_from: checkpoints`` evaluates checkpoints only, by design)."""
    groups = plan.topology.groups
    if any(g.settings.get("weights_from", "param_server") != "param_server"
           for g in groups.values() if g.cls.endswith(":EvalActor")):
        return False
    modules = {name: group.actor_package for name, group in groups.items()}
    servers = {i.name for i in plan.instances if modules.get(i.group) == "actors.param_server"}
    return ("actors.evaluator" in modules.values() and "actors.trainer" in modules.values()
            and any(servers & set(link.members) for link in plan.links.values()))


def catch_up_evaluations(config: ExperimentConfig, run_dir: Path) -> None:
    """The periodic evaluations the evaluator missed (it was away when the run ended, or fell behind): those
    whose weights are left on disk are evaluated here, the rest named as skipped in eval.jsonl."""
    from actors.evaluator.actor import catch_up
    from actors.runtime.recovery import FINISHED

    try:
        final = int(json.loads((run_dir / FINISHED).read_text())["step"])
    except (OSError, ValueError, KeyError):
        return
    caught, skipped = catch_up(config, run_dir, final)
    if caught or skipped:
        print(f"periodic evaluations the evaluator missed: {versions(caught) or 'none'} evaluated from their "
              f"checkpoints now" + (f"; {versions(skipped)} skipped (their weights are no longer kept)"
                                    if skipped else ""), flush=True)


def versions(numbers: list[int]) -> str:
    """Weight versions as words, so that a lone one does not read as a count: 'version 40', 'versions 10, 20'."""
    if not numbers:
        return ""
    return ("version " if len(numbers) == 1 else "versions ") + ", ".join(map(str, numbers))


def final_evaluation(config: ExperimentConfig, run_dir: Path) -> dict[str, Any] | None:
    """Greedy held-out accuracy of the model the run started from and of its last checkpoint, side by
    side, per level (`actors.evaluator.harness.evaluate_held_out`); written to RUN_DIR/summary.json and RUN_DIR/eval.jsonl
    (read by tools.plot)."""
    from actors.dataset import resolve_data_path
    from actors.engines.checkpoint import has_weights
    from actors.evaluator.harness import evaluate_held_out
    from actors.runtime.recovery import latest_checkpoint
    from actors.trainer.metrics import trained_history

    test = config.data.test
    found = latest_checkpoint(run_dir)
    if not test or not resolve_data_path(test).exists() or found is None:
        why = ("data.test is not set" if not test else f"data.test {test}: no such file" if
               not resolve_data_path(test).exists() else "the run wrote no checkpoint")
        print(f"no final evaluation: {why}", flush=True)
        return None
    step, ckpt = found
    models = {"start": config.model.path, "final": str(ckpt / "model")}
    reports = {name: evaluate_held_out(path, config) for name, path in models.items()
               if path and has_weights(path)}
    metrics = trained_history([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                              if (run_dir / "metrics.jsonl").exists() else [])
    keys = sorted({k for r in reports.values() for k in r["by_level"]}, key=lambda k: (len(k), k))
    rows = [("model", "step", "overall", *[f"level {k}" for k in keys])]
    for name, r in reports.items():
        rows.append((name, str(step if name == "final" else 0), f"{100 * r['overall']['greedy_accuracy']:.1f}%",
                     *[f"{100 * r['by_level'][k]['greedy_accuracy']:.1f}%" if k in r["by_level"] else "" for k in keys]))
    summary = {"final_step": step, "start_model": models["start"], "final_model": models["final"],
               "greedy_accuracy": {n: r["overall"]["greedy_accuracy"] for n, r in reports.items()},
               "greedy_accuracy_by_level": {n: {k: v["greedy_accuracy"] for k, v in r["by_level"].items()}
                                            for n, r in reports.items()}}
    summary.update(run_figures(metrics))
    if "start" in reports and "final" in reports:
        summary["gain_points"] = 100 * (reports["final"]["overall"]["greedy_accuracy"]
                                        - reports["start"]["overall"]["greedy_accuracy"])
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    with open(run_dir / "eval.jsonl", "a") as f:
        for name, r in reports.items():
            entry = {"model": name, "step": step if name == "final" else 0,
                     "overall": r["overall"], "by_level": r["by_level"]}
            if metrics:  # on the metrics' clock, so tools.plot can place it on its time axis
                entry["time"] = metrics[-1]["time"] if name == "final" else metrics[0]["time"] - metrics[0]["step_seconds"]
            f.write(json.dumps(entry) + "\n")
    print(f"held-out greedy accuracy ({test}):")
    print("\n".join(table_lines(rows)))
    if "gain_points" in summary:
        print(f"RL gain over the start: {summary['gain_points']:+.1f} points; "
              f"{summary.get('steps', 0)} steps, {summary.get('tokens_trained', 0):.0f} tokens trained, "
              f"{summary.get('effective_throughput', 0):.0f} tok/s effective, max staleness "
              f"{summary.get('staleness_max', 0):.0f}", flush=True)
    if "mismatch_tokens" in summary:
        print(f"engine/trainer mismatch on {summary['mismatch_tokens']:.0f} tokens sampled by the weights that "
              f"trained on them: mean |log-prob difference| {summary['mismatch_logprob_diff_mean']:.2e}, "
              f"largest {summary['logprob_gap_max']:.2e}", flush=True)
    return summary


def run_figures(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What a run's summary says of its trained steps (metrics.jsonl's records, `trained_history`): steps, wall
    time, tokens, throughput, staleness, and the engine/trainer mismatch on tokens sampled by the weights that
    trained on them (token-weighted mean |trainer - engine| log-prob, largest gap); {} without steps."""
    if not metrics:
        return {}
    wall = metrics[-1]["time"] - metrics[0]["time"] + metrics[0]["step_seconds"]
    tokens = sum(m["n_tokens"] for m in metrics)
    out = {"steps": len(metrics), "wall_seconds": wall, "tokens_trained": tokens,
           "effective_throughput": tokens / max(wall, 1e-9), "staleness_max": max(m["staleness_max"] for m in metrics)}
    if mismatch_tokens := sum(m.get("mismatch_tokens", 0.0) for m in metrics):
        out.update(mismatch_tokens=mismatch_tokens,
                   mismatch_logprob_diff_mean=sum(m["mismatch_logprob_diff_mean"] * m["mismatch_tokens"]
                                                  for m in metrics if m.get("mismatch_tokens")) / mismatch_tokens,
                   logprob_gap_max=max(m.get("logprob_gap_max", 0.0) for m in metrics))
    return out
