"""The buffer's dispatch rule for rollouts whose weights are too old (the rest of the buffer runs in the
end-to-end tests)."""
from __future__ import annotations

from collections import Counter

from actors.buffer import BufferActor
from algo.staleness import StalenessGate
from transport.protocol import Sample, ScoredGroup, Task


def _buffer(eta: int) -> BufferActor:
    buf = BufferActor.__new__(BufferActor)       # only the dispatch state, no process or bus
    buf.eta, buf.max_per_rollout = eta, 8
    buf.gate = StalenessGate(batch_size=4, max_staleness=eta)
    buf.rollout_versions, buf.rollout_clocks, buf.inflight = {}, {}, {}
    buf.counters = Counter()
    return buf


def _scored(rollout: str, version: int) -> ScoredGroup:
    return ScoredGroup(group_id="g", query_id="q", prompt_ids=[1], task=Task(), rollout=rollout,
                       samples=[Sample(output_ids=[2, 3], logprobs=[-1.0, -1.0], versions=[version - 1, version], finish_reason="stop")])


def test_a_rollout_behind_the_gate_gets_one_group_at_a_time() -> None:
    # A rollout whose weights are older than eta allows generates only stale groups; sending it a full
    # load again and again flooded its queues until its heartbeats went unanswered (the run stalled).
    buf = _buffer(eta=1)
    assert buf._rollout_cap("rollout.0") == 8                   # nothing seen yet
    buf.on_scored(_scored("rollout.0", 3))                      # not in flight: counted as late, version noted
    buf.gate.set_version(4)
    assert buf._rollout_cap("rollout.0") == 8                   # 4 - 3 <= eta
    buf.gate.set_version(5)
    assert buf._rollout_cap("rollout.0") == 1                   # 5 - 3 > eta: one group, to learn when it caught up
    buf.on_scored(_scored("rollout.0", 5))
    assert buf._rollout_cap("rollout.0") == 8


def test_the_buffer_checkpoints_into_its_own_run_directory_only(tmp_path) -> None:
    import json

    from actors.recovery import checkpoint_dir
    from transport.protocol import CheckpointRequest
    buf = _buffer(eta=1)
    buf.run_dir, buf.ready, buf.reissue, buf.epoch, buf.position, buf.attempts = tmp_path, [], [], 0, 5, {}
    buf.stats = type("Stats", (), {})()
    buf.dataset = type("Data", (), {"path": "d.jsonl", "__len__": lambda self: 9})()
    done = buf.on_checkpoint(CheckpointRequest(step=3))
    assert done.step == 3
    assert json.loads((checkpoint_dir(tmp_path, 3) / "buffer.json").read_text())["position"] == 5
