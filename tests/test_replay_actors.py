"""tools.replay --into on the real actors, from the message logs of one real recorded run (`tools.up --record`):
each replays identically, and a changed setting is reported as the first divergence naming message and field."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tools import replay
from tools.bench.chaos import finish_run, launch, make_assets


@pytest.fixture(scope="module")
def recorded() -> Iterator[Path]:
    """A 3-step run of topology/local.yaml with every actor's messages logged; yields its msglog dir.

    In a directory of its own, not pytest's: the basetemp of a pytest run is removed by later runs (they
    keep three), and other pytest runs may start on the same machine while the replays read the run's model."""
    with tempfile.TemporaryDirectory(prefix="replay-actors-") as tmp:
        yield _record(Path(tmp))


def _record(base: Path) -> Path:
    assets = make_assets(base, train_per_level=40)
    run_dir = base / "run"
    # A random model answers everything wrong, so every group's rewards are equal and GRPO's advantages zero;
    # a KL penalty to the starting weights (the rollout engine's and the trainer's log-probs differ in the
    # last digits) gives the trainer something to learn, and two minibatches a clip ratio to report.
    proc = launch(assets, run_dir, steps=3, ckpt_every=3,
                  extra=("experiment.run.final_eval=false", "experiment.algo.kl_coef=0.1",
                         "experiment.algo.ppo_minibatches=2", "--record"))
    out = finish_run(proc, run_dir, timeout=600)
    assert proc.returncode == 0, out[-4000:]
    logs = run_dir / "msglog"
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        f"{n}.msglog" for n in ("buffer", "reward", "trainer", "param_server", "rollout.0", "rollout.1", "evaluator"))
    return logs


def test_buffer_replays_identically(recorded: Path, capsys: pytest.CaptureFixture) -> None:
    # The trainer's first BatchRequest arrives before any scored group: a replay that waited for each
    # handler to finish before taking the next message would wait for ever.
    assert replay.main([str(recorded / "buffer.msglog"), "--into", "actors.buffer:BufferActor"]) == 0
    out = capsys.readouterr().out
    assert "identical: every outbound message matches the original" in out, out


def test_buffer_with_a_changed_setting_reports_the_first_divergence(recorded: Path) -> None:
    log = str(recorded / "buffer.msglog")
    # Another seed shuffles the dataset differently: the first group handed out is another prompt.
    d = replay.replay_into(log, "actors.buffer:BufferActor", overrides=["seed=2"]).divergence
    assert d is not None and d.inbound_position == -1 and d.outbound_position == 0
    assert d.message == "rl.generate_group" and d.field == "group_id" and d.expected != d.actual
    # A smaller batch admits fewer groups at once: the original's later groups never go out.
    r = replay.replay_into(log, "actors.buffer:BufferActor", idle_timeout=5, overrides=["algo.batch_size=3"])
    d = r.divergence
    assert d is not None and d.message == "rl.generate_group" and d.actual == "nothing", d
    assert any("then nothing for 5 s" in n for n in r.notes), r.notes


def test_reward_replays_identically_and_a_changed_grader_setting_is_caught(recorded: Path) -> None:
    log = str(recorded / "reward.msglog")
    same = replay.replay_into(log, "actors.reward.math:MathReward")
    # score_seconds differs in any rerun: ScoredGroup declares it VOLATILE, so it is not compared
    assert same.compared and same.divergence is None and same.fed > 0, same
    # a random model answers every prompt wrong (algo.reward_wrong, -5 here); another value for a wrong answer
    # changes the first scored group's first sample
    d = replay.replay_into(log, "actors.reward.math:MathReward", overrides=["algo.reward_wrong=-0.5"]).divergence
    assert d is not None and d.inbound_position == 0 and d.message == "rl.scored_group", d
    assert d.field == "answers.samples[0].reward" and (d.expected, d.actual) == ("-5.0", "-0.5"), d


def test_what_the_original_received_as_it_stopped_is_not_held_against_the_replay(recorded: Path, tmp_path: Path) -> None:
    # A run that ends while the reward actor holds answers it has not scored leaves inbound records at the
    # log's end with no reply; the replay scores them. The same log with the last group's scores cut off
    # stands for that run: the replay's scores for it are noted, not reported as a divergence.
    from transport.messages import decode_header
    from transport.msglog import MessageLogWriter, read_log

    records, _ = read_log(recorded / "reward.msglog")
    causes = {r.cause for r in records if r.kind == "out"}
    last_in = [r for r in records if r.kind == "in" and decode_header(r.frames)[0].id in causes][-1]
    cut = decode_header(last_in.frames)[0].id    # the last message the original answered
    log = tmp_path / "reward.msglog"
    meta = next(r.meta for r in records if r.kind == "meta")
    with MessageLogWriter(log, meta={k: v for k, v in meta.items() if k not in ("k", "t", "pid")}) as w:
        for r in records:
            if r.kind == "event":
                w.record_event(r.event, r.peer)
            elif r.kind in ("in", "out") and r.cause != cut:
                w.record(r.kind, r.frames, peer=r.peer, t=r.t, rejected=r.rejected, cause=r.cause)
    result = replay.replay_into(str(log), "actors.reward.math:MathReward")
    assert result.compared and result.divergence is None, result
    assert any("are not compared" in n for n in result.notes), result.notes


def test_what_the_original_answered_as_it_stopped_is_not_held_against_the_replay(recorded: Path,
                                                                                 tmp_path: Path) -> None:
    # A rollout stopped by a signal at the run's end hands back the groups it holds ("draining"), which the
    # replay, never stopped there, does not. The recorded reward log with its last answer made unlike the
    # replay's (another group's scores) stands for that: after a "stopping" event it is noted, not compared;
    # without the event the same log is a divergence.
    from transport.messages import decode_header
    from transport.msglog import MessageLogWriter, read_log

    records, _ = read_log(recorded / "reward.msglog")
    answers = [r for r in records if r.kind == "out" and r.cause is not None]
    last, other = answers[-1], next(r for r in reversed(answers) if r.cause != answers[-1].cause)
    meta = next(r.meta for r in records if r.kind == "meta")

    def rewrite(path: Path, stopping: bool) -> str:
        with MessageLogWriter(path, meta={k: v for k, v in meta.items() if k not in ("k", "t", "pid")}) as w:
            for r in records:
                if r.kind == "event":
                    # The original's own "stopping" event is left out wherever it fell (a reward actor that
                    # began to stop while it held groups answers them after it): each variant places its own.
                    if r.event != "stopping":
                        w.record_event(r.event, r.peer)
                elif r.kind in ("in", "out") and r.cause == last.cause and r.kind == "out":
                    if stopping and r is last:
                        w.record_event("stopping", "reward")
                    if r is last:
                        w.record("out", other.frames, peer=r.peer, t=r.t, cause=r.cause)
                elif r.kind in ("in", "out"):
                    w.record(r.kind, r.frames, peer=r.peer, t=r.t, rejected=r.rejected, cause=r.cause)
        return str(path)

    assert decode_header(other.frames)[0].kind == decode_header(last.frames)[0].kind
    differs = replay.replay_into(rewrite(tmp_path / "a.msglog", stopping=False), "actors.reward.math:MathReward")
    assert differs.divergence is not None, differs
    drained = replay.replay_into(rewrite(tmp_path / "b.msglog", stopping=True), "actors.reward.math:MathReward")
    assert drained.compared and drained.divergence is None, drained
    assert any("began to stop" in n for n in drained.notes), drained.notes


def test_parameter_server_replays_with_its_links_stood_in_for(recorded: Path) -> None:
    log = str(recorded / "param_server.msglog")
    # The trainer's buckets come from the log; the buckets pushed to each rollout compare by header (names,
    # shapes, checksum of the bytes).
    # Timers run at the replay's own pace: on this shared machine the replay's second ack can come more than
    # late_s (2 s) after the first, and the push would end without it, as it never did in the original.
    # (Were it a late ack in the original, the longer late_s would show as a divergence there.)
    same = replay.replay_into(log, "actors.param_server:ParamServerActor", overrides=["late_s=600"])
    assert same.compared and same.divergence is None, (same.divergence, same.notes)
    assert same.sent > 0 and not same.notes, same.notes
    # the rollout link's members in another order: the link is formed with the rollouts' ranks swapped
    d = replay.replay_into(log, "actors.param_server:ParamServerActor", idle_timeout=10,
                           overrides=["late_s=600",
                                      "links.ps_to_rollout.members=[param_server, rollout.1, rollout.0]"]
                           ).divergence
    assert d is not None and (d.message, d.field) == ("rl.link_reform", "members[1]"), d
    assert (d.expected, d.actual) == ('"rollout.0"', '"rollout.1"'), d


def test_trainer_replays_identically_and_a_changed_step_count_is_caught(recorded: Path) -> None:
    log = str(recorded / "trainer.msglog")
    # Batches come as the buffer's recorded replies; the weights it publishes go on a stood-in link and are
    # compared by their buckets' checksums, so identical means the same training, bit for bit.
    same = replay.replay_into(log, "actors.trainer:TrainerActor")
    assert same.compared and same.divergence is None, (same.divergence, same.notes)
    assert same.sent > 0 and not same.notes, same.notes
    d = replay.replay_into(log, "actors.trainer:TrainerActor", idle_timeout=10,
                           overrides=["run.total_steps=2"]).divergence
    # after step 2 it checkpoints where the original asked for the third batch
    assert d is not None and d.inbound_position == -1 and d.peer == "buffer", d
    assert (d.message, d.field) == ("rl.batch_request", None) and "rl.checkpoint_request" in d.actual, d


def test_a_log_the_previous_schema_wrote_replays_identically(recorded: Path, tmp_path: Path) -> None:
    # The trainer's log as schema 5 wrote it: version 5 on every message, its status requests naming the
    # weights link's epoch min_generation (after timeout_s), and its batches' stats counting data passes as
    # epoch. Decoding upgrades each body to the current layout, so the log replays as one recorded now; without
    # the upgrades the replay's first request would differ, and the batches would not decode.
    import msgpack

    from transport.msglog import MessageLogWriter, read_log

    records, _ = read_log(recorded / "trainer.msglog")
    meta = next(r.meta for r in records if r.kind == "meta")
    path, renamed, batches = tmp_path / "trainer-v5.msglog", 0, 0
    with MessageLogWriter(path, meta={k: v for k, v in meta.items() if k not in ("k", "t", "pid")}) as w:
        for r in records:
            if r.kind == "event":
                w.record_event(r.event, r.peer)
            elif r.kind.startswith("bulk_"):
                w.record_bulk(r.kind.removeprefix("bulk_"), r.peer.split("#")[0], r.peer,
                              msgpack.unpackb(r.frames[0], raw=False), r.frames[1] if len(r.frames) > 1 else None,
                              cause=r.cause)
            elif r.kind in ("in", "out"):
                head = msgpack.unpackb(r.frames[0], raw=False)
                head[1] = 5
                if head[0] == "ps.weights_status_request":
                    body = {k: v for k, v in head[7].items() if k != "min_epoch"}
                    head[7] = {**body, "min_generation": head[7]["min_epoch"]}
                    renamed += 1
                if head[0] == "rl.batch":
                    stats = head[7]["stats"]
                    head[7]["stats"] = {("epoch" if k == "data_pass" else k): v for k, v in stats.items()}
                    batches += "epoch" in head[7]["stats"]
                w.record(r.kind, [msgpack.packb(head), *r.frames[1:]], peer=r.peer, t=r.t, rejected=r.rejected,
                         cause=r.cause)
    assert renamed > 0 and batches > 0
    same = replay.replay_into(str(path), "actors.trainer:TrainerActor")
    assert same.compared and same.divergence is None and same.sent > 0, (same.divergence, same.notes)


def test_offline_retraining_prints_recorded_and_new_metrics_per_step(recorded: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    log = str(recorded / "trainer.msglog")
    # the recorded batches trained again with a ten times larger KL coefficient
    assert replay.main([log, "--into", "actors.trainer:TrainerActor", "--set", "algo.kl_coef=1.0"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["step", "loss"])
    assert "kl (rec/new)" in lines[head] and "clip ratio (rec/new)" in lines[head] and "grad norm" in lines[head]
    rows = [ln.split() for ln in lines[head + 1: head + 4]]
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    recorded_loss, new_loss = (float(x) for x in rows[0][1].split("/"))
    assert recorded_loss != new_loss, out      # every step trained, each with its recorded and its new loss
    # the recorded column is the run's own metrics.jsonl
    import json
    first = json.loads((recorded.parent / "metrics.jsonl").read_text().splitlines()[0])
    assert recorded_loss == pytest.approx(first["loss"], rel=1e-5)
    # the weights it publishes differ from the first step on: named by link and field
    assert "message bulk, field checksum" in out and "train_to_ps#1" in out, out


@pytest.mark.parametrize("name", ["rollout.0", "rollout.1"])
def test_rollout_replays_the_same_tokens_until_weights_change_mid_generation(recorded: Path, name: str) -> None:
    log = recorded / f"{name}.msglog"
    # The embedded engine samples each group with the seed in its GenerateGroup, so the same tokens come out
    # as a rule. Two things break the rule: which sequences share a decode batch (arrival timing) changes the
    # order of float sums, by about 1e-7 in a log-prob, and once in a while that flips a sampled token (seen
    # once in CI at output_ids[10] of a group on the starting weights); and where the original swapped
    # weights in the middle of a generation, the replay (which takes the buckets when the message is
    # delivered) swaps at another decode step. So a divergence, if any, is in a group's answers, and every
    # other message (acks, hellos, returns) replays identically up to it.
    r = replay.replay_into(str(log), "actors.rollout:RolloutActor", float_tol=1e-5)
    assert r.compared and r.fed > 0, r
    if r.divergence is not None:
        assert r.divergence.message == "rl.trajectories", r.divergence
        assert r.divergence.field is not None and r.divergence.field.startswith("answers.samples["), r.divergence
    # weights held in bfloat16 instead: a group's log-probs, or the hash of the weights it acks, differ
    d = replay.replay_into(str(log), "actors.rollout:RolloutActor", float_tol=1e-5,
                           overrides=["model.dtype=bfloat16"]).divergence
    assert d is not None and d.inbound_position >= 0, d
    assert (d.message, d.field) == ("rl.weights_ack", "weights_hash") or \
        (d.message == "rl.trajectories" and d.field is not None and d.field.startswith("answers.samples[0].")), d


def test_a_recorded_trainer_log_replays_into_another_loss(recorded: Path, capsys: pytest.CaptureFixture) -> None:
    # The recorded run set eps_clip 0.2 (configs/local.yaml); GSPO fixes its own clip range, which takes over.
    log = str(recorded / "trainer.msglog")
    assert replay.main([log, "--into", "actors.trainer:TrainerActor", "--set", "experiment.algo.loss=gspo"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["step", "loss"])
    rows = [ln.split() for ln in lines[head + 1: head + 4]]
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    assert all(r[1].split("/")[0] != r[1].split("/")[1] for r in rows), out   # every batch trained under GSPO
    # a key the user sets for the switch that contradicts the loss is refused, naming it
    assert replay.main([log, "--into", "actors.trainer:TrainerActor", "--set", "experiment.algo.loss=gspo",
                        "--set", "experiment.algo.eps_clip=0.2"]) == 2
    assert "loss gspo sets eps_clip: 0.0003" in capsys.readouterr().err
