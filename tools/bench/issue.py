"""`python -m tools.bench issue [--json] [--rollouts N] [--rewards N] [--per-rollout K] [--events N] [--sim-steps N]`

The buffer's issue path, side by side with the rule it replaced. `BufferState.issue_next` picks the
least-loaded rollout and reward actor from per-worker counts kept as groups are issued and released
(`BufferState.rollout_load`, `reward_load`); before, it counted them by scanning every group in flight on
every issue (`ScanLeastLoaded`, kept here as the reference). Two measurements, each running both rules in
the same process one after the other:

- **workload**: a randomized run of the buffer's decisions at a cluster's fan-out (default 192 rollouts of 8
  groups and 48 reward actors, as topology/64node.yaml): groups scored, handed back, dropped as invalid or
  stale, overdue, workers dying and saying hello again (with a KV pool that caps their groups), batches
  taken and versions set, with a fixed seed. Both rules must make the same decisions, issue by issue (a
  difference is an error, exit status 1); reported: CPU seconds spent in `issue_next` under each rule and their
  ratio.
- **planner**: `tools.plan`'s simulation of AReaL's 7B run on 16 nodes (tools.plan.published: 64 servers,
  512 x 16, eta 4) with this project's buffer rules, as the planner's sweep runs it, for `--sim-steps` steps
  under each rule: the same figures (step time, counters) and the
  CPU seconds of each (`--sim-steps 0` skips it).

Times are the process's CPU seconds (`time.process_time`), which other work on a shared machine disturbs less
than wall clock; compare them side by side only.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections import Counter
from typing import Any, Callable

from actors.buffer.state import BufferState
from algo.serving import DecodePace
from transport.protocol import Answers, Sample


class ScanLeastLoaded:
    """The least-loaded pick as `BufferState` made it before it kept per-worker counts: every group in flight
    is scanned on every issue. Mixed in ahead of a `BufferState` (sub)class: `scanning(rules)`."""

    def _least_loaded(self, names: list[str], load: Counter[str], alive: Callable[[str], bool],
                      cap: Callable[[str], int | None]) -> str | None:
        state: BufferState = self   # type: ignore[assignment]
        attr = "rollout" if load is state.rollout_load else "reward"
        counts = {r: 0 for r in names if r in state.greeted and alive(r)}
        for f in state.inflight.values():
            if getattr(f, attr) in counts:
                counts[getattr(f, attr)] += 1
        free = [(n, r) for r, n in counts.items() if cap(r) is None or n < cap(r)]
        return min(free)[1] if free else None


def scanning(rules: type[BufferState]) -> type[BufferState]:
    """`rules` with the old scanning pick."""
    return type(f"Scanning{rules.__name__}", (ScanLeastLoaded, rules), {})


def _answers(rollout: str, rng: random.Random, version: int, max_new: int) -> Answers:
    lag = rng.choice([0, 0, 0, 1, 2, 3])
    lengths = [rng.randint(1, max_new) for _ in range(4)]
    samples = [Sample(output_ids=range(n), logprobs=[], versions=[max(0, version - lag), version],  # type: ignore[arg-type]
                      finish_reason="stop", reward=rng.choice([0.0, 1.0])) for n in lengths]
    # 1-3 ms a token: the derived group timeout comes out near its 30 s floor, so some groups go overdue
    return Answers(samples=samples, rollout=rollout, gen_seconds=max(lengths) * rng.uniform(0.001, 0.003))


def workload(rules: type[BufferState], *, rollouts: int, rewards: int, per_rollout: int, events: int,
             seed: int, after_each: Callable[[BufferState], None] | None = None) -> tuple[list[tuple[Any, ...]], float]:
    """A randomized run of the buffer's decisions under `rules`: every decision it made, in order (each issue,
    each hand-back, each overdue group, each batch), and the CPU seconds spent in `issue_next`. The random
    choices depend only on `seed` and the decisions, so two rules that decide alike see the same run.
    `after_each(state)` is called after every event (tests check invariants with it)."""
    rng = random.Random(seed)
    names = [f"rollout.{i}" for i in range(rollouts)]
    graders = [f"reward.{i}" for i in range(rewards)]
    max_new = 4096
    st = rules(n_records=5000, rollouts=names, rewards=graders, batch_size=max(1, rollouts * per_rollout // 4),
               eta=2, seed=seed, dynamic_sampling=True, max_per_rollout=per_rollout, group_size=4,
               max_new_tokens=max_new, prompt_tokens=100.0, pace=DecodePace(50.0, 2.0, 30.0))
    for w in names + graders:
        if rng.random() < 0.9:   # the rest say hello later
            # a KV pool between 2 and 12 answers of max_new: some rollouts are capped below per_rollout
            st.worker_hello(w, kv_tokens=rng.randint(2, 12) * max_new if w in names else 0)
    dead: set[str] = set()
    alive = lambda name: name not in dead   # noqa: E731
    decisions: list[tuple[Any, ...]] = []
    gone: list[tuple[str, str]] = []                        # (group, rollout) handed back: their results are late
    issue_s, now, version = 0.0, 0.0, 0
    for _ in range(events):
        t0 = time.process_time()
        while (issue := st.issue_next(alive, now)) is not None:
            decisions.append(("issue", issue.group_id, issue.rollout, issue.reward))
        issue_s += time.process_time() - t0
        now += rng.uniform(0.0, 2.0)
        roll = rng.random()
        held = sorted(st.inflight)
        if roll < 0.75 and not held:                        # nothing in flight: time passes
            pass
        elif roll < 0.70:                                   # a result; now and then one issued again since (late)
            gid, rollout = rng.choice(gone) if gone and rng.random() < 0.05 else (g := rng.choice(held),
                                                                                   st.inflight[g].rollout)
            result = st.scored(gid, _answers(rollout, rng, version, max_new))
            decisions.append(("scored", gid, result.outcome))
        elif roll < 0.74:
            gid = rng.choice(held)
            gone.append((gid, st.inflight[gid].rollout))
            decisions.append(("hand_back", gid, st.hand_back(gid) is not None))
        elif roll < 0.75:
            gid = rng.choice(held)
            decisions.append(("invalid", gid, st.drop_invalid(gid) is not None))
        elif roll < 0.78:                                   # a worker dies
            w = rng.choice(names + graders)
            dead.add(w)
            decisions.append(("dead", w, sorted(st.hand_back_held_by(w))))
        elif roll < 0.82:                                   # a worker (re)starts
            w = rng.choice(names + graders)
            dead.discard(w)
            kv = rng.randint(2, 12) * max_new if w in names else 0
            decisions.append(("hello", w, sorted(st.worker_hello(w, kv_tokens=kv))))
        elif roll < 0.86:                                   # the overdue check; each overdue group aborted
            late = st.overdue(now)
            for gid in sorted(late):
                gone.append((gid, late[gid].rollout))
                st.hand_back(gid)
            decisions.append(("overdue", sorted(late)))
        else:                                               # the trainer asks for a batch
            dropped = st.drop_stale()
            batch = st.take_batch()
            decisions.append(("batch", [g.key for g in dropped], None if batch is None else [g.key for g in batch]))
            if batch is not None:
                version += 1
                st.set_version(version)
        if after_each is not None:
            after_each(st)
    return decisions, issue_s


def planner(rules: type[BufferState], steps: int) -> tuple[dict[str, Any], float]:
    """tools.plan's simulation of AReaL's 7B run on 16 nodes (eta 4, as the sweep runs it) under `rules`: its figures
    and CPU seconds."""
    from tools.plan import published, setup, sim

    cfg = dataclasses.replace(setup.sim_config(published.cluster("7B", 16, 16), eta=4, steps=steps),
                              buffer_rules=rules)
    t0 = time.process_time()
    result = sim.simulate(cfg)
    seconds = time.process_time() - t0
    return {"step_time_s": result.step_time, "counters": result.counters}, seconds


def run(rollouts: int, rewards: int, per_rollout: int, events: int, sim_steps: int, seed: int) -> dict[str, Any]:
    kw = dict(rollouts=rollouts, rewards=rewards, per_rollout=per_rollout, events=events, seed=seed)
    counted, counted_s = workload(BufferState, **kw)
    scanned, scanned_s = workload(scanning(BufferState), **kw)
    out: dict[str, Any] = {"workload": {
        **kw, "decisions": len(counted), "issues": sum(d[0] == "issue" for d in counted),
        "identical": counted == scanned, "issue_cpu_s_scan": scanned_s, "issue_cpu_s_counts": counted_s,
        "speedup": scanned_s / counted_s}}
    if sim_steps:
        new, new_s = planner(BufferState, sim_steps)
        old, old_s = planner(scanning(BufferState), sim_steps)
        out["planner"] = {"run": "7B on 16 nodes, 512 x 16, eta 4 (tools.plan.published.cluster), the buffer's rules", "steps": sim_steps,
                          "identical": new == old, "step_time_s": new["step_time_s"], "cpu_s_scan": old_s,
                          "cpu_s_counts": new_s, "speedup": old_s / new_s}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench issue", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=192)
    ap.add_argument("--rewards", type=int, default=48)
    ap.add_argument("--per-rollout", type=int, default=8, help="buffer.max_groups_per_rollout")
    ap.add_argument("--events", type=int, default=5000, help="random events of the workload")
    ap.add_argument("--sim-steps", type=int, default=3, help="steps of the planner's simulation (0: skip it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if min(args.rollouts, args.rewards, args.per_rollout, args.events) < 1 or args.sim_steps < 0:
        print("--rollouts, --rewards, --per-rollout and --events must be >= 1, --sim-steps >= 0", file=sys.stderr)
        return 2
    out = run(args.rollouts, args.rewards, args.per_rollout, args.events, args.sim_steps, args.seed)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        w = out["workload"]
        print(f"workload: {w['rollouts']} rollouts x {w['per_rollout']} groups, {w['rewards']} reward actors, "
              f"{w['events']} events, {w['issues']} issues; decisions identical: {w['identical']}; issue_next "
              f"{w['issue_cpu_s_scan']:.2f} CPU s scanning, {w['issue_cpu_s_counts']:.2f} s with counts: {w['speedup']:.1f}x")
        if "planner" in out:
            p = out["planner"]
            print(f"planner: {p['run']}, {p['steps']} steps; figures identical: {p['identical']}; "
                  f"{p['cpu_s_scan']:.1f} CPU s scanning, {p['cpu_s_counts']:.1f} s with counts: {p['speedup']:.1f}x")
    identical = out["workload"]["identical"] and out.get("planner", {}).get("identical", True)
    if not identical:
        print("the two rules made different decisions", file=sys.stderr)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
