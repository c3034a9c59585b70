"""`python -m tools.bench chaos --soak [--steps N] [--every K] [--seed S] [--json]`: faults over a long run.

One long run of `topology/local.yaml` (the assets of `tools.bench.chaos`; three rollouts, two reward actors, a
checkpoint every `--ckpt-every` steps, `run.keep_checkpoints` at its default of 2) gets a fault every `--every`
trainer steps, drawn with `--seed` from shuffled rounds of every kind, so each round has each once:

  kill:<kind>       kill -9 of one actor of that kind (rollout, reward, buffer, trainer, param_server, evaluator)
  stop:<kind>       SIGSTOP of one actor of that kind for 2-8 s (across the bus's heartbeat timeout), then SIGCONT
  pair              kill -9 of two actors of different kinds at once
  launcher_kill     the launcher and every actor killed with -9 (a node lost), then the run launched again
  launcher_stop     SIGTERM to the launcher (a clean stop: exit 143, every actor logs `stopped`, nobody SIGKILLed),
                    then the run launched again

After each fault the run must make `--every` new steps, and then: no prompt in two batches, staleness within
eta, no member given up; at the end: the launch exits 0 with every step 1..N trained, nothing lost (handed out
but neither trained, dropped on purpose nor pending: `tools.bench.chaos.account`) and a clean stop. The supervisor
gets `max_restarts` 10 (the default, 3 in 300 s, is a policy the soak's own rate of kills would exceed): a
member given up then means restarts that failed ten times, not a policy met; and `ready_timeout` 600 s (three
rollouts starting at once on a loaded 2-core machine took over the default 120 s).

Reported: faults survived, steps, the longest time per actor kind from a fault to the trainer's next new step.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from tools.bench import chaos

KINDS = ("rollout", "reward", "buffer", "trainer", "param_server", "evaluator")
ROUND = (*(f"kill:{k}" for k in KINDS), *(f"stop:{k}" for k in KINDS if k != "evaluator"), "pair",
         "launcher_kill", "launcher_stop")
MAX_RESTARTS = 10
READY_TIMEOUT_S = 600.0   # a start on a loaded 2-core machine (three rollouts at once) can take minutes
LAUNCH_STOP_S = 120.0   # bound on a launcher's clean stop (its supervisor's stop_timeout is 30 s)


class SoakFailure(RuntimeError):
    """A check after a fault, or at the end, found the run wrong; the message says which and where."""


def schedule(n: int, seed: int, kinds: tuple[str, ...] = ROUND) -> list[str]:
    """`n` faults: rounds of `kinds`, each shuffled, so that every kind comes once a round."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        block = list(kinds)
        rng.shuffle(block)
        out.extend(block)
    return out[:n]


class Soak:
    """One soak: its run directory, the launch now running and what each fault did."""

    def __init__(self, assets: dict[str, Path], out: Path, steps: int, every: int, ckpt_every: int, rollouts: int,
                 seed: int, log: Callable[[str], None], step_timeout: float) -> None:
        self.assets, self.out, self.run_dir = assets, out, out / "run"
        self.steps, self.every, self.ckpt_every, self.rollouts = steps, every, ckpt_every, rollouts
        self.rng, self.log, self.step_timeout = random.Random(seed), log, step_timeout
        self.launches: list[Path] = []   # each launch's console output
        self.proc: subprocess.Popen | None = None
        self.faults: list[dict[str, Any]] = []

    # --------------------------------------------------------------------------------------- launches

    def launch(self) -> None:
        output = self.out / f"launch-{len(self.launches) + 1}.out"
        self.launches.append(output)
        with open(output, "w") as sink:
            self.proc = chaos.launch(self.assets, self.run_dir, self.steps, self.ckpt_every, extra=(
                "actors.reward.count=2", f"actors.rollout.count={self.rollouts}",
                f"supervisor.max_restarts={MAX_RESTARTS}", f"supervisor.ready_timeout={READY_TIMEOUT_S:g}"),
                stdout=sink)

    def output(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.launches if p.exists())

    def actors(self, kind: str) -> list[str]:
        names = sorted(p.stem for p in (self.run_dir / "ready").glob("*.json"))
        return [n for n in names if n == kind or n.startswith(kind + ".")]

    def pid(self, name: str) -> int | None:
        try:
            return int(chaos.ready_info(self.run_dir, name)["pid"])
        except (OSError, ValueError, KeyError):
            return None

    def stopped_counts(self) -> Counter:
        """`stopped` lines per actor log so far."""
        counts: Counter = Counter()
        for log in (self.run_dir / "logs").glob("*.jsonl"):
            counts[log.stem] = log.read_text(errors="replace").count('"event": "stopped"')
        return counts

    def newest_step(self) -> int:
        return max((r["step"] for r in chaos.step_records(self.run_dir)), default=0)

    def wait_for_step(self, step: int) -> None:
        assert self.proc is not None
        try:
            chaos.wait_for_step(self.proc, self.run_dir, min(step, self.steps), timeout=self.step_timeout)
        except RuntimeError as exc:
            raise SoakFailure(f"no progress: {exc}") from None

    # --------------------------------------------------------------------------------------- faults

    def inject(self, fault: str) -> dict[str, Any]:
        """Do `fault` now; returns its record (what was hit)."""
        kind, _, target = fault.partition(":")
        record: dict[str, Any] = {"fault": fault, "step": self.newest_step(), "time": time.time()}
        if kind in ("kill", "stop"):
            victims = [self.rng.choice(self.actors(target))] if self.actors(target) else []
        elif fault == "pair":
            first, second = self.rng.sample([k for k in KINDS if self.actors(k)], 2)
            victims = [self.rng.choice(self.actors(first)), self.rng.choice(self.actors(second))]
        else:
            victims = []
        record["actors"] = victims
        if kind in ("kill", "pair"):
            for name in victims:
                if (pid := self.pid(name)) is not None:
                    os.kill(pid, signal.SIGKILL)
        elif kind == "stop" and victims and (pid := self.pid(victims[0])) is not None:
            record["stopped_s"] = round(self.rng.uniform(2.0, 8.0), 1)
            with chaos.frozen(pid):
                time.sleep(record["stopped_s"])   # the fault's duration
        elif fault == "launcher_kill":
            assert self.proc is not None
            chaos.kill_everything(self.proc, self.run_dir)
            self.launch()
        elif fault == "launcher_stop":
            self.stop_cleanly(record)
            self.launch()
        return record

    def stop_cleanly(self, record: dict[str, Any]) -> None:
        """SIGTERM the launcher: it must exit 143 (stopped before the last step) with every actor logging
        `stopped` and none SIGKILLed by its supervisor."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        unclean = self.launch_end(LAUNCH_STOP_S, "the launcher did not stop within {:g} s of SIGTERM")
        record["stop_s"] = round(time.monotonic() - t0, 1)
        if self.proc.returncode != 128 + signal.SIGTERM or unclean:
            raise SoakFailure(f"unclean stop: launcher exit {self.proc.returncode}; {unclean or 'otherwise clean'}")

    def launch_end(self, timeout: float, late: str) -> str:
        """Wait for the launch to end (SoakFailure(`late`) after `timeout` s); returns what was unclean about its
        stop: actors it ran that logged no `stopped`, or one its supervisor SIGKILLed ("" when clean)."""
        assert self.proc is not None
        before = self.stopped_counts()
        running = set(p.stem for p in (self.run_dir / "ready").glob("*.json"))
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            chaos.kill_everything(self.proc, self.run_dir)
            raise SoakFailure(late.format(timeout)) from None
        after = self.stopped_counts()
        unstopped = sorted(n for n in running if after[n] <= before[n])
        killed = "actor_killed" in self.launches[-1].read_text(errors="replace")
        return "; ".join(([f"no `stopped` from {unstopped}"] if unstopped else [])
                         + (["an actor SIGKILLed by its supervisor"] if killed else []))

    # --------------------------------------------------------------------------------------- checks

    def check(self, where: str) -> dict[str, Any]:
        """The checks that hold at any time: no prompt in two batches, staleness within eta, nobody given up."""
        trained, _ = chaos.ledger(self.run_dir)
        twice = sum(1 for n in trained.values() if n > 1)
        stale = max((r.get("staleness_max", 0) for r in chaos.step_records(self.run_dir)), default=0)
        given_up = "actor_given_up" in self.output()
        if twice or stale > chaos.ETA or given_up:
            raise SoakFailure(f"after {where}: {twice} prompts in two batches, staleness {stale} (eta {chaos.ETA}), "
                              f"{'a member given up' if given_up else 'nobody given up'}")
        return {"twice": twice, "staleness_max": stale}

    def finish(self, timeout: float) -> dict[str, Any]:
        """The last launch runs to its end: exit 0, steps 1..N each trained, nothing lost, a clean stop."""
        assert self.proc is not None
        unclean = self.launch_end(timeout, "the run did not end within {:g} s")
        trained = sorted({r["step"] for r in chaos.step_records(self.run_dir)})
        counts = chaos.account(self.run_dir)
        end = {"exit_code": self.proc.returncode, "steps_trained": len(trained), **counts, "clean_stop": not unclean}
        if (self.proc.returncode != 0 or trained != list(range(1, self.steps + 1)) or counts["lost"]
                or counts["twice"] or unclean):
            raise SoakFailure(f"at the end: {end}; {unclean or 'a clean stop'}")
        return end


def longest_gaps(faults: list[dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, float]:
    """Per actor kind (and launcher), the longest time from one of its faults to the trainer's next new step
    (a step beyond the newest one before the fault)."""
    out: dict[str, float] = {}
    for f in faults:
        after = [r["time"] for r in records if r["time"] > f["time"] and r["step"] > f["step"]]
        if not after:
            continue
        gap = min(after) - f["time"]
        kinds = {f["fault"]} if f["fault"].startswith("launcher") else {a.split(".")[0] for a in f["actors"]}
        for kind in kinds:
            out[kind] = round(max(out.get(kind, 0.0), gap), 1)
    return dict(sorted(out.items()))


def run_soak(assets: dict[str, Path], out: Path, steps: int, every: int, ckpt_every: int = 5, rollouts: int = 3,
             seed: int = 0, faults: list[str] | None = None, log: Callable[[str], None] = print,
             step_timeout: float = 600.0) -> dict[str, Any]:
    """The soak (see the module's docstring); `faults` replaces the drawn schedule. Returns the report; a check
    that fails ends it with `ok` false and the reason."""
    planned = faults if faults is not None else schedule(max(0, (steps - every) // every), seed)
    soak = Soak(assets, out, steps, every, ckpt_every, rollouts, seed, log, step_timeout)
    t0 = time.monotonic()
    report: dict[str, Any] = {"steps": steps, "every": every, "ckpt_every": ckpt_every, "rollouts": rollouts,
                              "seed": seed, "eta": chaos.ETA, "max_restarts": MAX_RESTARTS, "planned": len(planned)}
    soak.launch()
    try:
        for i, fault in enumerate(planned, 1):
            at = i * every
            if at >= steps:
                break
            soak.wait_for_step(at)
            record = soak.inject(fault)
            soak.faults.append(record)
            soak.wait_for_step(at + every)
            record.update(soak.check(f"fault {i} ({fault} on {record['actors'] or 'the launcher'})"))
            log(f"bench chaos --soak: fault {i}/{len(planned)} {fault} {record['actors'] or ''} at step "
                f"{record['step']}: survived")
        report["end"] = soak.finish(timeout=soak.step_timeout + steps * 5.0)
        report["ok"] = True
    except SoakFailure as exc:
        report.update(ok=False, failure=str(exc))
        log(f"bench chaos --soak: FAILED: {exc}")
    finally:
        if soak.proc is not None and soak.proc.poll() is None:
            chaos.kill_everything(soak.proc, soak.run_dir)
    records = chaos.step_records(soak.run_dir)
    report.update(
        faults_survived=len(soak.faults) - (0 if report["ok"] else 1), faults=soak.faults,
        fault_kinds=dict(Counter(f["fault"] for f in soak.faults)), launches=len(soak.launches),
        steps_trained=len({r["step"] for r in records}), longest_gap_s=longest_gaps(soak.faults, records),
        restarts=dict(Counter(line.split("actor=")[1].split()[0] for line in soak.output().splitlines()
                              if "actor_died" in line and "actor=" in line)),
        wall_s=round(time.monotonic() - t0, 1), run_dir=str(soak.run_dir))
    return report


def summary_lines(r: dict[str, Any]) -> list[str]:
    lines = [f"soak: {r['steps_trained']}/{r['steps']} steps, {r['faults_survived']}/{len(r['faults'])} faults "
             f"survived ({', '.join(f'{n}x {k}' for k, n in sorted(r['fault_kinds'].items()))}), "
             f"{r['launches']} launches, {r['wall_s']:.0f} s"]
    lines.append("longest time from a fault to the next new step, per kind: "
                 + ", ".join(f"{k} {v:.1f} s" for k, v in r["longest_gap_s"].items()))
    if r["ok"]:
        e = r["end"]
        lines.append(f"end: exit {e['exit_code']}, {e['lost']} lost, {e['twice']} trained twice, {e['issued']} "
                     f"prompts handed out, clean stop; nobody given up")
    else:
        lines.append(f"FAILED: {r['failure']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench chaos --soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--soak", action="store_true", help="(how tools.bench chooses this benchmark)")
    ap.add_argument("--steps", type=int, default=300, help="training steps of the run (300)")
    ap.add_argument("--every", type=int, default=9, help="steps between faults (9)")
    ap.add_argument("--ckpt-every", type=int, default=5, help="steps between checkpoints (5)")
    ap.add_argument("--rollouts", type=int, default=3, help="rollout actors (3)")
    ap.add_argument("--seed", type=int, default=0, help="the draw of faults and victims (0)")
    ap.add_argument("--out", default=None, help="folder for the run directory (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if not 0 < args.every < args.steps:
        ap.error(f"--every must be a step of the run (1 to {args.steps - 1})")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-soak-"))
    report = run_soak(chaos.make_assets(out / "assets"), out, args.steps, args.every, args.ckpt_every, args.rollouts,
                      args.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(report) if args.json else "\n".join(summary_lines(report)))
    return 0 if report["ok"] else 1
