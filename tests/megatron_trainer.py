"""Test-only: the trainer actor with the Megatron backend on CPU (megatron-core asks for CUDA in places;
tests/megatron_cpu_shim.py maps those requests to CPU in the actor's process). Everything else is the
product's TrainerActor, so a topology naming this class runs the real multi-rank trainer."""
from __future__ import annotations

from actors.trainer.actor import TrainerActor


class CPUMegatronTrainerActor(TrainerActor):
    async def on_start(self) -> None:
        from tests import megatron_cpu_shim

        megatron_cpu_shim.install()
        await super().on_start()
