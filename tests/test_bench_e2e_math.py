"""tools.bench e2e's math report: async against sync and colocated (the headline ratios) and the SFT control."""
from __future__ import annotations

import json

import pytest

from tools.bench.e2e import DEFAULT_MODES, MODES, build_report, report_lines


def run(throughput: float, wall: float, final: float, steps: int = 40) -> dict:
    return {"steps": steps, "tokens_trained": throughput * wall, "wall_seconds": wall,
            "effective_throughput": throughput, "staleness_max": 4,
            "greedy_accuracy": {"start": 0.2, "final": final}}


def test_the_math_report_carries_the_async_ratios_though_modes_holds_other_tasks_modes():
    assert "one_turn" in MODES   # the agent task's mode: the math bench never runs it
    results = {"async": run(1000.0, 70.0, 0.99), "sync": run(500.0, 140.0, 0.98),
               "colocated": run(800.0, 100.0, 0.97), "sft": run(10000.0, 70.0, 0.26)}
    assert set(results) == set(DEFAULT_MODES["math"].split(","))
    report = build_report("math", "topology/local.yaml", 40, results)
    assert report["throughput_ratio"] == pytest.approx(2.0)
    assert report["colocated_ratio"] == pytest.approx(1.25)
    assert report["time_ratio"] == pytest.approx(2.0)
    assert report["accuracy_gap_points"] == pytest.approx(1.0)
    assert report["rl_over_sft_points"] == pytest.approx(73.0)
    assert report["sync_effective_throughput"] == 500.0 and report["sft_wall_seconds"] == 70.0
    assert "multi_turn_over_one_turn_points" not in report
    text = "\n".join(report_lines(report))
    assert "throughput async/sync 2.00x, async/colocated 1.25x, wall time sync/async 2.00x" in text
    assert "async RL 99.0% vs SFT continued for the same wall time 26.0%" in text


def test_a_subset_of_modes_reports_the_ratios_its_runs_allow():
    only_sync = build_report("math", "topology/local.yaml", 40,
                             {"async": run(900.0, 70.0, 0.99), "sync": run(450.0, 140.0, 0.99)})
    assert only_sync["throughput_ratio"] == pytest.approx(2.0) and "colocated_ratio" not in only_sync
    assert "throughput async/sync 2.00x, wall time" in "\n".join(report_lines(only_sync))
    only_async = build_report("code", "topology/local_code.yaml", 12, {"async": run(900.0, 70.0, 0.99)})
    assert "throughput_ratio" not in only_async and "accuracy_gap_points" not in only_async
    assert len(report_lines(only_async)) == 2   # the table's header and its one row


def test_lora_beside_full_fine_tuning_reports_both_gains_and_weight_syncs():
    full = {**run(1000.0, 70.0, 0.90, steps=20), "weight_sync": {"weight_sync_seconds": 0.12, "weight_push_seconds": 0.8}}
    lora = {**run(1100.0, 60.0, 0.88, steps=20), "weight_sync": {"weight_sync_seconds": 0.05, "weight_push_seconds": 0.5}}
    assert MODES["lora"] == ["config=configs/local_lora.yaml"]
    report = build_report("math", "topology/local.yaml", 20, {"async": full, "lora": lora})
    assert report["lora_gain_points"] == pytest.approx(68.0) and report["full_gain_points"] == pytest.approx(70.0)
    assert report["lora_minus_full_points"] == pytest.approx(-2.0)
    assert report["lora_weight_sync_seconds"] == 0.05 and report["full_weight_push_seconds"] == 0.8
    assert "throughput_ratio" not in report
    text = "\n".join(report_lines(report))
    assert ("held-out accuracy: LoRA 88.0% (+68.0 points over the warm start), full fine-tuning 90.0% (+70.0); "
            "LoRA weight sync 0.050 s, push 0.500 s (medians), full weight sync 0.120 s, push 0.800 s (medians)") in text


def test_weight_sync_medians_come_from_the_trainer_s_metrics(tmp_path):
    from tools.bench.e2e import weight_sync_medians
    rows = [{"step": i, "weight_sync_seconds": s, "weight_push_seconds": p}
            for i, (s, p) in enumerate([(0.0, 0.0), (0.3, 0.9), (0.1, 0.5), (0.2, 0.7)])]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # the first step has published nothing yet (0.0): left out
    assert weight_sync_medians(tmp_path) == {"weight_sync_seconds": 0.2, "weight_push_seconds": 0.7}
    assert weight_sync_medians(tmp_path / "none") == {"weight_sync_seconds": None, "weight_push_seconds": None}
