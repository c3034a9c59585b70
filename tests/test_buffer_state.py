"""The buffer's decisions (actors/buffer/state.py) on plain data: dispatch under the staleness gate,
dynamic sampling, batches with the second staleness check, re-issue of lost work, and checkpoints that
lose no prompt and train none twice. The actor around it runs in tests/test_e2e_loop.py."""
from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from actors.buffer.state import BufferState, Resume, ledger_after_resume, plan_resume
from algo.serving import DecodePace, groups_in_kv
from tools.bench import issue as issue_bench
from transport.protocol import Answers, Sample, WorkerHello


def everyone_alive(name: str) -> bool:
    """The bus's liveness view in these tests: every worker is up."""
    return True


def state(eta: int = 1, batch_size: int = 4, rollouts: int = 2, rewards: int = 1, n_records: int = 10,
          **kw: object) -> BufferState:
    st = BufferState(n_records=n_records, rollouts=[f"rollout.{i}" for i in range(rollouts)],
                     rewards=[f"reward.{i}" for i in range(rewards)], batch_size=batch_size, eta=eta, seed=7, **kw)
    for w in st.rollouts + st.rewards:
        st.worker_hello(w)
    return st


def answers(rollout: str = "rollout.0", versions: tuple[int, ...] = (0, 0), rewards: tuple[float, ...] = (5.0, -5.0),
            busy: float = 0.0, up: float = 0.0) -> Answers:
    samples = [Sample(output_ids=[2] * len(versions), logprobs=[-1.0] * len(versions), versions=list(versions),
                      finish_reason="stop", reward=r) for r in rewards]
    return Answers(samples=samples, rollout=rollout, busy_seconds=busy, up_seconds=up)


def issue_all(st: BufferState, alive=everyone_alive, now: float = 0.0) -> list:
    out = []
    for _ in range(1000):
        issue = st.issue_next(alive, now)
        if issue is None:
            return out
        out.append(issue)
    raise AssertionError("the gate never closed")


# ---------------------------------------------------------------- dispatch


def test_work_goes_to_the_least_loaded_greeted_live_worker_under_the_gate() -> None:
    st = state(eta=1, batch_size=4, rollouts=3)
    st.greeted.discard("rollout.2")                               # no hello yet: gets nothing
    issues = issue_all(st, alive=lambda name: name != "rollout.1")
    assert len(issues) == (0 + 1 + 1) * 4                         # (v + eta + 1) * B
    assert {i.rollout for i in issues} == {"rollout.0"} and {i.reward for i in issues} == {"reward.0"}
    st.set_version(1)
    more = issue_all(st)                                          # everyone up now: rollout.1 catches up first
    assert [i.rollout for i in more] == ["rollout.1"] * 4
    assert len({i.group_id for i in issues + more}) == 12 and len({i.seed for i in issues + more}) == 12


def test_a_rollout_holds_at_most_max_per_rollout_groups() -> None:
    st = state(eta=4, rollouts=2, max_per_rollout=3)
    issues = issue_all(st)
    assert sorted(i.rollout for i in issues) == ["rollout.0"] * 3 + ["rollout.1"] * 3
    assert st.gate.running == 6 and st.gate.can_admit()            # the gate has room, the workers do not


def test_max_concurrent_caps_the_groups_in_flight() -> None:
    st = state(eta=4, max_concurrent=5)
    assert len(issue_all(st)) == 5


def test_a_rollout_behind_the_gate_gets_one_group_at_a_time() -> None:
    # A rollout whose weights are older than eta allows generates only stale groups; sending it a full
    # load again and again flooded its queues until its heartbeats went unanswered (the run stalled).
    st = state(eta=1)
    assert st.rollout_cap("rollout.0") == 8                        # nothing seen yet
    assert st.scored("not-in-flight", answers("rollout.0", (2, 3))).outcome == "late"   # version noted
    st.set_version(4)
    assert st.rollout_cap("rollout.0") == 8                        # 4 - 3 <= eta
    st.set_version(5)
    assert st.rollout_cap("rollout.0") == 1                        # 5 - 3 > eta: one group, to learn when it caught up
    st.scored("not-in-flight", answers("rollout.0", (4, 5)))
    assert st.rollout_cap("rollout.0") == 8
    st.set_version(7)
    st.worker_hello("rollout.0")                                   # restarted: its old weights are forgotten
    assert st.rollout_cap("rollout.0") == 8


def test_the_cursor_walks_a_seeded_permutation_and_starts_a_new_data_pass() -> None:
    st = state(eta=8, batch_size=4, n_records=5)
    keys = [i.key for i in issue_all(st)][:12]
    assert [e for e, _ in keys] == [0] * 5 + [1] * 5 + [2] * 2
    assert sorted(k for e, k in keys if e == 0) == list(range(5)) == sorted(k for e, k in keys if e == 1)
    assert [k for e, k in keys if e == 0] == [k for e, k in [i.key for i in issue_all(state(eta=8, n_records=5))][:5]]
    assert st.stats.data_pass == 3


def test_the_load_counts_are_the_groups_in_flight_after_every_decision() -> None:
    """Issue, score, hand back, drop as invalid, overdue, worker deaths and hellos, batches: after each, the
    per-worker counts the least-loaded pick reads are a recount of the groups in flight."""
    def recount(st: BufferState) -> None:
        assert +st.rollout_load == Counter(f.rollout for f in st.inflight.values())
        assert +st.reward_load == Counter(f.reward for f in st.inflight.values())
        assert min(st.rollout_load.values(), default=0) >= 0 and min(st.reward_load.values(), default=0) >= 0

    decisions, _ = issue_bench.workload(BufferState, rollouts=6, rewards=2, per_rollout=3, events=600, seed=1,
                                        after_each=recount)
    kinds = Counter(d[0] for d in decisions)
    assert all(kinds[k] > 0 for k in ("issue", "scored", "hand_back", "invalid", "dead", "hello", "overdue", "batch"))


@pytest.mark.parametrize("seed", range(3))
def test_the_least_loaded_pick_from_counts_decides_as_the_scan_of_every_group_in_flight(seed: int) -> None:
    """The pick from per-worker counts makes the decisions the scan of every group in flight made
    (`tools.bench.issue.ScanLeastLoaded`), issue by issue, on a randomized run with ties, KV-pool caps,
    rollouts behind the gate, dead and ungreeted workers. The run is sensitive to the rule: a pick that breaks
    ties the other way, or ignores the caps, decides differently."""
    kw = dict(rollouts=12, rewards=3, per_rollout=4, events=1500, seed=seed)
    counted, _ = issue_bench.workload(BufferState, **kw)
    scanned, _ = issue_bench.workload(issue_bench.scanning(BufferState), **kw)
    assert counted == scanned
    issued = [d for d in counted if d[0] == "issue"]
    assert len(issued) > 800 and len({d[2] for d in issued}) == 12 and len({d[3] for d in issued}) == 3
    assert any(d[0] == "overdue" and d[1] for d in counted)
    assert {d[2] for d in counted if d[0] == "scored"} == {"accepted", "uniform", "late"}

    class LastNameWins(BufferState):
        def _least_loaded(self, names, load, alive, cap):  # type: ignore[no-untyped-def]
            ok = [r for r in names if r in self.greeted and alive(r) and (cap(r) is None or load[r] < cap(r))]
            return max(ok, key=lambda r: (-load[r], r)) if ok else None

    class NoCaps(BufferState):
        def rollout_cap(self, rollout: str) -> int:
            return self.max_per_rollout

    for rules in (LastNameWins, NoCaps):
        assert issue_bench.workload(rules, **kw)[0] != scanned, rules.__name__


# ---------------------------------------------------------------- results and batches


def test_dynamic_sampling_drops_uniform_groups_and_refills_their_slot() -> None:
    st = state(eta=0, batch_size=2, dynamic_sampling=True)
    a, b = issue_all(st)
    assert st.scored(a.group_id, answers(rewards=(5.0, 5.0))).outcome == "uniform"
    assert st.uniform_streak == 1 and st.stats.dropped_uniform == 1 and not st.ready
    assert st.scored(b.group_id, answers(rewards=(5.0, -5.0))).outcome == "accepted" and st.uniform_streak == 0
    assert len(issue_all(st)) == 1                                  # the dropped group's slot, nothing more
    off = state(eta=0, batch_size=2)
    assert off.scored(issue_all(off)[0].group_id, answers(rewards=(5.0, 5.0))).outcome == "accepted"


def test_a_batch_takes_the_oldest_fresh_groups_and_reissues_the_stale_first() -> None:
    st = state(eta=1, batch_size=2)
    first = issue_all(st)                                           # 4 groups at version 0
    for i, versions in zip(first, [(0, 1), (0, 0), (1, 1), (1, 2)]):
        assert st.scored(i.group_id, answers(versions=versions)).outcome == "accepted"
    st.set_version(2)
    stale = st.drop_stale()
    assert [g.key for g in stale] == [first[0].key, first[1].key] and st.stats.dropped_stale == 2
    assert st.gate.accepted == 2 and [k for k in st.reissue] == [first[0].key, first[1].key]
    batch = st.take_batch()
    assert batch is not None and [g.key for g in batch] == [first[2].key, first[3].key]
    assert [g.start_version for g in batch] == [1, 1]
    assert st.take_batch() is None
    again = issue_all(st)
    assert [i.key for i in again[:2]] == [first[0].key, first[1].key]   # the stale prompts come back first
    stats = st.batch_stats()
    assert (stats.depth, stats.running, stats.accepted, stats.dropped_stale) == (0, len(again), 2, 2)


def test_a_group_newer_than_the_buffers_version_is_fresh() -> None:
    st = state(eta=0, batch_size=1)
    (i,) = issue_all(st)
    st.scored(i.group_id, answers(versions=(1, 2)))                  # weights ahead of the VersionUpdate
    assert st.drop_stale() == [] and st.take_batch() is not None


def test_rollout_utilisation_counts_since_the_previous_batch() -> None:
    st = state(eta=4, batch_size=1)
    a, b, c = issue_all(st)[:3]
    assert st.batch_stats().rollout_utilisation == -1.0             # no clocks yet
    st.scored(a.group_id, answers("rollout.0", busy=3.0, up=4.0))
    st.scored(b.group_id, answers("rollout.1", busy=1.0, up=4.0))
    assert st.batch_stats().rollout_utilisation == pytest.approx(0.5)
    st.scored(c.group_id, answers("rollout.0", busy=1.0, up=2.0))   # restarted: its clocks began again
    assert st.batch_stats().rollout_utilisation == pytest.approx(0.5)


def test_rollout_utilisation_stays_a_share_when_a_slow_restart_outlives_the_old_uptime() -> None:
    # rollout.0 was up 10 s (busy 2 s) at the last batch; it restarts, and its new process is up 12 s (busy 11 s)
    # by the next: counted from its hello, not as the old process's clocks subtracted from the new ones
    st = state(eta=8, batch_size=2, n_records=40)
    on_rollout_1 = [i for i in issue_all(st) if i.rollout == "rollout.1"]   # groups a restart of rollout.0 leaves
    a, b, c, d = on_rollout_1[:4]
    st.scored(a.group_id, answers("rollout.0", busy=2.0, up=10.0))
    st.scored(b.group_id, answers("rollout.1", busy=5.0, up=10.0))
    st.batch_stats()
    st.worker_hello("rollout.0")
    st.scored(c.group_id, answers("rollout.0", busy=11.0, up=12.0))
    st.scored(d.group_id, answers("rollout.1", busy=6.0, up=12.0))
    assert st.batch_stats().rollout_utilisation == pytest.approx((11.0 + 1.0) / (12.0 + 2.0))
    # clocks of one process that disagree (busy gained past up) count as busy the whole time, never more
    st.scored(on_rollout_1[4].group_id, answers("rollout.1", busy=9.0, up=13.0))
    assert 0.0 <= st.batch_stats().rollout_utilisation <= 1.0


# ---------------------------------------------------------------- lost work


def test_a_dead_or_restarted_workers_groups_are_issued_again_and_late_answers_ignored() -> None:
    st = state(eta=0, batch_size=4, rollouts=2, rewards=2)
    issues = issue_all(st)
    held = {i.group_id for i in issues if "rollout.1" in (i.rollout, i.reward) or i.reward == "reward.1"}
    gone = st.hand_back_held_by("rollout.1") | st.worker_hello("reward.1")
    assert set(gone) == held and st.stats.returned == len(held) and st.gate.running == 4 - len(held)
    again = issue_all(st)
    assert sorted(i.key for i in again) == sorted(f.key for f in gone.values())
    lost = next(iter(gone))
    assert st.scored(lost, answers()).outcome == "late"               # the re-issue wins
    assert st.hand_back(lost) is None                                 # handed back once only


def test_a_silent_worker_keeps_its_groups_until_it_restarts_or_stays_silent_too_long() -> None:
    """The buffer actor's handling of the bus's verdicts (BufferActor.on_peer_dead / on_peer_alive / the hello /
    the periodic check): a rollout that missed one heartbeat timeout and is heard again keeps its groups (the
    buffer once issued them again at once, and a node's restart on a loaded machine made 56 groups run twice);
    a restarted one's are issued again at its hello; one unheard for the limit loses them, and is asked to stop
    them should it wake."""
    import asyncio
    from types import SimpleNamespace

    import structlog

    from actors.buffer.actor import BufferActor

    st = state(eta=2, batch_size=4, rollouts=3, silence_limit_s=30.0, group_timeout_s=1000.0)
    issues = issue_all(st, now=time.time())
    held = {r: [i for i in issues if i.rollout == r] for r in st.rollouts}
    assert all(held.values())
    buffer = BufferActor.__new__(BufferActor)
    spawned: list[str] = []

    def spawn(coro: object, name: str, critical: bool = True) -> None:
        coro.close()   # type: ignore[attr-defined]
        spawned.append(name)

    buffer.__dict__.update(state=st, log=structlog.get_logger("test"), changed=asyncio.Event(), spawn=spawn,
                           cfg=SimpleNamespace(bus=SimpleNamespace(heartbeat_timeout=5.0)))

    def reissued() -> set:
        return set(st.reissue)

    # Unheard for a bit more than one heartbeat timeout, then heard again: nothing is issued again.
    buffer.on_peer_dead("rollout.1")
    assert reissued() == set()
    buffer._expire(time.time() + 1.0)
    buffer.on_peer_alive("rollout.1")
    buffer._expire(time.time() + 60.0)
    assert reissued() == set() and st.stats.returned == 0 and spawned == []
    assert all(i.group_id in st.inflight for i in held["rollout.1"])
    assert st.scored(held["rollout.1"][0].group_id, answers("rollout.1")).outcome == "accepted"
    # Unheard, then a hello from its new incarnation: a restart lost its groups, issued again at once.
    buffer.on_peer_dead("rollout.0")
    buffer.on_worker_hello(WorkerHello(role="rollout"), SimpleNamespace(sender="rollout.0"))
    assert reissued() == {i.key for i in held["rollout.0"]}
    # Unheard and never heard again: its groups go once it has been silent for the limit, not before.
    buffer.on_peer_dead("rollout.2")
    now = time.time()
    buffer._expire(now + 20.0)                      # silent 25 s
    assert reissued() == {i.key for i in held["rollout.0"]}
    buffer._expire(now + 26.0)                      # silent 31 s
    assert reissued() == {i.key for i in held["rollout.0"] + held["rollout.2"]}
    assert sorted(spawned) == sorted(f"abort-{i.group_id}" for i in held["rollout.2"])
    assert all(st.scored(i.group_id, answers("rollout.2")).outcome == "late" for i in held["rollout.2"])
    assert st.stats.returned == len(held["rollout.0"]) + len(held["rollout.2"])


def test_a_restarted_worker_s_groups_are_handed_back_at_once_and_it_gets_no_work_until_its_hello() -> None:
    # Its supervisor restarted it and the new process pings but never says hello (its server never gets
    # healthy): its pings cleared the silence, and the old process's groups waited for their timeout.
    st = state(eta=3, batch_size=4, rollouts=2, rewards=2, max_per_rollout=3)
    issues = issue_all(st)
    held = {i.group_id for i in issues if i.rollout == "rollout.1"}
    assert held and st.rollout_load["rollout.1"] == len(held)
    st.worker_silent("rollout.1", 0.0)
    gone = st.worker_restarted("rollout.1")
    assert set(gone) == held and sorted(st.reissue) == sorted(i.key for i in issues if i.group_id in held)
    assert st.rollout_load["rollout.1"] == 0 and "rollout.1" not in st.silent_since and "rollout.1" not in st.greeted
    assert st.silent_too_long(1e9) == {}                          # nothing left to hand back for its silence
    for g in list(st.inflight):                                   # the others' groups come back: room for more
        st.scored(g, answers())
    more = issue_all(st)
    assert more and {i.rollout for i in more} == {"rollout.0"}    # no hello yet: no work
    # its hello: nothing handed back twice; work again
    assert st.worker_hello("rollout.1") == {} and st.stats.returned == len(held)
    again = issue_all(st)
    assert again and {i.rollout for i in again} == {"rollout.1"}


def test_a_restarted_reward_actor_s_groups_are_handed_back_and_scored_elsewhere() -> None:
    st = state(eta=3, batch_size=4, rollouts=2, rewards=2)
    issues = issue_all(st)
    held = {i.group_id for i in issues if i.reward == "reward.1"}
    assert held and st.reward_load["reward.1"] == len(held)
    assert set(st.worker_restarted("reward.1")) == held and st.reward_load["reward.1"] == 0
    for g in list(st.inflight):
        st.scored(g, answers())
    assert {i.reward for i in issue_all(st)} == {"reward.0"}
    assert all(st.scored(g, answers()).outcome == "late" for g in held)   # the old process's answers: too late
    assert st.worker_hello("reward.1") == {}


def test_the_buffer_actor_reissues_a_restarted_worker_s_groups_naming_the_restart() -> None:
    """BufferActor.on_peer_restarted, then the new process's hello; a worker paused and heard again keeps its
    groups (the same process: its bus's incarnation did not change, so no restart is reported)."""
    import asyncio
    from types import SimpleNamespace

    import structlog
    from structlog.testing import capture_logs

    from actors.buffer.actor import BufferActor

    st = state(eta=2, batch_size=4, rollouts=2, rewards=1, silence_limit_s=30.0, group_timeout_s=1000.0)
    issues = issue_all(st, now=time.time())
    held = {r: {i.group_id for i in issues if i.rollout == r} for r in st.rollouts}
    buffer = BufferActor.__new__(BufferActor)
    buffer.__dict__.update(state=st, log=structlog.get_logger("test"), changed=asyncio.Event(),
                           cfg=SimpleNamespace(bus=SimpleNamespace(heartbeat_timeout=5.0)))
    with capture_logs() as logs:
        buffer.on_peer_dead("rollout.0")                     # a pause: dead, then heard again
        buffer.on_peer_alive("rollout.0")
        buffer.on_peer_dead("rollout.1")                     # killed; its new process pings: alive, restarted
        buffer.on_peer_alive("rollout.1")
        buffer.on_peer_restarted("rollout.1")
        buffer.on_peer_restarted("evaluator")                # not a worker of the buffer: nothing
        buffer.on_worker_hello(WorkerHello(role="rollout"), SimpleNamespace(sender="rollout.1"))
    reissued = [e for e in logs if e["event"] == "group_reissued"]
    assert {e["group"] for e in reissued} == held["rollout.1"]
    assert {e["reason"] for e in reissued} == {"rollout.1 restarted"}
    assert [(e["worker"], e["groups_reissued"]) for e in logs if e["event"] == "worker_restarted"] == \
        [("rollout.1", len(held["rollout.1"]))]
    assert held["rollout.0"] <= set(st.inflight) and st.stats.returned == len(held["rollout.1"])
    assert buffer.changed.is_set() and "rollout.1" in st.greeted


def test_groups_with_no_result_expire_and_invalid_prompts_are_dropped() -> None:
    st = state(eta=0, batch_size=2, group_timeout_s=10.0)
    a, b = issue_all(st, now=0.0)
    assert st.overdue(5.0) == {}
    assert set(st.overdue(11.0)) == {a.group_id, b.group_id} and not st.reissue
    for g in (a, b):
        st.hand_back(g.group_id)      # their rollouts stopped them
    assert list(st.reissue) == [a.key, b.key]
    c, d = issue_all(st, now=20.0)
    assert (c.key, d.key) == (a.key, b.key)
    dropped = st.drop_invalid(c.group_id)
    assert dropped is not None and dropped.key == c.key and c.key not in st.reissue
    assert st.drop_invalid(c.group_id) is None and st.gate.running == 1 and st.gate.accepted == 0


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_records_untrained_work_for_reissue_and_the_gate_as_it_will_be() -> None:
    st = state(eta=1, batch_size=2)
    issues = issue_all(st)
    st.scored(issues[0].group_id, answers())
    st.scored(issues[1].group_id, answers())
    assert [g.key for g in st.take_batch()] == [issues[0].key, issues[1].key]
    st.scored(issues[2].group_id, answers())                          # ready, not trained
    st.hand_back(issues[3].group_id)                                  # waiting for re-issue
    saved = st.state_dict()
    assert saved["gate"]["accepted"] == 2 and saved["gate"]["running"] == 0
    assert [tuple(k) for k in saved["reissue"]] == [issues[2].key, issues[3].key]
    back = state(eta=1, batch_size=2)
    back.load_state_dict(saved)
    assert (back.data_pass, back.position, back.attempts) == (st.data_pass, st.position, st.attempts)
    resumed = issue_all(back)
    assert [i.key for i in resumed[:2]] == [issues[2].key, issues[3].key]
    assert len(resumed) == 2 and back.gate.running == 2               # (1 + 1 + 1) * 2 - 2 accepted - 2 running
    fresh = state(eta=1, batch_size=2)
    assert back.order == fresh._permutation(back.data_pass)


def test_the_buffer_checkpoints_into_its_own_run_directory_only(tmp_path) -> None:
    """CheckpointRequest names only a step: where the state goes is the buffer's own run directory. Served
    batches up to the newest complete checkpoint are removed; a step that is none is refused."""
    import json

    from actors.buffer.actor import BufferFiles
    from actors.runtime.recovery import checkpoint_dir, mark_complete
    files = BufferFiles(tmp_path)
    for step in (2, 3, 4):
        files.served_path(step).write_bytes(b"")
    (checkpoint_dir(tmp_path, 3) / "model").mkdir(parents=True)   # a complete checkpoint has both parts
    (checkpoint_dir(tmp_path, 3) / "model" / "model.safetensors").write_bytes(b"weights")
    (checkpoint_dir(tmp_path, 3) / "buffer.json").write_text("{}")
    mark_complete(checkpoint_dir(tmp_path, 3), {"step": 3})
    path = files.write_checkpoint(4, {"position": 5})
    assert path == checkpoint_dir(tmp_path, 4) / "buffer.json" and json.loads(path.read_text()) == {"position": 5}
    assert files.served_steps() == [4]
    with pytest.raises(ValueError, match="not a training step"):
        files.write_checkpoint(-1, {})


# ---------------------------------------------------------------- resuming after a restart


def test_a_resume_serves_again_the_batches_served_since_its_checkpoint_in_order() -> None:
    assert plan_resume([1, 2, 3, 4], 2) == Resume(served_again=[3, 4], discarded=[], served_through=4)
    assert plan_resume([3, 5], 2) == Resume(served_again=[], discarded=[3, 5], served_through=2)  # a gap
    assert plan_resume([4], 2) == Resume(served_again=[], discarded=[4], served_through=2)
    assert plan_resume([], 0) == Resume(served_again=[], discarded=[], served_through=0)
    st = state()
    st.served(6)
    st.resume(plan_resume([3, 4], 2), None)
    assert st.served_through == 4 and st.serves_again(4) and not st.serves_again(5)


def test_the_ledger_after_a_resume_drops_rolled_back_batches_and_restores_a_lost_line() -> None:
    ledger = [{"event": "batch", "step": 1}, {"event": "dropped_uniform", "key": [0, 3]},
              {"event": "batch", "step": 2}, {"event": "batch", "step": 3}, {"event": "batch", "step": 4}]
    # steps 3 and 4 are served again; step 5's batch reached the disk but not the ledger before a crash
    resume = plan_resume([3, 4, 5], 2)
    saved = {k: {"event": "batch", "step": k, "keys": [[0, k]]} for k in (3, 4, 5)}
    assert ledger_after_resume(ledger, resume, saved) == ledger + [saved[5]]
    # a gap: nothing after the checkpoint is served again, so those batches leave the ledger
    assert ledger_after_resume(ledger, plan_resume([3, 5], 2), saved) == ledger[:3]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_run_with_deaths_drops_and_restores_trains_every_prompt_once_within_eta(seed: int, dynamic: bool) -> None:
    """Random arrivals, worker deaths and restarts (a hello later, or none), uniform and stale groups, and
    restores from the last checkpoint (what happened after it is rolled back, as the trainer's and the
    ledger's steps are): every prompt
    the cursor handed out is trained once, dropped as uniform once, or still pending, and every trained
    group is within eta; the run keeps making progress."""
    rng = random.Random(seed)
    B, eta, steps = 3, 1, 25

    def make() -> BufferState:
        return state(eta=eta, batch_size=B, rollouts=2, n_records=7, dynamic_sampling=dynamic)

    st = make()
    events: list[tuple[str, tuple[int, int]]] = []                     # ("trained" | "uniform", key)
    version, checkpoint = 0, (0, 0, st.state_dict())                  # (version, len(events), state)
    for _ in range(20_000):
        if version >= steps:
            break
        issue_all(st)
        assert all(f.rollout in st.greeted and f.reward in st.greeted for f in st.inflight.values())
        roll = rng.random()
        if st.inflight and roll < 0.6:
            gid = rng.choice(list(st.inflight))
            lag = rng.choice([0, 0, 0, 1, 2])
            rewards = (5.0, 5.0) if rng.random() < 0.2 else (5.0, -5.0)
            result = st.scored(gid, answers(versions=(max(0, version - lag), version), rewards=rewards))
            if result.outcome == "uniform":
                events.append(("uniform", result.key))
        elif st.inflight and roll < 0.63:
            st.hand_back_held_by(rng.choice(st.rollouts))
        elif st.inflight and roll < 0.65:                                # unheard: heard again, or gone too long
            worker = rng.choice(st.rollouts + st.rewards)
            st.worker_silent(worker, 0.0)
            if rng.random() < 0.5:
                st.worker_heard(worker)
            st.silent_too_long(rng.choice([10.0, 100.0]))
        elif roll < 0.67:                                                # restarted: its hello comes later, or not
            worker = rng.choice(st.rollouts + st.rewards)
            st.worker_restarted(worker)
            assert worker not in st.greeted
        elif roll < 0.7 and (waiting := sorted(set(st.rollouts + st.rewards) - st.greeted)):
            assert st.worker_hello(rng.choice(waiting)) == {}, "a restarted worker's hello handed back work twice"
        elif roll < 0.9:
            st.drop_stale()
            batch = st.take_batch()
            if batch is not None:
                assert all(version - g.start_version <= eta for g in batch)
                events.extend(("trained", g.key) for g in batch)
                version += 1
                st.set_version(version)
                if rng.random() < 0.3:
                    checkpoint = (version, len(events), st.state_dict())
        elif roll < 0.93:                                                # crash: back to the last checkpoint
            version, n_events, saved = checkpoint
            st = make()
            st.load_state_dict(saved)
            st.set_version(version)
            events = events[:n_events]
    assert version >= steps, f"stalled at version {version}: {st.gate}"
    assert sum(kind == "trained" for kind, _ in events) == B * steps
    pending = [tuple(k) for k in st.state_dict()["reissue"]]
    accounted = [k for _, k in events] + pending
    handed_out = [(e, i) for e in range(st.data_pass) for i in range(7)] + [(st.data_pass, i) for i in st.order[:st.position]]
    assert len(accounted) == len(set(accounted)), "a prompt was trained or dropped twice"
    assert set(accounted) == set(handed_out), "a prompt was lost"


# ---------------------------------------------------------------- long generations


def test_an_overdue_group_keeps_its_slot_until_its_copy_is_stopped() -> None:
    # Re-issued at once, a group whose answers are merely long runs twice on a server that was already
    # behind: the second copy times out in turn, and the load piles up.
    st = state(eta=4, batch_size=4, rollouts=1, max_per_rollout=2, group_timeout_s=100.0)
    a, b = issue_all(st, now=0.0)
    late = st.overdue(150.0)
    assert set(late) == {a.group_id, b.group_id} and all(f.aborting for f in late.values())
    assert st.overdue(300.0) == {}                         # once each
    assert not st.reissue and issue_all(st, now=300.0) == []   # the slots stay taken: nothing more goes there
    st.hand_back(a.group_id)                               # its rollout says the copy stopped
    [again] = issue_all(st, now=301.0)
    assert again.key == a.key and again.group_id != a.group_id
    assert st.scored(b.group_id, answers()).outcome == "accepted"   # finished after all, as the abort went out


def test_each_rollout_s_issues_aborts_and_re_issues_are_counted() -> None:
    # What tools.plan reports per server comes from these counts, not from a copy of the rules.
    st = state(eta=4, batch_size=4, rollouts=2, max_per_rollout=1, group_timeout_s=100.0)
    a, b = issue_all(st, now=0.0)
    assert a.rollout != b.rollout
    st.overdue(150.0)
    st.hand_back(a.group_id)
    issue_all(st, now=151.0)
    assert st.per_rollout[a.rollout] == {"issued": 2, "overdue": 1, "handed_back": 1}
    assert st.per_rollout[b.rollout] == {"issued": 1, "overdue": 1}


def test_the_group_timeout_follows_the_measured_pace() -> None:
    # A fixed 1,800 s cuts 32k-token answers of a 32B model (AReaL's published step there is 6,707 s).
    st = state(group_timeout_s=None, max_new_tokens=31744, group_size=2, pace=DecodePace(5.0, 3.0, 60.0))
    assert st.group_timeout() == pytest.approx(3 * 31744 / 5.0)        # assumed until measured
    [issue, *_] = issue_all(st)
    slow = answers()
    slow.samples[0].output_ids = [2] * 20000
    slow.gen_seconds = 4000.0                                         # 0.2 s per token for its longest answer
    st.scored(issue.group_id, slow)
    assert st.group_timeout() == pytest.approx(3 * 31744 * 0.2)       # 19,046 s
    assert state(group_timeout_s=1800.0).group_timeout() == 1800.0    # a configured one stays fixed


def test_a_rollout_holds_the_groups_its_servers_kv_pool_fits() -> None:
    # topology/64node.yaml at 7B: the KV pool of a tp-2 server holds 60 answers of 32k (tools.plan); 16
    # answers a group and 8 groups a rollout put 128 requests on it.
    st = state(eta=8, batch_size=64, rollouts=2, max_per_rollout=8, group_size=16, max_new_tokens=31744,
               prompt_tokens=1024.0)
    st.worker_hello("rollout.0", kv_tokens=60 * 32768)
    issues = issue_all(st)
    held = {r: sum(1 for i in issues if i.rollout == r) for r in st.rollouts}
    assert held == {"rollout.0": 3, "rollout.1": 8}        # rollout.1 reported no pool: max_groups_per_rollout
    assert st.rollout_cap("rollout.0") == groups_in_kv(60 * 32768, 16, 1024 + 31744, 8) == 3
    short = answers(versions=(0,) * 16, rewards=(5.0,) * 16)
    for sample in short.samples:
        sample.output_ids = [2] * 4000
    st.scored(issues[0].group_id, short)                   # answers are shorter than the limit: more fit
    assert st.rollout_cap("rollout.0") == 8                # 1,966,080 // (16 x 5,024) = 24, at most 8


# ---------------------------------------------------------------- versions


def test_a_version_no_served_batch_can_have_produced_is_refused_with_a_log_line() -> None:
    # A VersionUpdate to 1,000,000 once opened the gate for good: every group then looked stale, the run stalled.
    import asyncio
    from collections import Counter

    from actors.buffer.actor import BufferActor
    from transport.protocol import VersionUpdate

    st = state(batch_size=2)
    assert st.version_reachable(0) and not st.version_reachable(1)
    st.served(3)
    assert st.version_reachable(3) and not any(st.version_reachable(v) for v in (4, 10**6, -1))

    logged: list[tuple[str, dict]] = []
    buffer = BufferActor.__new__(BufferActor)            # only what the handler reads
    buffer.state, buffer.counters = st, Counter()
    buffer.changed, buffer.arrived = asyncio.Event(), asyncio.Event()
    buffer.log = type("Log", (), {"warning": lambda self, event, **kw: logged.append((event, kw))})()
    buffer.on_version(VersionUpdate(version=10**6))
    assert st.gate.version == 0 and buffer.counters["versions_refused"] == 1
    assert logged == [("version_refused", {"version": 10**6, "gate_version": 0, "served_through": 3,
                                           "reason": "no batch past step 3 was served, so the trainer cannot have "
                                                     "finished step 1000000; the gate stays where it is"})]
    buffer.on_version(VersionUpdate(version=2))
    assert st.gate.version == 2 and len(logged) == 1


def test_the_kv_context_is_the_mean_of_the_last_1024_answers() -> None:
    # rollout_cap reads it for every rollout on every issue: kept as a running sum over a sliding window.
    st = state(eta=1000, batch_size=1, rollouts=1, max_per_rollout=1000, n_records=2000, max_new_tokens=500,
               prompt_tokens=10.0)
    assert st.context_tokens() == 510.0                      # no answer back yet: the full max_new_tokens
    lengths = []
    for i in range(700):
        issue = st.issue_next(everyone_alive, 0.0)
        got = answers(rewards=(5.0, -5.0))
        for j, sample in enumerate(got.samples):
            sample.output_ids = [2] * (1 + (7 * i + j) % 300)
            lengths.append(len(sample.output_ids))
        assert st.scored(issue.group_id, got).outcome == "accepted"
        st.take_batch()
    window = lengths[-1024:]
    assert st.context_tokens() == pytest.approx(10.0 + sum(window) / len(window), rel=1e-12)
