"""The asynchronous RL loop through the real launcher and real actor processes (docs/architecture.md, "Invariants").

A small random Qwen2 model with the shipped tokenizer and a small synthetic dataset keep each run short;
what is checked is the system, not learning: versions advance, no sample is trained staler than eta,
every accepted sample is trained exactly once (also across kills and recoveries), weights reach every
rollout with the trainer's hash, and killed workers are restarted without stopping the run.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import sys
import time
from pathlib import Path

import pytest

from tools.bench.chaos import ETA, finish_run, kill_everything as kill_run, launch, make_assets, ready_info, run_guard
from tools.bench.chaos import step_records as metrics, wait_for_step

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_assets(tmp_path_factory.mktemp("e2e"), train_per_level=40)


def actor_pid(run_dir: Path, name: str) -> int:
    return int(ready_info(run_dir, name)["pid"])


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 300) -> str:
    out = finish_run(proc, run_dir, timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def run_to_end(assets: dict[str, Path], run_dir: Path, steps: int, ckpt_every: int,
               topology: str = "topology/local.yaml") -> None:
    """Launch a run, let it finish (killing whatever is left if it does not) and check the invariants."""
    finish(launch(assets, run_dir, steps=steps, ckpt_every=ckpt_every, topology=topology), run_dir)
    check_invariants(run_dir, steps)


def events(run_dir: Path, actor: str, event: str | None = None) -> list[dict]:
    """An actor's structlog JSON records (those of one event kind, if given)."""
    records = [json.loads(line) for line in (run_dir / "logs" / f"{actor}.jsonl").read_text().splitlines()]
    return [r for r in records if event is None or r.get("event") == event]


def trained_batches(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "buffer" / "ledger.jsonl").read_text().splitlines())
            if r["event"] == "batch"]


def check_invariants(run_dir: Path, steps: int) -> None:
    batches = trained_batches(run_dir)
    assert [b["step"] for b in batches] == list(range(1, steps + 1))
    keys = [tuple(k) for b in batches for k in b["keys"]]
    assert len(keys) == 4 * steps and len(set(keys)) == len(keys), "a prompt was trained twice"
    for b in batches:  # the buffer's batch-time check: no group older than eta versions
        assert all(b["version"] - v <= ETA for v in b["start_versions"]), b
    final = {m["step"]: m for m in metrics(run_dir)}  # after a recovery the re-done steps win
    assert sorted(final) == list(range(1, steps + 1))
    assert all(m["staleness_max"] <= ETA for m in final.values())
    assert all(m["logprob_gap_max"] < 1e-3 for m in final.values())
    # the per-step metrics that come from other actors: rollout utilisation (buffer), push and stall
    # times (parameter server)
    # A batch whose groups all arrived before the previous batch carries no utilisation (no rollout clock moved
    # between them); how many do depends on the relative speed of generation and training, so only its presence
    # and its range are this test's.
    utilisation = [m["rollout_utilisation"] for m in final.values() if "rollout_utilisation" in m]
    assert utilisation and all(0.0 <= u <= 1.0 + 1e-6 for u in utilisation), utilisation
    assert all(m["weight_push_seconds"] >= 0 and m["gen_stall_seconds"] >= 0 for m in final.values())
    pushes = events(run_dir, "param_server", "weights_pushed")
    assert pushes, "the parameter server pushed no weights"
    for p in pushes:  # an ack is missing only from a rollout killed during that push
        assert all(r["ack_ok"] for r in p["rollouts"].values() if "error" not in r), p


def run_killing(assets: dict[str, Path], run_dir: Path, victims: list[str],
                env: dict[str, str] | None = None, steps: int = 6) -> dict[str, int]:
    """A `steps`-step run whose `victims` are killed with -9 at step 2; checks the run's invariants and returns
    every actor's restart count from the launcher's summary."""
    proc = launch(assets, run_dir, steps=steps, ckpt_every=3, env=env)
    with run_guard(proc, run_dir):
        wait_for_step(proc, run_dir, 2)
        for name in victims:
            os.kill(actor_pid(run_dir, name), signal.SIGKILL)
        out = finish(proc, run_dir)
    check_invariants(run_dir, steps)
    names = {spec["name"] for spec in json.loads((run_dir / "plan.json").read_text())["specs"]}
    return {line.split()[0]: int(line.split()[-1]) for line in out.splitlines() if line.split()[:1] and
            line.split()[0] in names}


def test_async_loop_survives_killed_rollout_and_reward(assets: dict[str, Path], tmp_path: Path) -> None:
    # A private TMPDIR, short: multiprocessing puts unix sockets (at most 107 bytes of path) under it.
    run_dir, tmp = tmp_path / "run", Path(tempfile.mkdtemp(prefix="e2e-"))
    restarts = run_killing(assets, run_dir, ["rollout.0", "reward"], env={"TMPDIR": str(tmp)})
    assert {name: n for name, n in restarts.items() if n} == {"rollout.0": 1, "reward": 1}, restarts
    assert (run_dir / "checkpoints" / "step_000006" / "COMPLETE").exists()
    # Nothing of the run is left in the temporary directory, not even by the processes killed with -9.
    # (torchinductor_<user> is torch's compile cache, one per user, reused by every run.)
    assert sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")) == []
    shutil.rmtree(tmp)


def test_a_killed_parameter_server_is_restarted_in_place(assets: dict[str, Path], tmp_path: Path) -> None:
    # Once the trainer then failed (WeightsRejected: the train link is not formed) and the run with it.
    run_dir = tmp_path / "run"
    # 10 steps: in a 6-step run the trainer once finished on buffered groups before the restarted server
    # (a new process importing torch on a loaded machine) was back, so it had nothing left to push.
    restarts = run_killing(assets, run_dir, ["param_server"], steps=10)
    assert {name: n for name, n in restarts.items() if n} == {"param_server": 1}, restarts
    pushed = [p["version"] for p in events(run_dir, "param_server", "weights_pushed")]
    assert pushed and pushed[-1] >= 5, pushed   # the restarted server went on pushing new versions


@pytest.mark.parametrize("victim", ["trainer", "buffer"])
def test_a_killed_trainer_or_buffer_is_restarted_in_place(victim: str, assets: dict[str, Path],
                                                          tmp_path: Path) -> None:
    # Both were refused a restart once, so the run failed and needed a relaunch. Now the buffer keeps every
    # batch served since the last checkpoint: a restarted trainer resumes from that checkpoint and is served
    # the same batches again; a restarted buffer takes up from the newest batch it served.
    run_dir = tmp_path / "run"
    restarts = run_killing(assets, run_dir, [victim])
    assert {name: n for name, n in restarts.items() if n} == {victim: 1}, restarts
    if victim == "trainer":
        first, resumed = events(run_dir, "trainer", "trainer_started")   # from the last checkpoint (or the start)
        # The steps after the checkpoint are served again, from the first on. (A request asked twice before the
        # kill, as when the buffer starts after the trainer on a loaded machine, is served again too.)
        again = sorted({e["step"] for e in events(run_dir, "buffer", "batch_served_again")
                        if e["step"] > resumed["version"]})
        assert again and again == list(range(resumed["version"] + 1, resumed["version"] + 1 + len(again))), again
    else:
        [restored] = events(run_dir, "buffer", "buffer_restored")
        assert restored["served_through"] >= 2, restored


def test_a_hung_rollout_holds_up_neither_the_weights_nor_the_trainer(assets: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    # SIGSTOP of one rollout once held every weight push for the link timeout and then kept failing: the
    # healthy rollout got no new weights and the trainer made no step while the other hung.
    run_dir, steps = tmp_path / "run", 14
    proc = launch(assets, run_dir, steps=steps, ckpt_every=7)
    with run_guard(proc, run_dir):
        wait_for_step(proc, run_dir, 2)
        hung = actor_pid(run_dir, "rollout.1")
        os.kill(hung, signal.SIGSTOP)
        try:
            stopped_at = max(m["step"] for m in metrics(run_dir))
            wait_for_step(proc, run_dir, stopped_at + 5, timeout=120)   # training goes on without it
        finally:
            os.kill(hung, signal.SIGCONT)
        out = finish(proc, run_dir)
    check_invariants(run_dir, steps)
    assert re.search(r"rollout\.1 .* \(restarts 0\)", out), out[-2000:]   # it was never restarted
    pushes = events(run_dir, "param_server", "weights_pushed")
    without = [p["version"] for p in pushes if "ack_ok" not in p["rollouts"].get("rollout.1", {})
               and p["rollouts"]["rollout.0"]["ack_ok"]]
    # rollout.0 kept getting new versions while rollout.1 was left out: the trainer's 5 steps meanwhile need its
    # samples within eta (1) of the trainer, so at least two versions reached it (more, or fewer pushes, as the
    # parameter server coalesces versions that arrive during a push, follow the machine's speed)
    assert len(without) >= 2, pushes
    caught_up = [p["version"] for p in pushes if p["rollouts"].get("rollout.1", {}).get("ack_ok")]
    assert caught_up and caught_up[-1] > without[0], pushes   # ... and rollout.1 caught up once it was back
    # While it was stopped its lane ran late (or it was found dead and left out of the group): never waited on.
    assert any("late" in p["rollouts"].get("rollout.1", {}).get("error", "") for p in pushes) or any(
        f["left_out"] == ["rollout.1"] for f in events(run_dir, "param_server", "rollout_link_formed")), pushes


def test_killed_run_recovers_from_its_last_checkpoint(assets: dict[str, Path], tmp_path: Path) -> None:
    # Steps of this tiny model take about 0.1 s: a run long enough that it cannot finish between seeing
    # step 3 and the kill, whatever the machine's speed.
    steps = 20
    run_dir = tmp_path / "run"
    proc = launch(assets, run_dir, steps=steps, ckpt_every=2)
    with run_guard(proc, run_dir):
        wait_for_step(proc, run_dir, 5)
        # A crash of the whole run: the launcher and every actor die at once, nothing shuts down cleanly.
        kill_run(proc, run_dir)
    complete = sorted(int(c.parent.name.split("_")[1]) for c in (run_dir / "checkpoints").glob("*/COMPLETE"))
    assert len(complete) >= 2 and complete[-1] < steps, complete
    # And the newest checkpoint's weights were truncated afterwards (once: SafetensorError, no fallback).
    newest = run_dir / "checkpoints" / f"step_{complete[-1]:06d}"
    weights = newest / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    run_to_end(assets, run_dir, steps, ckpt_every=2)
    resumed = events(run_dir, "trainer", "trainer_started")
    assert resumed[-1]["version"] == complete[-2], (resumed, complete)  # from the newest sound checkpoint
    assert newest.with_name(newest.name + ".corrupt").is_dir()


def direct_topology(tmp_path: Path, rollout_settings: str = "{engine: torch}") -> Path:
    """topology/local.yaml with the GPU topologies' weight path: one link of [trainer.0, rollout]."""
    local = (ROOT / "topology" / "local.yaml").read_text()
    links = local[local.index("\nlinks:"):local.index("\nactors:")]
    direct = local.replace(links, "\nlinks:\n  weights: {backend: gloo, members: [trainer.0, rollout], port: auto, "
                                  "timeout_s: 30}\n")
    direct = direct.replace("settings: {engine: torch}", f"settings: {rollout_settings}")
    topology = tmp_path / "direct.yaml"
    topology.write_text(direct)
    return topology


def test_direct_weights_trainer_broadcasts_to_rollouts(assets: dict[str, Path], tmp_path: Path) -> None:
    # The GPU topologies' weight path on gloo: one link of [trainer.0, rollout], none to the parameter
    # server, which only coordinates. A killed rollout makes it re-form the group with the trainer.
    topology = direct_topology(tmp_path)
    # The trainer's end of a formation that waits for the hung rollout.0 ends only at the link timeout (the
    # parameter server abandons it at once; the trainer's next formation waits for that one): this is about the
    # group formed again, not how long the timeout is.
    topology.write_text(topology.read_text().replace("timeout_s: 30", "timeout_s: 10"))
    run_dir = tmp_path / "run"
    proc = launch(assets, run_dir, steps=12, ckpt_every=6, topology=str(topology),
                  extra=("experiment.eval.every_versions=5",))

    def rejoined() -> list[dict]:   # pushes that reached rollout.1 on a group formed after the first one
        return [p for p in events(run_dir, "param_server", "weights_pushed")
                if p["epoch"] > 0 and p["rollouts"].get("rollout.1", {}).get("ack_ok")]

    with run_guard(proc, run_dir):
        wait_for_step(proc, run_dir, 3)
        # rollout.0 hangs while rollout.1 is killed, so that nothing trains until rollout.1 is back: the run
        # cannot end before its restart however slowly a loaded machine restarts it (12 steps once ended first)
        hung = actor_pid(run_dir, "rollout.0")
        os.kill(hung, signal.SIGSTOP)
        os.kill(actor_pid(run_dir, "rollout.1"), signal.SIGKILL)
        try:
            deadline = time.monotonic() + 300
            while not rejoined():
                assert time.monotonic() < deadline and proc.poll() is None, "rollout.1 got no weights after its restart"
                time.sleep(0.2)   # polling logs another process writes
        finally:
            os.kill(hung, signal.SIGCONT)
        finish(proc, run_dir)
    check_invariants(run_dir, 12)
    assert [e["path"] for e in events(run_dir, "param_server", "start_weights")] == ["TrainerFanout"]
    formed = events(run_dir, "param_server", "rollout_link_formed")
    assert len(formed) >= 2, "the group was not formed again after the rollout restarted"
    assert len(events(run_dir, "trainer", "weights_link_formed")) >= len(formed)
    pushes = events(run_dir, "param_server", "weights_pushed")
    # the killed rollout was abandoned at once, not waited for until the ack timeout (the hung rollout.0's lane
    # may run late meanwhile: test_a_hung_rollout_holds_up_neither_the_weights_nor_the_trainer is about that)
    failed = {r["error"].split(":")[0] for p in pushes for r in [p["rollouts"].get("rollout.1", {})] if "error" in r}
    assert failed <= {"abandoned"}, failed
    # the restarted rollout got weights from the trainer on a re-formed group (hashes checked above)
    assert rejoined(), pushes
    # evaluation during the run needs weights at the parameter server: here the evaluator says why not, once
    assert len(events(run_dir, "evaluator", "evaluation_unavailable")) == 1
    # the final evaluation sits on the metrics' clock, so tools.plot draws it with the curves
    from tools import plot
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert sorted(e["model"] for e in evals) == ["final", "start"] and all("time" in e for e in evals)
    _, notes = plot.plot_run(run_dir)
    assert not [n for n in notes if "eval.jsonl" in n], notes


def server_pids(run_dir: Path, rollout: str) -> list[int]:
    """The SGLang server processes a rollout actor started (its children)."""
    out = subprocess.run(["pgrep", "-P", str(actor_pid(run_dir, rollout))], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_direct_weights_into_sglang_servers(assets: dict[str, Path], tmp_path: Path) -> None:
    # Rollouts driving SGLang servers: the stand-in over the real HTTP routes, serving exactly SGLang's
    # (`--no-weights-hash`: no route reads weights back, so every ack is checked by the version the server
    # reports). Each server joins the trainer's group itself (/init_weights_update_group at the rank offset
    # the parameter server assigns) and receives every version with /update_weights_from_distributed while
    # the trainer broadcasts. rollout.1's server is SIGKILLed mid-run and rollout.0 hangs (SIGSTOP) at the same
    # moment, so that nothing trains until rollout.1's server is back: its engine restarts it, the rollout
    # says hello again, a group of it alone is formed (the hung one left out) and training goes on; then
    # rollout.0 comes back, a group of both is formed and the run finishes with both on the last version.
    standin = (f"{{engine: sglang, sglang: {{command: [{sys.executable}, -m, testsupport.sglang_standin, "
               f"--no-weights-hash]}}}}")
    topology = direct_topology(tmp_path, standin)
    topology.write_text(topology.read_text().replace("timeout_s: 30", "timeout_s: 10"))  # faster recovery
    run_dir = tmp_path / "run"
    steps = 24
    proc = launch(assets, run_dir, steps=steps, ckpt_every=steps, topology=str(topology))
    with run_guard(proc, run_dir):
        wait_for_step(proc, run_dir, 3)
        killed = server_pids(run_dir, "rollout.1")
        assert len(killed) == 1, killed
        hung = actor_pid(run_dir, "rollout.0")
        os.kill(hung, signal.SIGSTOP)
        os.kill(killed[0], signal.SIGKILL)
        try:
            deadline = time.monotonic() + 180
            while not [e for e in events(run_dir, "rollout.1", "weights_updated")
                       if e["timestamp"] > max([r["timestamp"] for r in events(
                           run_dir, "rollout.1", "engine_server_restarted")] or ["9"])]:
                assert time.monotonic() < deadline and proc.poll() is None, "rollout.1 got no weights after its restart"
                time.sleep(0.2)
        finally:   # (the logs' clock, read just before: whatever they say after it happened after the SIGCONT)
            continued = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            os.kill(hung, signal.SIGCONT)
        finish(proc, run_dir)
    check_invariants(run_dir, steps)
    assert [e["restarts"] for e in events(run_dir, "rollout.1", "engine_server_restarted")] == [1]
    # the parameter server heard of the death at once: no group waited for rollout.1 until its server was back
    [down] = events(run_dir, "param_server", "rollout_server_down")
    back = min(e["timestamp"] for e in events(run_dir, "param_server", "rollout_hello")
               if e["rollout"] == "rollout.1" and e["timestamp"] > down["timestamp"])
    formed = events(run_dir, "param_server", "rollout_link_formed")
    assert all("rollout.1" in e["left_out"] for e in formed if down["timestamp"] < e["timestamp"] < back), formed
    assert any(e["left_out"] == ["rollout.0"] for e in formed), formed   # the hung one was left out
    assert all(e.get("servers") and e["ranks"] == 1 + 2 - len(e["left_out"]) for e in formed), formed
    pushes = events(run_dir, "param_server", "weights_pushed")
    assert all(r["ack_ok"] and r["verified"] == "version" for p in pushes for r in p["rollouts"].values()
               if "error" not in r), pushes
    # rollout.0, continued, was formed in again beside rollout.1
    assert any(e["left_out"] == [] and e["timestamp"] > continued for e in formed), formed
    # ... and the last group's pushes reached every member. That group is both rollouts unless rollout.0, just
    # continued on a loaded machine, fell silent past the heartbeat timeout again: then the parameter server
    # leaves it out on probation (test_param_server's subject) and the run may end before that runs out.
    flapped = [e for e in events(run_dir, "param_server", "rollout_dead")
               if e["rollout"] == "rollout.0" and e["timestamp"] > continued]
    last = {"rollout.0", "rollout.1"} - set(formed[-1]["left_out"])
    assert flapped or last == {"rollout.0", "rollout.1"}, (formed, flapped)
    after = [p for p in pushes if p["epoch"] == formed[-1]["epoch"]]
    assert after and all(set(p["rollouts"]) == last for p in after), after
    assert all("error" not in r for p in after for r in p["rollouts"].values()), after
    for name in ("rollout.0", "rollout.1"):
        updates = events(run_dir, name, "weights_updated")
        assert updates and all(e.get("through_server") and e["verified"] == "version" for e in updates), name
    # no server outlives the run
    servers = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "sglang_standin" in text and (str(assets["model"]) in text or str(run_dir) in text):
            servers.append(text)
    assert not servers, servers
    assert (run_dir / "logs" / "rollout.1.sglang.log").exists()   # in the run directory, not the cwd


# A rank silent for the bus's heartbeat timeout (5 s) stops the trainer world. Two Megatron ranks building their
# models on one core beside a loaded machine's other work went silent that long at start, and the run stopped
# before its first step: these runs test the ranks' work, not their answer time, so a rank may be silent longer.
RANK_SILENCE_S = 60


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_multi_rank_megatron_trainer_runs_the_loop(assets: dict[str, Path], tmp_path: Path, lora: bool) -> None:
    # The GPU topologies' trainer shape on CPU: one torch.distributed world of two data-parallel Megatron
    # ranks (world_port), trainer.0 on the bus and in the weights link, trainer.1 following its calls. With
    # LoRA (topology/local_lora.yaml's settings) every version is the Megatron trainer's adapter alone, which
    # the embedded rollouts merge into their kept base.
    from actors.engines import megatron
    if not megatron.is_available():
        pytest.skip(f"megatron-core not importable ({megatron.MEGATRON_IMPORT_ERROR})")
    local = (ROOT / "topology" / ("local_lora.yaml" if lora else "local.yaml")).read_text()
    links = local[local.index("\nlinks:"):local.index("\nactors:")]
    trainer = local[local.index("\n  trainer:"):local.index("\n  param_server:")]
    text = local.replace(links, "\nlinks:\n"
                                "  train_to_ps: {backend: gloo, members: [trainer.0, param_server], port: auto, timeout_s: 30}\n"
                                "  ps_to_rollout: {backend: gloo, members: [param_server, rollout], port: auto, timeout_s: 30}\n")
    text = text.replace(trainer, "\n  trainer:\n"
                                 "    class: tests.megatron_trainer:CPUMegatronTrainerActor\n"
                                 "    count: 2\n    cpus: [1]\n    threads: 1\n"
                                 "    parallel: {dp: 2, tp: 1, pp: 1}\n    world_port: auto\n"
                                 f"    settings: {{backend: megatron, bus: {{heartbeat_timeout: {RANK_SILENCE_S}}}}}")
    topology = tmp_path / "megatron_dp2.yaml"
    topology.write_text(text)
    run_dir = tmp_path / "run"
    steps = 4
    run_to_end(assets, run_dir, steps, ckpt_every=2, topology=str(topology))
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, steps + 1))
    assert events(run_dir, "trainer.1", "trainer_rank_started")[0]["world"] == 2
    assert events(run_dir, "trainer.1", "trainer_rank_done")        # it followed rank 0 to the end
    assert (run_dir / "checkpoints" / f"step_{steps:06d}" / "COMPLETE").exists()
    if lora:
        from actors.engines.lora import ADAPTER_WEIGHTS, read_adapter
        found = sorted((run_dir / "checkpoints" / f"step_{steps:06d}").rglob(ADAPTER_WEIGHTS))
        assert found, "a LoRA checkpoint holds the adapter in PEFT's layout"
        _, adapter, _ = read_adapter(str(found[0].parent))
        assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter), sorted(adapter)[:4]
        for name in ("rollout.0", "rollout.1"):
            assert events(run_dir, name, "weights_updated"), f"{name} took no adapter version"


def test_pipeline_stages_each_send_their_own_layers_to_sglang_servers(assets: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    # The 64-node shape of the weight path on CPU: a Megatron trainer of two pipeline stages (one layer
    # each) and two SGLang stand-in servers. Each stage's sender hosts a group of its own that both servers
    # join, and broadcasts only its own layers there (stage 1's never pass through trainer.0); the servers
    # take the stages' buckets in one interruption per version. Every ack is checked by the version the
    # server reports (the SGLang client asks only SGLang's own routes, and SGLang cannot read weights back).
    from actors.engines import megatron
    if not megatron.is_available():
        pytest.skip(f"megatron-core not importable ({megatron.MEGATRON_IMPORT_ERROR})")
    standin = f"{{engine: sglang, sglang: {{command: [{sys.executable}, -m, testsupport.sglang_standin]}}}}"
    text = direct_topology(tmp_path, standin).read_text()
    trainer = text[text.index("\n  trainer:"):text.index("\n  param_server:")]
    text = text.replace(trainer, "\n  trainer:\n"
                                 "    class: tests.megatron_trainer:CPUMegatronTrainerActor\n"
                                 "    count: 2\n    cpus: [1]\n    threads: 1\n"
                                 "    parallel: {dp: 1, tp: 1, pp: 2}\n    world_port: auto\n"
                                 f"    settings: {{backend: megatron, bus: {{heartbeat_timeout: {RANK_SILENCE_S}}}}}")
    topology = tmp_path / "megatron_pp2.yaml"
    topology.write_text(text)
    run_dir = tmp_path / "run"
    steps = 4
    run_to_end(assets, run_dir, steps, ckpt_every=steps, topology=str(topology))
    formed = events(run_dir, "param_server", "rollout_link_formed")
    # A server still starting when the first version waits joins late: a formation may leave it out (then it
    # has one rank less); the last one has both.
    assert formed and all(e["stages"] == 2 and e["ranks"] == 3 - len(e["left_out"]) for e in formed), formed
    assert formed[-1]["ranks"] == 3, formed
    pushes = events(run_dir, "param_server", "weights_pushed")
    # (how many versions are pushed follows the machine's speed: versions that arrive during a push are coalesced)
    both = {"rollout.0", "rollout.1"}
    assert pushes and all(set(p["rollouts"]) <= both for p in pushes) and set(pushes[-1]["rollouts"]) == both, pushes
    assert all(r["ack_ok"] and r["verified"] == "version" for p in pushes for r in p["rollouts"].values()), pushes
    for name in ("rollout.0", "rollout.1"):
        hashes = events(run_dir, name, "weights_updated")
        assert hashes and all(e.get("through_server") and e["verified"] == "version" for e in hashes), name
        assert not events(run_dir, name, "weights_hash_mismatch"), name
    hosted = events(run_dir, "trainer.0", "weights_group_hosted")
    assert hosted and all(len(e["ports"]) == 2 for e in hosted), hosted
    assert [e["stage"] for e in events(run_dir, "trainer.1", "weights_group_hosted")] == [1] * len(hosted)
    # trainer.1 broadcast stage 1's buckets itself for every version pushed (the last broadcast's push may
    # still be collecting acks when the run ends, so it can be missing from the parameter server's log)
    sent = sorted(e["version"] for e in events(run_dir, "trainer.1", "stage_weights_sent"))
    pushed = sorted(p["version"] for p in pushes)
    assert sent[:len(pushed)] == pushed and len(sent) - len(pushed) <= 1, (sent, pushed)
    assert all(e["stage"] == 1 and e["buckets"] >= 1 and e["error"] is None
               for e in events(run_dir, "trainer.1", "stage_weights_sent"))
