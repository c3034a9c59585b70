"""`python -m tools.bench chaos [--json] [--faults a,b] [--steps N] [--hang-s S] [--set KEY=VALUE]`: the fault matrix.

`python -m tools.bench chaos --soak [--steps 300] [--every 9] [--seed S]` runs the soak instead: one long run
with a fault every --every steps, checked after each (tools/bench/soak.py, which tools.bench hands --soak to).

Each fault is injected into a short real run of `topology/local.yaml` (a small random Qwen2 model on the
synthetic arithmetic task, so the runs are short; two reward actors, so that one can hang) once the
trainer has made step `--at`:

  none               no fault: the baseline
  kill_<kind>        kill -9 of one rollout, reward actor, the buffer, the trainer or the parameter server
  kill_template      kill -9 of the start template the actors are forked from, then of a reward actor: no
                     actor may go with the template, and the restart starts a fresh interpreter
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

Attacks (run with `bus.transport=tcp` and nothing else changed, so the bus has its default protection, but for
spoof_ipc, which attacks the topology as it is; the intruder runs as another uid, a user the bench creates with useradd, and with the standard library alone:
tools/bench/intruder.py; skipped, saying why, where the bench cannot become another user):

  spoof              messages claiming to be the evaluator or the trainer: an eval-weights fetch and a status
                     read from the parameter server, a checkpoint trigger, a version jump to 1,000,000 and a
                     batch request (a batch stolen) to the buffer, a run-finished to every actor; first, the
                     same client against an open socket the bench holds (the control: it gets through there)
  spoof_insecure_tcp the same against a run with bus.insecure_tcp: true (no CURVE; the run's tokens)
  spoof_ipc          the same against the embedded default's ipc bus (its unix sockets)
  rendezvous         every link's rendezvous port, from another address of this machine (the network's view)
                     and over loopback, where the intruder reads the keys and forges the addresses the next
                     formation reads; then a rollout is killed, so that the link forms again

Reported per fault, from the run's own files: whether it finished in its launch (survived in place) and
which actors were restarted; prompts lost (handed out by the buffer, but neither trained, nor dropped on
purpose, nor still pending at the end: buffer/final_state.json against the ledger) and trained twice
(in two batches); the largest staleness trained against eta; and the longest gap between two trainer
steps, which for a hung actor should stay within the heartbeat timeout plus one step.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pwd
import random
import shutil
import signal
import socket
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
from transport.ports import free_port_range

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = "topology/local.yaml"
TINY = ROOT / "configs" / "models" / "arith-tiny"
VICTIMS = {"rollout": "rollout.1", "reward": "reward.0", "buffer": "buffer", "trainer": "trainer",
           "param_server": "param_server"}
STALLS = ("stall_buffer", "freeze_param_server")
ATTACKS = ("spoof", "spoof_insecure_tcp", "spoof_ipc", "rendezvous")
FAULTS = ("none", *(f"kill_{k}" for k in VICTIMS), "kill_template", "hang_rollout", "hang_reward", "flood", "relaunch",
          *STALLS,
          *ATTACKS)
STALL_WATCHDOG = ("experiment.run.watchdog.min_s=30", "experiment.run.watchdog.after_steps=5")
ETA = 1


def make_assets(base: Path, train_per_level: int = 200, task: str = "math") -> dict[str, Path]:
    """A synthetic dataset of `task` (tools.make_task) and a small random model with the shipped tokenizer
    (nothing to download); the end-to-end tests run on the same."""
    from actors.engines.checkpoint import save_model
    from actors.engines.model import Qwen2Config, Qwen2ForCausalLM

    from tools import make_task

    with contextlib.redirect_stdout(io.StringIO()):   # in this process: a fresh interpreter took 3-4 s of CPU
        code = make_task.main(["--task", task, "--out", str(base / "data"), "--levels", "1-3",
                               "--train-per-level", str(train_per_level), "--test-per-level", "5"])
    if code != 0:
        raise RuntimeError(f"tools.make_task --task {task} exited {code}")
    vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    save_model(Qwen2ForCausalLM(cfg).init_weights(0), str(base / "model"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / name, base / "model" / name)
    return {"data": base / "data", "model": base / "model"}


def launch(assets: dict[str, Path], run_dir: Path, steps: int, ckpt_every: int, topology: str = TOPOLOGY,
           extra: tuple[str, ...] = (), env: dict[str, str] | None = None, stdout: Any = subprocess.PIPE) -> subprocess.Popen:
    """A short run of `topology` on the assets: 4 groups of 4 answers a step, eta 1, answers of at most 12
    tokens, every group trained (a random model answers everything wrong: dynamic sampling would drop all), no
    evaluation during the run (the figures compare runs without it)."""
    overrides = [f"experiment.model.path={assets['model']}", f"experiment.data.train={assets['data'] / 'train.jsonl'}",
                 f"experiment.data.test={assets['data'] / 'test.jsonl'}", f"experiment.run.total_steps={steps}",
                 f"experiment.run.checkpoint_every_steps={ckpt_every}", "experiment.algo.batch_size=4",
                 "experiment.algo.group_size=4", f"experiment.algo.eta={ETA}", "experiment.gen.max_new_tokens=12",
                 "experiment.algo.dynamic_sampling=false", "experiment.eval.every_versions=0", *extra]
    return subprocess.Popen([sys.executable, "-m", "tools.up", topology, *overrides, "--run-dir", str(run_dir),
                             "--no-progress"], cwd=ROOT, stdout=stdout, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, **(env or {})})


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """The trainer's metrics lines in the order written (a restarted trainer writes its re-done steps again)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def log_events(run_dir: Path, actor: str, names: set[str]) -> list[dict[str, Any]]:
    """An actor's structlog records of the given event names, in the order written."""
    path = run_dir / "logs" / f"{actor}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, (x for x in lines if x.startswith("{") and x.endswith("}")))
            if e.get("event") in names]


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in step_records(run_dir)):
        if proc.poll() is not None:
            said = proc.stdout.read()[-3000:] if proc.stdout is not None else "(its output went to a file)"
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before step {step}:\n{said}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no step {step} within {timeout:g} s")
        time.sleep(0.2)   # polling a file another process writes


def ready_info(run_dir: Path, name: str) -> dict[str, Any]:
    return json.loads((run_dir / "ready" / f"{name}.json").read_text())


def start_template_pid(run_dir: Path) -> int:
    """The pid of the start template the launcher forks actors from (its `start_template_ready` event)."""
    ready = log_events(run_dir, "launcher", {"start_template_ready"})
    if not ready:
        raise RuntimeError(f"the launcher of {run_dir} started no start template (supervisor.fork_start off?)")
    return int(ready[-1]["pid"])


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


def ledger(run_dir: Path) -> tuple[Counter, set]:
    """(batches each prompt was trained in, prompts dropped on purpose) by the buffer's ledger."""
    path = run_dir / "buffer" / "ledger.jsonl"
    trained: Counter = Counter()
    dropped = set()
    for rec in map(json.loads, path.read_text().splitlines() if path.exists() else []):
        if rec["event"] == "batch":
            trained.update(tuple(k) for k in rec["keys"])
        else:
            dropped.add(tuple(rec["key"]))
    return trained, dropped


def account(run_dir: Path) -> dict[str, int]:
    """What became of every prompt the buffer handed out: trained, dropped on purpose, still pending, lost."""
    final = json.loads((run_dir / "buffer" / "final_state.json").read_text())
    trained, dropped = ledger(run_dir)
    issued = {tuple(k) for k in final["issued"]}
    pending = {tuple(k) for k in final["reissue"]}
    lost = issued - set(trained) - dropped - pending
    return {"issued": len(issued), "trained": sum(trained.values()), "pending": len(pending),
            "dropped": len(dropped), "lost": len(lost), "twice": sum(1 for n in trained.values() if n > 1)}


def run_fault(fault: str, assets: dict[str, Path], out: Path, steps: int, at: int, hang_s: float,
              flood_n: int, log: Callable[[str], None], run_timeout: float = 900,
              settings: tuple[str, ...] = ()) -> dict[str, Any]:
    """``settings``: further `key=value` overrides of every run (``--set``)."""
    if fault in STALLS:
        return run_stall(fault, assets, out, steps, at, hang_s, settings)
    run_dir = out / fault
    intruder = intruder_account() if fault in ATTACKS else None
    if isinstance(intruder, str):
        return {"fault": fault, "skipped": intruder}
    attack_report: dict[str, Any] = {}
    if fault in ATTACKS:    # the run must outlast the attack (and, for `rendezvous`, the link's new formation)
        steps = max(steps, at + ATTACK_STEPS_AFTER)
    t0 = time.monotonic()
    proc = launch(assets, run_dir, steps, max(2, steps // 4),
                  extra=("actors.reward.count=2", *attack_overrides(fault), *settings))
    launches = 1
    try:   # not run_guard: a relaunch replaces the process to guard
        wait_for_step(proc, run_dir, at)
        kind, _, target = fault.partition("_")
        if fault == "kill_template":
            os.kill(start_template_pid(run_dir), signal.SIGKILL)
            os.kill(int(ready_info(run_dir, VICTIMS["reward"])["pid"]), signal.SIGKILL)
        elif kind == "kill":
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
        elif fault in ATTACKS:
            attack_report = attack(fault, run_dir, steps, intruder, log)
            # it proves something only if the run was still going when it ended (unless it stopped the run)
            attack_report["run_going"] = proc.poll() is None and max(
                (r["step"] for r in step_records(run_dir)), default=0) < steps
        elif fault == "relaunch":
            kill_everything(proc, run_dir)
            proc, launches = launch(assets, run_dir, steps, max(2, steps // 4),
                                    extra=("actors.reward.count=2", *settings)), 2
        try:
            output = finish_run(proc, run_dir, timeout=run_timeout)
        except subprocess.TimeoutExpired:   # a stalled run is a row of the table (killed: not in place), not a crash
            output = ""
            log(f"bench chaos: {fault}: the run did not end within {run_timeout:g} s; killed")
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
    if fault in ATTACKS:
        result.update(attack_outcome(fault, attack_report, run_dir, steps))
    return result


def run_stall(fault: str, assets: dict[str, Path], out: Path, steps: int, at: int, hang_s: float,
              settings: tuple[str, ...] = ()) -> dict[str, Any]:
    """A stall injected once the trainer made step `at` (see the module's docstring): whether the run said so
    (the watchdog's diagnosis naming the cause) or, for the frozen parameter server, trained on meanwhile."""
    run_dir = out / fault
    t0 = time.monotonic()
    # The buffer's stall gets a short watchdog (30 s without a step; the default of the local config is 120 s);
    # the freeze keeps the default, which a freeze of --hang-s 60 stays under.
    watchdog = STALL_WATCHDOG if fault == "stall_buffer" else ()
    proc = launch(assets, run_dir, steps, max(2, steps // 4), extra=("actors.reward.count=2", *watchdog, *settings))
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
    as `stall_target_met` says; no attack accepted, and the intruder's client shown to work where nothing stops
    it. Skipped attacks are left out (the report says so)."""
    return all(stall_target_met(r) if r["fault"] in STALLS else
               (r["survived_in_place"] or (r["fault"] == "relaunch" and r["exit_code"] == 0))
               and r["lost"] == 0 and r["twice"] == 0 and r["staleness_max"] <= r["eta"] and r.get("gap_ok", True)
               and r.get("accepted", 0) == 0 and r.get("control_ok", True) and r.get("during_run", True)
               for r in results if not r.get("skipped"))


# ------------------------------------------------------------------------------------------------ attacks

INTRUDER_USER = "areal-intruder"
ATTACK_STEPS_AFTER = 40   # steps an attack row's run still has to go when the attack starts (about 10 s here)


def intruder_account() -> tuple[int, int] | str:
    """(uid, gid) of the unprivileged user the attacks run as, created if missing; or why there is none."""
    if os.geteuid() != 0:
        return "the attacks run as another user, and only root can create and become one: run the bench as root"
    try:
        entry = pwd.getpwnam(INTRUDER_USER)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            return "no useradd on this machine to create the intruder's user"
        made = subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                               INTRUDER_USER], capture_output=True, text=True, timeout=60)
        if made.returncode != 0:
            return f"useradd {INTRUDER_USER} failed: {made.stderr.strip()}"
        entry = pwd.getpwnam(INTRUDER_USER)
    if entry.pw_uid == 0:
        return f"user {INTRUDER_USER} has uid 0"
    return entry.pw_uid, entry.pw_gid


def run_as_intruder(plan: dict[str, Any], account: tuple[int, int], timeout: float = 300) -> dict[str, Any]:
    """tools/bench/intruder.py run as the intruder's user, from a copy it can read, by a Python it can start."""
    uid, gid = account
    scratch = Path(tempfile.mkdtemp(prefix="bench-intruder-"))
    try:
        scratch.chmod(0o755)
        script = scratch / "intruder.py"
        shutil.copy(Path(__file__).with_name("intruder.py"), script)
        script.chmod(0o644)
        as_intruder = dict(user=uid, group=gid, extra_groups=[], cwd=scratch, env={"PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True)
        tried = []
        for python in dict.fromkeys([sys.executable, "/usr/bin/python3", shutil.which("python3") or ""]):
            if python and _starts(python, as_intruder):
                break
            tried.append(python)
        else:
            raise RuntimeError(f"user {INTRUDER_USER} can start none of these Pythons: {tried}")
        done = subprocess.run([python, str(script)], input=json.dumps(plan), timeout=timeout, **as_intruder)
        if done.returncode != 0:
            raise RuntimeError(f"the intruder failed (exit {done.returncode}): {done.stderr[-2000:]}")
        return json.loads(done.stdout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _starts(python: str, how: dict[str, Any]) -> bool:
    try:
        return subprocess.run([python, "-c", "import json, socket, struct"], timeout=60, **how).returncode == 0
    except OSError:   # not executable by that user (an interpreter under root's home)
        return False


def attack_overrides(fault: str) -> tuple[str, ...]:
    """A tcp bus, its default protection unchanged (free ports for the actors); spoof_insecure_tcp opts out;
    spoof_ipc keeps the topology's ipc bus."""
    if fault not in ATTACKS or fault == "spoof_ipc":
        return ()
    extra = ("bus.transport=tcp", f"bus.base_port={free_port_range(16)}")
    return extra + (("bus.insecure_tcp=true",) if fault == "spoof_insecure_tcp" else ())


def spoofed_messages(run_dir: Path, steps: int) -> list[dict[str, Any]]:
    """Each spoof with the actor it goes to; frames built with the project's encoder, as hex."""
    from transport.messages import encode
    from transport.protocol import (BatchRequest, CheckpointRequest, EvalWeightsRequest, RunFinished, VersionUpdate,
                                    WeightsStatusRequest)

    def message(name: str, to: str, msg: Any, sender: str, wants_reply: bool) -> dict[str, Any]:
        return {"name": name, "to": to, "endpoint": ready_info(run_dir, to)["endpoint"], "wants_reply": wants_reply,
                "frames": [bytes(f).hex() for f in encode(msg, sender=sender, wants_reply=wants_reply)]}

    actors = sorted(p.stem for p in (run_dir / "ready").glob("*.json"))
    return [message("eval_weights", "param_server", EvalWeightsRequest(), "evaluator", True),
            message("status", "param_server", WeightsStatusRequest(), "trainer", True),
            message("checkpoint", "buffer", CheckpointRequest(step=steps + 100), "trainer", True),
            message("version_jump", "buffer", VersionUpdate(version=10**6), "trainer", False),
            # a step the trainer has not reached: the batch the buffer takes for it is the trainer's no more
            message("batch", "buffer", BatchRequest(step=steps + 100), "trainer", True),
            *(message("run_finished", name, RunFinished(step=1, reason="spoofed"), "trainer", False)
              for name in actors)]


def network_address() -> str:
    """An address of this machine that is not loopback (the network's way in): the interface of its default
    route (a UDP connect sends nothing), else 127.0.0.2, which a socket bound to every interface also takes."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.1", 9))   # TEST-NET-3: only the route is looked up
            addr = probe.getsockname()[0]
        except OSError:
            addr = ""
    return addr if addr and not addr.startswith("127.") else "127.0.0.2"


def rendezvous_stores(run_dir: Path) -> list[dict[str, Any]]:
    specs = json.loads((run_dir / "plan.json").read_text())["specs"]
    stores = {}
    for spec in specs:
        for name, link in spec["settings"]["links"].items():
            stores[name] = {"link": name, "host": link["master_addr"], "port": link["master_port"],
                            "network_host": network_address()}
    return list(stores.values())


@contextlib.contextmanager
def open_socket() -> Iterator[str]:
    """A ROUTER with no protection that answers every message with its own frames: the control target that
    shows the intruder's client gets through where nothing stops it."""
    import threading

    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if router.poll(100):
                router.send_multipart(router.recv_multipart())

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield endpoint
    finally:
        stop.set()
        server.join(timeout=5)
        router.close()
        ctx.term()


def attack(fault: str, run_dir: Path, steps: int, account: tuple[int, int], log: Callable[[str], None]) -> dict[str, Any]:
    """Run the intruder as its user against the live run; for `rendezvous`, kill a rollout after it so that the
    link to the rollouts forms again over the forged keys. Returns the intruder's report."""
    if fault == "rendezvous":
        report = run_as_intruder({"stores": rendezvous_stores(run_dir)}, account)
        os.kill(int(ready_info(run_dir, VICTIMS["rollout"])["pid"]), signal.SIGKILL)
    else:
        with open_socket() as control:
            messages = spoofed_messages(run_dir, steps)
            report = run_as_intruder({"control": {**messages[2], "name": "control", "endpoint": control},
                                      "messages": messages, "user": "evaluator"}, account)
    log(f"bench chaos: {fault}: intruder (uid {report['uid']}) done")
    return report


def _accepted(message: dict[str, Any]) -> bool:
    """The actor took the message: the handshake let it in, and the reply (where one was asked for) is not an
    Error. A one-way message past the handshake counts as taken."""
    from transport.messages import Error, decode

    if not str(message["handshake"]).startswith("accepted"):
        return False
    if not message.get("reply"):
        return True
    return not isinstance(decode([bytes.fromhex(f) for f in message["reply"]])[1], Error)


def attack_outcome(fault: str, report: dict[str, Any], run_dir: Path, steps: int) -> dict[str, Any]:
    """The attack row's figures: what was tried, what the run took, and where it said no."""
    from actors.runtime.recovery import checkpoint_dir

    out: dict[str, Any] = {"intruder_uid": report.get("uid"), "during_run": bool(report.get("run_going"))}
    if fault == "rendezvous":
        stores = report.get("stores", [])
        refused = sum(line.count("was not written by a member of this run")
                      for log in (run_dir / "logs").glob("*.jsonl") for line in log.read_text().splitlines())
        # the forged keys are those of the rollouts' link's next formation: there must have been one
        formed = [e for e in log_events(run_dir, "param_server", {"rollout_link_formed"}) if e.get("epoch", 0) > 0]
        out.update(attempts=2 * len(stores), accepted=sum(s["from_network"].startswith("connected") for s in stores),
                   keys_read=sum(s.get("keys_read", 0) for s in stores),
                   forged=sum(len(s.get("forged", [])) for s in stores), forged_refused=refused,
                   formed_again=len(formed), during_run=out["during_run"] and bool(formed),
                   attempts_detail={s["link"]: {"from_network": s["from_network"], "loopback": s["loopback"]}
                                    for s in stores})
        return out
    messages = report.get("messages", [])
    accepted = [m["name"] for m in messages if _accepted(m)]
    if checkpoint_dir(run_dir, steps + 100).exists() and "checkpoint" not in accepted:
        accepted.append("checkpoint")
    control = report.get("control") or {}
    out.update(attempts=len(messages), accepted=len(accepted), accepted_kinds=sorted(set(accepted)),
               control_ok=_accepted(control) and bool(control.get("reply")),
               handshakes=dict(Counter(str(m["handshake"]) for m in messages)))
    return out


def attack_summary(r: dict[str, Any]) -> str:
    """One line per attack row under the table."""
    valid = "" if r["during_run"] else " [NOT VALID: the run ended before the attack did; raise --steps]"
    if r["fault"] == "rendezvous":
        return (f"rendezvous ports reachable from the network {r['accepted']}/{r['attempts'] // 2}; over loopback "
                f"{r['keys_read']} keys read, {r['forged']} values forged, {r['forged_refused']} refused when a "
                f"member read them (the others were overwritten by their member first); the rollouts' link formed "
                f"again {r['formed_again']}x" + valid)
    handshakes = "; ".join(f"{n}x {h}" for h, n in r["handshakes"].items())
    return (f"{r['accepted']}/{r['attempts']} spoofed messages taken ({', '.join(r['accepted_kinds']) or 'none'}); "
            f"{handshakes}; the same client against an open socket: "
            f"{'got through' if r['control_ok'] else 'did NOT get through (the probe proves nothing)'}" + valid)


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
    ap.add_argument("--run-timeout", type=float, default=900.0,
                    help="a run not over after this many seconds is killed and reported as such (900)")
    ap.add_argument("--out", default=None, help="folder for the run directories (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further override of every run (as tools.up takes them), e.g. experiment.model.lora.rank=4")
    ap.add_argument("--make-assets", metavar="DIR", default=None,
                    help="only write the runs' assets to DIR (DIR/model: a small random model with the shipped "
                         "tokenizer; DIR/data: the arithmetic task's train/test files) and exit")
    args = ap.parse_args(argv)
    if args.make_assets:
        made = make_assets(Path(args.make_assets))
        print(f"model {made['model']}, data {made['data']}/train.jsonl and test.jsonl")
        return 0
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
        results.append(run_fault(fault, assets, out, args.steps, args.at, args.hang_s, args.flood, log,
                                 run_timeout=args.run_timeout, settings=tuple(args.set)))
    report = {"steps": args.steps, "at": args.at, "hang_s": args.hang_s, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
              "results": results, "target_met": target_met(results)}
    if args.json:
        print(json.dumps(report))
        return 0
    rows = [("fault", "in place", "restarted", "lost", "twice", "stale max", "max gap s", "gap limit s", "stall",
             "wall s", "attacks accepted")]
    skipped = [r for r in results if r.get("skipped")]
    for r in results:
        if r.get("skipped"):
            continue
        rows.append((r["fault"], "yes" if r["survived_in_place"] else f"no (exit {r['exit_code']}, "
                     f"{r['launches']} launches)", ",".join(f"{n}x{k}" for n, k in r["restarted"].items()) or "-",
                     str(r["lost"]), str(r["twice"]), f"{r['staleness_max']}/{r['eta']}", f"{r['max_step_gap_s']:.1f}",
                     f"{r['gap_limit_s']:.1f}" if "gap_limit_s" in r else "-", _stall_cell(r), f"{r['wall_s']:.0f}",
                     f"{r['accepted']}/{r['attempts']}" if "attempts" in r else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for r in results:
        if "attempts" in r:
            print(f"{r['fault']} (as uid {r['intruder_uid']}): " + attack_summary(r))
    for r in skipped:
        print(f"{r['fault']}: skipped: {r['skipped']}")
    print(f"target met: {'yes' if report['target_met'] else 'no'}; run directories under {out}")
    return 0
