"""A real multi-node launch through SLURM: a 2-node cluster on loopback (tests/slurm_cluster.py), then
`python -m tools.up topology/demo_slurm.yaml` inside `salloc` and through `--sbatch`. The echoer runs
on fake node n1, the pingers on n2; they exchange bus messages over tcp and a tensor bucket over a
gloo link between the nodes, and the run shuts down cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testsupport.local_actors import process_alive, wait_for_ready
from transport.ports import free_port, free_port_range

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import SlurmCluster, ensure_installed, unavailable_reason  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOPOLOGY = REPO / "topology" / "demo_slurm.yaml"
TIMEOUT = 180

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    ensure_installed()
    with SlurmCluster(nodes=2, cpus_per_node=2, gpus_per_node=2) as c:
        yield c


def port_overrides() -> list[str]:
    return [f"bus.base_port={free_port_range(16)}", f"links.demo.port={free_port()}"]


def check_demo_run(run_dir: Path, rounds: int) -> None:
    summary = json.loads((run_dir / "demo" / "summary.json").read_text())
    assert summary["node"] == "n1" and summary["pings"] == 2 * rounds and summary["buckets_sent"] == 2
    for name in ("ping.0", "ping.1"):
        report = summary["pingers"][name]
        assert report["node"] == "n2" and report["rounds"] == rounds and report["bulk_ok"] is True, report
    specs = {s["name"]: s for s in json.loads((run_dir / "plan.json").read_text())["specs"]}
    assert specs["echo"]["endpoint"].startswith("tcp://127.0.0.11:")   # each node binds its own address
    assert specs["ping.0"]["endpoint"].startswith("tcp://127.0.0.12:")
    assert specs["ping.1"]["settings"]["links"]["demo"]["master_addr"] == "127.0.0.11"
    for name in specs:
        lines = [json.loads(x) for x in (run_dir / "logs" / f"{name}.jsonl").read_text().splitlines() if x.strip()]
        assert [x for x in lines if x.get("event") == "stopped"][-1]["exit_code"] == 0, name
    for node in ("n1", "n2"):
        status = json.loads((run_dir / "nodes" / f"{node}.status.json").read_text())
        assert status["state"] == "stopped", status


def test_multi_node_launch_inside_salloc(cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = ["salloc", "-N2", "--exclusive", sys.executable, "-m", "tools.up", str(TOPOLOGY), *port_overrides(),
           "--run-dir", str(run_dir), "--no-progress"]
    res = subprocess.run(cmd, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "demo_slurm: finished after" in res.stdout
    assert "srun -N2 -n2 --ntasks-per-node=1 --nodelist=n1,n2" in res.stdout
    check_demo_run(run_dir, rounds=20)


def test_sigterm_stops_every_node_cleanly(cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = ["salloc", "-N2", "--exclusive", sys.executable, "-m", "tools.up", str(TOPOLOGY), *port_overrides(),
           "actors.ping.settings.rounds=100000000", "--run-dir", str(run_dir), "--no-progress"]
    salloc = subprocess.Popen(cmd, cwd=REPO, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        # every actor on both nodes announced ready
        pids = wait_for_ready(salloc, run_dir, 3, TIMEOUT, "multi-node run did not come up")
        launcher = [p for p in _children(salloc.pid) if "tools.up" in _cmdline(p)]
        assert launcher, "launcher process not found under salloc"
        os.kill(launcher[0], signal.SIGTERM)
        out, _ = salloc.communicate(timeout=90)
    finally:
        if salloc.poll() is None:
            salloc.kill()
    assert salloc.returncode == 0, out
    assert "demo_slurm: stopped by SIGTERM" in out
    assert not any(process_alive(p) for p in pids), "an actor outlived the run"
    assert not list((run_dir / "ready").glob("*.json"))


def test_sbatch_submits_its_own_allocation(cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "tools.up", str(TOPOLOGY), *port_overrides(), "actors.ping.settings.rounds=5",
           "--run-dir", str(run_dir), "--sbatch"]
    res = subprocess.run(cmd, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    job = (run_dir / "slurm_job_id").read_text().strip()
    deadline = time.monotonic() + TIMEOUT
    while True:  # poll the scheduler until the job has left the queue
        q = subprocess.run(["squeue", "-h", "-j", job], env=cluster.env, capture_output=True, text=True, timeout=30)
        if q.returncode != 0 or not q.stdout.strip():
            break
        assert time.monotonic() < deadline, f"job {job} still queued/running: {q.stdout}"
        time.sleep(0.2)
    out = (run_dir / "sbatch.out").read_text()
    assert "demo_slurm: finished after" in out, out
    check_demo_run(run_dir, rounds=5)


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(x) for x in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


PROBE = ("import json, os; from launch.slurm import allocation_hosts, read_allocation; "
         "hosts = allocation_hosts(); a = read_allocation(dict(os.environ), hosts); "
         "print('ALLOC', json.dumps({'hosts': hosts, 'cpus': a.cpus, 'gpus': a.gpus, 'source': a.source, "
         "'gpus_on_node': os.environ.get('SLURM_GPUS_ON_NODE')}))")


def _allocations(text: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("ALLOC ")]


def test_the_allocation_reads_alike_under_salloc_sbatch_and_srun(cluster: SlurmCluster, tmp_path: Path) -> None:
    # salloc runs its command outside any step: SLURM_GPUS_ON_NODE is unset there (salloc(1)), and the old
    # check read it as 0 GPUs. The controller's answer is the same in every environment.
    want = {"hosts": ["n1", "n2"], "cpus": {"n1": 2, "n2": 2}, "gpus": {"n1": 2, "n2": 2},
            "source": "scontrol show job -d"}
    env = dict(cluster.env, PYTHONPATH=str(REPO))
    alloc = ["-N2", "--exclusive", "--gres=gpu:2"]
    runs = {}
    res = subprocess.run(["salloc", *alloc, sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT)
    runs["salloc"] = _allocations(res.stdout)
    res = subprocess.run(["salloc", *alloc, "srun", "-N2", "-n2", sys.executable, "-c", PROBE], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT)
    runs["srun"] = _allocations(res.stdout)
    out = tmp_path / "sbatch.out"
    res = subprocess.run(["sbatch", "--wait", *alloc, f"--output={out}", "--wrap",
                          f"{sys.executable} -c \"{PROBE}\""], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr
    runs["sbatch"] = _allocations(out.read_text())
    assert [len(runs[k]) for k in ("salloc", "srun", "sbatch")] == [1, 2, 1], runs
    assert runs["salloc"][0]["gpus_on_node"] is None                 # what the old check read as 0
    for where, found in runs.items():
        for a in found:
            assert {k: a[k] for k in want} == want, (where, a)


def test_a_gpu_topology_launches_inside_salloc(cluster: SlurmCluster, tmp_path: Path) -> None:
    # The README's way for the GPU topologies: `salloc -N.. --gres=gpu:.. python -m tools.up ...`.
    run_dir = tmp_path / "run"
    cmd = ["salloc", "-N2", "--exclusive", "--gres=gpu:2", sys.executable, "-m", "tools.up", str(TOPOLOGY),
           *port_overrides(), "cluster.node.gpus=2", "actors.ping.settings.rounds=3", "--run-dir", str(run_dir),
           "--no-progress"]
    res = subprocess.run(cmd, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "demo_slurm: finished after" in res.stdout and "--gpus-per-node=2" in res.stdout
