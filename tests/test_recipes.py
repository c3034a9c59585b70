"""The shipped recipes (configs/areal_*.yaml): each names its source in AReaL's publications and the command that runs
it on the topology the tutorial names, and that command passes --dry-run; the 1.5B context stages chain."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from actors.recovery import checkpoint_dir
from tools.up import main as up_main

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "configs").glob("areal_*.yaml"))


def run_line(config: Path) -> list[str]:
    """The `# run: python -m tools.up ...` command of a recipe, as tools.up's arguments."""
    lines = [l for l in config.read_text().splitlines() if l.startswith("# run: python -m tools.up ")]
    assert len(lines) == 1, f"{config.name}: needs exactly one '# run: python -m tools.up ...' line"
    return shlex.split(lines[0].removeprefix("# run: python -m tools.up "))


def test_every_areal_recipe_is_shipped():
    names = {p.stem for p in RECIPES}
    assert names == {"areal_v01_1.5b_stage1_8k", "areal_v01_1.5b_stage2_16k", "areal_v01_1.5b_stage3_24k",
                     "areal_v02_7b_boba", "areal_32b_boba", "areal_v01_7b_r1_zero"}


@pytest.mark.parametrize("config", RECIPES, ids=lambda p: p.stem)
def test_recipe_dry_runs_on_its_topology(config: Path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    args = run_line(config)
    assert f"config=configs/{config.name}" in args
    assert "# Source (AReaL " in config.read_text().split("\nseed:")[0], f"{config.name}: quote its AReaL source"
    assert up_main([*args, "--dry-run"]) == 0, capsys.readouterr().err
    assert f"experiment config {config}" in capsys.readouterr().out.replace("\n  ", " ")


def test_recipe_settings_match_areal():
    doc = {p.stem: yaml.safe_load(p.read_text()) for p in RECIPES}
    shape = {k: (d["algo"]["batch_size"], d["algo"]["group_size"], d["gen"]["max_new_tokens"]) for k, d in doc.items()}
    assert shape["areal_v02_7b_boba"] == (512, 16, 27648) and doc["areal_v02_7b_boba"]["algo"]["eta"] == 8
    assert shape["areal_32b_boba"][:2] == (512, 32)
    assert [shape[f"areal_v01_1.5b_stage{i}"] for i in ("1_8k", "2_16k", "3_24k")] == \
        [(1024, 8, 8192), (1024, 8, 16384), (1024, 8, 24576)]
    assert "{prompt}" in doc["areal_v01_7b_r1_zero"]["data"]["prompt_template"]


def test_context_stages_each_start_from_the_last_checkpoint_of_the_one_before():
    stages = [REPO / "configs" / f"areal_v01_1.5b_stage{s}.yaml" for s in ("1_8k", "2_16k", "3_24k")]
    for prev, cur in zip(stages, stages[1:]):
        prev_doc, cur_doc = yaml.safe_load(prev.read_text()), yaml.safe_load(cur.read_text())
        prev_run_dir = run_line(prev)[run_line(prev).index("--run-dir") + 1]
        last = str(checkpoint_dir(prev_run_dir, prev_doc["run"]["total_steps"]) / "model")
        assert cur_doc["model"]["path"] == last, cur.name
