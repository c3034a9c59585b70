"""tools.sft: loss goes down on response tokens only, checkpoints load (here and in transformers), runs
are deterministic, --until-plateau stops and keeps the best checkpoint, bad data lines are typed errors."""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from actors.dataset import DatasetError
from actors.engines.base import TokenLogProbs
from actors.engines.checkpoint import load_model
from actors.engines.tokenizer import load_tokenizer
from actors.engines.torch_train import TRAINER_STATE, TorchTrainEngine, token_nll_loss
from actors.evaluator.harness import evaluate
from launch.prepare import sft
from launch.prepare.lm import (LMToolError, SFTExample, batch_stream, examples_from_records, load_or_init,
                               make_example, pack_examples)
from launch.prepare.task import make_splits, write_jsonl
from tools import sft as sft_cli

REPO = Path(__file__).resolve().parents[1]
ARITH = REPO / "configs" / "models" / "arith-tiny"


def make_tiny_model_dir(path: Path) -> Path:
    """The arith tokenizer with a 30k-parameter Qwen2 config and no weights."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(ARITH / name, path / name)
    config = json.loads((ARITH / "config.json").read_text())
    config.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=64, max_window_layers=2)
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_tiny_data(path: Path) -> Path:
    """14 level-1 problems with solutions, 24 level-2 problems without (operands 1..3)."""
    splits = make_splits(seed=0, levels=(1, 2), solved_levels=(1,), train_per_level=24, test_per_level=6,
                         max_operand=3)
    write_jsonl(splits["train"], path / "train.jsonl")
    write_jsonl(splits["test"], path / "test.jsonl")
    return path


def train_tiny_model(root: Path) -> dict[str, Path]:
    """A 30k-parameter model that memorised the level-1 training prompts (level 2 stays unsolved), for the
    tests of the tools that read a trained checkpoint (eval, filter_data)."""
    model_dir, data = make_tiny_model_dir(root / "init"), make_tiny_data(root / "data")
    cfg = sft.SFTConfig(data=str(data / "train.jsonl"), out=str(root / "ckpt"), model=str(model_dir), steps=120,
                        batch_size=16, lr=1e-2, warmup_steps=5, log_every=1000)
    sft.run_sft(cfg, lambda _: None)
    return {"ckpt": root / "ckpt", "data": data / "train.jsonl", "init": model_dir}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sft")
    return {"model": make_tiny_model_dir(root / "model"), "data": make_tiny_data(root / "data"), "root": root}


def config(tiny: dict[str, Path], out: Path, **overrides) -> sft.SFTConfig:
    values = dict(data=str(tiny["data"] / "train.jsonl"), out=str(out), model=str(tiny["model"]), steps=20,
                  batch_size=16, lr=1e-2, warmup_steps=5, max_new_tokens=16, log_every=1000)
    values.update(overrides)
    return sft.SFTConfig(**values)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / sft.METRICS_FILE).read_text().splitlines()]


def test_loss_mask_covers_only_the_response_and_eos():
    examples = [SFTExample("a", (5, 6, 7), (8, 9, 0)), SFTExample("b", (5, 6), (1, 0))]
    [batch] = pack_examples(examples, 64)
    assert batch.seq_lens() == [6, 4]
    assert batch.fields["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="a: 6 tokens do not fit a micro-batch of 5"):
        pack_examples(examples, 5)


def test_batch_stream_covers_every_example_once_per_epoch():
    stream = batch_stream(10, 4, seed=3)
    seen = [i for _ in range(5) for i in next(stream)]  # 20 = two epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    again = batch_stream(10, 4, seed=3)
    assert [i for _ in range(5) for i in next(again)] == seen


def test_sft_lowers_the_loss_writes_a_loadable_checkpoint_and_is_deterministic(tiny, tmp_path):
    logs: list[str] = []
    summary = sft.run_sft(config(tiny, tmp_path / "a"), logs.append)
    assert summary["initialised_randomly"] and any("initialised" in line and "randomly" in line for line in logs)
    assert summary["examples"] == 14 and summary["without_solutions"] == 24 and summary["steps"] == 20
    metrics = read_metrics(tmp_path / "a")
    losses = [m["loss"] for m in metrics if m["kind"] == "train"]
    assert len(losses) == 20 and all(m["tokens_per_s"] > 0 for m in metrics)
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3
    # The checkpoint is a complete model directory: weights, tokenizer, optimizer state.
    out = tmp_path / "a"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", TRAINER_STATE):
        assert (out / name).is_file(), name
    assert json.loads((out / sft.SUMMARY_FILE).read_text())["final_loss"] == summary["final_loss"]
    ours = load_model(str(out))
    ids = torch.tensor([load_tokenizer(str(out)).encode("Compute: 1+2\n1+2=3 \\boxed{3}")])
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours(ids), atol=1e-4, rtol=1e-4)
    # Same seed, same run: the same losses and weights; another seed differs.
    sft.run_sft(config(tiny, tmp_path / "b"), logs.append)
    assert [m["loss"] for m in read_metrics(tmp_path / "b") if m["kind"] == "train"] == losses
    again = load_model(str(tmp_path / "b"))
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), again.parameters()))
    sft.run_sft(config(tiny, tmp_path / "c", seed=1), logs.append)
    assert [m["loss"] for m in read_metrics(tmp_path / "c") if m["kind"] == "train"] != losses


def test_sft_continues_from_a_checkpoint_with_weights(tiny, tmp_path):
    sft.run_sft(config(tiny, tmp_path / "first", steps=3), lambda _: None)
    model, initialised = load_or_init(tmp_path / "first")
    assert not initialised
    logs: list[str] = []
    summary = sft.run_sft(config(tiny, tmp_path / "second", model=str(tmp_path / "first"), steps=2,
                                 eval_data=str(tiny["data"] / "test.jsonl"), eval_every=2), logs.append)
    assert not summary["initialised_randomly"] and any("loaded" in line for line in logs)
    # The loaded weights are evaluated first: a kept checkpoint must beat them.
    assert [e["step"] for e in read_metrics(tmp_path / "second") if e["kind"] == "eval"] == [0, 2]


def test_until_plateau_stops_and_keeps_the_best_checkpoint(tiny, tmp_path):
    # Held-out = the training prompts: the model memorises level 1 (accuracy climbs to 100% of it,
    # 36.8% overall) and never solves level 2, so accuracy plateaus well before the 400-step cap.
    out = tmp_path / "plateau"
    cfg = config(tiny, out, steps=400, eval_data=str(tiny["data"] / "train.jsonl"), eval_every=15,
                 until_plateau=True, patience=2, min_delta=0.01)
    summary = sft.run_sft(cfg, lambda _: None)
    assert summary["stop_reason"] == "plateau" and summary["steps"] < 400
    evals = [m for m in read_metrics(out) if m["kind"] == "eval"]
    accs = [e["accuracy"] for e in evals]
    best = max(range(len(evals)), key=lambda i: (accs[i], -i))  # first of the highest
    assert summary["kept_step"] == evals[best]["step"] and summary["kept_accuracy"] == accs[best]
    assert accs[best] > 0.3 and evals[best]["accuracy_by_level"]["1"] > 0.9
    # The stop rule: the last `patience` evaluations did not beat the reference by more than min_delta.
    assert all(a <= max(accs[:-2]) + 0.01 for a in accs[-2:]) and summary["steps"] == evals[-1]["step"]
    # The kept checkpoint is the best step's (not the last), and re-evaluating it gives the same accuracy.
    state = torch.load(out / TRAINER_STATE, map_location="cpu", weights_only=False)
    assert state["step"] == summary["kept_step"] < summary["steps"]
    report = evaluate(str(out), str(tiny["data"] / "train.jsonl"), samples=0, max_new_tokens=16)
    assert report["overall"]["greedy_accuracy"] == pytest.approx(summary["kept_accuracy"])


def test_pairs_format_and_bad_lines_go_through_the_dataset_errors(tiny, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "Compute: 1+1\\n", "response": "2 \\\\boxed{2}"}\n'
                     '{"prompt": "Compute: 2+1\\n", "response": ""}\n'
                     '{"prompt": "Compute: 3-1\\n", "response": "2 \\\\boxed{2}"}\n')
    common = ["--model", str(tiny["model"]), "--steps", "2", "--batch-size", "2", "--json"]
    assert sft_cli.main(["--data", str(pairs), "--out", str(tmp_path / "o1"), *common]) == 2
    assert f"{pairs}:2: field 'response': expected a non-empty string" in capsys.readouterr().err
    assert sft_cli.main(["--data", str(pairs), "--out", str(tmp_path / "o2"), "--on-error", "skip", *common]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["examples"] == 2 and summary["skipped_lines"] == 1 and summary["steps"] == 2

    records = tmp_path / "records.jsonl"
    lines = (tiny["data"] / "train.jsonl").read_text().splitlines()
    records.write_text("\n".join(lines[:3] + ['{"query_id": "x", "prompt": 5}'] + lines[3:]) + "\n")
    with pytest.raises(DatasetError, match=r"records.jsonl:4: field 'prompt'"):
        sft.run_sft(config(tiny, tmp_path / "o3", data=str(records)), lambda _: None)
    summary = sft.run_sft(config(tiny, tmp_path / "o4", data=str(records), on_error="skip", steps=1), lambda _: None)
    assert summary["skipped_lines"] == 1 and summary["examples"] == 14


def test_bad_settings_are_named(tiny, tmp_path, capsys):
    with pytest.raises(sft.SFTError, match="--until-plateau needs --eval-data"):
        sft.run_sft(config(tiny, tmp_path, until_plateau=True), lambda _: None)
    with pytest.raises(sft.SFTError, match="--eval-data and --eval-every go together"):
        sft.run_sft(config(tiny, tmp_path, eval_data="x.jsonl"), lambda _: None)
    with pytest.raises(sft.SFTError, match="no training examples"):
        sft.run_sft(config(tiny, tmp_path, levels=[2]), lambda _: None)
    assert sft_cli.main(["--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o"),
                     "--model", str(tiny["model"])]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err


def test_keep_last_stops_when_accuracy_stops_changing_and_keeps_the_final_weights(tiny, tmp_path):
    out = tmp_path / "last"
    cfg = config(tiny, out, steps=400, eval_data=str(tiny["data"] / "train.jsonl"), eval_every=15,
                 until_plateau=True, keep="last", patience=2, min_delta=0.02)
    summary = sft.run_sft(cfg, lambda _: None)
    accs = [e["accuracy"] for e in read_metrics(out) if e["kind"] == "eval"]
    assert summary["stop_reason"] == "plateau" and summary["steps"] < 400
    # The stop rule: the mean of the last two evaluations is within min_delta of the two before.
    assert abs(sum(accs[-2:]) / 2 - sum(accs[-4:-2]) / 2) <= 0.02
    state = torch.load(out / TRAINER_STATE, map_location="cpu", weights_only=False)
    assert state["step"] == summary["kept_step"] == summary["steps"]  # the final weights, not the best
    assert summary["kept_accuracy"] == accs[-1]
    with pytest.raises(sft.SFTError, match="--keep"):
        config(tiny, tmp_path / "x", keep="worst").check()


def test_max_seconds_stops_on_time_and_saves_the_weights(tiny, tmp_path):
    # Any step takes longer than a nanosecond: the budget is spent after the first step, whatever the machine.
    summary = sft.run_sft(config(tiny, tmp_path / "out", steps=50, max_seconds=1e-9), lambda _: None)
    assert summary["stop_reason"] == "time" and summary["steps"] == 1
    load_model(str(tmp_path / "out"))
    with pytest.raises(sft.SFTError, match="--max-seconds must be > 0"):
        sft.run_sft(config(tiny, tmp_path / "bad", max_seconds=0), lambda _: None)


# --- episodes' demonstrations: transcripts whose observations are never trained ---------------------

def agent_record(guess: bool = False):
    from actors.dataset import parse_record
    from launch.prepare import agent_task

    chain = agent_task.Chain(12, 34, (("+", 56),))
    transcript = (agent_task.guess_transcript(chain, random.Random(0)) if guess
                  else agent_task.tool_transcript(chain))
    return parse_record(agent_task.record(chain, "train", 0, transcript))


def test_transcripts_train_the_models_turns_and_never_the_observations():
    tokenizer = load_tokenizer(str(ARITH))
    [example] = examples_from_records([agent_record()], tokenizer)
    turns = ["[12*34]", "=408\n", "[408+56]", "=464\n", "\\boxed{464}"]
    want = [m for i, text in enumerate(turns) for m in [1 - i % 2] * len(tokenizer.encode(text))] + [1]
    assert example.response_mask == tuple(want) and example.trained_tokens == sum(want)
    assert list(example.response_ids) == [t for text in turns for t in tokenizer.encode(text)] + [tokenizer.eos_token_id]
    [batch] = pack_examples([example], 256)
    assert batch.fields["loss_mask"].tolist() == [0.0] * len(example.prompt_ids) + [float(m) for m in want]
    # The loss is the NLL of the model's tokens alone: observation tokens contribute nothing.
    model = TorchTrainEngine(model=load_or_init(str(ARITH), seed=0)[0])
    logprobs = model.compute_logprobs(batch).logprobs
    loss, _ = token_nll_loss(TokenLogProbs(logprobs), batch)
    trained = torch.tensor([0.0] * len(example.prompt_ids) + [float(m) for m in want]).bool()
    assert torch.allclose(loss, -logprobs[trained].sum()) and not torch.allclose(loss, -logprobs[len(example.prompt_ids):].sum())
    # A guess is a one-segment transcript: every response token trained, as a plain solution would be.
    [guess] = examples_from_records([agent_record(guess=True)], tokenizer)
    assert guess.response_mask == (1,) * len(guess.response_ids)


def test_examples_of_other_tasks_are_unchanged_by_transcripts():
    tokenizer = load_tokenizer(str(ARITH))
    from actors.dataset import parse_record
    rec = parse_record({"query_id": "q", "prompt": "Compute: 1+2\n", "solutions": ["3 \\boxed{3}"]})
    [example] = examples_from_records([rec], tokenizer)
    assert example.response_mask is None and example.trained_tokens == len(example.response_ids)
    assert example == make_example(tokenizer, "q", "Compute: 1+2\n", "3 \\boxed{3}")


@pytest.mark.parametrize("transcripts, cause", [
    ([], "transcripts must be a non-empty list"),
    ([[{"role": "env", "text": "=1\n"}]], "segment 0: role 'env', expected 'model'"),
    ([[{"role": "model", "text": "[1+1]"}, {"role": "env", "text": "=2\n"}]], "must end with a model segment"),
    ([[{"role": "model", "text": ""}]], "segment 0: text must be a non-empty string"),
    ([[{"role": "model", "text": "x", "extra": 1}]], "segment 0: expected"),
])
def test_malformed_transcripts_name_the_record_and_segment(transcripts, cause):
    from actors.dataset import parse_record
    rec = parse_record({"query_id": "bad-7", "prompt": "p\n", "answer": "1", "solutions": ["x"], "transcripts": transcripts})
    with pytest.raises(LMToolError, match=rf"bad-7: .*{re.escape(cause)}"):
        examples_from_records([rec], load_tokenizer(str(ARITH)))


def test_sft_on_agent_transcripts_evaluates_held_out_episodes(tiny, tmp_path):
    from launch.prepare import agent_task

    splits = agent_task.make_splits(seed=0, levels=[1], train_per_level=48, test_per_level=6, guess_fraction=0.0)
    write_jsonl(splits["train"], tmp_path / "data" / "train.jsonl")
    write_jsonl(splits["test"], tmp_path / "data" / "test.jsonl")
    cfg = config(tiny, tmp_path / "out", data=str(tmp_path / "data" / "train.jsonl"), steps=4,
                 eval_data=str(tmp_path / "data" / "test.jsonl"), eval_every=4, max_turns=2)
    summary = sft.run_sft(cfg, lambda _: None)
    assert summary["steps"] == 4 and summary["examples"] == 48
    [entry] = [m for m in read_metrics(tmp_path / "out") if m["kind"] == "eval"]
    assert "tool_calls" in entry and entry["n"] == 6   # answered by episodes of up to two turns
    train = [m for m in read_metrics(tmp_path / "out") if m["kind"] == "train"]
    # Only the model's tokens count as trained response tokens (L1: "[ab*cd]" 7 + "\boxed{...}" + eos).
    assert all(m["response_tokens"] < m["tokens"] - 48 for m in train)
