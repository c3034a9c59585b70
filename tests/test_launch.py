"""`python -m tools.up`: dry runs of every shipped topology, and real local launches of the demo actors
(bus messages + a gloo bulk link), supervisor restart inside a run, giving up, and Ctrl-C."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from testsupport.local_actors import process_alive, wait_for_ready
from tools.bench.chaos import finish_run, run_guard
from launch import readiness, report
from tools import up
import topology as topo_mod
from topology import load
from transport.ports import free_port, free_port_range

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p.name for p in (REPO / "topology").glob("*.yaml"))
LAUNCH_TIMEOUT = 150


def missing_actor_modules(path: Path) -> list[str]:
    """Actor modules a topology names whose source files do not exist yet (built by other issues)."""
    plan = load(path, check_imports=False)
    missing = []
    for g in plan.topology.groups.values():
        module = g.cls.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(module)
    return sorted(set(missing))


@pytest.mark.parametrize("name", SHIPPED)
def test_dry_run_every_shipped_topology(name: str, capsys: pytest.CaptureFixture) -> None:
    path = REPO / "topology" / name
    missing = missing_actor_modules(path)
    if missing:
        pytest.skip(f"actor module(s) {', '.join(missing)} not built yet; this dry run imports every class")
    assert up.main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = load(path)
    for section in ("placement", "bus:", "commands"):
        assert section in out
    for link in plan.links:
        assert f"  {link}: " in out
    assert f"{len(plan.instances)} actor instance(s)" in out


@pytest.mark.parametrize("name", SHIPPED)
def test_dry_run_report_without_import_check(name: str, capsys: pytest.CaptureFixture) -> None:
    path = REPO / "topology" / name
    assert up.main([str(path), "--dry-run", "--no-import-check"]) == 0
    out = capsys.readouterr().out
    plan = load(path, check_imports=False)
    assert out.startswith(f"topology {plan.topology.name} ")
    for inst in plan.instances[:3]:
        assert inst.endpoint in out
    if len(plan.topology.nodes) > 1:
        assert "srun -N" in out and "tools.node_agent" in out
    else:
        assert "-m actors.runtime.run" in out


def test_dry_run_64node_table(capsys: pytest.CaptureFixture) -> None:
    assert up.main([str(REPO / "topology" / "64node.yaml"), "--dry-run", "--no-import-check"]) == 0
    out = capsys.readouterr().out
    assert "64 node(s), 512 GPU(s) x H800, 371 actor instance(s)" in out   # the evaluator included
    # identical nodes once, with their count; the trainer node that also holds the buffer on its own row
    assert re.search(r"#0 \.\. #47 \(x48\) \[8/8 gpu, 32/48 cpu_workers each\] +rollout\.0 \.\. rollout\.191 "
                     r"\(4 per node\) +actors.rollout:RolloutActor +0-7 \(2 each\)", out), out
    assert re.search(r"^ +reward\.0 \.\. reward\.47 \(1 per node\) +actors.reward.math:MathReward", out, re.M)
    assert re.search(r"#48 \[8/8 gpu, 0/48 cpu_workers\] +trainer\.0 \.\. trainer\.7 \(x8\)", out)
    assert "#49 .. #63 (x15) [8/8 gpu, 0/48 cpu_workers each]  trainer.8 .. trainer.127 (8 per node)" in out
    assert ("on #0 .. #47 (x48): node agent -> supervisor -> 5 actor(s) each: rollout.0 .. rollout.191 (4 per node), "
            "reward.0 .. reward.47 (1 per node)") in out
    assert "on #48: node agent -> supervisor -> 11 actor(s): trainer.0-7, buffer, param_server, evaluator" in out
    assert "#17" not in out and len(out.splitlines()) < 100, len(out.splitlines())
    # what the code forms: the servers join the trainer's group with their tp ranks, 1 + 192 x 2
    assert "1 group(s) of 1 + 192 x 2 = 385 ranks, rank 0 = trainer.0; rollout.0's server is ranks 1-2" in out
    assert "rendezvous: trainer.0 on #48, a free port picked at each formation; name weights-g<epoch>" in out
    assert "the link's port 29500 is not used" in out and "group of 193" not in out.replace("own group of 193", "")
    # the ports a firewall must let through
    assert "bus: tcp 20000-20370, each actor's own port on its node (CurveZMQ), from every node" in out
    assert "trainer world: #48:29400 (rendezvous), from its 16 node(s)" in out
    assert "weights: a free port on #48 (rendezvous, picked at each formation in the ephemeral range" in out
    # ready budgets: a rollout waits for its SGLang server's own start budget; the run needs half of them
    assert re.search(r"rollout +192 +96 \(the rest join when ready\) +720 s +supervisor.ready_timeout 120 \+ "
                     r"sglang.health_timeout_s 600", out), out
    assert re.search(r"trainer +128 +all +120 s +supervisor.ready_timeout", out)
    assert "NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7" in out
    assert "NCCL_NET_GDR_LEVEL=PHB" in out and "NCCL_SOCKET_IFNAME=bond0" in out
    assert "srun -N64 --ntasks-per-node=1 --cpus-per-task=48 --mem=0 --gpus-per-node=8 --kill-on-bad-exit=1" in out
    assert ("trainer world: nccl world of 128 ranks (trainer.0-127), rank 0 = trainer.0 leads, rendezvous #48:29400"
            in out)
    assert "pipeline stages" not in out
    # the data check: what the run reads, absent here, is said to be read by the nodes (not a problem, not silent)
    assert "inputs (a sample of each data file; launch/inputs.py)" in out
    assert ("data.train /storage/datasets/boba_106k_0319.jsonl: absent on this machine; the run's nodes read it at "
            "launch") in out
    # and after the run, the commands that show it
    assert "  python3 -m tools.trace RUN_DIR" in out and "  python3 -m tools.report RUN_DIR" in out
    assert "model.path /storage/models/DeepSeek-R1-Distill-Qwen-7B: absent on this machine" in out


def test_the_full_dry_run_lists_every_node(capsys: pytest.CaptureFixture) -> None:
    assert up.main([str(REPO / "topology" / "64node.yaml"), "--dry-run", "--full", "--no-import-check"]) == 0
    out = capsys.readouterr().out
    for node in range(64):
        assert re.search(rf"^  #{node} \[8/8 gpu", out, re.M) and f"    on #{node}: node agent" in out, node
    assert "rollout.188 .. rollout.191 (x4)" in out and " .. #" not in out and "per node" not in out


def test_nodes_are_shown_as_one_only_when_they_hold_the_same_and_their_numbers_continue() -> None:
    row = {"group": "rollout", "count": 2, "cls": "actors.rollout:RolloutActor", "gpus": "0-3 (2 each)",
           "cpus": "any", "threads": "4", "workers": "-", "first_index": 0, "last_index": 1}
    following = dict(row, first_index=2, last_index=3)
    assert report._same_shape([row], [following])
    assert not report._same_shape([row], [dict(following, first_index=6, last_index=7)])   # rollout.6-7: a gap
    assert not report._same_shape([row], [dict(following, gpus="0-1 (1 each)")])
    assert not report._same_shape([row], [following, dict(following, group="reward")])


def test_a_dry_run_refuses_a_trainer_world_the_trainer_would_refuse_at_start(capsys: pytest.CaptureFixture) -> None:
    # Placement accepts two torch trainers (dp=2 on two CPU instances); the trainer class does not: without a
    # world they would each train alone. The dry run says so before anything starts, in one line naming the key.
    assert up.main([str(REPO / "topology" / "local.yaml"), "actors.trainer.count=2", "actors.trainer.parallel.dp=2",
                    "--dry-run", "--no-import-check"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].endswith("local.yaml: 1 problem(s)"), err
    assert err[1].startswith("  actors.trainer.world_port: the group has 2 instances but no world_port"), err


@pytest.mark.parametrize("overrides, problem", [
    (["experiment.model.path=null"], "model.path: not set (the tokenizer to decode answers comes from it)"),
    (["experiment.gen.env_timeout_s=5", "actors.rollout.settings.python_tool.timeout_s=5"],
     "python_tool.timeout_s (5 s) must be below gen.env_timeout_s (5 s)"),
])
def test_each_actor_class_s_settings_check_runs_for_every_instance(overrides: list[str], problem: str) -> None:
    # What the reward actor, the evaluator and the rollout refuse at start, known from the plan alone; the
    # same line of several instances (two rollouts, the model path of every reader) is said once.
    plan = topo_mod.load(REPO / "topology" / "local.yaml", overrides, check_imports=False)
    problems = readiness.settings_problems(plan)
    assert problem in "\n".join(problems) and len(problems) == len(set(problems)), problems
    assert readiness.settings_problems(topo_mod.load(REPO / "topology" / "local.yaml", check_imports=False)) == []


def test_dry_run_names_each_pipeline_stage_sender(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text = (REPO / "topology" / "64node.yaml").read_text()
    assert "dp: 32, tp: 4, pp: 1" in text
    pp2 = tmp_path / "64node_pp2.yaml"
    pp2.write_text(text.replace("dp: 32, tp: 4, pp: 1", "dp: 16, tp: 4, pp: 2"))
    assert up.main([str(pp2), "--dry-run", "--no-import-check"]) == 0
    assert ("2 pipeline stages: each stage's sender hosts a weights group of its own with the rollouts' servers: "
            "trainer.0, trainer.64") in capsys.readouterr().out


def test_the_launchers_own_torch_work_runs_with_the_trainers_threads() -> None:
    """The warm start and the evaluations after a run train and generate in the launcher's process: with
    torch's thread per core, a tiny model's step on a busy machine waits on every operation's slowest thread."""
    import torch

    from launch.local import use_trainer_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert use_trainer_threads(load(REPO / "topology" / "local_agent.yaml", check_imports=False)) == 1
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        plan = load(REPO / "topology" / "local.yaml", ["actors.trainer.threads=2"], check_imports=False)
        assert use_trainer_threads(plan) == 2 and torch.get_num_threads() == 2
        assert use_trainer_threads(load(REPO / "topology" / "demo_local.yaml", check_imports=False)) is None
        assert torch.get_num_threads() == 2   # no trainer: left as it was
    finally:
        torch.set_num_threads(before)


def test_a_world_gives_each_instance_its_rank_and_rendezvous() -> None:
    plan = topo_mod.load(REPO / "topology" / "1node.yaml", check_imports=False)
    specs = {s["name"]: s for s in plan.specs("/tmp/run")}
    for rank in (0, 1):
        spec = specs[f"trainer.{rank}"]
        assert {k: spec["env"][k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")} == {
            "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "29400"}
        assert spec["env"]["CUDA_VISIBLE_DEVICES"] == str(6 + rank)     # its own GPU: LOCAL_RANK 0 within it
        assert spec["settings"]["instance"]["world"]["rank"] == rank
    assert "RANK" not in specs["rollout.0"]["env"] and "world" not in specs["rollout.0"]["settings"]["instance"]


@pytest.mark.parametrize("group, problem", [
    ("{class: 'testsupport.demo:Echoer', count: 2, world_port: auto}", "auto needs a one-node topology"),
    ("{class: 'testsupport.demo:Echoer', count: 2, gpus: 2, world_port: 29400}", "one rank per instance"),
    ("{class: 'testsupport.demo:Echoer', count: 2, world_port: 99999}", "is not a port"),
])
def test_bad_world_ports_are_refused(tmp_path: Path, group: str, problem: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {nodes: [a, b], node: {gpus: 4}}\nbus: {transport: tcp}\n"
                   f"actors:\n  t: {group}\n")
    with pytest.raises(topo_mod.TopologyError, match=problem):
        topo_mod.load(bad, check_imports=False)


@pytest.mark.parametrize("settings, problem", [
    ({}, "no world_port"),                                     # separate instances would each train alone
    ({"world": {"rank": 1}}, "needs backend: megatron"),
    ({"world": {"rank": 0}, "backend": "megatron", "parallel": {"pp": 2},
      "links": {"train_to_ps": {"name": "train_to_ps", "backend": "gloo", "master_addr": "127.0.0.1", "master_port": 0,
                                "rank": 0, "world_size": 2}}},
     "parallel.pp: > 1 needs direct weights"),
    ({"world": {"rank": 1}, "backend": "megatron",
      "links": {"weights": {"name": "weights", "backend": "nccl", "master_addr": "127.0.0.1", "master_port": 0,
                            "rank": 1, "world_size": 3}}},
     r"trainer.1 is in links \['weights'\]: only rank 0 sends weights"),
])
def test_a_trainer_group_that_cannot_train_together_is_refused_at_start(tmp_path: Path, settings: dict,
                                                                       problem: str) -> None:
    import asyncio

    from actors.runtime.base import ActorSpec
    from actors.trainer.actor import TrainerActor, TrainerConfigError
    instance = {"group": "trainer", "index": 1, "count": 2,
                **{k: v for k, v in settings.items() if k not in ("backend", "links")}}
    spec = ActorSpec("trainer.1", "actors.trainer:TrainerActor", f"ipc://{tmp_path}/t",
                     settings={"instance": instance, "log_console": False, "backend": settings.get("backend", "torch"),
                               "links": settings.get("links", {})}, run_dir=str(tmp_path))
    with pytest.raises(TrainerConfigError, match=problem):
        asyncio.run(TrainerActor(spec).on_start())


def test_invalid_topology_exits_2_with_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {nodes: 1, node: {gpus: 2}}\nbus: {transport: ipc}\n"
                   "actors:\n  a: {class: 'testsupport.demo:Echoer', gpus: 3, cout: 1}\n")
    assert up.main([str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "actors.a.cout: unknown key (did you mean 'count'?)" in err


def launch(topology: Path, run_dir: Path, *extra: str, timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tools.up", str(topology), *extra, "--run-dir", str(run_dir), "--no-progress"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def demo_topology(tmp_path: Path, ping_settings: str, supervisor: str = "", link: bool = True) -> Path:
    path = tmp_path / "demo.yaml"
    links = f"links:\n  demo: {{backend: gloo, members: [echo, ping], port: {free_port()}, timeout_s: 60}}\n" \
        if link else ""
    path.write_text(
        "name: demo_test\ncluster: {nodes: 1, node: {cpus: 2}}\nbus: {transport: ipc}\n" + links + supervisor +
        "actors:\n"
        "  echo: {class: 'testsupport.demo:Echoer', cpus: [0]}\n"
        f"  ping: {{class: 'testsupport.demo:Pinger', count: 2, cpus: [[0], [1]], settings: {ping_settings}}}\n")
    return path


def assert_clean_stop(run_dir: Path, names: list[str]) -> None:
    assert not list((run_dir / "ready").glob("*.json")), "a ready file was left behind"
    for name in names:
        lines = [json.loads(x) for x in (run_dir / "logs" / f"{name}.jsonl").read_text().splitlines() if x.strip()]
        stopped = [x for x in lines if x.get("event") == "stopped"]
        assert stopped and stopped[-1]["exit_code"] == 0, f"{name} did not stop cleanly"


def test_local_launch_exchanges_messages_and_bulk_tensors(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    topo = demo_topology(tmp_path, "{rounds: 15, tensor_elems: 5000}")
    res = launch(topo, run_dir)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "demo_test: finished after" in res.stdout
    summary = json.loads((run_dir / "demo" / "summary.json").read_text())
    assert summary["pings"] == 30 and summary["buckets_sent"] == 2
    for name, cores in (("ping.0", [0]), ("ping.1", [1])):
        report = summary["pingers"][name]
        assert report["rounds"] == 15 and report["bulk_ok"] is True
        assert report["cores"] == cores  # `cpus:` became AREAL_CPU_AFFINITY in the launched process
    specs = json.loads((run_dir / "plan.json").read_text())["specs"]
    assert {s["name"]: s["env"]["OMP_NUM_THREADS"] for s in specs} == {"echo": "1", "ping.0": "1", "ping.1": "1"}
    assert_clean_stop(run_dir, ["echo", "ping.0", "ping.1"])


def test_supervisor_restarts_a_crashed_actor_inside_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    topo = demo_topology(tmp_path, "{rounds: 5, crash_once: true}", link=False,
                         supervisor="supervisor: {backoff_initial: 0.1, max_restarts: 2}\n")
    res = launch(topo, run_dir)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((run_dir / "demo" / "summary.json").read_text())
    assert {n: r["restarts_seen"] for n, r in summary["pingers"].items()} == {"ping.0": 1, "ping.1": 1}
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines()
            if line.split()[:1] in (["ping.0"], ["ping.1"])}   # the summary's rows: the last ones printed
    assert rows["ping.0"][-1] == "1" and rows["ping.1"][-1] == "1"  # restarts column of the summary
    assert_clean_stop(run_dir, ["echo", "ping.0", "ping.1"])


def test_run_stops_with_a_clear_message_when_an_actor_cannot_be_kept_up(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    topo = demo_topology(tmp_path, "{rounds: 5, crash_always: true}", link=False,
                         supervisor="supervisor: {backoff_initial: 0.05, max_restarts: 1, stop_timeout: 10}\n")
    res = launch(topo, run_dir)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "demo_test: failed: actor ping." in res.stdout and "giving up and stopping the run" in res.stdout
    # crashed pingers leave their ready file behind (os._exit); every process named in one is gone
    for ready in (run_dir / "ready").glob("*.json"):
        assert not process_alive(json.loads(ready.read_text())["pid"]), ready.name


def test_ctrl_c_stops_every_actor_cleanly(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    topo = demo_topology(tmp_path, "{rounds: 100000000}", link=False)
    proc = subprocess.Popen([sys.executable, "-m", "tools.up", str(topo), "--run-dir", str(run_dir),
                             "--no-progress"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    with run_guard(proc, run_dir):
        pids = wait_for_ready(proc, run_dir, 3, LAUNCH_TIMEOUT, "run did not come up")  # every actor announced ready
        proc.send_signal(signal.SIGINT)
        out = finish_run(proc, run_dir, timeout=60)
    assert proc.returncode == 0, out
    assert "demo_test: stopped by SIGINT" in out
    assert not any(process_alive(pid) for pid in pids)
    assert_clean_stop(run_dir, ["echo", "ping.0", "ping.1"])


def test_a_trainer_rank_that_dies_stops_the_other_ranks() -> None:
    # A torch.distributed world cannot take a rank back: the others would wait in a collective for it.
    from actors.trainer.actor import TrainerActor
    from topology.settings import TrainerSettings
    trainer = TrainerActor.__new__(TrainerActor)      # only what the callback reads
    stops: list[tuple[str, int]] = []
    trainer.request_stop = lambda reason, exit_code=0: stops.append((reason, exit_code))  # type: ignore[method-assign]
    trainer.cfg = TrainerSettings.model_validate({"groups": {"trainer": ["trainer.0", "trainer.1"],
                                                             "rollout": ["rollout.0"]}})
    trainer.log = type("Log", (), {"error": lambda *a, **k: None})()
    trainer.ranks = object()
    trainer.on_peer_dead("rollout.0")                  # not a rank of the world: nothing to do here
    assert stops == []
    trainer.on_peer_dead("trainer.1")
    assert len(stops) == 1 and stops[0][1] == 1 and "trainer rank trainer.1 stopped answering" in stops[0][0]
    # restarted faster than the heartbeat timeout: never declared dead, and its old process is gone all the same
    trainer.on_peer_restarted("rollout.0")
    assert len(stops) == 1
    trainer.on_peer_restarted("trainer.1")
    assert len(stops) == 2 and stops[1][1] == 1 and "trainer rank trainer.1 restarted" in stops[1][0]


def test_a_port_already_in_use_fails_the_dry_run_naming_its_key(tmp_path, capsys):
    import socket

    from tools.up import main
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        topo = tmp_path / "t.yaml"
        topo.write_text("cluster: {nodes: 1}\nbus: {transport: ipc}\n"
                        f"links: {{demo: {{backend: gloo, members: [echo, ping], port: {port}}}}}\n"
                        "actors:\n  echo: {class: 'testsupport.demo:Echoer'}\n  ping: {class: 'testsupport.demo:Pinger'}\n")
        assert main([str(topo), "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert f"links.demo.port: port {port} is already in use on this node" in err, err
    assert main([str(topo), "--dry-run"]) == 0


def test_the_dry_runs_weights_group_is_the_one_the_rollouts_and_parameter_server_form(tmp_path: Path) -> None:
    # Each rollout's receiver says how many ranks its server joins with (actors.weight_sync.make_receiver);
    # the parameter server asks the trainer for a group of 1 + their sum (weight_sync/direct.py).
    import collections

    import structlog

    from actors.engines.sglang import SGLangEngine
    from actors.weight_sync import make_receiver
    from topology.settings import RolloutSettings
    from transport.bulk import LinkConfig

    plan = load(REPO / "topology" / "64node.yaml", check_imports=False)
    ranks = 0
    for spec in plan.specs(tmp_path):
        if not spec["name"].startswith("rollout."):
            continue
        cfg = RolloutSettings.model_validate(spec["settings"])
        engine = SGLangEngine.from_settings(cfg, 0, "/models/m", run_dir=str(tmp_path))
        receiver = make_receiver(cfg, LinkConfig.from_dict(cfg.links["weights"].model_dump()), engine, verify=None,
                                 make_link=None, param_server="param_server", counters=collections.Counter(),
                                 log=structlog.get_logger(), active=lambda: 0)
        ranks += receiver.ranks
    assert 1 + ranks == report.server_groups(plan)["weights"].world == 385


def test_node_agents_never_fail_for_late_joiners_and_the_launcher_counts_them_across_nodes() -> None:
    # srun --kill-on-bad-exit stops every node when one node agent exits non-zero: a node whose rollouts'
    # servers never come up must not. The launcher counts each late-joining group across the nodes instead.
    plan = load(REPO / "topology" / "64node.yaml", check_imports=False)
    args = up.parse_args([str(REPO / "topology" / "64node.yaml")])
    options = readiness.supervisor_options(plan, args)
    assert options["late_joiners"] == {"rollout": 96} and options["ready_budgets"]["rollout.7"] == 720.0
    assert options["ready_budgets"]["trainer.0"] == 120.0
    node0 = readiness.node_supervisor_options(options, ["rollout.0", "rollout.1", "rollout.2", "rollout.3", "reward.0"])
    assert node0["late_joiners"] == {"rollout": 0} and set(node0["ready_budgets"]) == {
        "rollout.0", "rollout.1", "rollout.2", "rollout.3", "reward.0"}
    rules = readiness.ready_rules(plan, 120.0)
    rows = {f"rollout.{i}": {"state": "ready" if i < 96 else "starting"} for i in range(192)}
    reached: set[str] = set()
    assert readiness.quorum_problem(rows, rules, 10.0, reached) is None and reached == {"rollout"}
    rows = {f"rollout.{i}": {"state": "starting"} for i in range(192)}
    assert readiness.quorum_problem(rows, rules, 10.0, set()) is None                    # within their budget
    late = readiness.quorum_problem(rows, rules, 720.0 + readiness.QUORUM_GRACE_S + 1, set())
    assert late and "0 of 192 instances ready after their ready budget (720 s" in late
    rows = {f"rollout.{i}": {"state": "failed" if i < 97 else "ready"} for i in range(192)}
    down = readiness.quorum_problem(rows, rules, 10.0, {"rollout"})
    assert down and "97 of 192 instances could not be kept up; the run needs 96" in down


def test_a_relaunch_removes_the_temporary_directories_a_killed_launcher_left(tmp_path: Path) -> None:
    # Each kill -9 of the launcher left one TMPDIR per actor (and the bus's socket directory, when the run
    # directory's path is too long for unix sockets) that no relaunch removed.
    run_dir = tmp_path / ("r" * 90)
    topo = demo_topology(tmp_path, "{rounds: 100000000}", link=False)
    proc = subprocess.Popen([sys.executable, "-m", "tools.up", str(topo), "--run-dir", str(run_dir), "--no-progress"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    with run_guard(proc, run_dir):
        pids = wait_for_ready(proc, run_dir, 3, LAUNCH_TIMEOUT, "run did not come up")
        left = [Path((run_dir / "tmpdirs" / name).read_text()) for name in ("echo", "ping.0", "ping.1")]
        left.append(Path((run_dir / "ipc_dir").read_text()))
        os.killpg(proc.pid, signal.SIGKILL)           # the launcher, as kill -9 does it
        proc.wait(timeout=30)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert all(p.is_dir() for p in left), left
    res = launch(topo, run_dir, "actors.ping.settings.rounds=3")
    assert res.returncode == 0, res.stdout + res.stderr
    assert not [p for p in left if p.exists()], left
    assert not (run_dir / "tmpdirs").exists() or not list((run_dir / "tmpdirs").iterdir())


@pytest.mark.parametrize("insecure", [False, True])
def test_a_tcp_run_is_closed_to_other_users_and_an_insecure_one_says_so_at_launch(insecure: bool,
                                                                                   tmp_path: Path) -> None:
    # The insecure-bus warning was printed by --dry-run only; run directories were 0755 (logs, specs, metrics
    # and the ledger readable by every user).
    run_dir = tmp_path / "run"
    topo = demo_topology(tmp_path, "{rounds: 5, tensor_elems: 500}")
    # Every actor's bus port must be free, not only the first (one taken by another process failed the run).
    extra = ["bus.transport=tcp", f"bus.base_port={free_port_range(8)}"]
    res = launch(topo, run_dir, *extra, *(["bus.insecure_tcp=true"] if insecure else []))
    assert res.returncode == 0, res.stdout + res.stderr
    warned = "WARNING: bus.insecure_tcp is true: this run's tcp bus has no CurveZMQ" in res.stdout
    assert warned == insecure, res.stdout
    specs = json.loads((run_dir / "plan.json").read_text())["specs"]
    if insecure:
        assert all(s["curve"] is None and s["tokens"] == {"tokens_dir": str(run_dir / "tokens")} for s in specs)
    else:
        assert all(s["curve"] == {"keys_dir": str(run_dir / "curve")} and s["tokens"] is None for s in specs)
    assert {link["secret_file"] for s in specs for link in s["settings"]["links"].values()} == \
        {str(run_dir / "rendezvous.secret")}
    assert run_dir.stat().st_mode & 0o777 == 0o700
    shared = [str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.stat().st_mode & 0o077]
    assert not shared, f"readable or writable by other users: {shared}"
    assert (run_dir / "logs" / "echo.jsonl").exists() and (run_dir / "demo" / "summary.json").exists()
    assert_clean_stop(run_dir, ["echo", "ping.0", "ping.1"])
