"""A decoder's shape, from the model's Hugging Face config.json (read by the embedded model's own reader,
`actors.engines.model.config_from_dict`) or a built-in table: Qwen2 dense, Qwen3 dense and Qwen3-MoE."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path


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
    head_size: int = 0             # config.json's head_dim; 0: hidden // heads (Qwen2)
    qkv_bias: bool = True          # Qwen2: biases on q/k/v; Qwen3: none
    qk_norm: bool = False          # Qwen3: an RMSNorm of head_dim on q and on k
    #: Mixture of experts (Qwen3-MoE): `experts` SwiGLU experts of width `moe_intermediate` in each of
    #: `sparse_layers` layers, `experts_per_token` of them per token, and a router (experts x hidden); 0: dense.
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    sparse_layers: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention output (hidden for Qwen2; Qwen3's heads x head_dim)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """One layer's attention: q/k/v and output projections, the biases (Qwen2) or q/k norms (Qwen3)."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        return h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def expert_params(self) -> int:
        """Every expert of every sparse layer: the parameters expert parallelism splits."""
        return self.sparse_layers * self.experts * 3 * self.hidden * self.moe_intermediate

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters: every layer's attention and two norms, the dense layers' MLPs, the sparse layers'
        routers and experts, the embedding table, the output table unless tied, the final norm."""
        h = self.hidden
        head = 0 if self.tied else self.embedding_params
        mlps = (self.layers - self.sparse_layers) * 3 * h * self.intermediate \
            + self.sparse_layers * self.experts * h + self.expert_params
        return self.layers * (self.attention_params + 2 * h) + mlps + self.embedding_params + head + h

    @property
    def active_params(self) -> int:
        """The parameters one token passes through: its experts_per_token experts of each sparse layer instead
        of all of them (the FLOPs per token are twice this); `params` for a dense model."""
        return self.params - self.expert_params + \
            self.sparse_layers * self.experts_per_token * 3 * self.hidden * self.moe_intermediate

    @property
    def dense_params(self) -> int:
        """What is not an expert: replicated over expert-parallel ranks, reduced over all data-parallel ones."""
        return self.params - self.expert_params

    @property
    def layer_params(self) -> float:
        """One layer's parameters, on average over the layers (experts included)."""
        head = 0 if self.tied else self.embedding_params
        return (self.params - self.embedding_params - head - self.hidden) / self.layers

    def experts_read(self, tokens: int) -> float:
        """Expected distinct experts a batch of `tokens` tokens touches in one sparse layer, each token routing
        to experts_per_token of them uniformly: experts x (1 - (1 - k / experts)^tokens). A decode step reads
        these experts' weights, not all of them."""
        if not self.experts:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens)

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
    # Qwen/Qwen3-30B-A3B's config.json (model_type qwen3_moe): 48 layers, hidden 2048, 32 heads of head_dim 128
    # (q width 4096), 4 KV heads, no q/k/v bias, q/k norms, 128 experts of moe_intermediate_size 768 in every
    # layer (decoder_sparse_step 1, mlp_only_layers []), 8 per token, vocabulary 151936, untied output table,
    # max_position_embeddings 40960. Its model card: 30.5B parameters, 3.3B activated (`tests/test_plan.py`).
    "30B-A3B": ModelShape("Qwen3-30B-A3B", 48, 2048, 6144, 32, 4, 151936, False, "Qwen/Qwen3-30B-A3B config.json",
                          context_len=40960, head_size=128, qkv_bias=False, qk_norm=True, experts=128,
                          experts_per_token=8, moe_intermediate=768, sparse_layers=48),
}


def builtin_size(shape: ModelShape) -> str | None:
    """The built-in size ("1.5B", "7B", "32B", "30B-A3B") whose architecture `shape` has (a shape read from a config.json
    counts too; its name and source are not compared), or None for any other model."""
    arch = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "head_dim", "experts",
            "experts_per_token", "moe_intermediate", "sparse_layers")
    for size, known in BUILTIN.items():
        if all(getattr(shape, f) == getattr(known, f) for f in arch):
            return size
    return None


class ShapeError(ValueError):
    """The model's shape cannot be found; the message names the key or file."""


def from_hf_config(path: str | Path) -> ModelShape:
    """The shape a Hugging Face config.json of a family the embedded model reads (qwen2, qwen3, qwen3_moe)
    describes; another family, or a bad key, is a ShapeError with the reader's message."""
    from actors.engines.model import ConfigError, config_from_json_file   # loads torch: only when a file is read
    path = Path(path)
    try:
        cfg = config_from_json_file(str(path))
    except ConfigError as exc:
        raise ShapeError(str(exc)) from exc
    sparse = len(cfg.sparse_layers)
    moe = {"experts": cfg.num_experts, "experts_per_token": cfg.num_experts_per_tok,
           "moe_intermediate": cfg.moe_intermediate_size, "sparse_layers": sparse} if sparse else {}
    return ModelShape(name=path.parent.name, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                      intermediate=cfg.intermediate_size, heads=cfg.num_attention_heads,
                      kv_heads=cfg.num_key_value_heads, vocab=cfg.vocab_size, tied=bool(cfg.tie_word_embeddings),
                      source=str(path), context_len=int(cfg.max_position_embeddings or 131072),
                      head_size=cfg.head_dim, qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, **moe)


def resolve(model_path: str | None, root: str | Path = ".") -> ModelShape:
    """`model.path`'s config.json when it is readable here; else the built-in shape its name gives
    ("...-7B" -> 7B, "...-30B-A3B" -> 30B-A3B); else an error naming `model.path`."""
    if not model_path:
        raise ShapeError("experiment.model.path: not set, so the model's shape is unknown")
    config = Path(root, model_path, "config.json") if not Path(model_path).is_absolute() \
        else Path(model_path, "config.json")
    if config.is_file():
        return from_hf_config(config)
    size = re.search(r"(\d+(?:\.\d+)?)[bB](?:-[aA](\d+(?:\.\d+)?)[bB])?(?![a-zA-Z])", Path(model_path).name)
    name = size and f"{size.group(1)}B" + (f"-A{size.group(2)}B" if size.group(2) else "")
    if name and name in BUILTIN:
        return BUILTIN[name]
    raise ShapeError(f"experiment.model.path: {model_path!r} has no config.json here and its name gives none of "
                     f"the built-in sizes ({', '.join(BUILTIN)})")
