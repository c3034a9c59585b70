"""The control channel of a multi-rank trainer: rank 0 says which engine call comes next, the others follow
(their loop is actors/trainer/followers.py; the pipeline stages' weights senders, actors/weight_sync/servers.py,
follow the weights channel). Here, below both, so that either may use it.

A Megatron trainer is one torch.distributed world (one rank per GPU) whose collectives need every rank to
make the same engine calls in the same order. Only rank 0 (`trainer.0`) talks to the buffer and the
parameter server; before each engine call it broadcasts the command to the other ranks over a gloo group of
the world, and gathers their statistics back after a training step. Gloo, not NCCL: the commands are small
pickled objects that must not queue behind the GPUs' kernels. A training step's data is not broadcast: rank 0
sends each rank only its share of the batch, point to point, as the frames of a typed message
(`send_frames`, `recv_frames`: the wire's own encoding, tensors as raw bytes, never pickled).

A pipeline-parallel trainer has a second channel, for weights: each stage's sender (data- and
tensor-parallel rank 0 of the stage) hosts its own group with the rollouts' servers and broadcasts its own
layers there. Forming those groups and broadcasting are asked for by the parameter server while a training
step may be running, so they are led on a channel of their own, which the other ranks follow on a thread
of their own (HOST, BROADCAST; STOP ends it). Rank 0 stops that channel after the training one, once no
broadcast is led on it any more (the parameter server may ask for the last version's while the last step
ends): a rank leaves only when both have stopped (`actors.trainer.followers.follow_rank0`), or the broadcast it left would fail on
rank 0 and with it the end of the run.

The group's timeout only bounds a broadcast that never completes; a follower waits for rank 0's next
command as long as the run waits for its next batch. Liveness is the bus's job: every trainer rank
watches the others' heartbeats and stops the run when one dies (a torch.distributed world cannot take a
rank back).
"""
from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist


TRAIN, EXPORT, SAVE, STOP = "train", "export", "save", "stop"
HOST, BROADCAST = "host", "broadcast"        # the weights channel of a pipeline-parallel trainer
COMMANDS = (TRAIN, EXPORT, SAVE, STOP, HOST, BROADCAST)


class RankGroup:
    """The control channel of a trainer world (every rank constructs it, in the same order relative to
    other process groups)."""

    def __init__(self, timeout_s: float = 24 * 3600.0) -> None:
        if not dist.is_initialized():
            raise RuntimeError("RankGroup: torch.distributed is not initialised (the engine joins the world first)")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.stopped = False   # rank 0 has led STOP: nobody follows any more

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def lead(self, command: str, *args: Any) -> None:
        """Rank 0: tell every other rank to make the engine call `command` with `args`."""
        if command not in COMMANDS:
            raise ValueError(f"unknown trainer command {command!r} (one of {', '.join(COMMANDS)})")
        if self.stopped:   # the others have left or are leaving: a collective would wait for them in vain
            raise RuntimeError(f"cannot lead {command!r}: the other trainer ranks were told to stop (the run is over)")
        self.stopped = command == STOP
        dist.broadcast_object_list([(command, args)], src=0, group=self.group)

    def next_command(self) -> tuple[str, tuple[Any, ...]]:
        """Ranks > 0: wait for rank 0's next command."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's value on rank 0 (in rank order); None elsewhere."""
        out: list[Any] | None = [None] * self.size if self.leader else None
        dist.gather_object(value, out, dst=0, group=self.group)
        return out

    def send_frames(self, frames_by_rank: dict[int, list[Any]]) -> None:
        """Rank 0: send each rank its message frames (bytes or buffers, as `transport.messages.encode`
        makes them), to every rank at once; returns when all are sent."""
        pending, held = [], []   # the tensors stay referenced until every send has completed
        for dst, frames in frames_by_rank.items():
            sizes = torch.tensor([len(frames)] + [memoryview(f).nbytes for f in frames], dtype=torch.int64)
            tensors = [torch.tensor([sizes.numel()], dtype=torch.int64), sizes]
            for frame in frames:
                if memoryview(frame).nbytes:
                    # bytes are read-only; the buffers of a tensor frame are sent in place
                    buf = bytearray(frame) if isinstance(frame, bytes) else frame
                    tensors.append(torch.frombuffer(buf, dtype=torch.uint8))
            held.extend(tensors)
            pending.extend(dist.isend(t, dst, group=self.group) for t in tensors)
        for work in pending:
            work.wait()

    def recv_frames(self) -> list[memoryview]:
        """Ranks > 0: the frames rank 0 sent this rank (`send_frames`), for `transport.messages.decode`."""
        count = torch.zeros(1, dtype=torch.int64)
        dist.recv(count, 0, group=self.group)
        sizes = torch.zeros(int(count), dtype=torch.int64)
        dist.recv(sizes, 0, group=self.group)
        frames = []
        for n in sizes[1:].tolist():
            buf = torch.empty(n, dtype=torch.uint8)
            if n:
                dist.recv(buf, 0, group=self.group)
            frames.append(memoryview(buf.numpy()))
        return frames
