"""tools/bench/chaos.py: the prompt accounting it reports, and one real fault run through it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench import chaos


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


@pytest.mark.parametrize("fault", ["kill_reward", "relaunch"])
def test_a_fault_run_reports_it_survived_with_nothing_lost(fault: str, tmp_path: Path) -> None:
    # relaunch at step 1, before the first checkpoint (step 2): the relaunched buffer once started afresh beside the
    # old ledger, and the first steps' prompts were trained twice.
    assets = chaos.make_assets(tmp_path / "assets")
    result = chaos.run_fault(fault, assets, tmp_path, steps=6, at=1, hang_s=0, flood_n=0, log=print)
    assert result["exit_code"] == 0 and result["launches"] == (2 if fault == "relaunch" else 1), result
    if fault == "kill_reward":
        assert result["survived_in_place"] and result["restarted"] == {"reward.0": 1}, result
    assert result["lost"] == 0 and result["twice"] == 0 and result["trained"] == 6 * 4, result


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
