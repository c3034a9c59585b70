"""`python -m tools.bench e2e [--task math|code|agent] [--json] [--steps N] [overrides ...]`: asynchronous against
synchronous RL, and RL against more supervised training.

Three runs back to back of the same system on the same warm start, data and seed, each for the same
number of training steps (so the same number of trained samples):

  async       eta from the config, interruptible generation; rollouts pinned to core 0 and the trainer
              to core 1 (disjoint resources, as GPUs are disjoint on a cluster)
  sync        eta = 0 and no interruption (generate a batch, train, sync weights, repeat) on the same
              placement: AReaL's comparison, generation and training taking turns
  colocated   synchronous again, but each phase gets every core (rollouts and trainer both on cores
              0-1 with 2 threads): the best a synchronous user gets from this machine
  sft         the control: no RL, the warm start's last supervised stage continued from the same
              checkpoint for the async run's wall time (`python -m tools.sft --max-seconds`, both cores),
              then the same held-out evaluation; RL must beat it

`--task code` runs the code task's topology (topology/local_code.yaml: the code reward, unit tests in the
sandbox) and by default only async and the sft control: its question is learning, and the pass rate (all
hidden tests pass, greedy) is its accuracy. Each RL run also reports the reward's share of the run: the time
the reward actor spent scoring (at least one group in its hands; its ``busy_seconds`` counter) over the
training wall time, with the mean scoring time per group and the mean step time.

`--task agent` runs the agent task's topology (topology/local_agent.yaml: every answer an episode with the
calculator tool, docs/episodes.md) twice by default: async (the config's gen.max_turns) and one_turn (the same
RL with gen.max_turns=1: a call gets no observation). Its report adds multi_turn_over_one_turn_points and
multi_turn_gain_points (over the warm start), each run's turns and tool calls per episode, and the tool's
share: the seconds episodes spent in environment steps (summed over concurrent episodes) against the
rollouts' generation seconds and per training step.

`--task agent_chat` runs the same agent task twice by default: native (the calculator episode above) and
openai_agent (the same RL, every group run by tools/agents/calculator.py, an `openai`-package agent, through the
rollout's OpenAI endpoint, with the example's chat template tools/agents/calculator_chat.jinja and the
``brackets`` tool format: its conversations are the episode's text, token for token, so both runs start from the
same warm start and train on like sequences). Both are evaluated the same way (held out, greedy, as episodes).
Its report adds agent_gain_points, native_gain_points, agent_minus_native_points, and for the agent run its
drift events (0 expected), re-rendered histories, agent errors, endpoint calls and the endpoint's time per call.
`--modes native,openai_agent,agent_program` adds a third arm: the same agent as an external program,
tools/agents/calculator_program.py, in the bubblewrap sandbox with the endpoint its only way out; its figures
carry the prefix ``program_`` (program_agent_gain_points, program_agent_errors, ...).

`--modes async,lora` runs LoRA beside full fine-tuning on the math task at equal steps: lora is the same run with
configs/local_lora.yaml (the `config=` override of topology/local.yaml, which is what topology/local_lora.yaml
names: rank-8 adapters on the frozen warm start, every weight version the adapter alone). Its report adds
lora_accuracy, lora_gain_points and lora_minus_full_points, and for both runs the median weight sync (the
trainer's export and publish, `weight_sync_seconds`) and push to every rollout (`weight_push_seconds`) from the
trainer's metrics.jsonl.

Each run goes through `python -m tools.up TOPOLOGY` (its warm-start progress, made by the first run, is
passed on to stderr as it comes); the figures come from the run's own
summary.json (held-out greedy accuracy of the final checkpoint; tokens trained and wall time from the
trainer's metrics, actor start-up excluded). Printed as a table; `--json` prints one object with
throughput_ratio (async / sync), colocated_ratio (async / colocated), time_ratio (sync / async wall
time), the accuracies, and with the control sft_accuracy and rl_over_sft_points.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = "topology/local.yaml"
TOPOLOGIES = {"math": TOPOLOGY, "code": "topology/local_code.yaml", "agent": "topology/local_agent.yaml",
              "agent_chat": "topology/local_agent.yaml"}
PROGRESS_PREFIXES = ("prepare:", "sft:", "step ", "eval step ")   # lines of a run's output passed on as it goes
DEFAULT_MODES = {"math": "async,sync,colocated,sft", "code": "async,sft", "agent": "async,one_turn",
                 "agent_chat": "native,openai_agent"}

# The calculator agents' settings: the example's chat template and tool format (its conversations are the native
# episode's tokens), and a timeout for calls that queue behind a loaded engine.
AGENT_FORMAT = [f"actors.rollout.settings.agent.chat_template={ROOT / 'tools/agents/calculator_chat.jinja'}",
                "actors.rollout.settings.agent.tool_format=brackets", "actors.rollout.settings.agent.timeout_s=300"]

MODES: dict[str, list[str]] = {
    "async": [],
    "sync": ["experiment.algo.eta=0", "experiment.gen.interruptible=false"],
    "colocated": ["experiment.algo.eta=0", "experiment.gen.interruptible=false",
                  "actors.rollout.cpus=[0,1]", "actors.rollout.threads=2",
                  "actors.trainer.cpus=[0,1]", "actors.trainer.threads=2",
                  "actors.reward.cpus=[0,1]", "actors.buffer.cpus=[0,1]", "actors.param_server.cpus=[0,1]"],
    # LoRA on the same task and placement: the experiment config topology/local_lora.yaml names
    "lora": ["config=configs/local_lora.yaml"],
    # The agent task's control: the same RL on episodes of one turn. One turn earns a reward on almost no group
    # (without the tool the answer is a guess), so dynamic sampling would leave the trainer without batches;
    # it trains every group instead, and an all-wrong group's group-normalised advantages are zero anyway.
    "one_turn": ["experiment.gen.max_turns=1", "experiment.algo.dynamic_sampling=false"],
    # The agent task's episodes, and the same task run by an openai-package agent through the endpoint.
    "native": [],
    "openai_agent": ["actors.rollout.settings.agent.function=tools.agents.calculator:agent", *AGENT_FORMAT],
    # The same agent as an external program in the bubblewrap sandbox, the endpoint its only way out.
    "agent_program": ['actors.rollout.settings.agent.command=["{python}","-I","{files}/calculator_program.py"]',
                      "actors.rollout.settings.agent.sandbox=true",
                      f"actors.rollout.settings.agent.files=[{ROOT / 'tools/agents/calculator_program.py'}]",
                      *AGENT_FORMAT],
}
AGENT_MODES = ("openai_agent", "agent_program")   # compared with native when present
SYNC_MODES = ("sync", "colocated")   # the synchronous runs async is compared with, whichever a task ran


def run_local(name: str, steps: int, overrides: list[str], out: Path, log: Any,
              bench: str = "e2e", topology: str = TOPOLOGY) -> dict[str, Any]:
    """One fresh run of the embedded default for `steps` steps into out/name; its summary.json."""
    run_dir = out / name
    # No evaluation during the runs: the benches compare training alone (the figures in the README were
    # measured so), and the evaluator's core-0 time would differ between placements. `overrides` may turn it on.
    cmd = [sys.executable, "-m", "tools.up", topology, f"experiment.run.total_steps={steps}",
           f"experiment.run.checkpoint_every_steps={steps}", "experiment.run.recover=off",
           "experiment.eval.every_versions=0", *overrides,
           "--run-dir", str(run_dir), "--no-progress"]
    log(f"bench {bench}: {name}: {' '.join(cmd[2:])}")
    t0 = time.time()
    tail: collections.deque[str] = collections.deque(maxlen=120)
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            # The warm start (made by the first run, up to an hour on the 2-core machine) reports its stages,
            # steps and evaluations: passed on, so a long wait shows where it is.
            if line.startswith(PROGRESS_PREFIXES):
                log(f"bench {bench}: {name}: {line.rstrip()}")
    if proc.returncode != 0:
        raise RuntimeError(f"{name} run failed (exit {proc.returncode}):\n{''.join(tail)[-6000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["launch_seconds"] = time.time() - t0
    summary["run_dir"] = str(run_dir)
    share = reward_share(run_dir, summary.get("wall_seconds"), summary.get("steps"))
    if share:
        summary["reward"] = share
    episodes = episode_share(run_dir, summary.get("steps"))
    if episodes:
        summary["episodes"] = episodes
    agents = agent_share(run_dir)
    if agents:
        summary["agents"] = agents
    summary["weight_sync"] = weight_sync_medians(run_dir)
    return summary


def last_rollout_events(run_dir: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Per rollout log, its last ``rollout_stats`` event and its ``stopped`` counters (actors/rollout/actor.py);
    logs without both are left out."""
    out = []
    for path in sorted((run_dir / "logs").glob("rollout*.jsonl")):
        stats = stopped = None
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "rollout_stats":
                stats = event
            elif event.get("event") == "stopped":
                stopped = event.get("counters") or {}
        if stats is not None and stopped is not None:
            out.append((stats, stopped))
    return out


def agent_share(run_dir: Path) -> dict[str, Any] | None:
    """The agents' conversations and endpoint over the run's rollouts: drift and re-rendered events, agent
    errors, endpoint calls and its own time per call; None when no rollout served an agent."""
    counters = {"drift": 0, "rerendered": 0, "errors": 0, "tool_calls": 0, "requests": 0}
    calls = overhead_s = engine_s = 0.0
    served = False
    for stats, stopped in last_rollout_events(run_dir):
        endpoint = stats.get("agent_endpoint")
        if not endpoint:
            continue
        served = True
        for key in counters:
            counters[key] += stopped.get(f"agent_{key}", 0)
        calls += endpoint.get("calls", 0)
        overhead_s += endpoint.get("overhead_s", 0.0)
        engine_s += endpoint.get("engine_s", 0.0)
    if not served:
        return None
    return {**counters, "endpoint_calls": calls, "endpoint_overhead_ms_per_call": 1000 * overhead_s / max(calls, 1),
            "engine_ms_per_call": 1000 * engine_s / max(calls, 1)}


def episode_share(run_dir: Path, steps: int | None) -> dict[str, Any] | None:
    """Turns, tool calls and environment seconds per episode over the run's rollouts, from their last
    ``rollout_stats`` and ``stopped`` events (actors/rollout/actor.py); None when no rollout counted an episode."""
    counters: dict[str, float] = {"episodes": 0, "turns": 0, "tool_calls": 0}
    env_seconds = gen_seconds = 0.0
    for stats, stopped in last_rollout_events(run_dir):
        for key in counters:
            counters[key] += stopped.get(key, 0)
        env_seconds += stats.get("env_seconds", 0.0)
        gen_seconds += stats.get("gen_seconds", 0.0)
    if not counters["episodes"]:
        return None
    n = counters["episodes"]
    return {"episodes": n, "turns_per_episode": counters["turns"] / n,
            "tool_calls_per_episode": counters["tool_calls"] / n, "env_seconds": env_seconds,
            "gen_seconds": gen_seconds, "tool_share_of_generation": env_seconds / gen_seconds if gen_seconds else 0.0,
            "env_seconds_per_step": env_seconds / steps if steps else None}


def reward_share(run_dir: Path, wall_seconds: float | None, steps: int | None) -> dict[str, Any] | None:
    """The reward actors' scoring time against the run's training wall time, from their ``stopped`` events
    (actors/reward/actor.py counters); None when no reward actor logged one."""
    counters = []
    for path in sorted((run_dir / "logs").glob("reward*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "stopped" and "busy_seconds" in (event.get("counters") or {}):
                counters.append(event["counters"])
    if not counters or not wall_seconds or not steps:
        return None
    busy = sum(c["busy_seconds"] for c in counters)
    groups = sum(c.get("groups_scored", 0) for c in counters)
    return {"busy_seconds": busy, "score_seconds": sum(c.get("score_seconds", 0.0) for c in counters),
            "groups_scored": groups, "samples_scored": sum(c.get("samples_scored", 0) for c in counters),
            "samples_correct": sum(c.get("samples_correct", 0) for c in counters),
            "seconds_per_group": sum(c.get("score_seconds", 0.0) for c in counters) / max(groups, 1),
            "busy_seconds_per_step": busy / steps, "step_seconds": wall_seconds / steps,
            "share_of_wall": busy / wall_seconds}


def weight_sync_medians(run_dir: Path) -> dict[str, float | None]:
    """Medians over the trainer's steps (metrics.jsonl) of its weight sync (export and publish) and of the
    parameter server's push to every rollout; None when no step reported one."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    out: dict[str, float | None] = {}
    for key in ("weight_sync_seconds", "weight_push_seconds"):
        values = [r[key] for r in rows if r.get(key)]
        out[key] = statistics.median(values) if values else None
    return out


def run_mode(mode: str, steps: int, extra: list[str], out: Path, log: Any,
             topology: str = TOPOLOGY) -> dict[str, Any]:
    return run_local(mode, steps, [*MODES[mode], *extra], out, log, topology=topology)


def run_sft_control(async_run: dict[str, Any], extra: list[str], out: Path, log: Any,
                    topology_path: str = TOPOLOGY) -> dict[str, Any]:
    """Continue the warm start's last supervised stage from the RL run's start checkpoint for its wall time."""
    import topology
    from actors.evaluator.harness import evaluate_held_out
    from launch.prepare.stage import cli_args

    topo = topology.load(ROOT / topology_path, extra).topology
    prepare = topo.config.prepare
    stages = (prepare.warm_start.stages if prepare and prepare.warm_start else None) or []
    if not stages:
        raise RuntimeError("sft control: the config has no prepare.warm_start.stages to continue")
    stage = stages[-1]
    # the stage's optimisation settings, without its stopping rule: the control stops on time only
    args = {k: v for k, v in stage.args.items()
            if k not in ("steps", "epochs", "until_plateau", "keep", "patience", "min_delta", "eval_every")}
    args["warmup_steps"] = 0
    seconds = async_run["wall_seconds"]
    control = out / "sft"
    cmd = [sys.executable, "-m", "tools.sft", "--model", async_run["start_model"],
           "--data", str(Path(stage.data) / "train.jsonl"), "--out", str(control),
           "--steps", "1000000", "--max-seconds", f"{seconds:.1f}", "--json", *cli_args(args)]
    log(f"bench e2e: sft: {' '.join(cmd[2:])}")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"sft control failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    sft = json.loads(proc.stdout.strip().splitlines()[-1])
    report = evaluate_held_out(str(control), topo.config, str(ROOT / str(topo.config.data.test)))
    return {"steps": sft["steps"], "tokens_trained": sft["tokens"], "wall_seconds": sft["seconds"],
            "effective_throughput": sft["tokens_per_s"], "staleness_max": 0,
            "greedy_accuracy": {"start": async_run["greedy_accuracy"].get("start"),
                                "final": report["overall"]["greedy_accuracy"]},
            "run_dir": str(control)}


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Async against the synchronous runs the results hold (sync, colocated or both; the headline figures)."""
    a = results["async"]
    syncs = {m: results[m] for m in SYNC_MODES if m in results}

    def acc(r: dict[str, Any]) -> float:
        return r["greedy_accuracy"]["final"]

    out: dict[str, Any] = {"async_accuracy": acc(a), "start_accuracy": a["greedy_accuracy"].get("start"),
                           "accuracy_gap_points": 100 * (acc(a) - max(acc(r) for r in syncs.values()))}
    if "sync" in syncs:
        out["throughput_ratio"] = a["effective_throughput"] / syncs["sync"]["effective_throughput"]
        out["time_ratio"] = syncs["sync"]["wall_seconds"] / a["wall_seconds"]
    if "colocated" in syncs:
        out["colocated_ratio"] = a["effective_throughput"] / syncs["colocated"]["effective_throughput"]
    out.update({f"{m}_accuracy": acc(r) for m, r in syncs.items()})
    out.update({f"{m}_{k}": r[k] for m, r in results.items()
                for k in ("effective_throughput", "wall_seconds", "tokens_trained", "staleness_max")})
    return out


def compare_control(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rl, sft = results["async"]["greedy_accuracy"], results["sft"]["greedy_accuracy"]
    return {"async_accuracy": rl["final"], "sft_accuracy": sft["final"], "start_accuracy": rl.get("start"),
            "rl_over_sft_points": 100 * (rl["final"] - sft["final"])}


def compare_turns(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    multi, one = results["async"]["greedy_accuracy"], results["one_turn"]["greedy_accuracy"]
    return {"multi_turn_accuracy": multi["final"], "one_turn_accuracy": one["final"],
            "start_accuracy": multi.get("start"), "one_turn_start_accuracy": one.get("start"),
            "multi_turn_gain_points": 100 * (multi["final"] - (multi.get("start") or 0.0)),
            "multi_turn_over_one_turn_points": 100 * (multi["final"] - one["final"])}


def compare_lora(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """LoRA against full fine-tuning (the async run) at the same steps from the same warm start."""
    full, lora = results["async"], results["lora"]
    gain = lambda acc: 100 * (acc["final"] - (acc.get("start") or 0.0))
    out: dict[str, Any] = {"full_accuracy": full["greedy_accuracy"]["final"], "lora_accuracy": lora["greedy_accuracy"]["final"],
                           "start_accuracy": full["greedy_accuracy"].get("start"),
                           "full_gain_points": gain(full["greedy_accuracy"]), "lora_gain_points": gain(lora["greedy_accuracy"]),
                           "lora_minus_full_points": 100 * (lora["greedy_accuracy"]["final"] - full["greedy_accuracy"]["final"])}
    for name, run in (("full", full), ("lora", lora)):
        out.update({f"{name}_{k}": v for k, v in (run.get("weight_sync") or {}).items()})
        out.update({f"{name}_{k}": run.get(k) for k in ("wall_seconds", "launch_seconds")})
    return out


def compare_agent(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each agent run (openai_agent, agent_program) against the native episodes' at the same steps, from the same
    warm start; the openai agent's figures under their own names, the program's prefixed ``program_``."""
    native = results["native"]["greedy_accuracy"]
    gain = lambda acc: 100 * (acc["final"] - (acc.get("start") or 0.0))
    out: dict[str, Any] = {"native_accuracy": native["final"], "start_accuracy": native.get("start"),
                           "native_gain_points": gain(native)}
    for mode in ("native", *AGENT_MODES):
        if mode in results:
            episodes = results[mode].get("episodes") or {}
            out[f"{mode}_turns_per_episode"] = episodes.get("turns_per_episode")
            out[f"{mode}_tool_calls_per_episode"] = episodes.get("tool_calls_per_episode")
    for mode, prefix in zip(AGENT_MODES, ("", "program_")):
        if mode not in results:
            continue
        acc, agents = results[mode]["greedy_accuracy"], results[mode].get("agents") or {}
        out.update({f"{prefix}agent_accuracy": acc["final"], f"{prefix}agent_gain_points": gain(acc),
                    f"{prefix}agent_minus_native_points": 100 * (acc["final"] - native["final"]),
                    f"{prefix}drift_events": agents.get("drift"), f"{prefix}rerendered_events": agents.get("rerendered"),
                    f"{prefix}agent_errors": agents.get("errors"), f"{prefix}endpoint_calls": agents.get("endpoint_calls"),
                    f"{prefix}endpoint_overhead_ms_per_call": agents.get("endpoint_overhead_ms_per_call")})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=sorted(TOPOLOGIES), default="math",
                    help="math: topology/local.yaml (default); code: topology/local_code.yaml; "
                         "agent: topology/local_agent.yaml; agent_chat: the agent task natively and as an "
                         "openai-package agent through the endpoint")
    ap.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    ap.add_argument("--modes", default=None,
                    help="comma list of runs (default for math all: async,sync,colocated,sft; for code async,sft; "
                         "for agent async,one_turn; for agent_chat native,openai_agent, to which agent_program "
                         "may be added; sft needs async; async,lora: LoRA beside full fine-tuning)")
    ap.add_argument("--out", default=None, help="folder for the three run directories (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides applied to every run")
    args = ap.parse_args(argv)
    topology_path = TOPOLOGIES[args.task]
    modes = [m for m in (args.modes or DEFAULT_MODES[args.task]).split(",") if m]
    unknown = [m for m in modes if m not in MODES and m != "sft"]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}, sft")
    if "sft" in modes and "async" not in modes:
        ap.error("the sft control runs for the async run's wall time: add async to --modes")
    if "lora" in modes and args.task != "math":
        ap.error(f"the lora run is the math task's (configs/local_lora.yaml), not --task {args.task}'s")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    # The first run prepares the shared data and warm start; the others reuse them (tools/prepare.py).
    results = {m: run_mode(m, args.steps, args.overrides, out, log, topology_path) for m in modes if m in MODES}
    if "sft" in modes:
        results["sft"] = run_sft_control(results["async"], args.overrides, out, log, topology_path)
    report = build_report(args.task, topology_path, args.steps, results)
    if args.json:
        print(json.dumps(report, default=str))
        return 0
    for line in report_lines(report):
        print(line)
    print(f"run directories under {out}")
    return 0


def build_report(task: str, topology: str, steps: int, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The bench's JSON object: the runs, and each comparison whose runs are all there."""
    report: dict[str, Any] = {"task": task, "topology": topology, "steps": steps, "runs": results}
    if "async" in results and any(m in results for m in SYNC_MODES):
        report.update(compare(results))
    if "sft" in results:
        report.update(compare_control(results))
    if {"async", "one_turn"} <= set(results):
        report.update(compare_turns(results))
    if "native" in results and any(m in results for m in AGENT_MODES):
        report.update(compare_agent(results))
    if {"async", "lora"} <= set(results):
        report.update(compare_lora(results))
    return report


def report_lines(report: dict[str, Any]) -> list[str]:
    """The table and the comparison lines printed without --json."""
    results = report["runs"]
    rows = [("run", "steps", "tokens", "wall s", "tok/s", "max stale", "held-out acc")]
    for m, r in results.items():
        rows.append((m, str(r["steps"]), f"{r['tokens_trained']:.0f}", f"{r['wall_seconds']:.1f}",
                     f"{r['effective_throughput']:.0f}", f"{r['staleness_max']:.0f}",
                     f"{100 * r['greedy_accuracy']['final']:.1f}%"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    ratios = []
    if "throughput_ratio" in report:
        ratios.append(f"throughput async/sync {report['throughput_ratio']:.2f}x")
    if "colocated_ratio" in report:
        ratios.append(f"async/colocated {report['colocated_ratio']:.2f}x")
    if "time_ratio" in report:
        ratios.append(f"wall time sync/async {report['time_ratio']:.2f}x")
    if "accuracy_gap_points" in report:
        lines.append(", ".join([*ratios, f"accuracy async - best sync {report['accuracy_gap_points']:+.1f} points"]))
    if "rl_over_sft_points" in report:
        lines.append(f"held-out accuracy: async RL {100 * report['async_accuracy']:.1f}% vs SFT continued for the "
                     f"same wall time {100 * report['sft_accuracy']:.1f}% ({report['rl_over_sft_points']:+.1f} "
                     f"points; start {100 * (report['start_accuracy'] or 0):.1f}%)")
    for m, r in results.items():
        if "reward" in r:
            w = r["reward"]
            lines.append(f"{m}: reward busy {w['busy_seconds']:.1f} s of {r['wall_seconds']:.1f} s training wall "
                         f"time ({100 * w['share_of_wall']:.0f}%); {w['busy_seconds_per_step']:.2f} s per step of "
                         f"{w['step_seconds']:.2f} s; {w['seconds_per_group']:.2f} s per group scored "
                         f"({w['groups_scored']} groups)")
    if "multi_turn_over_one_turn_points" in report:
        lines.append(f"held-out accuracy: multi-turn RL {100 * report['multi_turn_accuracy']:.1f}% "
                     f"({report['multi_turn_gain_points']:+.1f} points over the warm start), the same RL on one "
                     f"turn {100 * report['one_turn_accuracy']:.1f}% "
                     f"({report['multi_turn_over_one_turn_points']:+.1f} points)")
    if "lora_minus_full_points" in report:
        sync = lambda name: (f"weight sync {report[f'{name}_weight_sync_seconds'] or 0:.3f} s, push "
                             f"{report[f'{name}_weight_push_seconds'] or 0:.3f} s (medians)")
        lines.append(f"held-out accuracy: LoRA {100 * report['lora_accuracy']:.1f}% "
                     f"({report['lora_gain_points']:+.1f} points over the warm start), full fine-tuning "
                     f"{100 * report['full_accuracy']:.1f}% ({report['full_gain_points']:+.1f}); LoRA {sync('lora')}, "
                     f"full {sync('full')}")
    for m, r in results.items():
        if "episodes" in r:
            e = r["episodes"]
            lines.append(f"{m}: {e['turns_per_episode']:.2f} turns, {e['tool_calls_per_episode']:.2f} tool calls "
                         f"per episode; tool {e['env_seconds']:.1f} s of {e['gen_seconds']:.1f} s generation "
                         f"({100 * e['tool_share_of_generation']:.1f}%)")
    for name, prefix in (("openai agent", ""), ("agent program", "program_")):
        if f"{prefix}agent_minus_native_points" in report:
            lines.append(f"held-out accuracy: {name} {100 * report[f'{prefix}agent_accuracy']:.1f}% "
                         f"({report[f'{prefix}agent_gain_points']:+.1f} points over the warm start), native episodes "
                         f"{100 * report['native_accuracy']:.1f}% ({report['native_gain_points']:+.1f}); drift events "
                         f"{report[f'{prefix}drift_events']}, agent errors {report[f'{prefix}agent_errors']}, endpoint "
                         f"{report[f'{prefix}endpoint_overhead_ms_per_call'] or 0:.1f} ms per call "
                         f"({report[f'{prefix}endpoint_calls'] or 0:.0f} calls)")
    return lines
