"""tools.replay --into on an agent run: a 3-step run of topology/local.yaml whose rollouts run an `openai`-package
agent (tools/agents/calculator.py) for every group, recorded; the buffer (its batches' prompts are the ones the
conversations rendered, from Answers.prompt_ids) and the trainer replay it identically."""
from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools import replay
from tools.bench.chaos import finish_run, launch, make_assets
from transport.messages import decode
from transport.msglog import read_log
from transport.protocol import ScoredGroup


@pytest.fixture(scope="module")
def recorded() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="replay-agent-") as tmp:
        base = Path(tmp)
        assets = make_assets(base, train_per_level=40)
        run_dir = base / "run"
        # The chat-rendered first call (tool list, role line) and a Qwen tool call need more than the math
        # default's 64 tokens a turn.
        proc = launch(assets, run_dir, steps=3, ckpt_every=3,
                      extra=("experiment.run.final_eval=false", "experiment.algo.kl_coef=0.1",
                             "experiment.gen.max_new_tokens=96", "experiment.gen.max_context=256",
                             "actors.rollout.settings.agent.function=tools.agents.calculator:agent",
                             "actors.rollout.settings.agent.timeout_s=120", "--record"))
        out = finish_run(proc, run_dir, timeout=600)
        assert proc.returncode == 0, out[-4000:]
        yield run_dir / "msglog"


def test_an_agent_runs_answers_carry_their_rendered_prompt_and_replay_identically(recorded: Path) -> None:
    records, _ = read_log(recorded / "buffer.msglog")
    inbound = [decode(r.frames)[1] for r in records if r.kind == "in" and r.rejected is None]
    scored = [m for m in inbound if isinstance(m, ScoredGroup)]
    assert scored and all(g.answers.prompt_ids for g in scored)
    for name, cls in (("buffer", "actors.buffer:BufferActor"), ("trainer", "actors.trainer:TrainerActor")):
        same = replay.replay_into(str(recorded / f"{name}.msglog"), cls)
        assert same.compared and same.divergence is None, (name, same.divergence, same.notes)
        assert same.sent > 0, name
