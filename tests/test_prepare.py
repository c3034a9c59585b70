"""The prepare stage (launch/prepare/stage.py, tools/prepare.py): what the first command on a fresh machine makes before the run starts."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from actors.engines.checkpoint import has_weights
from launch.prepare.stage import PrepareError, prepare

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "models" / "arith-tiny"
SFT_ARGS = {"steps": 3, "batch_size": 8, "eval_every": 0, "max_new_tokens": 8, "seed": 0}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The shipped model directory shrunk to a tiny width: config and tokenizer, no weights."""
    out = tmp_path / "model"
    shutil.copytree(TINY, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def experiment(tmp_path: Path, model_dir: Path) -> dict:
    small = {"train_per_level": 20, "test_per_level": 4, "max_operand": 9}
    return {
        "model": {"path": str(model_dir)},
        "data": {"train": str(tmp_path / "d" / "train.jsonl"), "test": str(tmp_path / "d" / "test.jsonl")},
        "prepare": {
            "data": [{"out": str(tmp_path / "d"), "args": {**small, "direct_fraction": 0.8, "direct_wrong": 1.0}},
                     {"out": str(tmp_path / "careful"), "args": {**small, "direct_fraction": 0.0}}],
            "warm_start": {"out": str(tmp_path / "ws"), "stages": [
                {"data": str(tmp_path / "careful"), "args": SFT_ARGS},
                {"data": str(tmp_path / "d"), "args": SFT_ARGS}]},
        },
    }


def test_data_and_staged_warm_start_are_made_once_then_reused(tmp_path: Path, model_dir: Path) -> None:
    lines: list[str] = []
    exp = prepare(experiment(tmp_path, model_dir), log=lines.append)
    for folder in ("d", "careful"):
        assert (tmp_path / folder / "train.jsonl").exists() and (tmp_path / folder / "test.jsonl").exists()
    assert exp["model"]["path"] == str(tmp_path / "ws" / "stage2")
    assert has_weights(tmp_path / "ws" / "stage1") and has_weights(tmp_path / "ws" / "stage2")
    assert any("stage 2/2" in line for line in lines)
    # Only stage 1 started from random weights; stage 2 continued from stage 1's checkpoint.
    random_starts = [i for i, line in enumerate(lines) if "has no weights: initialised" in line]
    stage2 = next(i for i, line in enumerate(lines) if "stage 2/2" in line)
    assert len(random_starts) == 1 and random_starts[0] < stage2

    lines.clear()
    again = prepare(experiment(tmp_path, model_dir), log=lines.append)
    assert again["model"]["path"] == exp["model"]["path"]
    assert any("reusing the warm start" in line for line in lines) and not any("stage 1/2" in x for x in lines)

    changed = experiment(tmp_path, model_dir)
    changed["prepare"]["warm_start"]["stages"][1]["args"] = {**SFT_ARGS, "steps": 4}
    lines.clear()
    prepare(changed, log=lines.append)
    assert any("stage 1/2" in line for line in lines), "a changed recipe must train a new warm start"


def test_a_model_with_weights_needs_no_warm_start(tmp_path: Path, model_dir: Path) -> None:
    trained = prepare(experiment(tmp_path, model_dir))["model"]["path"]
    exp2 = experiment(tmp_path, model_dir)
    exp2["model"]["path"] = trained
    lines: list[str] = []
    assert prepare(exp2, log=lines.append) == exp2 and not any("warm start" in line for line in lines)


def test_the_run_is_planned_from_the_prepared_document(tmp_path: Path, model_dir: Path) -> None:
    # prepare once changed the plan's own experiment document in place, so the plan's typed config named
    # the weightless model or the warm start depending on when it was read. Now prepare returns the prepared
    # document and leaves its argument as it was, and the run's plan is a new one built from it.
    import topology

    exp = experiment(tmp_path, model_dir)
    plan = topology.load(ROOT / "topology" / "local.yaml", [
        f"experiment.model.path={model_dir}", f"experiment.data.train={exp['data']['train']}",
        f"experiment.data.test={exp['data']['test']}", f"experiment.prepare={json.dumps(exp['prepare'])}"],
        check_imports=False)
    written = copy.deepcopy(plan.topology.experiment)
    prepared = prepare(plan.topology.experiment, log=lambda _: None)
    start = str(tmp_path / "ws" / "stage2")
    assert plan.topology.experiment == written and prepared["model"]["path"] == start
    assert prepared == {**written, "model": {**written["model"], "path": start}}
    run = plan.with_experiment(prepared)
    assert run.topology.config.model.path == start and plan.topology.config.model.path == str(model_dir)
    assert {spec["settings"]["model"]["path"] for spec in run.specs("RUN_DIR")} == {start}


@pytest.mark.parametrize("mutate, words", [
    (lambda p: p.update(extra=1), r"prepare\.extra: unknown key"),
    (lambda p: p["warm_start"]["stages"][0].pop("data"), r"stages\[0\]\.data"),
    (lambda p: p["warm_start"]["stages"][1]["args"].update(colour=1), r"stages\[1\]\.args: unknown"),
    (lambda p: p["warm_start"]["stages"][1]["args"].update(model="x"), r"stages\[1\]\.args: unknown or reserved"),
    (lambda p: p["warm_start"].pop("out"), "warm_start.out"),
    (lambda p: p["data"][0].pop("out"), r"prepare\.data\[0\]\.out"),
    (lambda p: p["data"][0]["args"].update(levels=[1, 2]), r"prepare\.data\[0\]\.args\.levels"),
])
def test_bad_prepare_sections_name_the_key(tmp_path: Path, model_dir: Path, mutate, words) -> None:
    exp = experiment(tmp_path, model_dir)
    exp["prepare"]["warm_start"]["stages"][1]["args"] = dict(SFT_ARGS)
    mutate(exp["prepare"])
    with pytest.raises(PrepareError, match=words):
        prepare(exp, log=lambda _: None)


def test_a_run_evaluates_the_warm_start_it_made_as_its_start(tmp_path: Path, model_dir: Path) -> None:
    # tools.up prepares first, then reads the typed config: the start model the summary names and evaluates
    # is the warm start, not the weightless directory the config file names
    from tools.bench.chaos import finish_run, launch

    exp = experiment(tmp_path, model_dir)
    assets = {"model": model_dir, "data": tmp_path / "d"}
    run_dir = tmp_path / "run"
    proc = launch(assets, run_dir, steps=1, ckpt_every=1,
                  extra=(f"experiment.prepare={json.dumps(exp['prepare'])}", "experiment.run.final_eval=true"))
    out = finish_run(proc, run_dir, timeout=300)
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["start_model"] == str(tmp_path / "ws" / "stage2"), summary
    assert set(summary["greedy_accuracy"]) == {"start", "final"}, summary


def test_dry_run_names_a_warm_start_argument_the_tool_does_not_take(capsys: pytest.CaptureFixture) -> None:
    # the layout is the config model's; the stage's args are tools.sft's, which --dry-run asks it about
    from tools import up

    bad = "experiment.prepare.warm_start.stages=[{data: data/arith, args: {steps: 3, colour: 1, model: x}}]"
    assert up.main([str(ROOT / "topology" / "local.yaml"), bad, "--dry-run", "--no-import-check"]) == 2
    err = capsys.readouterr().err
    assert "experiment.prepare.warm_start.stages[0].args: unknown or reserved key(s) colour, model" in err, err



def test_overridden_data_paths_leave_the_recipes_folders_alone(tmp_path: Path, model_dir: Path) -> None:
    # With data.train/test elsewhere and a model that has weights, nothing reads the recipes' folders: the
    # shipped config's data/arith* were written into the repository anyway.
    trained = prepare(experiment(tmp_path / "first", model_dir))["model"]["path"]
    exp = experiment(tmp_path, model_dir)
    elsewhere = tmp_path / "first" / "d"
    exp["model"]["path"] = trained
    exp["data"] = {"train": str(elsewhere / "train.jsonl"), "test": str(elsewhere / "test.jsonl")}
    lines: list[str] = []
    prepare(exp, log=lines.append)
    assert not (tmp_path / "d").exists() and not (tmp_path / "careful").exists(), lines
    assert any("not making" in line and str(tmp_path / "careful") in line for line in lines), lines
    # the folder the run reads is still made when it is missing
    exp["data"] = {"train": str(tmp_path / "d" / "train.jsonl"), "test": str(tmp_path / "d" / "test.jsonl")}
    prepare(exp, log=lambda _: None)
    assert (tmp_path / "d" / "train.jsonl").exists() and not (tmp_path / "careful").exists()


def test_a_shipped_warm_start_is_used_while_it_matches_its_recipe_and_its_hash(tmp_path: Path, model_dir: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    from launch.prepare.stage import SHIPPED_MANIFEST, sha256_file
    from tools.prepare import main

    shipped = tmp_path / "shipped"
    exp = experiment(tmp_path, model_dir)
    exp["prepare"]["warm_start"]["shipped"] = str(shipped)
    # the rebuild command, as a user runs it: trains from scratch and writes the shipped copy with its manifest
    overrides = [f"experiment.{key}={json.dumps(exp[key])}" for key in ("model", "data", "prepare")]
    assert main(["topology/local.yaml", *overrides, "--ship"]) == 0
    assert f"prepare: the run starts from {tmp_path / 'ws' / 'stage2'}" in capsys.readouterr().out
    manifest = json.loads((shipped / SHIPPED_MANIFEST).read_text())
    assert manifest["weights"] == {"model.safetensors": sha256_file(shipped / "model.safetensors")}
    assert manifest["command"].startswith("python3 -m tools.prepare topology/local.yaml") and "--ship" in manifest["command"]
    assert [s["steps"] for s in manifest["stages"]] == [3, 3] and (shipped / "tokenizer.json").exists()

    def fresh_clone() -> list[str]:   # the cache is gone; the shipped copy is all there is
        shutil.rmtree(tmp_path / "ws", ignore_errors=True)
        lines: list[str] = []
        prepared = prepare(copy.deepcopy(exp), log=lines.append)
        lines.append(f"model.path {prepared['model']['path']}")
        return lines

    lines = fresh_clone()
    assert lines[-1] == f"model.path {shipped}" and not any("stage 1/2" in x for x in lines), lines
    assert any("using the shipped warm start" in x and "sha256 checked" in x for x in lines)

    # a changed file is refused (one line saying why) and the warm start trained
    weights = shipped / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    lines = fresh_clone()
    refused = [x for x in lines if x.startswith("prepare: not using the shipped warm start")]
    assert len(refused) == 1 and "model.safetensors has sha256" in refused[0], lines
    assert any("stage 1/2" in x for x in lines) and lines[-1] == f"model.path {tmp_path / 'ws' / 'stage2'}"

    # a changed recipe is refused too, though the files are intact
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    exp["prepare"]["warm_start"]["stages"][1]["args"] = {**SFT_ARGS, "steps": 4}
    lines = fresh_clone()
    assert any("made by another recipe" in x for x in lines) and any("stage 1/2" in x for x in lines), lines
