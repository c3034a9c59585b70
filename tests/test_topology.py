"""Topology schema, validation messages (one line each, naming the key), overrides and placement."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

import topology as T
from topology import TopologyError

REPO = Path(__file__).resolve().parent.parent


def gpu_doc() -> dict:
    """A valid 2-node x 8-GPU topology (classes are not import-checked in these tests)."""
    return {
        "name": "t",
        "cluster": {"nodes": "gpu[01-02]", "node": {"gpus": 8, "gpu_kind": "H800", "cpus": 16,
                                                   "nics": {"ib": ["mlx5_0", "mlx5_1"], "socket": "eth0"}}},
        "bus": {"transport": "tcp", "base_port": 21000, "port_range": 100},
        "links": {"weights": {"backend": "nccl", "members": ["trainer.0", "rollout"], "port": 29500, "gdr": True}},
        "actors": {
            "rollout": {"class": "m:Rollout", "count": 4, "nodes": [0], "gpus": 2, "parallel": {"tp": 2}},
            "trainer": {"class": "m:Trainer", "count": 8, "nodes": ["gpu02"], "gpus": 1,
                        "parallel": {"dp": 2, "tp": 4, "pp": 1}},
            "reward": {"class": "m:Reward", "count": 2, "cpu_workers": 8},
        },
    }


def problems(doc: dict, **kw) -> list[str]:
    with pytest.raises(TopologyError) as info:
        T.validate(doc, check_imports=False, **kw)
    return info.value.problems


def test_valid_topology_places_every_instance() -> None:
    plan = T.place(T.validate(gpu_doc(), check_imports=False))
    by_name = {i.name: i for i in plan.instances}
    assert [i.name for i in plan.instances][:4] == ["rollout.0", "rollout.1", "rollout.2", "rollout.3"]
    assert by_name["rollout.3"].host == "gpu01" and by_name["rollout.3"].gpus == [6, 7]
    assert by_name["trainer.7"].host == "gpu02" and by_name["trainer.7"].gpus == [7]
    assert by_name["reward.0"].host == "gpu01" and by_name["reward.1"].host == "gpu02"
    assert by_name["reward.0"].env["CUDA_VISIBLE_DEVICES"] == ""  # CPU actors keep off the GPUs
    assert by_name["trainer.0"].endpoint.endswith(":21004")
    link = plan.links["weights"]
    assert link.members == ["trainer.0", "rollout.0", "rollout.1", "rollout.2", "rollout.3"]
    assert link.master_host == "gpu02"
    assert link.env == {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_NET_GDR_LEVEL": "PHB",
                        "NCCL_NET_GDR_READ": "1"}
    assert by_name["rollout.2"].env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"  # exported to link members only
    assert "NCCL_IB_HCA" not in by_name["reward.0"].env


def test_a_topology_types_its_own_copy_of_the_experiment_once() -> None:
    # The typed config was once a property re-validated from a document anyone could change (tools.prepare
    # did, in place): read before the change it named one model, after it another. Now the topology copies
    # the document it is given and types it once; another document is another plan.
    experiment = {"gen": {"temperature": 1.0}}
    plan = T.place(T.validate(gpu_doc(), check_imports=False, experiment=experiment))
    experiment["gen"]["temperature"] = 0.5
    assert plan.topology.experiment == {"gen": {"temperature": 1.0}} and plan.topology.config.gen.temperature == 1.0
    with pytest.raises(AttributeError):
        plan.topology.experiment = experiment
    other = plan.with_experiment(experiment)
    assert other.topology.config.gen.temperature == 0.5 and plan.topology.config.gen.temperature == 1.0
    assert {s["settings"]["gen"]["temperature"] for s in other.specs("/tmp/run")} == {0.5}
    with pytest.raises(TopologyError, match="experiment.gen.temperature"):
        plan.with_experiment({"gen": {"temperature": "hot"}})


def test_specs_carry_placement_links_and_experiment() -> None:
    doc = gpu_doc()
    doc["actors"]["rollout"]["settings"] = {"engine": "sglang", "gen": {"temperature": 0.5}}
    topo = T.validate(doc, check_imports=False, experiment={"gen": {"temperature": 1.0, "max_new_tokens": 9}})
    specs = {s["name"]: s for s in T.place(topo).specs("/tmp/run")}
    r1 = specs["rollout.1"]
    assert set(r1) == {"name", "cls", "endpoint", "peers", "settings", "run_dir", "curve", "env", "tokens"}
    assert r1["settings"]["gen"] == {"temperature": 0.5, "max_new_tokens": 9}  # group settings win, key by key
    assert r1["settings"]["instance"]["gpus"] == [2, 3]
    assert r1["settings"]["groups"]["trainer"][-1] == "trainer.7"
    weights = r1["settings"]["links"]["weights"]
    assert (weights["rank"], weights["world_size"], weights["master_port"]) == (2, 5, 29500)
    assert "weights" not in specs["reward.0"]["settings"]["links"]
    assert "rollout.1" not in r1["peers"] and r1["peers"]["trainer.0"] == specs["trainer.0"]["endpoint"]


def test_cpu_placement_becomes_affinity_and_threads() -> None:
    doc = {"cluster": {"nodes": 1, "node": {"cpus": 2}}, "bus": {"transport": "ipc"},
           "actors": {"gen": {"class": "m:A", "count": 2, "cpus": [[0], [1]]},
                      "train": {"class": "m:B", "cpus": [0, 1], "threads": 2},
                      "free": {"class": "m:C"}}}
    env = {i.name: i.env for i in T.place(T.validate(doc, check_imports=False)).instances}
    assert env["gen.0"] == {"OMP_NUM_THREADS": "1", "AREAL_CPU_AFFINITY": "0"}
    assert env["gen.1"]["AREAL_CPU_AFFINITY"] == "1"
    assert env["train"] == {"OMP_NUM_THREADS": "2", "AREAL_CPU_AFFINITY": "0,1"}
    assert env["free"] == {"OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["actors"]["rollout"].update(cout=4),
     "actors.rollout.cout: unknown key (did you mean 'count'?)"),
    (lambda d: d["bus"].update(base_prot=1),
     "bus.base_prot: unknown key (did you mean 'base_port'?)"),
    (lambda d: d.update(actor={}), "actor: unknown key (did you mean 'actors'?)"),
    (lambda d: d["cluster"]["node"].update(gpu=8), "cluster.node.gpu: unknown key (did you mean 'gpus'?)"),
    (lambda d: d["actors"]["trainer"]["parallel"].update(sp=2), "actors.trainer.parallel.sp: unknown key"),
    (lambda d: d["actors"]["rollout"].update(count=5),
     "actors.rollout.gpus: GPUs over-subscribed on node gpu01: 10 requested (rollout: 10) but it has 8"),
    (lambda d: d["actors"]["reward"].update(nodes=[1], gpus=1, count=1),
     "actors.reward.gpus: GPUs over-subscribed on node gpu02: 9 requested (trainer: 8, reward: 1) but it has 8"),
    (lambda d: d["actors"]["trainer"]["parallel"].update(dp=3),
     "actors.trainer.parallel: dp*tp*pp = 12 but 8 GPUs assigned"),
    (lambda d: d["actors"]["trainer"]["parallel"].update(dp=1, tp=8, pp=1) or d["actors"]["trainer"].update(count=16, nodes=[0, 1]) or d["actors"].pop("rollout") or d["links"].clear(),
     "actors.trainer.parallel: dp*tp*pp = 8 but 16 GPUs assigned"),
    (lambda d: d["actors"]["rollout"]["parallel"].update(tp=3),
     "actors.rollout.parallel.tp: 3 does not divide the 8 GPUs assigned"),
    (lambda d: d["actors"]["trainer"]["parallel"].update(tp=16, dp=1, pp=1) or d["actors"]["trainer"].update(count=16, nodes=[0, 1]) or d["actors"].pop("rollout") or d["links"].clear(),
     "actors.trainer.parallel.tp: 16 is larger than the 8 GPUs of a node (tensor parallelism stays inside a node's NVLink)"),
    (lambda d: d["actors"]["reward"].update(cpu_workers=17),
     "actors.reward.cpu_workers: CPU workers over-subscribed on node gpu01: 17 requested (reward: 17) but it has 16 cores"),
    (lambda d: d["links"]["weights"].update(members=["trainer.0", "rollouts"]),
     "links.weights.members[1]: no actor group 'rollouts' (did you mean 'rollout'?)"),
    (lambda d: d["links"]["weights"].update(members=["trainer.8", "rollout"]),
     "links.weights.members[0]: 'trainer.8': group trainer has instances 0-7"),
    (lambda d: d["links"].update(cpu={"backend": "nccl", "members": ["reward", "trainer.0"], "port": 29501}),
     "links.cpu.backend: nccl needs GPUs but member group reward has none (use gloo)"),
    (lambda d: d["links"]["weights"].update(port=21050),
     "links.weights.port: 21050 collides with the bus ports 21000-21099"),
    (lambda d: d["links"].update(again={"backend": "nccl", "members": ["trainer.0", "trainer.1"], "port": 29500}),
     "links.again.port: 29500 is already the rendezvous port of links.weights on the same node"),
    (lambda d: d["links"].update(g={"backend": "gloo", "members": ["trainer", "reward"], "port": 29501, "gdr": True}),
     "links.g.gdr: GPUDirect RDMA needs backend nccl"),
    (lambda d: d["links"]["weights"].update(env={"NCCL_NET_GDR_LEVEL": "SYS"}) or
     d["links"].update(other={"backend": "nccl", "members": ["trainer.0", "trainer.1"], "port": 29501, "gdr": True}),
     "links.other.env.NCCL_NET_GDR_LEVEL: 'PHB' conflicts with 'SYS' from links.weights for group trainer"),
    (lambda d: d["bus"].update(port_range=10), "bus.port_range: 14 actor instances need 14 ports but the range has 10"),
    (lambda d: d["bus"].update(transport="ipc"), "bus.transport: ipc works on one node only; the cluster has 2 (use tcp)"),
    (lambda d: d["bus"].update(transport="udp"), "bus.transport: input should be 'tcp' or 'ipc' (value: 'udp')"),
    (lambda d: d["actors"]["rollout"].update(nodes=[2]),
     "actors.rollout.nodes[0]: node index 2 out of range (cluster has 2 nodes: 0-1)"),
    (lambda d: d["actors"]["rollout"].update(nodes=["gpu03"]), "actors.rollout.nodes[0]: host 'gpu03' is not in cluster.nodes"),
    (lambda d: d["actors"]["rollout"].update(count="four"), "actors.rollout.count: input should be a valid integer (value: 'four')"),
    (lambda d: d["actors"]["reward"].update(cpus=[[0], [99]]),
     "actors.reward.cpus[1]: core(s) [99] do not exist (nodes have 16 cores: 0-15)"),
    (lambda d: d["actors"]["reward"].update(settings={"links": {}}), "actors.reward.settings.links: reserved: the launcher fills it in"),
    (lambda d: d["actors"]["reward"].update(env={"BAD-NAME": 1}), "actors.reward.env.BAD-NAME: not a valid environment variable name"),
    (lambda d: d["actors"]["reward"].pop("class"), "actors.reward.class: missing: the actor class as module.path:ClassName"),
])
def test_each_validation_error_names_its_key(mutate, expected) -> None:
    doc = gpu_doc()
    mutate(doc)
    found = problems(doc)
    assert any(p == expected or p.startswith(expected + ";") for p in found), "\n".join(found)


def test_all_problems_are_collected_not_just_the_first() -> None:
    doc = gpu_doc()
    doc["actors"]["rollout"]["cout"] = 1
    doc["bus"]["transprt"] = "tcp"
    doc["actors"]["trainer"]["parallel"]["dp"] = 3
    found = problems(doc)
    assert any(p.startswith("actors.rollout.cout:") for p in found)
    assert any(p.startswith("bus.transprt:") for p in found)
    assert "actors.trainer.parallel: dp*tp*pp = 12 but 8 GPUs assigned" in found
    assert all("\n" not in p for p in found)


def test_class_import_and_actor_checks() -> None:
    doc = {"cluster": {"nodes": 1}, "bus": {"transport": "ipc"},
           "actors": {"a": {"class": "no_such_module_xyz:Thing"}, "b": {"class": "topology:Plan"},
                      "c": {"class": "topology:Missing"}, "d": {"class": "not a path"}}}
    with pytest.raises(TopologyError) as info:
        T.validate(doc, check_imports=True)
    found = info.value.problems
    assert ("actors.a.class: cannot import no_such_module_xyz: ModuleNotFoundError: No module named "
            "'no_such_module_xyz'") in found
    assert "actors.c.class: topology has no attribute 'Missing'" in found
    assert "actors.d.class: expected module.path:ClassName, got 'not a path'" in found
    b = [p for p in found if p.startswith("actors.b.class:")]
    assert b and ("is not an Actor subclass" in b[0] or "actors.runtime.base does not import" in b[0])


def test_demo_classes_pass_the_actor_check() -> None:
    doc = {"cluster": {"nodes": 1}, "bus": {"transport": "ipc"},
           "actors": {"echo": {"class": "testsupport.demo:Echoer"}, "ping": {"class": "testsupport.demo:Pinger"}}}
    T.validate(doc, check_imports=True)


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster:\n  nodes: 1\nactors:\n  a: {class: x:Y\n")
    with pytest.raises(TopologyError, match=r"line \d+, column \d+: YAML syntax error"):
        T.load(bad)


def test_a_binary_file_is_refused_in_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"cluster:\n  nodes: 1\n\x00\xff\xfe\x89PNG")
    with pytest.raises(TopologyError, match=r"line 3: not a YAML text file \(byte 21 is not UTF-8\)"):
        T.load(binary)
    from tools.up import main
    assert main([str(binary), "--dry-run"]) == 2


def test_overrides_topology_and_experiment(tmp_path: Path) -> None:
    (tmp_path / "exp.yaml").write_text("algo: {lr: 1.0e-5, eta: 4}\n")
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"config": "exp.yaml", "cluster": {"nodes": 1}, "bus": {"transport": "ipc"},
                                    "actors": {"a": {"class": "m:A"}}}))
    plan = T.load(path, ["actors.a.count=3", "actors.a.cpus=[[0],[0],[0]]", "experiment.algo.eta=0",
                         "experiment.algo.dual_clip=3.0"], check_imports=False)
    assert [i.name for i in plan.instances] == ["a.0", "a.1", "a.2"]
    assert plan.topology.experiment["algo"] == {"lr": 1e-5, "eta": 0, "dual_clip": 3.0}
    with pytest.raises(TopologyError) as info:
        T.load(path, ["experiment.algo.etta=0", "actors.a.cuont=2"], check_imports=False)
    found = info.value.problems
    assert any(p.startswith("experiment.algo.etta: unknown key (did you mean 'eta'?)") for p in found)
    assert any(p.startswith("actors.a.cuont: unknown key (did you mean 'count'?)") for p in found)
    with pytest.raises(TopologyError, match="expected key.sub=value"):
        T.load(path, ["actors.a.count"], check_imports=False)
    with pytest.raises(TopologyError, match="drop the leading +"):
        T.load(path, ["+experiment.algo.eta=1"], check_imports=False)


def test_missing_config_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("config: nowhere.yaml\ncluster: {nodes: 1}\nbus: {transport: ipc}\nactors: {a: {class: 'm:A'}}\n")
    with pytest.raises(TopologyError, match="config: 'nowhere.yaml' not found"):
        T.load(path, check_imports=False)


def test_expand_nodelist() -> None:
    assert T.expand_nodelist("node[001-003,7],gpu-a[1-2]") == ["node001", "node002", "node003", "node7",
                                                               "gpu-a1", "gpu-a2"]
    assert T.expand_nodelist("n1,n2") == ["n1", "n2"]
    with pytest.raises(ValueError):
        T.expand_nodelist("node[a-b]")


def test_allocation_fills_in_node_names() -> None:
    doc = copy.deepcopy(gpu_doc())
    doc["cluster"]["nodes"] = 2
    doc["actors"]["trainer"]["nodes"] = [1]
    plan = T.place(T.validate(doc, check_imports=False))
    assert plan.topology.nodes_from_allocation and plan.instances[0].host == "#0"
    real = plan.with_hosts(["hostA", "hostB", "hostC"])
    assert {i.host for i in real.instances if i.group == "trainer"} == {"hostB"}
    with pytest.raises(TopologyError, match="topology needs 2 nodes but the allocation has 1"):
        plan.with_hosts(["hostA"])
    named = T.place(T.validate(gpu_doc(), check_imports=False))
    with pytest.raises(TopologyError, match="gpu02 not in the allocation"):
        named.with_hosts(["gpu01", "n7"])


SHIPPED = sorted(p.name for p in (REPO / "topology").glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_topology_is_valid_without_imports(name: str) -> None:
    plan = T.load(REPO / "topology" / name, check_imports=False)
    assert plan.instances
    gpus_used = sum(len(i.gpus) for i in plan.instances)
    assert gpus_used <= sum(n.gpus for n in plan.topology.nodes)


def test_64node_matches_the_seeds_split() -> None:
    plan = T.load(REPO / "topology" / "64node.yaml", check_imports=False)
    gpus = {}
    for inst in plan.instances:
        gpus[inst.group] = gpus.get(inst.group, 0) + len(inst.gpus)
    assert gpus["rollout"] == 384 and gpus["trainer"] == 128  # 75 / 25 of 512 H800
    assert {plan.topology.nodes[i.node].gpu_kind for i in plan.instances} == {"H800"}
    trainer_nodes = {i.node for i in plan.instances if i.group == "trainer"}
    assert trainer_nodes == set(range(48, 64))
    assert {i.node for i in plan.instances if i.group == "reward"} == set(range(48))  # CPUs of rollout nodes
    assert plan.links["weights"].env["NCCL_NET_GDR_LEVEL"] == "PHB"


def test_curve_is_on_by_default_on_tcp_and_ipc_sockets_are_private(tmp_path: Path) -> None:
    # Without CURVE any local user could send a tcp bus messages (a spoofed BatchRequest stole a batch).
    tcp = {"cluster": {"nodes": 1}, "bus": {"transport": "tcp"}, "actors": {"a": {"class": "m:A"}}}
    assert T.validate(tcp, check_imports=False).bus.curve
    ipc = {"cluster": {"nodes": 1}, "bus": {"transport": "ipc"}, "actors": {"a": {"class": "m:A"}}}
    assert not T.validate(ipc, check_imports=False).bus.curve
    from launch.rundir import build_specs
    [spec] = build_specs(T.place(T.validate(ipc, check_imports=False)), tmp_path)
    ipc_dir = Path(spec["endpoint"].removeprefix("ipc://")).parent
    assert ipc_dir.stat().st_mode & 0o777 == 0o700


def test_a_tcp_bus_runs_without_curve_only_when_the_topology_says_insecure_tcp() -> None:
    # `bus.curve: false` once left a tcp bus open to every user of the machine; the shipped local topology
    # pinned it, so `bus.transport=tcp` alone gave an open bus.
    def bus(**keys: Any) -> dict[str, Any]:
        return {"cluster": {"nodes": 1}, "bus": keys, "actors": {"a": {"class": "m:A"}}}

    for path in ("topology/local.yaml", "topology/local_code.yaml"):
        plan = T.load(REPO / path, ["bus.transport=tcp"], check_imports=False)
        assert plan.topology.bus.curve, path
    with pytest.raises(T.TopologyError, match=r"bus.curve: false is refused on a tcp bus: any user who can reach "
                                               r"its ports could command the run. CurveZMQ stays on unless you set "
                                               r"bus.insecure_tcp: true"):
        T.validate(bus(transport="tcp", curve=False), check_imports=False)
    assert not T.validate(bus(transport="tcp", insecure_tcp=True), check_imports=False).bus.curve
    with pytest.raises(T.TopologyError, match=r"bus.insecure_tcp: contradicts bus.curve: true"):
        T.validate(bus(transport="tcp", insecure_tcp=True, curve=True), check_imports=False)
    with pytest.raises(T.TopologyError, match=r"bus.insecure_tcp: is for a tcp bus; this bus is ipc"):
        T.validate(bus(transport="ipc", insecure_tcp=True), check_imports=False)
    assert T.validate(bus(transport="ipc", curve=True), check_imports=False).bus.curve


@pytest.mark.parametrize("override, words", [
    ("experiment.algo.eta=-1", "experiment.algo.eta: input should be greater than or equal to 0 (value: -1)"),
    ("experiment.algo.batch_size=0", "experiment.algo.batch_size: input should be greater than or equal to 1"),
    ("experiment.algo.group_size=1.5", "experiment.algo.group_size: input should be a valid integer"),
    ("experiment.run.total_steps=abc", "experiment.run.total_steps: input should be a valid integer"),
    ("experiment.gen.temperature=-1", "experiment.gen.temperature: input should be greater than or equal to 0"),
    ("experiment.algo.lr=.nan", "experiment.algo.lr: input should be a finite number"),
    ("experiment.algo.kl_coef=-0.1", "experiment.algo.kl_coef: input should be greater than or equal to 0"),
    ("experiment.algo.kl_estimator=k4", "experiment.algo.kl_estimator: input should be 'k1', 'k2' or 'k3'"),
    ("experiment.mem_fraction_static=0.8", "experiment.mem_fraction_static: unknown key"),
    ("experiment.data.layout=csv", "experiment.data.layout: input should be 'areal', 'areal_eval', 'gsm8k' or 'math'"),
    ("experiment.data.fields.question=q", "experiment.data.fields.question: unknown key"),
    ("experiment.data.prompt_template=Question", "experiment.data.prompt_template: value error, must contain {prompt} or name a template"),
    ("experiment.run.recover=maybe", "experiment.run.recover: input should be 'auto' or 'off' (value: 'maybe')"),
    ("experiment.algo.group_size=1", "experiment.algo.group_size: value error, 1 answer per prompt gives every "
                                     "answer advantage 0"),
])
def test_experiment_values_are_checked_before_anything_runs(override: str, words: str) -> None:
    # Each of these once passed --dry-run; at launch the error surfaced only in an actor's log, or never.
    with pytest.raises(TopologyError) as err:
        T.load(REPO / "topology" / "local.yaml", [override], check_imports=False)
    assert words in str(err.value), str(err.value)


def test_recover_off_is_accepted_though_yaml_reads_it_as_false() -> None:
    # `experiment.run.recover=off`, the launcher's own advice and tools.bench e2e's override, was refused.
    from actors.runtime.recovery import recovering
    loaded = T.load(REPO / "topology" / "local.yaml", ["experiment.run.recover=off"], check_imports=False)
    assert not recovering(loaded.topology.config)


def test_every_shipped_experiment_config_passes_the_schema() -> None:
    from topology.experiment import experiment_problems
    for config in sorted((REPO / "configs").glob("*.yaml")):
        assert experiment_problems(yaml.safe_load(config.read_text())) == [], config


@pytest.mark.parametrize("override, words", [
    ("experiment.algo.eta", "override 'experiment.algo.eta': expected key.sub=value"),
    ("experiment.algo..eta=1", "override 'experiment.algo..eta=1': bad key 'experiment.algo..eta'"),
    ("experiment.algo.eta=[1", "override 'experiment.algo.eta=[1': value is not valid YAML (expected ',' or ']'"),
    ("actors.rollout.count", "override 'actors.rollout.count': expected key.sub=value"),
])
def test_a_malformed_override_is_named_as_it_was_typed_on_one_line(override: str, words: str) -> None:
    # The `experiment.` prefix was dropped from these messages, and a YAML error spread over several lines.
    with pytest.raises(TopologyError) as err:
        T.load(REPO / "topology" / "local.yaml", [override], check_imports=False)
    [problem] = err.value.problems
    assert problem.startswith(words) and "\n" not in problem, problem
