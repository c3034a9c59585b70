"""The small tokenizer and the shipped tiny model directory."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from launch.prepare import task
from tools import make_tokenizer

MODEL_DIR = Path(make_tokenizer.DEFAULT_OUT)


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def test_round_trips_every_dataset_string(shipped):
    splits = task.make_splits(seed=3, levels=range(1, 9), solved_levels=range(1, 9),
                                   train_per_level=300, test_per_level=30,
                                   max_operand=task.RECIPE_MAX_OPERAND, direct_fraction=0.5)
    texts = [t for recs in splits.values() for r in recs
             for t in (r["prompt"], r["answer"], *r.get("solutions", []))]
    for text in texts:
        assert shipped.decode(shipped.encode(text).ids, skip_special_tokens=False) == text


def test_digits_and_operators_are_single_tokens(shipped):
    enc = shipped.encode("Compute: 17-204+3\n")
    assert enc.tokens[1:-1] == ["1", "7", "-", "2", "0", "4", "+", "3"]
    # The fixed text is compressed, which keeps prompts and answers short.
    assert len(shipped.encode("9-5+3=4+3=7 \\boxed{7}").ids) == 14


def test_arbitrary_text_round_trips(shipped):
    for text in ["héllo wörld ∑ 🙂", "tabs\tand\nnewlines  ", "<|endoftext|> literal", ""]:
        ids = shipped.encode(text).ids
        assert shipped.decode(ids, skip_special_tokens=False) == text


def test_special_token_and_model_config_agree(shipped):
    config = json.loads((MODEL_DIR / "config.json").read_text())
    tok_config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    gen_config = json.loads((MODEL_DIR / "generation_config.json").read_text())
    eos = shipped.token_to_id(make_tokenizer.EOS_TOKEN)
    assert shipped.encode("<|endoftext|>").ids == [eos]
    assert config["vocab_size"] == shipped.get_vocab_size() and 200 <= config["vocab_size"] <= 600
    assert config["eos_token_id"] == config["pad_token_id"] == gen_config["eos_token_id"] == eos
    assert tok_config["eos_token"] == tok_config["pad_token"] == make_tokenizer.EOS_TOKEN
    assert config["model_type"] == "qwen2" and config["hidden_size"] % config["num_attention_heads"] == 0


def test_shipped_directory_is_what_the_tool_builds(tmp_path):
    # Regenerating must reproduce the committed files byte for byte (the tool is the source of truth).
    assert make_tokenizer.main(["--out", str(tmp_path)]) == 0
    for name in ("tokenizer.json", "config.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (MODEL_DIR / name).read_bytes(), name


def test_loads_in_transformers_with_a_few_million_parameters_or_less():
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(MODEL_DIR)
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    assert tok.decode(tok("Compute: 1+2\n")["input_ids"]) == "Compute: 1+2\n"
    assert tok.eos_token_id == config.eos_token_id
    h, inter, layers, vocab = (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                               config.vocab_size)
    kv = h // config.num_attention_heads * config.num_key_value_heads
    per_layer = h * (h + 2 * kv + h) + 3 * h * inter + 2 * h
    assert 0.3e6 < layers * per_layer + vocab * h < 5e6


def test_the_moe_model_directory_carries_the_same_tokenizer() -> None:
    # configs/models/arith-tiny-moe (topology/local_moe.yaml) shares the task and so the tokenizer of arith-tiny.
    root = Path(__file__).resolve().parent.parent / "configs" / "models"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (root / "arith-tiny-moe" / name).read_bytes() == (root / "arith-tiny" / name).read_bytes(), name
    config = json.loads((root / "arith-tiny-moe" / "config.json").read_text())
    dense = json.loads((root / "arith-tiny" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["vocab_size"] == dense["vocab_size"]
    # As many active MLP units per token as the dense default.
    assert config["num_experts_per_tok"] * config["moe_intermediate_size"] == dense["intermediate_size"]
