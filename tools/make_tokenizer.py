"""Builds the small tokenizer and the shipped tiny Qwen2 model directory (no weights).

The tokenizer is a byte-level BPE from the `tokenizers` library, so any string round-trips (all 256
bytes are in the alphabet), trained on the arithmetic task's text with a small vocabulary. Every digit
and arithmetic operator is split off on its own before BPE runs, so numbers are always one token per
digit: a tiny model then
learns digit-wise arithmetic instead of memorising multi-digit tokens. The few merges it learns are
the task's fixed text (``Compute: ``, `` \\boxed{``).

The model directory is what `actors/engines` load a fresh model from, in Hugging Face layout:
``config.json`` (Qwen2), ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``.
The model dimensions are the ones the task research settled on (docs/task.md).

    python -m tools.make_tokenizer                      # rewrites configs/models/arith-tiny/
    python -m tools.make_tokenizer --out /tmp/m --hidden-size 128 --layers 2
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from actors.rollout.chat import EMBEDDED_CHAT_TEMPLATE
from launch.prepare import task

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN,)
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "configs" / "models" / "arith-tiny"
DEFAULT_VOCAB_SIZE = 320

# The tiny model the task research settled on (docs/task.md): 1.09M parameters with the 272-token vocabulary.
DEFAULT_DIMS = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}


def corpus(seed: int = 0) -> Iterator[str]:
    """The task's text: every prompt and worked solution of a default-sized split."""
    splits = task.make_splits(seed=seed, levels=range(1, 9), solved_levels=range(1, 9),
                                   train_per_level=500, test_per_level=0)
    for rec in splits["train"]:
        yield rec["prompt"]
        yield from rec.get("solutions", [])


def build_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Digits and arithmetic operators isolated first (so a sign never fuses with "=" or a number);
    # byte-level mapping without its own regex so BPE may merge across the fixed text's spaces.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}|[-+*/=()]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def model_config(vocab_size: int, eos_id: int, dims: dict[str, int]) -> dict:
    """A Hugging Face Qwen2 config.json for the tiny model."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        **dims,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": dims["num_hidden_layers"],
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "float32",
    }


def write_model_dir(out: Path, tok: Tokenizer, dims: dict[str, int], max_new_tokens: int = 96) -> None:
    out.mkdir(parents=True, exist_ok=True)
    eos_id = tok.token_to_id(EOS_TOKEN)
    tok.save(str(out / "tokenizer.json"))
    files = {
        "config.json": model_config(tok.get_vocab_size(), eos_id, dims),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "bos_token": None,
            "model_max_length": dims["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "padding_side": "left",
            "chat_template": EMBEDDED_CHAT_TEMPLATE,
        },
        "generation_config.json": {
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
            "do_sample": False,
            "max_new_tokens": max_new_tokens,
        },
    }
    for name, obj in files.items():
        (out / name).write_text(json.dumps(obj, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.make_tokenizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    ap.add_argument("--seed", type=int, default=0)
    for key, value in DEFAULT_DIMS.items():
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=value, dest=key)
    args = ap.parse_args(argv)
    tok = build_tokenizer(corpus(args.seed), args.vocab_size)
    dims = {key: getattr(args, key) for key in DEFAULT_DIMS}
    if dims["hidden_size"] % dims["num_attention_heads"]:
        print("make_tokenizer: hidden_size must be a multiple of num_attention_heads", file=sys.stderr)
        return 2
    write_model_dir(args.out, tok, dims)
    print(f"wrote {args.out} (vocab {tok.get_vocab_size()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
