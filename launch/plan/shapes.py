"""A decoder's shape, from the model's Hugging Face config.json or a built-in table of Qwen2.5 shapes."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    source: str
    context_len: int = 131072      # max_position_embeddings: SGLang sizes its request pool with it

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One Qwen2 layer: q/k/v projections with biases, output projection, SwiGLU MLP, two RMSNorms."""
        h, kv, f = self.hidden, self.kv_dim, self.intermediate
        return h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * f + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.embedding_params
        return self.layers * self.layer_params + self.embedding_params + head + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_dim * dtype_bytes


# The distilled reasoning models AReaL trains (DeepSeek-R1-Distill-Qwen-*), as their Hugging Face
# config.json files give them; their bases are Qwen2.5-Math-1.5B, Qwen2.5-Math-7B and Qwen2.5-32B (layers,
# heads and KV heads also in the Qwen2.5 technical report, arXiv:2412.15115, Table 1). The distilled 1.5B
# does not tie its embeddings (1.78B parameters on its model card), unlike Qwen2.5-1.5B. All three have
# max_position_embeddings 131072 (the default `context_len`).
BUILTIN: dict[str, ModelShape] = {
    "1.5B": ModelShape("Qwen2-1.5B (R1-Distill)", 28, 1536, 8960, 12, 2, 151936, False,
                       "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B config.json"),
    "7B": ModelShape("Qwen2-7B (R1-Distill)", 28, 3584, 18944, 28, 4, 152064, False,
                     "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B config.json"),
    "32B": ModelShape("Qwen2-32B (R1-Distill)", 64, 5120, 27648, 40, 8, 152064, False,
                      "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B config.json"),
}


def builtin_size(shape: ModelShape) -> str | None:
    """The built-in size ("1.5B", "7B", "32B") whose architecture `shape` has (a shape read from a config.json
    counts too; its name and source are not compared), or None for any other model."""
    arch = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")
    for size, known in BUILTIN.items():
        if all(getattr(shape, f) == getattr(known, f) for f in arch):
            return size
    return None


class ShapeError(ValueError):
    """The model's shape cannot be found; the message names the key or file."""


def from_hf_config(path: str | Path) -> ModelShape:
    """The shape a Hugging Face Qwen2/Llama-style config.json describes."""
    path = Path(path)
    try:
        cfg: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShapeError(f"{path}: cannot read a Hugging Face config ({exc})") from exc
    missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                           "vocab_size") if k not in cfg]
    if missing:
        raise ShapeError(f"{path}: missing {', '.join(missing)}")
    return ModelShape(name=path.parent.name, layers=int(cfg["num_hidden_layers"]), hidden=int(cfg["hidden_size"]),
                      intermediate=int(cfg["intermediate_size"]), heads=int(cfg["num_attention_heads"]),
                      kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
                      vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
                      source=str(path), context_len=int(cfg.get("max_position_embeddings") or 131072))


def resolve(model_path: str | None, root: str | Path = ".") -> ModelShape:
    """`model.path`'s config.json when it is readable here; else the built-in shape its name gives
    ("...-7B" -> 7B); else an error naming `model.path`."""
    if not model_path:
        raise ShapeError("experiment.model.path: not set, so the model's shape is unknown")
    config = Path(root, model_path, "config.json") if not Path(model_path).is_absolute() \
        else Path(model_path, "config.json")
    if config.is_file():
        return from_hf_config(config)
    size = re.search(r"(\d+(?:\.\d+)?)[bB](?![a-zA-Z])", Path(model_path).name)
    if size and f"{size.group(1)}B" in BUILTIN:
        return BUILTIN[f"{size.group(1)}B"]
    raise ShapeError(f"experiment.model.path: {model_path!r} has no config.json here and its name gives none of "
                     f"the built-in sizes ({', '.join(BUILTIN)})")
