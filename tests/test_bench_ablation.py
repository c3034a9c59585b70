"""tools/bench/ablation.py: its arguments, and one real cell of the grid through the launcher."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.bench import ablation, chaos


@pytest.mark.parametrize("args, error", [
    (["--etas", "1,x"], "--etas: expected comma-separated integers"),
    (["--etas", "-1"], "--etas: staleness must be >= 0"),
    (["--objectives", "decoupled,grpo"], "--objectives: choose from decoupled, ppo"),
    (["--steps", "4", "--eval-every", "5"], "--eval-every must be in 1..--steps (4)"),
    (["--minibatches", "0"], "--minibatches must be >= 1"),
    (["--losses", "ppo,grpo2"], "--losses: choose from ppo, grpo"),
    (["--corrections", "tis,magic"], "--corrections: choose from none, tis"),
    (["--objectives", "ppo", "--corrections", "tis"], "--corrections: the plain ppo objective has no behaviour weight"),
    (["--seeds", "1,a"], "--seeds: expected comma-separated integers"),
])
def test_bad_arguments_are_refused_naming_the_option(args: list[str], error: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        ablation.main(args)
    assert exc.value.code == 2 and error in capsys.readouterr().err


def test_one_cell_trains_evaluates_each_checkpoint_and_plots(tmp_path: Path, capsys: Any) -> None:
    assets = chaos.make_assets(tmp_path / "assets")
    overrides = [f"experiment.model.path={assets['model']}", f"experiment.data.train={assets['data'] / 'train.jsonl'}",
                 f"experiment.data.test={assets['data'] / 'test.jsonl'}", "experiment.algo.batch_size=4",
                 "experiment.algo.group_size=4", "experiment.gen.max_new_tokens=12",
                 "experiment.algo.dynamic_sampling=false"]
    png = tmp_path / "ablation.png"
    assert ablation.main(["--etas", "1", "--objectives", "ppo", "--steps", "4", "--eval-every", "2",
                          "--minibatches", "2", "--out", str(tmp_path / "runs"), "--plot", str(png), "--json",
                          *overrides]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (cell,) = report["cells"]
    assert (cell["eta"], cell["objective"], cell["steps"]) == (1, "ppo", 4)
    assert set(cell["monitors"]) == set(ablation.MONITORS)
    assert cell["staleness_max"] <= 1
    # start, step 2, step 4: samples trained are 16 a step (4 prompts x 4 answers)
    assert [s for s, _ in cell["held_out_curve"]] == [0, 32, 64]
    assert all(0 <= a <= 1 for _, a in cell["held_out_curve"])
    assert cell["held_out_curve"][-1][1] == cell["final_accuracy"]
    assert [s for s, _ in cell["reward_curve"]] == [16, 32, 48, 64]
    assert png.stat().st_size > 10_000
    header, row = ablation.table(report["cells"])
    assert row.split()[:3] == ["1", "ppo", "4"] and f"{100 * cell['final_accuracy']:.1f}%" in row


def test_a_loss_cell_sets_every_key_its_paper_fixes() -> None:
    overrides = ablation.loss_overrides("dapo")
    assert overrides[0] == "experiment.algo.loss=dapo"
    assert "experiment.algo.eps_clip_high=0.28" in overrides and "experiment.algo.group_norm=true" in overrides
    assert "experiment.algo.loss_agg_mode=token-mean" in overrides
    # the overrides over configs/local.yaml (which sets eps_clip_high: 0.2) make a valid experiment for every loss
    import topology
    from topology.experiment import LOSS_SETTINGS
    for loss in LOSS_SETTINGS:
        for corr in ablation.CORRECTIONS:
            topology.load(ablation.ROOT / ablation.TOPOLOGY, ablation.loss_overrides(loss) + ablation.CORRECTIONS[corr])


def test_reports_of_a_grid_run_in_parts_combine_into_seed_means_and_bars(tmp_path: Path, capsys: Any) -> None:
    def cell(eta: int, loss: str, correction: str, seed: int, final: float) -> dict[str, Any]:
        return {"eta": eta, "objective": "decoupled", "loss": loss, "correction": correction, "seed": seed,
                "start_accuracy": 0.25, "final_accuracy": final, "staleness_mean": eta / 2, "staleness_max": eta,
                "monitors": {"mismatch_kl_k3": 1e-3, "tis_truncated_frac": 0.01, "rejected_frac": 0.02,
                             "entropy": 0.5, "avg_seq_len": 8.0}}
    parts = [tmp_path / "losses.json", tmp_path / "corrections.json"]
    parts[0].write_text(json.dumps({"cells": [cell(4, "grpo", "none", 1, 0.85), cell(4, "grpo", "none", 2, 0.65)]}))
    parts[1].write_text(json.dumps({"cells": [cell(16, "ppo", "tis", 1, 0.55)]}))
    png = tmp_path / "bars.png"
    assert ablation.main(["--combine", *map(str, parts), "--plot", str(png)]) == 0
    rows = capsys.readouterr().out.splitlines()
    # (85 - 25 + 65 - 25) / 2 = 50 points; the correction's 3 % is the two monitors' sum.
    assert rows[2] == ("| 4 | grpo | none | 25.0 % | 85.0 % / 65.0 % | +50.0 | 2.00 / 4 | 1.0e-03 | 3.00 % | "
                       "0.50 | 8.0 |"), rows
    assert rows[3].startswith("| 16 | ppo | tis | 25.0 % | 55.0 % | +30.0 |") and len(rows) == 4
    assert png.stat().st_size > 0
    (tmp_path / "broken.json").write_text("{")
    assert ablation.main(["--combine", str(tmp_path / "broken.json")]) == 2
    assert "broken.json: not an ablation report" in capsys.readouterr().err


def test_the_mismatch_monitor_averages_only_the_steps_that_measured_it() -> None:
    # Past eta 0 a step may train no token of the current weights: it logs 0 tokens and a KL of 0.
    steps = [{"mismatch_tokens": 300.0, "mismatch_kl_k3": 4e-3, "entropy": 0.4},
             {"mismatch_tokens": 100.0, "mismatch_kl_k3": 8e-3, "entropy": 0.6},
             {"mismatch_tokens": 0.0, "mismatch_kl_k3": 0.0, "entropy": 0.8}]
    monitors = ablation.step_monitors(steps)
    assert monitors["mismatch_kl_k3"] == pytest.approx((300 * 4e-3 + 100 * 8e-3) / 400)
    assert monitors["entropy"] == pytest.approx(0.6) and monitors["actor_clip_ratio"] == 0.0
