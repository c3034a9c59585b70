"""tools/bench/chaos.py: the prompt accounting it reports, and one real fault run through it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench import chaos


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One dataset and model for every run of this module: each run writes only to its own run directory."""
    return chaos.make_assets(tmp_path_factory.mktemp("chaos-assets"))


def write_run(run_dir: Path, issued: list, batches: list[list], dropped: list, pending: list) -> None:
    (run_dir / "buffer").mkdir(parents=True)
    (run_dir / "buffer" / "final_state.json").write_text(json.dumps({"issued": issued, "reissue": pending}))
    lines = [{"event": "batch", "step": i + 1, "keys": keys} for i, keys in enumerate(batches)]
    lines += [{"event": "dropped_uniform", "key": k} for k in dropped]
    (run_dir / "buffer" / "ledger.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_accounting_finds_a_lost_prompt_and_one_trained_twice(tmp_path: Path) -> None:
    issued = [[0, i] for i in range(6)]
    write_run(tmp_path / "ok", issued, [[[0, 0], [0, 1]], [[0, 2], [0, 3]]], [[0, 4]], [[0, 5]])
    assert chaos.account(tmp_path / "ok") == {"issued": 6, "trained": 4, "pending": 1, "dropped": 1, "lost": 0,
                                              "twice": 0}
    write_run(tmp_path / "bad", issued, [[[0, 0], [0, 1]], [[0, 1], [0, 3]]], [[0, 4]], [[0, 5]])
    got = chaos.account(tmp_path / "bad")
    assert got["lost"] == 1 and got["twice"] == 1   # [0, 2] vanished, [0, 1] was trained in two batches


def test_the_target_needs_every_fault_survived_nothing_lost_and_short_gaps() -> None:
    good = {"fault": "hang_rollout", "survived_in_place": True, "exit_code": 0, "lost": 0, "twice": 0,
            "staleness_max": 1, "eta": 1, "gap_ok": True}
    assert chaos.target_met([good, {**good, "fault": "relaunch", "survived_in_place": False}])
    for bad in ({"gap_ok": False}, {"lost": 2}, {"twice": 1}, {"staleness_max": 2}, {"survived_in_place": False}):
        assert not chaos.target_met([{**good, **bad}])


def test_the_target_needs_every_attack_refused_a_working_probe_and_an_attack_during_the_run() -> None:
    good = {"fault": "spoof", "survived_in_place": True, "exit_code": 0, "lost": 0, "twice": 0, "staleness_max": 1,
            "eta": 1, "attempts": 12, "accepted": 0, "control_ok": True, "during_run": True}
    assert chaos.target_met([good, {"fault": "rendezvous", "skipped": "not root"}])
    for bad in ({"accepted": 1}, {"control_ok": False}, {"during_run": False}):
        assert not chaos.target_met([{**good, **bad}])


@pytest.mark.parametrize("fault", ["spoof", "spoof_ipc", "rendezvous"])
def test_attacks_from_another_user_are_refused_and_the_run_loses_nothing(fault: str, assets: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    # From another uid a probe once stole batches, fetched the weights as "the evaluator", made the buffer write a
    # checkpoint, stalled the run with a version jump, stopped it with a run-finished, and read and wrote the
    # rendezvous keys.
    account = chaos.intruder_account()
    if isinstance(account, str):
        pytest.skip(account)
    result = chaos.run_fault(fault, assets, tmp_path, steps=6, at=1, hang_s=0, flood_n=0, log=print)
    assert result["survived_in_place"] and result["lost"] == 0 and result["twice"] == 0, json.dumps(result, default=str)
    assert result["during_run"] and result["intruder_uid"] == account[0], json.dumps(result, default=str)
    assert result["accepted"] == 0 and result["attempts"] > 0, json.dumps(result, default=str)
    if fault.startswith("spoof"):
        assert result["control_ok"], result     # the same client gets through a socket with no protection
        refusal = "refused: the socket speaks CURVE, which needs one of the run's keys" if fault == "spoof" else \
            "unreachable: Permission denied"
        assert result["handshakes"] == {refusal: result["attempts"]}, json.dumps(result, default=str)
    else:
        assert result["keys_read"] > 0 and result["forged"] > 0 and result["formed_again"] >= 1, json.dumps(result, default=str)

def test_the_spoof_rows_try_every_takeover_the_probe_made(tmp_path: Path) -> None:
    # The probe from another uid stole batches, fetched the weights as the evaluator, read the parameter server's
    # status, made the buffer write a checkpoint, jumped the version to 1,000,000 and stopped the run with a
    # run-finished: a spoof row that leaves one out says nothing about it.
    from transport.messages import decode

    actors = ["buffer", "evaluator", "param_server", "rollout.0", "trainer"]
    (tmp_path / "ready").mkdir()
    for i, name in enumerate(actors):
        (tmp_path / "ready" / f"{name}.json").write_text(json.dumps({"endpoint": f"tcp://127.0.0.1:{20000 + i}"}))
    tried = {}
    for spoof in chaos.spoofed_messages(tmp_path, steps=16):
        header, msg = decode([bytes.fromhex(f) for f in spoof["frames"]])
        tried.setdefault((spoof["to"], header.kind, header.sender), []).append(msg)
    assert sorted(tried) == sorted([
        ("param_server", "ps.eval_weights_request", "evaluator"), ("param_server", "ps.weights_status_request", "trainer"),
        ("buffer", "rl.checkpoint_request", "trainer"), ("buffer", "rl.version_update", "trainer"),
        ("buffer", "rl.batch_request", "trainer"), *((name, "rl.run_finished", "trainer") for name in actors)])
    assert tried["buffer", "rl.version_update", "trainer"][0].version == 10**6
    assert tried["buffer", "rl.batch_request", "trainer"][0].step > 16    # a step the trainer has not reached



@pytest.mark.parametrize("fault", ["kill_reward", "kill_template", "relaunch"])
def test_a_fault_run_reports_it_survived_with_nothing_lost(fault: str, assets: dict[str, Path], tmp_path: Path) -> None:
    # relaunch at step 1, before the first checkpoint (step 2): the relaunched buffer once started afresh beside the
    # old ledger, and the first steps' prompts were trained twice. kill_template: the start template and then
    # reward.0 killed with -9; the others run on, and reward.0's restart is a fresh interpreter.
    result = chaos.run_fault(fault, assets, tmp_path, steps=6, at=1, hang_s=0, flood_n=0, log=print)
    assert result["exit_code"] == 0 and result["launches"] == (2 if fault == "relaunch" else 1), json.dumps(result, default=str)
    if fault in ("kill_reward", "kill_template"):
        assert result["survived_in_place"] and result["restarted"] == {"reward.0": 1}, json.dumps(result, default=str)
    assert result["lost"] == 0 and result["twice"] == 0 and result["trained"] == 6 * 4, json.dumps(result, default=str)


def test_a_stall_meets_the_target_only_when_diagnosed_and_a_freeze_only_when_training_went_on() -> None:
    stalled = {"fault": "stall_buffer", "exit_code": 1, "diagnosed": True, "lost": 0, "twice": 0,
               "survived_in_place": False, "staleness_max": 1, "eta": 1, "steps_while_frozen": None}
    frozen = {"fault": "freeze_param_server", "exit_code": 0, "diagnosed": True, "lost": 0, "twice": 0,
              "survived_in_place": True, "staleness_max": 1, "eta": 1, "steps_while_frozen": 2}
    assert chaos.target_met([stalled, frozen])
    for bad in ({"diagnosed": False}, {"exit_code": 0}, {"lost": 1}):
        assert not chaos.target_met([{**stalled, **bad}])
    for bad in ({"steps_while_frozen": 0}, {"survived_in_place": False}, {"diagnosed": False}, {"twice": 1}):
        assert not chaos.target_met([{**frozen, **bad}])


# ---------------------------------------------------------------- the intruder the attack rows run as another user


def test_the_intruders_zmtp_client_gets_through_an_open_bus_and_not_through_curve_or_tokens(tmp_path: Path) -> None:
    # The attack rows report what the intruder could not do: first show that its client works where the bus is open.
    import asyncio

    from testsupport.bounded import run_bounded
    from tools.bench import intruder
    from transport.auth import CurveConfig, TokenConfig, generate_run_keys, generate_run_tokens
    from transport.bus import Bus
    from transport.messages import decode, encode
    from transport.protocol import CheckpointDone, CheckpointRequest

    keys, tokens = generate_run_keys(str(tmp_path), ["buffer"]), generate_run_tokens(str(tmp_path), ["buffer"])
    creds = {"open": {}, "curve": {"curve": CurveConfig.from_keys_dir(keys, "buffer")},
             "tokens": {"tokens": TokenConfig.from_spec({"tokens_dir": tokens}, "buffer")}}

    async def attack(kind: str, endpoint: str = "tcp://127.0.0.1:*") -> dict:
        bus = await Bus("buffer", endpoint, handler=lambda env: CheckpointDone(step=env.msg.step),
                        heartbeat_interval=None, **creds[kind]).start()
        frames = [f.hex() for f in encode(CheckpointRequest(step=7), sender="trainer", wants_reply=True)]
        target = {"name": "checkpoint", "endpoint": bus.endpoint, "frames": frames, "wants_reply": True}
        try:
            return await asyncio.to_thread(intruder.spoof, target, 3.0, "trainer", "0" * 64)
        finally:
            await bus.close()

    for endpoint in ("tcp://127.0.0.1:*", f"ipc://{tmp_path}/buffer"):   # (this user may reach the ipc socket)
        opened = run_bounded(attack("open", endpoint), 30)
        assert opened["handshake"] == "accepted (NULL)"
        assert decode([bytes.fromhex(f) for f in opened["reply"]])[1] == CheckpointDone(step=7)
    assert run_bounded(attack("curve"), 30) == {
        "name": "checkpoint", "reply": None,
        "handshake": "refused: the socket speaks CURVE, which needs one of the run's keys"}
    refused = run_bounded(attack("tokens"), 30)
    assert refused["reply"] is None and refused["handshake"] == "refused: the actor answered ERROR 400 instead of WELCOME", refused


def test_the_intruder_reads_and_forges_rendezvous_keys_and_a_signed_store_refuses_them(tmp_path: Path) -> None:
    import datetime

    import torch.distributed as dist

    from tools.bench import intruder
    from transport.bulk import RendezvousForgery, SignedStore, rendezvous_server
    from transport.ports import free_port

    port, timeout = free_port(), datetime.timedelta(seconds=10)
    server = rendezvous_server("127.0.0.1", port, 2, timeout)
    member = SignedStore(dist.TCPStore("127.0.0.1", port, 2, timeout=timeout, wait_for_workers=False), b"s" * 32)
    for key in ("weights/epoch3/0/0", "weights/epoch3/0/1", "weights/epoch3/0/2", "weights/latest_epoch"):
        member.set(key, b"genuine")
    got = intruder.probe_store({"link": "weights", "port": port, "host": "127.0.0.1", "network_host": "127.0.0.2"},
                               3.0)
    assert got["from_network"].startswith("refused via 127.0.0.2")
    assert got["loopback"] == "connected" and got["keys_read"] == 4
    assert got["forged"] == ["/weights/epoch4/0/1", "/weights/epoch4/0/2"]
    with pytest.raises(RendezvousForgery, match="'weights/epoch4/0/1' was not written by a member of this run"):
        member.get("weights/epoch4/0/1")
    del member, server


def test_the_soak_schedule_has_every_kind_once_a_round_and_the_gaps_go_to_the_kinds_hit() -> None:
    from tools.bench import soak

    drawn = soak.schedule(2 * len(soak.ROUND) + 3, seed=1)
    for start in (0, len(soak.ROUND)):
        assert sorted(drawn[start:start + len(soak.ROUND)]) == sorted(soak.ROUND)
    assert drawn != soak.schedule(len(drawn), seed=2) and drawn == soak.schedule(len(drawn), seed=1)
    assert {"pair", "launcher_kill", "launcher_stop", "kill:trainer", "stop:buffer"} <= set(soak.ROUND)
    records = [{"step": 4, "time": 10.0}, {"step": 3, "time": 14.0}, {"step": 5, "time": 19.0}, {"step": 6, "time": 20.0}]
    faults = [{"fault": "pair", "actors": ["trainer", "rollout.1"], "step": 4, "time": 11.0},
              {"fault": "launcher_stop", "actors": [], "step": 5, "time": 19.5}]
    # the trainer's re-done step 3 is no new progress: the gap runs to step 5
    assert soak.longest_gaps(faults, records) == {"launcher_stop": 0.5, "rollout": 8.0, "trainer": 8.0}


@pytest.mark.timeout(900)   # three launches' worth of starts: minutes on a 2-core machine shared with other runs
def test_a_short_soak_survives_a_pair_killed_and_the_launcher_stopped(assets: dict[str, Path], tmp_path: Path) -> None:
    # The long one (python -m tools.bench chaos --soak) draws hundreds of steps of faults; this is its smallest
    # form: two actors killed at once, then a SIGTERM stop of the launcher (every actor must log `stopped`, none
    # SIGKILLed) and a relaunch, and the run must end with exit 0, every step trained once and nothing lost.
    from tools.bench.soak import run_soak

    report = run_soak(assets, tmp_path, steps=9, every=3, ckpt_every=2, rollouts=2, faults=["pair", "launcher_stop"],
                      log=print, step_timeout=600)
    assert report["ok"], report.get("failure")
    assert report["faults_survived"] == 2 and report["launches"] == 2, report
    assert report["end"]["lost"] == 0 and report["end"]["twice"] == 0 and report["end"]["steps_trained"] == 9
