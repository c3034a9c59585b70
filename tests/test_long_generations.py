"""Long generations through the real launcher: a buffer, a reward actor and two rollouts driving stand-in SGLang
servers whose decode step takes what the planner's cost model gives a 7B model on H800 with tp 2 (13 ms at 60
answers of 16k tokens in flight), answers of up to 96 tokens from a random model (most long, a few cut at the
limit), and a group timeout short enough that the longest groups run out of time, as 32k-token groups do
against a fixed 1,800 s. What must hold: no two copies of a group ever run at once on the servers (an overdue
group is aborted where it runs before it is issued again), and no server holds more groups than its KV pool
fits, so re-issues cannot pile up on a server that is behind."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from actors.dataset import Layout, load_dataset
from actors.engines.tokenizer import load_tokenizer
from algo.serving import groups_in_kv
from launch.plan import hardware
from launch.plan.shapes import BUILTIN
from tools.bench.chaos import make_assets
from tools.plan import costs

ROOT = Path(__file__).resolve().parents[1]
GROUP_SIZE, MAX_NEW = 2, 96
TIMEOUT_S = 0.8   # a group of one answer at the limit takes 96 x 13 ms = 1.25 s at least: it runs out of time


def step_time_s() -> float:
    """One decode step of the 64-node rollout shape by the planner's cost model: Qwen2-7B, H800, tp 2, 60
    answers holding 16k tokens each (the KV pool holds 60 answers of 32k; launch/plan/memory.py)."""
    return costs.decode_cost(BUILTIN["7B"], hardware.gpu("H800"), 2, 60).step(60 * 16_000)


def events(run_dir: Path, actor: str, kind: str) -> list[dict]:
    path = run_dir / "logs" / f"{actor}.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [r for r in records if r.get("event") == kind]


def group_intervals(log_dir: Path) -> tuple[dict[str, tuple[float, float, str]], dict[str, list]]:
    """Per group id (`epoch-index-attempt`): (first start, last end, server file) of its samples' runs on the
    servers; and per server, the (time, +1/-1, group) changes of the groups it runs."""
    spans: dict[str, list[float]] = {}
    where: dict[str, str] = {}
    per_server: dict[str, list] = defaultdict(list)
    for path in sorted(log_dir.glob("standin-*.jsonl")):
        running: dict[str, int] = defaultdict(int)
        for line in path.read_text().splitlines():
            t, event, name = json.loads(line)
            if event not in ("start", "end") or "/" not in name:
                continue
            gid = name.split("/")[0]
            span = spans.setdefault(gid, [t, t])
            span[0], span[1] = min(span[0], t), max(span[1], t)
            where[gid] = path.name
            before = running[gid]
            running[gid] += 1 if event == "start" else -1
            if before == 0 and running[gid] == 1:
                per_server[path.name].append((t, 1, gid))
            elif before == 1 and running[gid] == 0:
                per_server[path.name].append((t, -1, gid))
    return {g: (a, b, where[g]) for g, (a, b) in spans.items()}, per_server


def asked_ids(run_dir: Path) -> set[str]:
    """The groups the rollouts were asked to stop (group_abort)."""
    return {e["group_id"] for r in ("rollout.0", "rollout.1") for e in events(run_dir, r, "group_abort")}


def test_overdue_groups_are_aborted_before_they_are_issued_again_and_servers_hold_what_fits(tmp_path: Path) -> None:
    assets = make_assets(tmp_path / "assets", train_per_level=20)
    tok = load_tokenizer(str(assets["model"]))
    prompts = [len(tok.encode(r.prompt)) for r in load_dataset(assets["data"] / "train.jsonl",
                                                                layout=Layout.from_settings(None)).records]
    # A pool of two groups of the shortest prompt with one-token answers: whatever answers come back, a
    # server may hold two groups at most (at the limit's length, one).
    kv_tokens = 2 * GROUP_SIZE * (min(prompts) + 1)
    most = groups_in_kv(kv_tokens, GROUP_SIZE, min(prompts) + 1, 8)
    assert most == 2 and groups_in_kv(kv_tokens, GROUP_SIZE, sum(prompts) / len(prompts) + MAX_NEW, 8) == 1
    log_dir = tmp_path / "standin-logs"
    log_dir.mkdir()
    command = [sys.executable, "-m", "testsupport.sglang_standin", "--standin-step-time-s", f"{step_time_s():.4f}",
               "--max-total-tokens", str(kv_tokens), "--standin-log-dir", str(log_dir)]
    topology = tmp_path / "longgen.yaml"
    topology.write_text(json.dumps({
        "name": "longgen", "cluster": {"nodes": 1, "node": {"cpus": 2}}, "bus": {"transport": "ipc", "curve": False},
        "actors": {
            "buffer": {"class": "actors.buffer:BufferActor", "cpus": [0]},
            "rollout": {"class": "actors.rollout:RolloutActor", "count": 2, "cpus": [1], "threads": 1,
                        "settings": {"engine": "sglang", "sglang": {"command": command,
                                                                    "env": {"OMP_NUM_THREADS": "1"}}}},
            "reward": {"class": "actors.reward.math:MathReward", "cpus": [0], "cpu_workers": 1}}}))
    run_dir = tmp_path / "run"
    overrides = [f"experiment.model.path={assets['model']}", f"experiment.data.train={assets['data'] / 'train.jsonl'}",
                 "experiment.algo.batch_size=4", f"experiment.algo.group_size={GROUP_SIZE}", "experiment.algo.eta=3",
                 f"experiment.gen.max_new_tokens={MAX_NEW}", f"experiment.buffer.group_timeout_s={TIMEOUT_S}",
                 "experiment.algo.dynamic_sampling=false", "experiment.run.final_eval=false"]
    proc = subprocess.Popen([sys.executable, "-m", "tools.up", str(topology), *overrides, "--run-dir", str(run_dir),
                             "--no-progress"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:   # bounded: until groups ran out of time and their rollouts were asked to stop them
            overdue = {e["group"] for e in events(run_dir, "buffer", "group_overdue")}
            if len(overdue) >= 6 and overdue <= asked_ids(run_dir) and proc.poll() is None:
                break
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no group ran out of time and was issued again"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]

    # the pool each server reported reached the buffer
    pools = {e["rollout"]: e["kv_tokens"] for e in events(run_dir, "buffer", "rollout_kv_pool")}
    assert pools == {"rollout.0": kv_tokens, "rollout.1": kv_tokens}
    # every group overdue before the stop was asked to stop on its rollout (one that ran out of time as the run
    # stopped may not have been), and most were still running there
    assert len(overdue) >= 6 and overdue <= asked_ids(run_dir)
    asked = [e for r in ("rollout.0", "rollout.1") for e in events(run_dir, r, "group_abort")]
    assert any(e["held"] for e in asked)
    spans, per_server = group_intervals(log_dir)
    # No two copies of one prompt ever ran at once, on one server or across both.
    by_key: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for gid, span in spans.items():
        by_key[gid.rsplit("-", 1)[0]].append(span)
    overlapping = []
    for key, attempts in by_key.items():
        attempts.sort()
        overlapping += [(key, a, b) for a, b in zip(attempts, attempts[1:]) if b[0] < a[1]]
    assert not overlapping, overlapping[:3]
    assert any(len(a) > 1 for a in by_key.values())       # some prompts were issued again
    # No server ran more groups at once than its KV pool fits.
    for server, changes in per_server.items():
        level, peak = 0, 0
        for _, delta, _ in sorted(changes):
            level += delta
            peak = max(peak, level)
        assert peak <= most, (server, peak)
