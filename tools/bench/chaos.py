"""`python -m tools.bench chaos [--json] [--faults a,b] [--steps N] [--hang-s S]`: the fault matrix.

Each fault is injected into a short real run of `topology/local.yaml` (a small random Qwen2 model on the
synthetic arithmetic task, so the runs are short; two reward actors, so that one can hang) once the
trainer has made step `--at`:

  none               no fault: the baseline
  kill_<kind>        kill -9 of one rollout, reward actor, the buffer, the trainer or the parameter server
  hang_<kind>        SIGSTOP of one rollout or reward actor for --hang-s seconds (60), then SIGCONT
  flood              --flood malformed messages (undecodable frames, unknown kinds, wrong fields, wrong
                     schema versions) to every actor's bus endpoint
  relaunch           the launcher and every actor killed at once, then the run launched again

and the stalls, where no actor dies (`run_stall`):

  stall_buffer       the buffer stops cleanly (SIGTERM, exit 0: the supervisor counts it finished) while the
                     trainer still needs batches: the progress watchdog must stop the run with a diagnosis
                     naming the stopped buffer, and a non-zero exit
  freeze_param_server  SIGSTOP of the parameter server for --hang-s seconds, then SIGCONT: training must go
                     on without a push while the rollouts' weights stay within eta, and the run finish

Reported per fault, from the run's own files: whether it finished in its launch (survived in place) and
which actors were restarted; prompts lost (handed out by the buffer, but neither trained, nor dropped on
purpose, nor still pending at the end: buffer/final_state.json against the ledger) and trained twice
(in two batches); the largest staleness trained against eta; and the longest gap between two trainer
steps, which for a hung actor should stay within the heartbeat timeout plus one step.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack

from transport.bus import HEARTBEAT_TIMEOUT_S
from transport.messages import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = "topology/local.yaml"
TINY = ROOT / "configs" / "models" / "arith-tiny"
VICTIMS = {"rollout": "rollout.1", "reward": "reward.0", "buffer": "buffer", "trainer": "trainer",
           "param_server": "param_server"}
STALLS = ("stall_buffer", "freeze_param_server")
FAULTS = ("none", *(f"kill_{k}" for k in VICTIMS), "hang_rollout", "hang_reward", "flood", "relaunch", *STALLS)
STALL_WATCHDOG = ("experiment.run.watchdog.min_s=30", "experiment.run.watchdog.after_steps=5")
ETA = 1


def make_assets(base: Path, train_per_level: int = 200, task: str = "math") -> dict[str, Path]:
    """A synthetic dataset of `task` (tools.make_task) and a small random model with the shipped tokenizer
    (nothing to download); the end-to-end tests run on the same."""
    from actors.engines.checkpoint import save_model
    from actors.engines.model import Qwen2Config, Qwen2ForCausalLM

    subprocess.run([sys.executable, "-m", "tools.make_task", "--task", task, "--out", str(base / "data"), "--levels", "1-3",
                    "--train-per-level", str(train_per_level), "--test-per-level", "5"], cwd=ROOT, check=True, capture_output=True)
    vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    save_model(Qwen2ForCausalLM(cfg).init_weights(0), str(base / "model"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / name, base / "model" / name)
    return {"data": base / "data", "model": base / "model"}


def launch(assets: dict[str, Path], run_dir: Path, steps: int, ckpt_every: int, topology: str = TOPOLOGY,
           extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> subprocess.Popen:
    """A short run of `topology` on the assets: 4 groups of 4 answers a step, eta 1, answers of at most 12
    tokens, every group trained (a random model answers everything wrong: dynamic sampling would drop all), no
    evaluation during the run (the figures compare runs without it)."""
    overrides = [f"experiment.model.path={assets['model']}", f"experiment.data.train={assets['data'] / 'train.jsonl'}",
                 f"experiment.data.test={assets['data'] / 'test.jsonl'}", f"experiment.run.total_steps={steps}",
                 f"experiment.run.checkpoint_every_steps={ckpt_every}", "experiment.algo.batch_size=4",
                 "experiment.algo.group_size=4", f"experiment.algo.eta={ETA}", "experiment.gen.max_new_tokens=12",
                 "experiment.algo.dynamic_sampling=false", "experiment.eval.every_versions=0", *extra]
    return subprocess.Popen([sys.executable, "-m", "tools.up", topology, *overrides, "--run-dir", str(run_dir),
                             "--no-progress"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, **(env or {})})


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """The trainer's metrics lines in the order written (a restarted trainer writes its re-done steps again)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in step_records(run_dir)):
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before step {step}:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no step {step} within {timeout:g} s")
        time.sleep(0.2)   # polling a file another process writes


def ready_info(run_dir: Path, name: str) -> dict[str, Any]:
    return json.loads((run_dir / "ready" / f"{name}.json").read_text())


def kill_everything(proc: subprocess.Popen, run_dir: Path) -> None:
    pids = []
    for ready in (run_dir / "ready").glob("*.json"):
        try:
            pids.append(int(json.loads(ready.read_text())["pid"]))
        except (OSError, ValueError, KeyError):
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


@contextlib.contextmanager
def run_guard(proc: subprocess.Popen, run_dir: Path) -> Iterator[subprocess.Popen]:
    """Nothing of a launched run outlives the block: a run still going when the block ends (it raised,
    or gave up waiting) is killed with every actor it started."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_everything(proc, run_dir)


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) for the block, continued (SIGCONT) however the block ends."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def finish_run(proc: subprocess.Popen, run_dir: Path, timeout: float) -> str:
    """Wait up to `timeout` s for a launched run to end and return its output (stdout and stderr together);
    a run that does not end is killed with every actor it started, and subprocess.TimeoutExpired raised."""
    with run_guard(proc, run_dir):
        out, _ = proc.communicate(timeout=timeout)
    return out


def malformed_messages(rng: random.Random) -> list[list[bytes]]:
    """One of each kind of bad input the bus must refuse without harm."""
    def head(tag: str, body: Any, version: int = SCHEMA_VERSION) -> bytes:
        return msgpack.packb([tag, version, "intruder", f"x{rng.getrandbits(32):x}", time.time(), None, True, body])
    return [[rng.randbytes(rng.randint(1, 64))],
            [b"\xc1" + rng.randbytes(16)],
            [msgpack.packb(["too", "short"])],
            [head("no.such.kind", {})],
            [head("rl.batch_request", {"step": "not a number"})],
            [head("rl.version_update", {"version": 10**6}, version=SCHEMA_VERSION + 7)],
            [head("rl.scored_group", {"group_id": 1})]]


def flood(run_dir: Path, per_actor: int, seed: int = 0) -> int:
    """Send `per_actor` malformed messages to every actor's endpoint; returns how many were sent."""
    import zmq

    rng, ctx, sent = random.Random(seed), zmq.Context(), 0
    try:
        for ready in sorted((run_dir / "ready").glob("*.json")):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 5000)
            sock.connect(json.loads(ready.read_text())["endpoint"])
            kinds = malformed_messages(rng)
            for i in range(per_actor):
                sock.send_multipart(kinds[i % len(kinds)])
                sent += 1
            sock.close(linger=1000)
    finally:
        ctx.term()
    return sent


def account(run_dir: Path) -> dict[str, int]:
    """What became of every prompt the buffer handed out: trained, dropped on purpose, still pending, lost."""
    final = json.loads((run_dir / "buffer" / "final_state.json").read_text())
    trained: Counter = Counter()
    dropped = set()
    for rec in map(json.loads, (run_dir / "buffer" / "ledger.jsonl").read_text().splitlines()):
        if rec["event"] == "batch":
            trained.update(tuple(k) for k in rec["keys"])
        else:
            dropped.add(tuple(rec["key"]))
    issued = {tuple(k) for k in final["issued"]}
    pending = {tuple(k) for k in final["reissue"]}
    lost = issued - set(trained) - dropped - pending
    return {"issued": len(issued), "trained": sum(trained.values()), "pending": len(pending),
            "dropped": len(dropped), "lost": len(lost), "twice": sum(1 for n in trained.values() if n > 1)}


def run_fault(fault: str, assets: dict[str, Path], out: Path, steps: int, at: int, hang_s: float,
              flood_n: int, log: Callable[[str], None]) -> dict[str, Any]:
    if fault in STALLS:
        return run_stall(fault, assets, out, steps, at, hang_s)
    run_dir = out / fault
    t0 = time.monotonic()
    proc = launch(assets, run_dir, steps, max(2, steps // 4), extra=("actors.reward.count=2",))
    launches = 1
    try:   # not run_guard: a relaunch replaces the process to guard
        wait_for_step(proc, run_dir, at)
        kind, _, target = fault.partition("_")
        if kind == "kill":
            os.kill(int(ready_info(run_dir, VICTIMS[target])["pid"]), signal.SIGKILL)
        elif kind == "hang":
            pid = int(ready_info(run_dir, VICTIMS[target])["pid"])
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(hang_s)   # the fault's duration
            finally:
                os.kill(pid, signal.SIGCONT)
        elif fault == "flood":
            log(f"bench chaos: flood: {flood(run_dir, flood_n)} malformed messages sent")
        elif fault == "relaunch":
            kill_everything(proc, run_dir)
            proc, launches = launch(assets, run_dir, steps, max(2, steps // 4), extra=("actors.reward.count=2",)), 2
        output = finish_run(proc, run_dir, timeout=900)
    finally:
        if proc.poll() is None:
            kill_everything(proc, run_dir)
    names = [p.stem for p in (run_dir / "ready").glob("*.json")] + list(VICTIMS.values())
    restarts = {line.split()[0]: int(line.split()[-1]) for line in output.splitlines()
                if line.split()[:1] and line.split()[0] in names and line.split()[-1].isdigit()}
    records = step_records(run_dir)
    final = {r["step"]: r for r in records}
    times = [r["time"] for r in records]
    gaps = [b - a for a, b in zip(times, times[1:])]
    step_s = statistics.median(gaps) if gaps else 0.0
    result: dict[str, Any] = {
        "fault": fault, "exit_code": proc.returncode, "launches": launches,
        "survived_in_place": proc.returncode == 0 and launches == 1 and sorted(final) == list(range(1, steps + 1)),
        "restarted": {n: k for n, k in restarts.items() if k}, **account(run_dir),
        "staleness_max": max((r.get("staleness_max", 0) for r in final.values()), default=0), "eta": ETA,
        "max_step_gap_s": round(max(gaps, default=0.0), 2), "median_step_s": round(step_s, 3),
        "wall_s": round(time.monotonic() - t0, 1)}
    if fault.startswith("hang_"):
        result["gap_limit_s"] = round(HEARTBEAT_TIMEOUT_S + step_s, 2)
        result["gap_ok"] = result["max_step_gap_s"] <= result["gap_limit_s"]
    return result


def run_stall(fault: str, assets: dict[str, Path], out: Path, steps: int, at: int, hang_s: float) -> dict[str, Any]:
    """A stall injected once the trainer made step `at` (see the module's docstring): whether the run said so
    (the watchdog's diagnosis naming the cause) or, for the frozen parameter server, trained on meanwhile."""
    run_dir = out / fault
    t0 = time.monotonic()
    # The buffer's stall gets a short watchdog (30 s without a step; the default of the local config is 120 s);
    # the freeze keeps the default, which a freeze of --hang-s 60 stays under.
    watchdog = STALL_WATCHDOG if fault == "stall_buffer" else ()
    proc = launch(assets, run_dir, steps, max(2, steps // 4), extra=("actors.reward.count=2", *watchdog))
    frozen_steps = None
    with run_guard(proc, run_dir):
        wait_for_step(proc, run_dir, at)
        if fault == "stall_buffer":
            os.kill(int(ready_info(run_dir, "buffer")["pid"]), signal.SIGTERM)
        else:
            before = max(r["step"] for r in step_records(run_dir))
            with frozen(int(ready_info(run_dir, "param_server")["pid"])):
                time.sleep(hang_s)   # the fault's duration
            frozen_steps = max(r["step"] for r in step_records(run_dir)) - before
        output = finish_run(proc, run_dir, timeout=900)
    records = step_records(run_dir)
    trained = {r["step"] for r in records}
    stall = run_dir / "stall.txt"
    if fault == "stall_buffer":
        diagnosed = proc.returncode != 0 and stall.exists() and "buffer has stopped" in stall.read_text() \
            and "NO PROGRESS" in output
    else:   # a freeze shorter than the watchdog's limit is no stall: the run must simply go on and finish
        diagnosed = not stall.exists()
    return {"fault": fault, "exit_code": proc.returncode, "launches": 1,
            "survived_in_place": proc.returncode == 0 and sorted(trained) == list(range(1, steps + 1)),
            "restarted": {}, **account(run_dir), "eta": ETA,
            "staleness_max": max((r.get("staleness_max", 0) for r in records), default=0),
            "diagnosed": diagnosed, "steps_while_frozen": frozen_steps,
            "max_step_gap_s": round(max((b["time"] - a["time"] for a, b in zip(records, records[1:])), default=0.0), 2),
            "wall_s": round(time.monotonic() - t0, 1)}


def stall_target_met(r: dict[str, Any]) -> bool:
    """A stalled run is stopped with its cause diagnosed and a non-zero exit; a frozen parameter server costs no
    training (at least a step while frozen, then the whole run); nothing lost or trained twice either way."""
    if r["fault"] == "stall_buffer":
        ok = r["exit_code"] not in (0, None) and r["diagnosed"]
    else:
        ok = r["survived_in_place"] and r["diagnosed"] and (r["steps_while_frozen"] or 0) >= 1 \
            and r["staleness_max"] <= r["eta"]
    return ok and r["lost"] == 0 and r["twice"] == 0


def target_met(results: list[dict[str, Any]]) -> bool:
    """Every fault survived in place (a relaunch: resumed), nothing lost or trained twice, the bound on
    staleness kept, and no step gap beyond the heartbeat timeout plus one step for a hung actor; every stall
    as `stall_target_met` says."""
    return all(stall_target_met(r) if r["fault"] in STALLS else
               (r["survived_in_place"] or (r["fault"] == "relaunch" and r["exit_code"] == 0))
               and r["lost"] == 0 and r["twice"] == 0 and r["staleness_max"] <= r["eta"] and r.get("gap_ok", True)
               for r in results)


def _stall_cell(r: dict[str, Any]) -> str:
    if r["fault"] == "stall_buffer":
        return "diagnosed" if r["diagnosed"] else "NOT diagnosed"
    if r["fault"] == "freeze_param_server":
        return f"{r['steps_while_frozen']} steps while frozen" + ("" if r["diagnosed"] else ", falsely diagnosed")
    return "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma list (default all: {','.join(FAULTS)})")
    ap.add_argument("--steps", type=int, default=16, help="training steps per run (default 16)")
    ap.add_argument("--at", type=int, default=3, help="inject the fault once the trainer made this step (3)")
    ap.add_argument("--hang-s", type=float, default=60.0, help="how long a hung actor stays stopped (60)")
    ap.add_argument("--flood", type=int, default=2000, help="malformed messages per actor (2000)")
    ap.add_argument("--out", default=None, help="folder for the run directories (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; choose from {', '.join(FAULTS)}")
    if not 0 < args.at < args.steps:
        ap.error(f"--at must be a step of the run (1 to {args.steps - 1})")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    assets = make_assets(out / "assets")
    results = []
    for i, fault in enumerate(faults, 1):
        log(f"bench chaos: [{i}/{len(faults)}] {fault}")
        results.append(run_fault(fault, assets, out, args.steps, args.at, args.hang_s, args.flood, log))
    report = {"steps": args.steps, "at": args.at, "hang_s": args.hang_s, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
              "results": results, "target_met": target_met(results)}
    if args.json:
        print(json.dumps(report))
        return 0
    rows = [("fault", "in place", "restarted", "lost", "twice", "stale max", "max gap s", "gap limit s", "stall",
             "wall s")]
    for r in results:
        rows.append((r["fault"], "yes" if r["survived_in_place"] else f"no (exit {r['exit_code']}, "
                     f"{r['launches']} launches)", ",".join(f"{n}x{k}" for n, k in r["restarted"].items()) or "-",
                     str(r["lost"]), str(r["twice"]), f"{r['staleness_max']}/{r['eta']}", f"{r['max_step_gap_s']:.1f}",
                     f"{r['gap_limit_s']:.1f}" if "gap_limit_s" in r else "-", _stall_cell(r), f"{r['wall_s']:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print(f"target met: {'yes' if report['target_met'] else 'no'}; run directories under {out}")
    return 0
