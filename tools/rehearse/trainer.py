"""The rehearsal's trainer: the real trainer actor (`actors.trainer.actor.TrainerActor`: its loop, batch requests,
version updates, weight publishing over the real weights path, metrics, the end of the run) whose training
step is the planner's cost of the modelled step, slept, instead of a step of the tiny model it holds.

The step's cost is `tools.plan.costs.train_step_seconds` of the modelled batch (every answer `token_scale`
times the tokens it carries, after the simulation's prompt) on the modelled trainer layout (its data-, tensor-
and pipeline-parallel sizes), divided by the time scale; the export of a version sleeps the modelled export
(tensor-parallel gather and copy to host) after the tiny model's real export. The metrics are computed from
the batch as a trained step's are (rewards, staleness, lengths); the PPO statistics are empty.
"""
from __future__ import annotations

import time
from typing import Any

from actors.batch import as_columns, sequence_lengths
from actors.trainer.metrics import step_metrics
from actors.trainer.step import ShareResult
from actors.trainer.actor import TrainerActor
from algo.ppo import PPOStats
from tools.rehearse.costs import RehearsalCosts
from transport.protocol import BatchTensors

COST_FILE = "rehearsal.json"   # in the run directory, written by tools.rehearse before the launch


class CostModelTrainer(TrainerActor):
    async def on_start(self) -> None:
        self.costs = RehearsalCosts.load(self.run_dir / COST_FILE)
        await super().on_start()

    def modelled_seconds(self, batch: BatchTensors) -> float:
        """The modelled step of this batch, in modelled seconds."""
        k, prompt = self.costs.token_scale, self.costs.sim.prompt_tokens
        _, group_ids = sequence_lengths(batch)
        lengths = [prompt + n * k for n in batch.output_lens]
        return self.costs.train_seconds(lengths, group_ids)

    def _train_step(self, batch: BatchTensors) -> dict[str, Any]:
        cols = as_columns(batch)
        modelled = self.modelled_seconds(cols)
        time.sleep(modelled / self.costs.time_scale)   # in the training thread, as a real step would hold it
        stats = step_metrics(cols, self.version, [ShareResult(PPOStats(), 0.0, [])])
        stats["modelled_train_seconds"] = modelled
        return stats

    def _export(self) -> Any:
        out = super()._export()
        time.sleep(self.costs.weight_sync().export_s / self.costs.time_scale)
        return out
