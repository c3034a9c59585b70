"""A training batch on the wire (transport.protocol.BatchTensors, laid out by actors/batch.py): within the
bus's frame limit at the 7B recipe's shape, bit-identical on arrival, and each data-parallel trainer rank
sent only its share."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import multiprocessing as mp
from typing import Any

import pytest
import torch
import torch.distributed as dist

from actors.batch import BATCH_FRAME_BYTES, flat, from_batch, from_columns, share, to_batch
from actors.engines.torch_train import TorchTrainEngine, TrainConfig
from actors.trainer.actor import StepConfig, rank_samples, train_share
from testsupport.tiny_models import sampled_batch, tiny_model
from tools.bench.batch import synthetic_batch
from topology.experiment import ExperimentConfig
from transport.bus import Bus
from transport.messages import decode, encode
from transport.protocol import BatchRequest, BatchTensors, BufferStats

FRAME_LIMIT = 256 << 20   # the bus's default max_frame_bytes
COLUMNS = ("prompt_ids", "output_ids", "logprobs", "versions")
SCALARS = ("step", "stats", "levels", "group_sizes", "prompt_lens", "output_lens", "rewards", "correct",
           "finish_reasons", "score_details", "carried")


def assert_same_batch(got: BatchTensors, want: BatchTensors) -> None:
    for name in SCALARS:
        assert getattr(got, name) == getattr(want, name), name
    for name in COLUMNS:
        a, b = flat(got, name), flat(want, name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_the_7b_recipes_batch_encodes_into_frames_under_the_limit() -> None:
    # 512 prompts x 16 answers of 31,744 tokens: about 1 GB per token column. torch.empty leaves the pages
    # untouched and encoding is zero-copy, so the full shape costs no memory here.
    groups, answers, new = 512, 16, 31744
    n = groups * answers
    empty = lambda dtype: torch.empty(n * new, dtype=dtype)   # noqa: E731
    batch = from_columns(
        step=1, stats=BufferStats(), levels=[0] * groups, group_sizes=[answers] * groups,
        prompt_ids=torch.zeros(groups * 300, dtype=torch.int32), prompt_lens=[300] * groups,
        output_ids=empty(torch.int32), output_lens=[new] * n, logprobs=empty(torch.float32),
        versions=empty(torch.int32), rewards=[0.0] * n, correct=[False] * n, finish_reasons=["length"] * n)
    frames = encode(batch, sender="buffer")
    sizes = [memoryview(f).nbytes for f in frames]
    assert sum(sizes[1:]) == 3 * n * new * 4 + groups * 300 * 4          # every token travels, once
    assert max(sizes) <= BATCH_FRAME_BYTES < FRAME_LIMIT
    assert sizes[0] < 1 << 20                                             # the scalar columns are small
    assert len(frames) - 1 == 1 + 3 * -(-n * new * 4 // BATCH_FRAME_BYTES)


def test_a_batch_over_the_frame_limit_crosses_a_real_bus_bit_identical() -> None:
    # 160 groups of the recipe's answers (16 x 31,744 tokens): each token column is 325 MB, over the bus's
    # 256 MiB frame limit, which the batch as one message of lists (before) could not pass.
    batch = synthetic_batch(groups=160)
    assert flat(batch, "output_ids").numel() * 4 > FRAME_LIMIT

    async def run() -> tuple[Any, dict[str, int]]:
        server = await Bus("buffer", "tcp://127.0.0.1:*", max_frame_bytes=FRAME_LIMIT,
                           handler=lambda env: batch if isinstance(env.msg, BatchRequest) else None).start()
        client = await Bus("trainer", "tcp://127.0.0.1:*", {"buffer": server.endpoint},
                           max_frame_bytes=FRAME_LIMIT).start()
        try:
            async with asyncio.timeout(300):
                got = await client.request("buffer", BatchRequest(step=1), timeout=300)
            return got, dict(client.rejected)
        finally:
            await client.close(linger=0.0)
            await server.close(linger=0.0)

    got, rejected = asyncio.run(run())
    assert not rejected and isinstance(got, BatchTensors)
    assert_same_batch(got, batch)


def test_a_list_form_batch_round_trips_and_a_share_carries_only_its_samples() -> None:
    batch = sampled_batch(tiny_model(0), groups=3, n=4)
    cols = from_batch(batch, frame_bytes=64)                              # many small frames
    _, back = decode([bytes(f) for f in encode(cols)])
    assert to_batch(back) == batch and len(back.output_ids) > 1
    part = share(back, [7, 1, 2])
    assert part.carried == [1, 2, 7]
    samples = [s for g in batch.groups for s in g.samples]
    assert flat(part, "output_ids").tolist() == sum((samples[i].output_ids for i in (1, 2, 7)), [])
    assert flat(part, "logprobs").tolist() == sum((samples[i].logprobs for i in (1, 2, 7)), [])
    assert part.output_lens == back.output_lens and part.rewards == back.rewards   # scalar columns whole
    with pytest.raises(ValueError, match="not carried"):
        share(part, [0])
    with pytest.raises(ValueError, match="share"):
        to_batch(part)


class _Replica(TorchTrainEngine):
    """A torch engine that says it is replica `rank` of `size`, so it trains on that replica's micro-batches
    (its loss denominator stays local: the same in both runs compared)."""

    def __init__(self, model: Any, rank: int, size: int) -> None:
        super().__init__(model=model, config=TrainConfig(lr=1e-3))
        self._dp = (rank, size)

    @property
    def data_parallel(self) -> tuple[int, int]:
        return self._dp


def _untimed(result: Any) -> Any:
    """A share's result without its wall-clock timings, which differ between any two runs."""
    updates = [{k: v for k, v in u.items() if not k.endswith("_seconds")} for u in result.updates]
    return dataclasses.replace(result, logprobs_seconds=0.0, updates=updates)


@pytest.mark.parametrize("kl_coef", [0.0, 0.2])
def test_a_rank_trains_on_its_share_exactly_as_on_the_whole_batch(kl_coef: float) -> None:
    model = tiny_model(1)
    batch = from_batch(sampled_batch(model, groups=4, n=4))
    cfg = StepConfig.from_settings(ExperimentConfig.model_validate(
        {"algo": {"ppo_minibatches": 2, "max_tokens_per_mb": 16, "kl_coef": kl_coef}}))
    dp = 2
    per_rank = rank_samples(batch, cfg, dp)
    if kl_coef == 0:   # the replicas' shares are disjoint and cover the batch
        assert sorted(i for s in per_rank for i in s) == list(range(len(batch.output_lens)))
    else:              # the reference log-probs of every sequence enter the advantages
        assert per_rank == [list(range(len(batch.output_lens)))] * dp
    for rank in range(dp):
        results = []
        for b in (batch, share(batch, per_rank[rank])):
            engine = _Replica(copy.deepcopy(model), rank, dp)
            ref = TorchTrainEngine(model=tiny_model(2)) if kl_coef else None
            result = train_share(engine, b, cfg, version=0, ref_engine=ref)
            results.append((result, torch.cat([p.detach().flatten() for p in engine.model.parameters()])))
        (whole, w_whole), (part, w_part) = results
        assert whole.ppo.n_tokens > 0 and _untimed(part) == _untimed(whole) and torch.equal(w_part, w_whole)
    other = share(batch, per_rank[1]) if kl_coef == 0 else None
    if other is not None:   # a rank sent another replica's share is refused, naming what it lacks
        with pytest.raises(ValueError, match="data-parallel rank 0 was not sent"):
            train_share(_Replica(copy.deepcopy(model), 0, dp), other, cfg, version=0)


def _rank_main(rank: int, world: int, store: str, batch_path: str, out: Any) -> None:
    from actors.runtime.rank_group import RankGroup
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        group = RankGroup(timeout_s=120)
        if group.leader:
            batch = torch.load(batch_path, weights_only=False)
            cfg = StepConfig.defaults(minibatches=2, max_tokens_per_mb=16)
            samples = rank_samples(batch, cfg, 2)
            rank_dp = [0, 0, 1, 1]   # two tensor-parallel ranks per replica
            encoded = {dp: encode(share(batch, samples[dp])) for dp in (0, 1)}
            group.send_frames({r: encoded[rank_dp[r]] for r in range(1, world)})
        else:
            # The frames as bytes, decoded by the test: a decoded share's tensors would cross the queue as file
            # descriptors that this process serves until it exits, and a rank that exited before the test read
            # them failed it (FileNotFoundError from multiprocessing's resource sharer, on a loaded machine).
            out.put((rank, [bytes(frame) for frame in group.recv_frames()]))
    finally:
        dist.destroy_process_group()


def test_trainer_zero_sends_each_rank_its_replicas_share_over_gloo(tmp_path) -> None:
    batch = from_batch(sampled_batch(tiny_model(3), groups=4, n=4), frame_bytes=128)
    torch.save(batch, tmp_path / "batch.pt")
    samples = rank_samples(batch, StepConfig.defaults(minibatches=2, max_tokens_per_mb=16), 2)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    world = 4
    procs = [ctx.Process(target=_rank_main, args=(r, world, str(tmp_path / "store"), str(tmp_path / "batch.pt"), out))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = {rank: decode(frames)[1] for rank, frames in (out.get(timeout=120) for _ in range(world - 1))}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    for rank, dp in ((1, 0), (2, 1), (3, 1)):
        assert got[rank].carried == samples[dp] and len(samples[dp]) < len(batch.output_lens)
        assert_same_batch(got[rank], share(batch, samples[dp]))


def test_the_buffer_keeps_a_served_batch_as_its_frames_and_reads_it_back(tmp_path) -> None:
    # What a restarted buffer serves again is the very batch it served (the file is written frame by frame)
    from actors.buffer.actor import BufferFiles
    files = BufferFiles(tmp_path)
    listed = sampled_batch(tiny_model(4), groups=2, n=3)
    listed.groups[0].samples[1].score_detail = "boxed 7 != 8"
    record, state = {"event": "batch", "step": listed.step}, {"data_pass": 0, "position": 2}
    sent = files.write_served(listed, record, state)
    assert files.served_steps() == [listed.step]
    got, got_record, got_state = files.read_served(listed.step)
    assert_same_batch(got, sent)
    assert to_batch(got) == listed and (got_record, got_state) == (record, state)


def test_a_batch_whose_columns_disagree_is_refused_naming_the_column() -> None:
    import msgpack

    from transport.messages import FieldError
    batch = from_batch(sampled_batch(tiny_model(5), groups=2, n=2))
    frames = encode(batch)
    head = msgpack.unpackb(frames[0])
    for column, value, says in (("output_lens", [1, 2, 3, 4], "output_ids: .* tokens"),
                                ("rewards", [0.0], "rewards: 1 values for 4 answers"),
                                ("group_sizes", [2, 1], "group_sizes"),
                                ("carried", [2, 1], "carried: must be ascending")):
        bad = {**head[7], column: value}
        with pytest.raises(FieldError, match=says):
            decode([msgpack.packb(head[:7] + [bad]), *frames[1:]])
    with pytest.raises(TypeError, match="logprobs: chunks must be 1-D float32"):
        BatchTensors(**{**vars(batch), "logprobs": [c.double() for c in batch.logprobs]})
