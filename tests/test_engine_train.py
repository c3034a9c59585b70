"""The embedded trainer backend: packing never leaks across sequences, gradient accumulation is exact,
weights export in buckets, checkpoints resume exactly and load in transformers."""
from __future__ import annotations

import math
import os

import pytest
import torch

from actors.engines.base import PackedBatch, RequestError
from actors.engines.checkpoint import CheckpointError, load_model
from actors.engines.torch_train import TorchTrainEngine, TrainConfig, token_nll_loss
from testsupport.tiny_models import random_sequences, tiny_model

VOCAB = 97


def engine(seed: int = 0, **config) -> TorchTrainEngine:
    return TorchTrainEngine(model=tiny_model(seed=seed), config=TrainConfig(**config))


def masked_batch(seqs, seed=0) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    masks = [[0.0] + [float(x) for x in (torch.rand(len(s) - 1, generator=gen) > 0.3).tolist()] for s in seqs]
    return PackedBatch.from_sequences(seqs, {"loss_mask": masks})


def test_packed_logprobs_equal_alone_and_never_see_other_sequences():
    trainer = engine()
    seqs = random_sequences(5, 2, 40, VOCAB, seed=1)
    packed = trainer.compute_logprobs(PackedBatch.from_sequences(seqs), with_entropy=True)
    cu = PackedBatch.from_sequences(seqs).cu_seqlens.tolist()
    for i, s in enumerate(seqs):
        alone = trainer.compute_logprobs(PackedBatch.from_sequences([s]), with_entropy=True)
        torch.testing.assert_close(packed.logprobs[cu[i]:cu[i + 1]], alone.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(packed.entropy[cu[i]:cu[i + 1]], alone.entropy, atol=1e-5, rtol=0)
        assert packed.logprobs[cu[i]] == 0.0 and packed.entropy[cu[i]] == 0.0
    # Changing every other sequence (same lengths, so the same kernels run) leaves sequence 2 bit-identical.
    others = random_sequences(5, 2, 40, VOCAB, seed=1)
    gen = torch.Generator().manual_seed(9)
    for j in (0, 1, 3, 4):
        others[j] = torch.randint(1, VOCAB, (len(others[j]),), generator=gen).tolist()
    changed = trainer.compute_logprobs(PackedBatch.from_sequences(others))
    assert torch.equal(changed.logprobs[cu[2]:cu[3]], packed.logprobs[cu[2]:cu[3]])
    assert not torch.equal(changed.logprobs[cu[0]:cu[1]], packed.logprobs[cu[0]:cu[1]])


def test_logprobs_are_log_softmax_of_temperature_scaled_logits():
    trainer = engine()
    seq = random_sequences(1, 12, 12, VOCAB, seed=2)[0]
    out = trainer.compute_logprobs(PackedBatch.from_sequences([seq]), temperature=0.5)
    with torch.no_grad():
        logits = trainer.model(torch.tensor([seq]))[0]
    expected = torch.log_softmax(logits[:-1] / 0.5, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs[1:], expected, atol=1e-5, rtol=0)


def test_micro_batch_split_gives_the_same_step_as_one_batch():
    seqs = random_sequences(8, 3, 30, VOCAB, seed=3)
    whole = masked_batch(seqs)
    # The same masks in both layouts.
    cu = whole.cu_seqlens.tolist()
    masks = [whole.fields["loss_mask"][cu[i]:cu[i + 1]].tolist() for i in range(len(seqs))]
    parts = [PackedBatch.from_sequences(seqs[a:b], {"loss_mask": masks[a:b]}) for a, b in ((0, 3), (3, 5), (5, 8))]
    a, b = engine(lr=1e-3), engine(lr=1e-3)
    stats_a = a.train_step([whole], token_nll_loss)
    stats_b = b.train_step(parts, token_nll_loss)
    assert math.isclose(stats_a["loss"], stats_b["loss"], rel_tol=1e-5)
    assert math.isclose(stats_a["grad_norm"], stats_b["grad_norm"], rel_tol=1e-4)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0, msg=name)
    assert stats_b["tokens"] == whole.num_tokens and stats_b["seqs"] == 8 and stats_b["version"] == 1
    assert math.isclose(stats_a["loss"], stats_a["nll"], rel_tol=1e-5)  # one micro-batch: mean NLL over the mask


def test_explicit_denominator_scales_the_loss_and_training_reduces_it():
    seqs = random_sequences(4, 10, 20, VOCAB, seed=4)
    batch = PackedBatch.from_sequences(seqs)
    trainer = engine(lr=3e-3, grad_clip=0.5)
    first = trainer.train_step([batch], token_nll_loss)
    half = engine(lr=3e-3).train_step([batch], token_nll_loss, loss_denominator=2 * (batch.num_tokens - 4))
    assert math.isclose(half["loss"], first["loss"] / 2, rel_tol=1e-5)
    for _ in range(20):
        last = trainer.train_step([batch], token_nll_loss)
    assert last["loss"] < 0.7 * first["loss"] and last["step"] == 21
    with pytest.raises(RequestError, match="no micro-batches"):
        trainer.train_step([], token_nll_loss)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        trainer.compute_logprobs(PackedBatch.from_sequences([[1, 500]]))
    with pytest.raises(RequestError, match="cu_seqlens"):
        PackedBatch(torch.tensor([1, 2, 3]), torch.tensor([0, 2]), torch.tensor([0, 1, 0]))
    with pytest.raises(RequestError, match=r"fields\['adv'\]"):
        PackedBatch(torch.tensor([1, 2]), torch.tensor([0, 2]), torch.tensor([0, 1]), {"adv": torch.zeros(3)})


def test_schedules():
    cosine = TrainConfig(schedule="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert [round(cosine.lr_factor(s), 4) for s in (0, 1, 2, 7, 12, 50)] == [0.5, 1.0, 1.0, 0.55, 0.1, 0.1]
    linear = TrainConfig(schedule="linear", total_steps=10)
    assert linear.lr_factor(5) == 0.5
    assert TrainConfig().lr_factor(1000) == 1.0
    with pytest.raises(ValueError, match="total_steps"):
        TrainConfig(schedule="cosine", warmup_steps=5, total_steps=5)
    trainer = engine(schedule="cosine", warmup_steps=1, total_steps=3, lr=1e-3)
    batch = PackedBatch.from_sequences(random_sequences(2, 5, 9, VOCAB, seed=5))
    lrs = [trainer.train_step([batch], token_nll_loss)["lr"] for _ in range(3)]
    assert lrs == pytest.approx([1e-3, 1e-3, 5e-4])


def test_export_weights_in_buckets_round_trips():
    trainer = engine(seed=6)
    buckets = list(trainer.export_weights(bucket_bytes=40_000))
    assert len(buckets) > 2
    for bucket in buckets[:-1]:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= 40_000 or len(bucket) == 1
    names = [n for b in buckets for n, _ in b]
    assert names == [n for n, _ in trainer.model.named_parameters()]
    exported = dict(kv for b in buckets for kv in b)
    before = exported["model.norm.weight"].clone()
    trainer.train_step([PackedBatch.from_sequences([[1, 2, 3, 4]])], token_nll_loss)
    assert torch.equal(exported["model.norm.weight"], before)  # copies, not views of live parameters
    tied = TorchTrainEngine(model=tiny_model(tie_word_embeddings=True))
    assert "lm_head.weight" not in [n for b in tied.export_weights() for n, _ in b]


def test_checkpoint_resumes_exactly_and_loads_in_transformers(tmp_path):
    batches = [PackedBatch.from_sequences(random_sequences(3, 5, 25, VOCAB, seed=s)) for s in range(4)]
    config = dict(lr=1e-3, schedule="cosine", warmup_steps=1, total_steps=6, weight_decay=0.1)
    a = engine(**config)
    for b in batches[:2]:
        a.train_step([b], token_nll_loss)
    a.save(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "trainer_state.pt"]
    after = [a.train_step([b], token_nll_loss)["loss"] for b in batches[2:]]
    noise_a = torch.rand(3)

    b = engine(seed=9, **config)  # different initial weights: everything must come from the checkpoint
    b.load(str(tmp_path))
    assert b.step == 2 and b.version == 2
    resumed = [b.train_step([x], token_nll_loss)["loss"] for x in batches[2:]]
    assert resumed == after
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name
    assert torch.equal(torch.rand(3), noise_a)  # the RNG stream resumes too

    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ours = load_model(str(tmp_path))
    ids = torch.tensor([batches[0].input_ids[:10].tolist()])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=2e-5, rtol=0)

    os.remove(tmp_path / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="no trainer_state.pt"):
        b.load(str(tmp_path))


def test_checkpoints_keep_the_tokenizer_after_the_start_directory_is_gone(tmp_path):
    # A resumed run starts from a checkpoint that checkpoint rotation later deletes; every checkpoint written
    # after that must still carry the tokenizer (the final evaluation and the rollouts load it from there).
    from actors.engines.checkpoint import save_model
    start = tmp_path / "start"
    save_model(tiny_model(seed=0), str(start))
    (start / "tokenizer.json").write_text('{"stand-in": true}')
    (start / "generation_config.json").write_text('{"eos_token_id": 1}')
    e = TorchTrainEngine(str(start), TrainConfig())
    for f in start.iterdir():
        f.unlink()
    start.rmdir()
    e.save(str(tmp_path / "later"))
    assert (tmp_path / "later" / "tokenizer.json").read_text() == '{"stand-in": true}'
    assert (tmp_path / "later" / "generation_config.json").read_text() == '{"eos_token_id": 1}'
