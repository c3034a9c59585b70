"""The shipped recipes (configs/areal_*.yaml, and the configs the GPU topologies name): each names its source in
AReaL's publications and cites it (or says "ours") on every value, the command that runs it on the topology the
tutorial names passes --dry-run, the 1.5B context stages chain, and the data files each names are AReaL's released
files, read through the recipe's own layout from samples in their real layout (tests/data/areal)."""
from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from actors.runtime.recovery import checkpoint_dir
from tools.up import main as up_main

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "configs").glob("areal_*.yaml"))
# every config a GPU topology names, and the AReaL recipes
GPU_CONFIGS = sorted({*RECIPES, *(REPO / yaml.safe_load(t.read_text())["config"]
                                  for t in (REPO / "topology").glob("*node.yaml"))})
AREAL_DATA = REPO / "tests" / "data" / "areal"


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
    zero = doc["areal_v01_7b_r1_zero"]
    assert (zero["algo"]["batch_size"], zero["algo"]["group_size"], zero["algo"]["lr"]) == (512, 64, 1e-6)
    assert (zero["algo"]["reward_correct"], zero["algo"]["reward_wrong"]) == (1.0, 0.0)   # AReaL's 0/1 zero rewards
    assert [doc[f"areal_v01_1.5b_stage{i}"]["gen"]["temperature"] for i in ("1_8k", "2_16k", "3_24k")] == [0.6] * 3
    for name, d in doc.items():   # AReaL's advantage form, optimizer and checkpoints by time, in every recipe
        assert (d["algo"]["group_norm"], d["algo"]["adv_norm"]) == (False, "batch"), name
        assert (d["algo"]["adam_beta2"], d["algo"]["weight_decay"]) == (0.95, 0.05), name
        assert d["run"]["checkpoint_every_s"] == 600 and d["data"]["max_prompt_tokens"] in (1024, 2048), name


def test_context_stages_each_start_from_the_last_checkpoint_of_the_one_before():
    stages = [REPO / "configs" / f"areal_v01_1.5b_stage{s}.yaml" for s in ("1_8k", "2_16k", "3_24k")]
    for prev, cur in zip(stages, stages[1:]):
        prev_doc, cur_doc = yaml.safe_load(prev.read_text()), yaml.safe_load(cur.read_text())
        prev_run_dir = run_line(prev)[run_line(prev).index("--run-dir") + 1]
        last = str(checkpoint_dir(prev_run_dir, prev_doc["run"]["total_steps"]) / "model")
        assert cur_doc["model"]["path"] == last, cur.name


def value_lines(config: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line of `config` that sets a value (a leaf key, not a mapping's header)."""
    out = []
    lines = config.read_text().splitlines()
    for i, line in enumerate(lines):
        body = line.split("#", 1)[0].rstrip()
        if not body.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = body.partition(":")
        nxt = next((l for l in lines[i + 1:] if l.strip() and not l.lstrip().startswith("#")), "")
        opens_mapping = not value.strip() and len(nxt) - len(nxt.lstrip()) > len(line) - len(line.lstrip())
        if sep and not opens_mapping:
            out.append((i + 1, line))
    return out


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda p: p.stem)
def test_every_value_cites_its_source_or_says_it_is_ours(config: Path):
    tags = {t.strip("[]") for t in re.findall(r"^#\s+(\[[a-z0-9.]+\])", config.read_text(), re.M)}
    assert tags, f"{config.name}: a header listing its sources as [tag] lines"
    for number, line in value_lines(config):
        comment = line.split("#", 1)[1] if "#" in line else ""
        cited = set(re.findall(r"\[([a-z][a-z0-9.]*)\]", comment))
        assert cited or comment.strip().startswith("ours"), f"{config.name}:{number}: no source for {line.strip()!r}"
        assert cited <= tags, f"{config.name}:{number}: {sorted(cited - tags)} is not a source of the header"


def fixture_for(path: str) -> Path:
    """The sample of an AReaL file a config names, by its released name (benchmarks by evaluation/data/<name>/)."""
    p = Path(path)
    return AREAL_DATA / "eval" / p.parent.name / p.name if p.name == "test.jsonl" else AREAL_DATA / p.name


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda p: p.stem)
def test_each_config_reads_areal_released_files_in_their_layout(config: Path, tmp_path: Path):
    from actors.dataset import DOWNLOAD_SUFFIX, Layout, load_dataset
    from topology.experiment import ExperimentConfig

    data = ExperimentConfig.model_validate(yaml.safe_load(config.read_text())).data
    assert data.train and data.test, f"{config.name}: data.train and data.test"
    files = {"train": data.train, "test": data.test, **({"id2info": data.id2info} if data.id2info else {})}
    local = {}
    for key, path in files.items():
        sample = fixture_for(path)
        assert sample.is_file(), f"{config.name}: data.{key} {path} is not one of AReaL's released files"
        # saved as the tutorial's wget saves it: NAME?download=true
        local[key] = tmp_path / f"{key}_{sample.name}"
        shutil.copy(sample, str(local[key]) + DOWNLOAD_SUFFIX)
    settings = data.model_copy(update={"train": str(local["train"]), "test": str(local["test"]),
                                       "id2info": str(local["id2info"]) if "id2info" in local else None})
    train = load_dataset(settings.train, layout=Layout.from_settings(settings))
    test = load_dataset(settings.test, layout=Layout.from_settings(settings, test=True))
    assert len(train) >= 2 and len(test) >= 1 and all(r.references for r in [*train, *test])
    # the released prompts carry their template: none is wrapped twice; the benchmark's questions get the template
    assert train.templated_as_is == len(train) and test.templated_as_is == 0
    template = Layout.from_settings(settings).prompt_template
    assert template and all(r.prompt.startswith(template.split("{prompt}")[0]) for r in test)


def test_a_run_says_what_it_will_evaluate_and_when_it_will_not(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert up_main(["topology/1node.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "evaluation on /storage/codes/AReaL/evaluation/data/aime24/test.jsonl:" in out
    # the shipped GPU topologies evaluate during the run on the rollouts' own engines (no GPU for the evaluator)
    assert ("during the run: every 10 versions, 30 problems, in evaluator: answered greedily by the rollouts' own "
            "engines, the weights they hold then") in out
    assert "at the end: the start model and the last checkpoint" in out
    for gpu_topology in ("4node", "16node", "64node"):
        assert up_main([f"topology/{gpu_topology}.yaml", "--dry-run"]) == 0
        assert "in evaluator: answered greedily by the rollouts' own engines" in capsys.readouterr().out
    assert up_main(["topology/demo_local.yaml", "experiment.data.test=held_out.jsonl",
                    "experiment.eval.every_versions=5", "--dry-run"]) == 0
    assert "during the run: none: the topology has no evaluator group (eval.every_versions 5 is unused)" in \
        capsys.readouterr().out
    assert up_main(["topology/1node.yaml", "experiment.data.test=null", "--dry-run"]) == 0
    assert "evaluation: none: data.test is not set" in capsys.readouterr().out
    assert up_main(["topology/local.yaml", "experiment.run.final_eval=false", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "during the run: every 10 versions, 60 problems, in evaluator" in out
    assert "at the end: none: run.final_eval is false" in out


def test_the_final_evaluation_says_why_it_does_not_run(tmp_path, capsys):
    from launch.evaluation import final_evaluation
    from topology.experiment import ExperimentConfig

    assert final_evaluation(ExperimentConfig(), tmp_path) is None
    assert "no final evaluation: data.test is not set" in capsys.readouterr().out
    missing = ExperimentConfig.model_validate({"data": {"test": str(tmp_path / "aime24.jsonl")}})
    assert final_evaluation(missing, tmp_path) is None
    assert f"no final evaluation: data.test {tmp_path / 'aime24.jsonl'}: no such file" in capsys.readouterr().out
    (tmp_path / "aime24.jsonl?download=true").write_text("{}\n")   # found under its download name
    assert final_evaluation(missing, tmp_path) is None
    assert "no final evaluation: the run wrote no checkpoint" in capsys.readouterr().out


def test_a_gpu_topology_evaluates_during_the_run_with_an_evaluator_on_a_rollouts_gpu(monkeypatch, capsys):
    # docs/topology.md's snippet: one rollout's GPU to an evaluator on its own SGLang server, reading checkpoints
    monkeypatch.chdir(REPO)
    evaluator = ("actors.evaluator={class: 'actors.evaluator:EvalActor', gpus: 1, threads: 4, "
                 "settings: {engine: sglang, weights_from: checkpoints}}")
    assert up_main(["topology/1node.yaml", "actors.rollout.count=5", evaluator, "--dry-run"]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert "during the run: every 10 versions, 30 problems, in evaluator: on each complete checkpoint" in out
    assert "localhost [8/8 gpu" in out


def test_the_run_summary_weighs_the_engine_trainer_mismatch_by_the_tokens_of_each_step():
    from launch.evaluation import run_figures

    step = {"time": 10.0, "step_seconds": 2.0, "n_tokens": 100.0, "staleness_max": 1.0}
    metrics = [{**step, "step": 1, "mismatch_tokens": 30.0, "mismatch_logprob_diff_mean": 0.1, "logprob_gap_max": 0.5},
               {**step, "step": 2, "time": 14.0, "mismatch_tokens": 0.0, "mismatch_logprob_diff_mean": 0.0,
                "logprob_gap_max": 0.0},
               {**step, "step": 3, "time": 18.0, "mismatch_tokens": 10.0, "mismatch_logprob_diff_mean": 0.5,
                "logprob_gap_max": 0.9}]
    figures = run_figures(metrics)
    assert figures["steps"] == 3 and figures["wall_seconds"] == 10.0 and figures["tokens_trained"] == 300.0
    assert figures["mismatch_tokens"] == 40.0 and figures["logprob_gap_max"] == 0.9
    assert figures["mismatch_logprob_diff_mean"] == pytest.approx((30 * 0.1 + 10 * 0.5) / 40)
    # records of a build that did not measure it: no figure rather than a zero
    assert "mismatch_logprob_diff_mean" not in run_figures([{**step, "step": 1}]) and run_figures([]) == {}
