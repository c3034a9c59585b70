"""The typed configuration: every key of the topology file, the experiment config and each actor's settings is
declared once (topology.schema, topology.experiment, topology.settings); unknown and misplaced keys are refused
with their full path, overrides go through the same models, --show-config says where each value came from, and
actors read typed settings."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

import topology as T
from topology import TopologyError
from topology.settings import ActorSettings, RolloutSettings, SettingsError, TrainerSettings, settings_model

REPO = Path(__file__).resolve().parent.parent


def one_node(**actors_settings: dict) -> dict:
    """A one-node topology of real actor classes (imported and settings-checked by validate)."""
    return {"cluster": {"nodes": 1, "node": {"cpus": 4}}, "bus": {"transport": "ipc"},
            "links": {"l": {"backend": "gloo", "members": ["ping", "echo"], "port": "auto"}},
            "supervisor": {"max_restarts": 1},
            "actors": {"echo": {"class": "testsupport.demo:Echoer", "settings": actors_settings.get("echo", {})},
                       "ping": {"class": "testsupport.demo:Pinger", "parallel": {"dp": 1},
                                "settings": actors_settings.get("ping", {})}}}


def problems_of(doc: dict) -> list[str]:
    with pytest.raises(TopologyError) as info:
        T.validate(doc, check_imports=True)
    return info.value.problems


@pytest.mark.parametrize("where, key", [
    ((), "nam"),
    (("cluster",), "node_count"),
    (("cluster", "node"), "gpu_count"),
    (("cluster", "node", "nics"), "infiniband"),
    (("bus",), "tranport"),
    (("supervisor",), "max_restart"),
    (("links", "l"), "bakend"),
    (("actors", "echo"), "setings"),
    (("actors", "ping", "parallel"), "ed"),
    (("actors", "ping", "settings"), "roundz"),
    (("actors", "ping", "settings", "algo"), "etaa"),
    (("actors", "ping", "settings", "message_log"), "flush_evry"),
])
def test_an_unknown_key_at_every_level_is_refused_with_its_full_path(where: tuple, key: str) -> None:
    doc = one_node(ping={"message_log": {"outbound": True}})
    node = doc
    for part in where:
        node = node.setdefault(part, {})
    node[key] = 1
    path = ".".join((*where, key))
    found = problems_of(doc)
    assert any(p.startswith(f"{path}: unknown key") for p in found), "\n".join(found)


CORE_ACTORS = {"trainer": "actors.trainer:TrainerActor", "rollout": "actors.rollout:RolloutActor",
               "param_server": "actors.param_server:ParamServerActor", "buffer": "actors.buffer:BufferActor"}


@pytest.mark.parametrize("group, settings, path, hint", [
    ("trainer", {"weight_bucket_mbb": 8}, "weight_bucket_mbb", "weight_bucket_mb"),
    ("trainer", {"algo": {"weight_decy": 0.1}}, "algo.weight_decy", "weight_decay"),
    ("rollout", {"sglang": {"mem_fraction_statc": 0.8}}, "sglang.mem_fraction_statc", "mem_fraction_static"),
    ("rollout", {"stats_every": 5.0}, "stats_every", "stats_every_s"),
    ("param_server", {"ack_timeout": 5.0}, "ack_timeout", "ack_timeout_s"),
    ("param_server", {"eval": {"every_version": 2}}, "eval.every_version", "every_versions"),
    ("buffer", {"buffer": {"max_groups_per_rolout": 2}}, "buffer.max_groups_per_rolout", "max_groups_per_rollout"),
    ("buffer", {"bus": {"max_inflght": 8}}, "bus.max_inflght", "max_inflight"),
])
def test_a_misspelt_key_of_a_core_actor_is_refused_naming_its_full_path(
        tmp_path: Path, group: str, settings: dict, path: str, hint: str) -> None:
    from actors.runtime.base import ActorSpec, load_actor_class
    # At launch, by the topology's check of the group's settings ...
    doc = {"cluster": {"nodes": 1}, "bus": {"transport": "ipc"},
           "actors": {group: {"class": CORE_ACTORS[group], "settings": settings}}}
    found = problems_of(doc)
    assert any(p.startswith(f"actors.{group}.settings.{path}: unknown key (did you mean '{hint}'?)")
               for p in found), found
    # ... and by the actor itself, before it starts, from the spec it is given.
    spec = ActorSpec(f"{group}.0", CORE_ACTORS[group], f"ipc://{tmp_path}/a", run_dir=str(tmp_path),
                     settings={"log_console": False, **settings})
    with pytest.raises(SettingsError) as info:
        load_actor_class(CORE_ACTORS[group])(spec)
    assert str(info.value).startswith(f"{group}.0: settings.{path}: unknown key (did you mean '{hint}'?)"), info.value


@pytest.mark.parametrize("settings, expected", [
    ({"engine": "sglang", "mem_fraction_static": 0.8},
     "actors.rollout.settings.mem_fraction_static: unknown key (did you mean 'sglang.mem_fraction_static'?)"),
    ({"kl_coef": 0.1}, "actors.rollout.settings.kl_coef: unknown key (did you mean 'algo.kl_coef'?)"),
    ({"gen": {"kl_coef": 0.1}}, "actors.rollout.settings.gen.kl_coef: unknown key"),
    ({"max_running": "many"}, "actors.rollout.settings.max_running: input should be a valid integer (value: 'many')"),
    ({"bus": {"heartbeat_timeout": 0}}, "actors.rollout.settings.bus.heartbeat_timeout: input should be greater than 0"),
])
def test_a_misplaced_or_mistyped_actor_setting_is_refused_at_launch(settings: dict, expected: str) -> None:
    doc = {"cluster": {"nodes": 1}, "bus": {"transport": "ipc"},
           "actors": {"rollout": {"class": "actors.rollout:RolloutActor", "settings": settings}}}
    found = problems_of(doc)
    assert any(p.startswith(expected) for p in found), found


@pytest.mark.parametrize("override, expected", [
    ("experiment.kl_coef=0.1", "experiment.kl_coef: unknown key (did you mean 'algo.kl_coef'?)"),
    ("experiment.gen.kl_coef=0.1", "experiment.gen.kl_coef: unknown key"),
    ("experiment.algo.eta=two", "experiment.algo.eta: input should be a valid integer (value: 'two')"),
    ("experiment.gen.top_p=2", "experiment.gen.top_p: input should be less than or equal to 1 (value: 2)"),
    ("experiment.prepare.warm_start.outt=x", "experiment.prepare.warm_start.outt: unknown key (did you mean 'out'?)"),
    ("experiment.prepare.data=[{args: {seed: 0}}]", "experiment.prepare.data[0].out: missing: the dataset folder"),
    ("experiment.prepare.data=[{out: d, args: {levels: [1, 2]}}]",
     "experiment.prepare.data[0].args.levels: value error, expected a scalar command-line value, got list"),
    ("actors.trainer.count=abc", "actors.trainer.count: input should be a valid integer (value: 'abc')"),
    ("actors.trainer.gpus=true", "actors.trainer.gpus: input should be a valid integer (value: True)"),
    ("bus.curve=1", "bus.curve: input should be a valid boolean (value: 1)"),
    ("experiment.eval.samples=3",
     "experiment.eval.samples: value error, 3 samples cannot give pass@8 and maj@8: use 0 (greedy only) or 8 or more"),
    ("actors.trainer.count.x=1", "actors.trainer.count: input should be a valid integer (value: {'x': 1})"),
    ("bus.transport.x=1", "bus.transport: override 'bus.transport.x=1' sets a key inside 'ipc', which is not a mapping"),
])
def test_overrides_are_checked_by_the_models(override: str, expected: str) -> None:
    with pytest.raises(TopologyError) as info:
        T.load(REPO / "topology" / "local.yaml", [override], check_imports=False)
    assert any(p.startswith(expected) for p in info.value.problems), info.value.problems


def test_an_override_sets_a_declared_key_the_files_leave_out() -> None:
    plan = T.load(REPO / "topology" / "local.yaml", ["experiment.algo.dual_clip=3.0", "supervisor.stop_timeout=5"],
                  check_imports=False)
    assert plan.topology.experiment["algo"]["dual_clip"] == 3.0
    assert plan.topology.supervisor["stop_timeout"] == 5


def test_every_actors_drain_is_a_share_of_the_supervisors_stop_budget(tmp_path: Path) -> None:
    # An actor's drain_timeout and the supervisor's stop_timeout were two equal numbers (30 s): a drain that used its
    # whole budget was SIGKILLed at its end, before its final state and its `stopped` line.
    plan = T.load(REPO / "topology" / "local.yaml", ["supervisor.stop_timeout=12"], check_imports=False)
    specs = plan.specs(tmp_path)
    assert specs and {s["settings"]["drain_timeout"] for s in specs} == {6.0}
    with pytest.raises(TopologyError) as info:
        T.load(REPO / "topology" / "local.yaml", ["actors.buffer.settings.drain_timeout=40"], check_imports=False)
    assert "actors.buffer.settings.drain_timeout: reserved: the launcher fills it in" in info.value.problems


def test_areal_key_names_are_read_as_ours_in_files_and_overrides(tmp_path: Path) -> None:
    # AReaL's tutorial names (its ppo-math quickstart options) in an experiment config and on the command line.
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump({
        "dataset": {"path": "/storage/datasets/boba_106k_0319.jsonl", "train_bs_n_seqs": 512, "max_prompt_len": 1024},
        "group_size": 16, "ppo": {"ppo_n_minibatches": 4, "gen": {"max_new_tokens": 27648}},
        "actor_train": {"mb_spec": {"max_tokens_per_mb": 30720}}, "exp_ctrl": {"ckpt_freq_secs": 600},
        "actor": {"optimizer": {"lr": 2.0e-5, "beta2": 0.95, "weight_decay": 0.05}}}))
    topo = yaml.safe_load((REPO / "topology" / "local.yaml").read_text())
    topo["config"] = "exp.yaml"
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(topo))
    plan = T.load(tmp_path / "t.yaml", ["experiment.dataset.train_bs_n_seqs=256"], check_imports=False)
    cfg = plan.topology.config
    assert (cfg.algo.batch_size, cfg.algo.group_size, cfg.algo.ppo_minibatches, cfg.algo.max_tokens_per_mb) == \
        (256, 16, 4, 30720)
    assert (cfg.data.train, cfg.data.max_prompt_tokens, cfg.gen.max_new_tokens) == \
        ("/storage/datasets/boba_106k_0319.jsonl", 1024, 27648)
    assert (cfg.run.checkpoint_every_s, cfg.algo.lr, cfg.algo.adam_beta2, cfg.algo.weight_decay) == \
        (600, 2e-5, 0.95, 0.05)
    # the actors are given one spelling of each key: ours
    assert "dataset" not in plan.topology.experiment and plan.topology.experiment["algo"]["batch_size"] == 256
    rows = {key: (value, source) for key, value, source in T.resolved_config(tmp_path / "t.yaml")}
    assert rows["experiment.algo.group_size"] == (16, "config file")


@pytest.mark.parametrize("doc, expected", [
    ({"dataset": {"train_bs_n_seqs": 512}, "algo": {"batch_size": 32}},
     "experiment.dataset.train_bs_n_seqs: AReaL's name for algo.batch_size, which is also set, to 32: keep one"),
    ({"ppo": {"adv_norm": True}}, "experiment.ppo.adv_norm: AReaL's key has no single equivalent here: set algo.adv_norm"),
    ({"ppo": {"reward_output_scaling": 5}}, "experiment.ppo.reward_output_scaling: AReaL's key has no single"),
])
def test_an_areal_key_that_cannot_be_read_as_ours_says_what_to_set(doc: dict, expected: str) -> None:
    from topology.experiment import experiment_problems

    problems = experiment_problems(doc)
    assert any(p.startswith(expected) for p in problems), problems


def test_show_config_says_where_each_value_came_from(tmp_path: Path) -> None:
    (tmp_path / "exp.yaml").write_text("algo: {lr: 1.0e-5, eta: 4}\ngen: {max_new_tokens: 16}\n")
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({
        "config": "exp.yaml", "cluster": {"nodes": 1}, "bus": {"transport": "ipc"},
        "actors": {"ping": {"class": "testsupport.demo:Pinger", "settings": {"rounds": 3, "gen": {"temperature": 0.5}}},
                   "echo": {"class": "testsupport.demo:Echoer"}}}))
    rows = {key: (value, source) for key, value, source in
            T.resolved_config(path, ["experiment.algo.eta=1", "actors.echo.count=1"])}
    assert rows["bus.transport"] == ("ipc", "topology file")
    assert rows["bus.base_port"] == (20000, "default")
    assert rows["bus.curve"] == (False, "default")            # resolved: off on ipc
    assert rows["actors.echo.count"] == (1, "override")
    assert rows["actors.ping.count"] == (1, "default")
    assert rows["actors.ping.settings.rounds"] == (3, "topology file")
    assert rows["actors.ping.settings.tensor_elems"] == (1024, "default")
    assert rows["actors.ping.settings.gen.temperature"] == (0.5, "topology file")
    assert "actors.ping.settings.gen.top_p" not in rows       # the experiment's, listed under experiment.*
    assert rows["experiment.algo.eta"] == (1, "override")
    assert rows["experiment.algo.lr"] == (1e-5, "config file")
    assert rows["experiment.gen.max_new_tokens"] == (16, "config file")
    assert rows["experiment.algo.batch_size"] == (32, "default")
    assert rows["supervisor.max_restarts"] == (3, "default")


def test_show_config_prints_one_line_per_key(capsys: pytest.CaptureFixture) -> None:
    from tools.up import main
    assert main([str(REPO / "topology" / "local.yaml"), "--show-config", "experiment.algo.eta=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("experiment.algo.eta = 2 ") and line.endswith("# override") for line in out)
    assert any(line.startswith("bus.transport = 'ipc' ") and line.endswith("# topology file") for line in out)
    assert any(line.startswith("experiment.model.path = ") and line.endswith("# config file") for line in out)
    assert main([str(REPO / "topology" / "local.yaml"), "--show-config", "experiment.algo.etaa=2"]) == 2


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "topology").glob("*.yaml")))
def test_show_config_resolves_every_shipped_topology(name: str) -> None:
    rows = T.resolved_config(REPO / "topology" / name)
    assert len({key for key, _, _ in rows}) == len(rows)   # each key once
    assert {source for _, _, source in rows} <= {"default", "topology file", "config file", "override"}


def test_actors_read_typed_settings(tmp_path: Path) -> None:
    from actors.runtime.base import ActorSpec
    from testsupport.demo import DemoSettings, Pinger
    spec = ActorSpec("ping", "testsupport.demo:Pinger", f"ipc://{tmp_path}/p", run_dir=str(tmp_path),
                     settings={"log_console": False, "rounds": 2, "algo": {"eta": 0}})
    actor = Pinger(spec)
    assert isinstance(actor.cfg, DemoSettings)
    assert (actor.cfg.rounds, actor.cfg.algo.eta, actor.cfg.algo.batch_size, actor.cfg.gen.max_new_tokens) == (2, 0, 32, 64)
    bad = dataclasses.replace(spec, settings={"rounds": 2, "algo": {"kl_coeff": 0.1}})
    with pytest.raises(SettingsError, match=r"ping: settings.algo.kl_coeff: unknown key \(did you mean 'kl_coef'\?\)"):
        Pinger(bad)


def test_settings_models_of_the_actor_classes() -> None:
    from testsupport.demo import DemoSettings, Echoer
    from actors.reward.math import MathReward
    from actors.buffer.actor import BufferActor
    from actors.param_server.actor import ParamServerActor
    from actors.rollout.actor import RolloutActor
    from actors.trainer.actor import TrainerActor
    from topology.settings import BufferSettings, ParamServerSettings, RewardSettings
    assert settings_model(Echoer) is DemoSettings
    assert settings_model(MathReward) is RewardSettings
    assert settings_model(RolloutActor) is RolloutSettings
    assert settings_model(TrainerActor) is TrainerSettings
    assert settings_model(ParamServerActor) is ParamServerSettings
    assert settings_model(BufferActor) is BufferSettings
    assert settings_model(object) is ActorSettings


def test_sft_command_line_defaults_are_the_dataclass_defaults() -> None:
    from launch.prepare.sft import SFTConfig
    from tools.sft import parse_args
    cfg, as_json = parse_args(["--data", "d.jsonl", "--out", "o"])
    assert cfg == SFTConfig(data="d.jsonl", out="o") and not as_json
    cfg, _ = parse_args(["--data", "d", "--out", "o", "--levels", "1-3", "--keep", "last", "--until-plateau",
                         "--lr", "0.5", "--max-seconds", "9"])
    assert (cfg.levels, cfg.keep, cfg.until_plateau, cfg.lr, cfg.max_seconds) == ([1, 2, 3], "last", True, 0.5, 9.0)
    with pytest.raises(SystemExit):
        parse_args(["--data", "d", "--out", "o", "--steps", "3", "--epochs", "1"])


def test_bus_settings_hand_the_bus_only_the_keys_they_set() -> None:
    from topology.settings import BusSettings
    # an explicit null turns heartbeats off; a key left out keeps transport.bus.Bus's own default
    assert BusSettings.model_validate({"heartbeat_interval": None, "max_inflight": 8}).bus_kwargs() == \
        {"heartbeat_interval": None, "max_inflight": 8}
    assert BusSettings().bus_kwargs() == {}
