"""What the rehearsal's stand-ins cost: the planner's cost model of the run (tools/plan), written once by the
rehearsal into RUN_DIR/rehearsal.json and read by every stand-in server and the stand-in trainer.

Two scales turn a 7B/32k run into one a 2-core machine can carry:

* ``time_scale``: every modelled second takes 1/time_scale of a real second (a 130 s step takes about 4 s).
* ``token_scale``: every token the control plane sees stands for ``token_scale`` tokens of the modelled run.
  The costs are those of the modelled lengths; the messages carry 1/token_scale of the tokens, so a batch of
  512 answers of 7,700 tokens is 512 answers of about 240 on the wire. The experiment's token budgets are
  divided by it (gen.max_new_tokens, data.max_prompt_tokens), the servers' KV pool and context too, so every
  rule that compares tokens (the buffer's groups per KV pool, SGLang's context check) compares the same ratios.

Nothing here decides anything: the decisions stay with the real actors and, in the stand-in servers, with
the planner's model of SGLang's scheduler (tools/plan/engines.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from launch.plan import hardware
from launch.plan.shapes import ModelShape
from tools.plan import costs
from tools.plan.sim import SimConfig

__all__ = ["RehearsalCosts"]


@dataclasses.dataclass(frozen=True)
class RehearsalCosts:
    sim: SimConfig                 # the simulation of the same run (its shape, GPU, layout, lengths)
    time_scale: float
    token_scale: int
    #: server index (its rollout's instance index) -> how many times slower its steps are (a straggler)
    slow: dict[int, float] = dataclasses.field(default_factory=dict)
    #: server indices whose server never becomes healthy (stays "starting")
    never_up: tuple[int, ...] = ()

    # --- the modelled run's costs, in modelled seconds --------------------------------------------------
    def decode_cost(self, n: int) -> costs.DecodeCost:
        return costs.decode_cost(self.sim.shape, self.sim.gpu, self.sim.server_tp, n)

    def prefill_seconds(self, tokens: float, sum_sq: float) -> float:
        return costs.prefill_seconds(self.sim.shape, self.sim.gpu, self.sim.server_tp, tokens, sum_sq)

    def train_seconds(self, lengths: list[int], group_of: list[int]) -> float:
        return costs.train_step_seconds(self.sim.shape, self.sim.gpu, self.sim.trainer, lengths, group_of)

    def weight_sync(self) -> costs.WeightSync:
        s = self.sim
        return costs.weight_sync(s.shape, s.gpu, s.trainer.tp, s.trainer.pp, s.gpus_per_node, s.weights_across_nodes)

    def answer_tokens(self, answer_id: str) -> int:
        """The modelled length of one answer, drawn from the simulation's length distribution, the same for
        every resubmission of the answer (seeded by its id)."""
        seed = int.from_bytes(hashlib.blake2b(f"{self.sim.seed}/{answer_id}".encode(), digest_size=8).digest(), "big")
        return int(self.sim.draw_lengths(np.random.default_rng(seed), 1)[0])

    # --- the file ----------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        s = self.sim
        return {"time_scale": self.time_scale, "token_scale": self.token_scale,
                "slow": {str(k): v for k, v in self.slow.items()}, "never_up": list(self.never_up),
                "shape": dataclasses.asdict(s.shape), "gpu": dataclasses.asdict(s.gpu),
                "trainer": dataclasses.asdict(s.trainer), "server_tp": s.server_tp,
                "gpus_per_node": s.gpus_per_node, "weights_across_nodes": s.weights_across_nodes,
                "kv_tokens_per_server": s.kv_tokens_per_server, "context_len": s.context_len,
                "max_new_tokens": s.max_new_tokens, "lengths": s.lengths, "prompt_tokens": s.prompt_tokens,
                "seed": s.seed}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RehearsalCosts":
        sim = SimConfig(shape=ModelShape(**d["shape"]), gpu=hardware.GPU(**d["gpu"]),
                        gpus_per_node=int(d["gpus_per_node"]), servers=1, server_tp=int(d["server_tp"]),
                        trainer=costs.TrainerShape(**d["trainer"]), batch_size=1, group_size=1, eta=0,
                        max_new_tokens=int(d["max_new_tokens"]), kv_tokens_per_server=int(d["kv_tokens_per_server"]),
                        context_len=int(d["context_len"]), lengths=dict(d["lengths"]),
                        prompt_tokens=int(d["prompt_tokens"]), weights_across_nodes=bool(d["weights_across_nodes"]),
                        seed=int(d["seed"]))
        return cls(sim, float(d["time_scale"]), int(d["token_scale"]),
                   {int(k): float(v) for k, v in d.get("slow", {}).items()}, tuple(int(i) for i in d.get("never_up", [])))

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "RehearsalCosts":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a rehearsal cost file ({type(exc).__name__}: {exc})") from None
