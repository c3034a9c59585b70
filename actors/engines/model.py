"""The Qwen2, Qwen3 and Qwen3-MoE causal language models in plain torch, in one readable file.

The three families share one decoder: Qwen3 adds an RMSNorm over each head's queries and keys and drops the
q/k/v biases; Qwen3-MoE replaces the MLP of its sparse layers by a routed mixture of experts (moe.py).
`config_from_dict` reads a Hugging Face `config.json` and picks the family by its `model_type`. Parameter
names are exactly those of the Hugging Face checkpoints (`model.layers.0.self_attn.q_proj.weight`,
`model.layers.0.mlp.experts.3.gate_proj.weight`, ...), so a local copy of a real Qwen2/Qwen2.5/DeepSeek-R1-
Distill-Qwen/Qwen3/Qwen3-MoE model loads unchanged, and what we save loads in `transformers`. The numerics
follow `transformers` step by step (float32 RMSNorm, rotary tables in float32, logits in float32) so logits
match to float32 precision (tests/test_model_qwen2.py, tests/test_model_qwen3.py).

Four attention modes share one code path (`AttnContext.kind`):
  "causal"   [B, T] batch, each row from position 0, right padding allowed (pads are never attended
             by real tokens because attention is causal)
  "packed"   [1, N] stream of several sequences (cu_seqlens); attention never crosses a boundary
  "prefill"  like "causal", and the keys/values are written into rows of a `KVCache`
  "decode"   [B, 1] one new token per cache row at position lens[b]; attends to cache[: lens[b] + 1]
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from .moe import MLP, RoutingTrace, SparseMoeBlock


class ConfigError(ValueError):
    """A config.json is missing a key or has a bad value; the message names the key and the file."""


@dataclasses.dataclass
class Qwen2Config:
    """A Qwen2 config.json; the base of the other families' configs (each adds its keys and overrides
    the properties below that say how its layers differ)."""

    MODEL_TYPE: ClassVar[str] = "qwen2"
    ARCHITECTURE: ClassVar[str] = "Qwen2ForCausalLM"
    DEFAULT_HEAD_DIM: ClassVar[int] = 0   # when config.json has none; 0: hidden_size // num_attention_heads
    ALIASES: ClassVar[dict[str, str]] = {}  # another name a config.json may give a key -> the key

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: hidden_size // num_attention_heads, as in Hugging Face
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"
    # Keys of config.json we do not interpret, kept so a saved config round-trips.
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> Qwen2Config:
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        for alias, key in cls.ALIASES.items():
            if alias in raw:
                if key in raw and raw[key] != raw[alias]:
                    raise ConfigError(f"{source}: keys {key!r} ({raw[key]!r}) and {alias!r} ({raw[alias]!r}) disagree")
                raw = {**{k: v for k, v in raw.items() if k != alias}, key: raw[alias]}
        for key in cls.REQUIRED:
            if key not in raw:
                raise ConfigError(f"{source}: missing key {key!r}")
        model_type = raw.get("model_type", cls.MODEL_TYPE)
        if model_type != cls.MODEL_TYPE:
            raise ConfigError(f"{source}: key 'model_type' is {model_type!r}; this reader takes only "
                              f"{cls.MODEL_TYPE!r} (config_from_dict takes {', '.join(map(repr, FAMILIES))})")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: key 'hidden_act' is {raw['hidden_act']!r}; only 'silu' is supported")
        if raw.get("use_sliding_window", False):
            raise ConfigError(f"{source}: key 'use_sliding_window' is true; sliding-window attention is not supported")
        rope_theta = raw.get("rope_theta")
        rope_parameters = raw.get("rope_parameters") or {}
        if rope_theta is None:  # transformers >= 5 writes rope_parameters instead of rope_theta
            rope_theta = rope_parameters.get("rope_theta", 10000.0)
        for rope_key in ("rope_scaling", "rope_parameters"):
            rope = raw.get(rope_key) or {}
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind != "default":
                raise ConfigError(f"{source}: key {rope_key!r} has rope_type {kind!r}; only 'default' is supported")
        fields = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values: dict[str, Any] = {k: raw[k] for k in fields if k in raw and raw[k] is not None}
        values["rope_theta"] = float(rope_theta)
        values.setdefault("num_key_value_heads", raw["num_attention_heads"])
        values["head_dim"] = int(raw.get("head_dim") or cls.DEFAULT_HEAD_DIM)
        if "torch_dtype" not in raw and isinstance(raw.get("dtype"), str):
            values["torch_dtype"] = raw["dtype"]
        for key in cls.REQUIRED + ("num_key_value_heads", "max_position_embeddings"):
            value = values.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"{source}: key {key!r} must be a positive integer, got {value!r}")
        if values["num_attention_heads"] % values["num_key_value_heads"]:
            raise ConfigError(f"{source}: key 'num_key_value_heads' ({values['num_key_value_heads']}) must divide "
                              f"num_attention_heads ({values['num_attention_heads']})")
        if not values.get("head_dim") and values["hidden_size"] % values["num_attention_heads"]:
            raise ConfigError(f"{source}: key 'hidden_size' must be divisible by num_attention_heads")
        known = fields | {"rope_parameters", "rope_scaling", "dtype"}
        values["extra"] = {k: v for k, v in raw.items() if k not in known}
        config = cls(**values)
        config.check(source)
        return config

    def check(self, source: str) -> None:
        """The family's own rules on its keys (the shared ones are checked by from_dict)."""

    @classmethod
    def from_json_file(cls, path: str) -> Qwen2Config:
        return cls.from_dict(_read_config_json(path), source=path)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.extra)
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        out.update(architectures=[self.ARCHITECTURE], model_type=self.MODEL_TYPE, use_sliding_window=False,
                   rope_scaling=None)
        return out

    # How the family's layers differ from Qwen2's.
    @property
    def qkv_bias(self) -> bool:
        return True

    @property
    def qk_norm(self) -> bool:
        return False

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` routes its tokens to experts instead of one MLP."""
        return False

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_sparse_layer(i)]

    def num_parameters(self, active: bool = False) -> int:
        """All parameters, or (``active``) those one token passes through: its top-k experts of each
        sparse layer."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        total = 0
        for i in range(self.num_hidden_layers):
            total += attn + 2 * h + self._mlp_parameters(i, active)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + embed + h

    def _mlp_parameters(self, layer_idx: int, active: bool) -> int:
        return 3 * self.hidden_size * self.intermediate_size


@dataclasses.dataclass
class Qwen3Config(Qwen2Config):
    """Qwen3: q/k RMSNorm per head, no q/k/v bias, head_dim its own key (transformers' Qwen3Config)."""

    MODEL_TYPE: ClassVar[str] = "qwen3"
    ARCHITECTURE: ClassVar[str] = "Qwen3ForCausalLM"
    DEFAULT_HEAD_DIM: ClassVar[int] = 128   # transformers' Qwen3Config default

    attention_bias: bool = False

    def check(self, source: str) -> None:
        if self.attention_bias:
            raise ConfigError(f"{source}: key 'attention_bias' is true; only false (Qwen3's released models) is supported")

    @property
    def qkv_bias(self) -> bool:
        return False

    @property
    def qk_norm(self) -> bool:
        return True


@dataclasses.dataclass
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE: layer i is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    (transformers' Qwen3MoeDecoderLayer); its tokens go to num_experts_per_tok of num_experts experts."""

    MODEL_TYPE: ClassVar[str] = "qwen3_moe"
    ARCHITECTURE: ClassVar[str] = "Qwen3MoeForCausalLM"
    DEFAULT_HEAD_DIM: ClassVar[int] = 0   # Qwen3MoeAttention: getattr(config, "head_dim", hidden // heads)
    # transformers >= 5 writes num_local_experts (Qwen3MoeConfig.attribute_map); released checkpoints num_experts
    ALIASES: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)
    router_aux_loss_coef: float = 0.001

    def check(self, source: str) -> None:
        super().check(source)
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{source}: key {key!r} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"{source}: key 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds "
                              f"num_experts ({self.num_experts})")
        if not isinstance(self.mlp_only_layers, list) or not all(isinstance(i, int) for i in self.mlp_only_layers):
            raise ConfigError(f"{source}: key 'mlp_only_layers' must be a list of layer indices, "
                              f"got {self.mlp_only_layers!r}")

    def is_sparse_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    def _mlp_parameters(self, layer_idx: int, active: bool) -> int:
        if not self.is_sparse_layer(layer_idx):
            return super()._mlp_parameters(layer_idx, active)
        experts = self.num_experts_per_tok if active else self.num_experts
        return experts * 3 * self.hidden_size * self.moe_intermediate_size + self.num_experts * self.hidden_size


# model_type -> its config class: the families this model implements.
FAMILIES: dict[str, type[Qwen2Config]] = {c.MODEL_TYPE: c for c in (Qwen2Config, Qwen3Config, Qwen3MoeConfig)}


def config_from_dict(raw: dict[str, Any], source: str = "config") -> Qwen2Config:
    """The config of the family ``raw['model_type']`` names (qwen2 when absent)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type", "qwen2")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        architectures = raw.get("architectures") or []
        found = f"{model_type!r}" + (f" ({', '.join(map(str, architectures))})" if architectures else "")
        raise ConfigError(f"{source}: key 'model_type' is {found}; supported: "
                          f"{', '.join(f'{t} ({c.ARCHITECTURE})' for t, c in FAMILIES.items())}")
    return family.from_dict(raw, source)


def config_from_json_file(path: str) -> Qwen2Config:
    """``config_from_dict`` of a config.json file."""
    return config_from_dict(_read_config_json(path), source=path)


CONFIG_FILE = "config.json"


def load_config(model_dir: str) -> Qwen2Config:
    """The config of whichever supported family the directory's config.json names."""
    return config_from_json_file(os.path.join(model_dir, CONFIG_FILE))


def _read_config_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (a model directory needs config.json)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the scale, exactly as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryTable(nn.Module):
    """cos/sin rows per position, computed in float32 like transformers and cached as they grow.

    Not a buffer: casting the model to bfloat16 must not round the frequencies.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self._cos = self._sin = torch.empty(0)

    def _grow(self, length: int, device: torch.device) -> None:
        length = max(length, 2 * self._cos.shape[0], 256)
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        freqs = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype, length: int | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``length``: a bound the caller knows (every position is below it). Given, the rows needed are not
        read back from the device: a read-back is a host sync, which a CUDA graph's capture refuses."""
        if length is not None:
            needed = length
        else:
            needed = int(position_ids.max()) + 1 if position_ids.numel() else 1
        if needed > self._cos.shape[0] or self._cos.device != position_ids.device:
            self._grow(needed, position_ids.device)
        return self._cos[position_ids].to(dtype), self._sin[position_ids].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Keys and values of many sequences: one row per sequence, padded to a shared capacity.

    k/v: [layers, rows, kv_heads, capacity, head_dim]. Row r holds positions 0..len_r-1 contiguously;
    the generation engine keeps live rows compacted at the front so a decode step reads a view.
    """

    def __init__(self, config: Qwen2Config, rows: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        shape = (config.num_hidden_layers, rows, config.num_key_value_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, rows: int, capacity: int) -> None:
        """Grow (doubling) so that `rows` rows of `capacity` positions fit; contents are kept."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        new_rows = max(rows, self.rows if rows <= self.rows else 2 * self.rows)
        new_cap = max(capacity, self.capacity if capacity <= self.capacity else 2 * self.capacity)
        shape = (self.k.shape[0], new_rows, self.k.shape[2], new_cap, self.k.shape[4])
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.zeros(shape, dtype=self.dtype, device=self.device)
            new[:, :old.shape[1], :, :old.shape[3]] = old
            setattr(self, name, new)

    def copy_row(self, src: int, dst: int, length: int) -> None:
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


@dataclasses.dataclass
class AttnContext:
    kind: Literal["causal", "packed", "prefill", "decode"]
    cu_seqlens: list[int] | None = None      # packed
    packed_mask: torch.Tensor | None = None  # packed with the block-diagonal mask: [N, N] bool
    cache: KVCache | None = None             # prefill / decode
    row_start: int = 0                       # prefill: first cache row written
    lens: torch.Tensor | None = None         # decode: [B] position of the new token per row
    decode_mask: torch.Tensor | None = None  # decode: [B, 1, 1, T] bool, True = attend
    decode_span: int = 0                     # decode: cache positions read (max(lens) + 1)
    routing: RoutingTrace | None = None      # sparse layers: record and/or replay their expert choices


PackedAttn = Literal["mask", "loop"]


def block_diagonal_mask(cu_seqlens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[N, N] bool, True where query i may attend key j: same sequence and j <= i."""
    n = cu_seqlens[-1]
    seq_id = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=device),
                                     torch.tensor(cu_seqlens, device=device).diff())
    idx = torch.arange(n, device=device)
    return (seq_id[:, None] == seq_id[None, :]) & (idx[None, :] <= idx[:, None])


# cuDNN's fused attention builds an execution plan for every new shape: about 3 ms of CPU per call on an
# H100, which was 70% of a decode step's time (docs/gpu.md). Decoding and per-sequence packed
# training present a new shape almost every call, so it is left out; the other backends keep torch's order.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# What torch.nn.attention.sdpa_kernel switches on and off (process-wide flags, consulted on CPU and CUDA alike).
_SDPA_ENABLED = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
                 SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
                 SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
                 SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled}


def enabled_backends(backends: Sequence[SDPBackend]) -> list[SDPBackend]:
    """``backends`` less those switched off where the call is made (an enclosing ``sdpa_kernel``): a
    restriction of ours narrows what the caller allowed and never widens it."""
    return [b for b in backends if _SDPA_ENABLED.get(b, lambda: True)()]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
         backends: Sequence[SDPBackend] | None = None) -> torch.Tensor:
    """`F.scaled_dot_product_attention` restricted to ``backends`` (default SDPA_BACKENDS) among those enabled
    where it is called (both train engines and decoding use it)."""
    allowed = enabled_backends(SDPA_BACKENDS if backends is None else backends)
    if not allowed:
        raise RuntimeError(f"scaled_dot_product_attention: none of {[b.name for b in backends or SDPA_BACKENDS]} "
                           "is enabled here (an enclosing torch.nn.attention.sdpa_kernel switched them off)")
    with sdpa_kernel(allowed):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)


class Attention(nn.Module):
    def __init__(self, config: Qwen2Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        if config.qk_norm:  # Qwen3: each head's query and key normalised before the rotation
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        gqa = self.num_heads != self.num_kv_heads
        if ctx.kind == "decode":
            out = self._decode(q, k, v, ctx)
        elif ctx.kind == "packed" and ctx.packed_mask is None:
            # One causal attention per sequence: no N x N mask, no wasted cross-sequence work.
            cu = ctx.cu_seqlens
            out = torch.cat([
                sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=gqa)
                for s, e in zip(cu[:-1], cu[1:])], dim=2)
        elif ctx.kind == "packed":
            out = sdpa(q, k, v, attn_mask=ctx.packed_mask, enable_gqa=gqa)
        else:
            if ctx.kind == "prefill":
                rows = slice(ctx.row_start, ctx.row_start + b)
                ctx.cache.k[self.layer_idx, rows, :, :t] = k
                ctx.cache.v[self.layer_idx, rows, :, :t] = v
            out = sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        b = q.shape[0]
        cache, lens = ctx.cache, ctx.lens
        rows = torch.arange(b, device=q.device)
        cache.k[self.layer_idx, rows, :, lens] = k[:, :, 0]
        cache.v[self.layer_idx, rows, :, lens] = v[:, :, 0]
        keys = cache.k[self.layer_idx, :b, :, :ctx.decode_span]
        values = cache.v[self.layer_idx, :b, :, :ctx.decode_span]
        # Grouped-query trick: the query heads sharing one kv head become that head's "query positions",
        # so keys/values are read once instead of being repeated per query head.
        group = self.num_heads // self.num_kv_heads
        qg = q.view(b, self.num_kv_heads, group, self.head_dim)
        out = sdpa(qg, keys, values, attn_mask=ctx.decode_mask)
        return out.reshape(b, self.num_heads, 1, self.head_dim)


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen2Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.sparse = config.is_sparse_layer(layer_idx)
        if self.sparse:
            self.mlp = SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                      config.num_experts_per_tok, config.norm_topk_prob)
            self.sparse_index = config.sparse_layers.index(layer_idx)  # its slot in a RoutingTrace
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, ctx.routing, self.sparse_index) if self.sparse else self.mlp(h))


class Qwen2Backbone(nn.Module):
    """Named `model` inside Qwen2ForCausalLM, as in Hugging Face checkpoints."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryTable(config.head_dim, config.rope_theta)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # A decode step's positions are below its span, known on the host: no read-back, so it can be captured.
        cos, sin = self.rotary(position_ids, x.dtype, ctx.decode_span if ctx.kind == "decode" else None)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)


class _SkipMetaInitialisers(TorchFunctionMode):
    """torch.nn.init's functions on a meta tensor do nothing but return it. They have nothing to fill there, and
    the first one would make torch import torch._dynamo and sympy for its meta kernels (about 800 modules, 2 s
    of CPU): the cost of every shape check and model load that builds on the meta device first. A function
    mode is per thread, so a model built on another thread meanwhile is initialised as usual."""

    INITIALISERS = frozenset(getattr(nn.init, name) for name in dir(nn.init)
                             if name.endswith("_") and not name.startswith("_"))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.INITIALISERS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


class Qwen2ForCausalLM(nn.Module):
    """The causal LM of every family in FAMILIES: Qwen3 and Qwen3-MoE are Qwen2's decoder with the
    differences their configs name (Attention, DecoderLayer)."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen2Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def on_meta(cls, config: Qwen2Config) -> Qwen2ForCausalLM:
        """The model with its parameters on the meta device: names and shapes, no storage, no initialisation."""
        with torch.device("meta"), _SkipMetaInitialisers():
            return cls(config)

    def materialise(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
        """Give a model built on_meta storage to load into: uninitialised tensors of ``dtype`` (floating ones;
        others keep theirs) on ``device``, tied weights still tied. Module.to_empty would do it through torch's
        Python meta kernels, whose first use imports sympy (486 modules, 0.45 s of CPU in each process)."""
        made: dict[int, nn.Parameter] = {}   # by the meta parameter: a tied one is made once
        for module in self.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if id(p) not in made:
                    kind = dtype if p.is_floating_point() else p.dtype
                    made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=kind, device=device),
                                               requires_grad=p.requires_grad)
                module.register_parameter(name, made[id(p)])
        return self

    def init_weights(self, seed: int = 0) -> Qwen2ForCausalLM:
        """Random initialisation like transformers' (normal(0, initializer_range), zero biases)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * self.config.initializer_range)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    # --- whole sequences -------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: list[int] | torch.Tensor | None = None, packed_attn: PackedAttn = "loop",
                routing: RoutingTrace | None = None) -> torch.Tensor:
        """float32 logits. input_ids [B, T] (causal, right padding allowed) or [N] packed with cu_seqlens."""
        return self.logits(self.hidden_states(input_ids, position_ids, cu_seqlens, packed_attn, routing))

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      cu_seqlens: list[int] | torch.Tensor | None = None, packed_attn: PackedAttn = "loop",
                      routing: RoutingTrace | None = None) -> torch.Tensor:
        """Final-norm hidden states, [B, T, H] or [N, H] when packed. ``routing``: what the sparse layers
        record and replay (token rows in the order of input_ids)."""
        if cu_seqlens is None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            return self.model(input_ids, position_ids, AttnContext("causal", routing=routing))
        cu = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        if position_ids is None:
            position_ids = torch.cat([torch.arange(e - s, device=input_ids.device) for s, e in zip(cu[:-1], cu[1:])])
        mask = block_diagonal_mask(cu, input_ids.device) if packed_attn == "mask" else None
        ctx = AttnContext("packed", cu_seqlens=cu, packed_mask=mask, routing=routing)
        return self.model(input_ids[None], position_ids[None], ctx)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # --- generation with a KV cache ---------------------------------------------------------------
    def new_cache(self, rows: int, capacity: int) -> KVCache:
        return KVCache(self.config, rows, capacity, self.dtype, self.device)

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache, row_start: int = 0,
                routing: RoutingTrace | None = None) -> torch.Tensor:
        """Run right-padded prompts [B, T] from position 0, write their keys/values into cache rows
        row_start.., and return float32 logits [B, V] of each row's last real token (lengths[b] - 1)."""
        b, t = input_ids.shape
        cache.reserve(row_start + b, t)
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        ctx = AttnContext("prefill", cache=cache, row_start=row_start, routing=routing)
        hidden = self.model(input_ids, positions, ctx)
        last = hidden[torch.arange(b, device=hidden.device), lengths.to(hidden.device) - 1]
        return self.logits(last)

    def decode(self, tokens: torch.Tensor, lens: torch.Tensor, cache: KVCache, span: int | None = None,
               routing: RoutingTrace | None = None) -> torch.Tensor:
        """One step for cache rows 0..B-1: tokens [B] sit at positions lens [B]; returns logits [B, V].
        ``span``: cache positions to read (at least max(lens) + 1; the cache must hold them), given when the
        step is captured in a CUDA graph, which cannot read max(lens) back to the host."""
        if span is None:
            span = int(lens.max()) + 1
            cache.reserve(tokens.shape[0], span)
        mask = (torch.arange(span, device=tokens.device)[None, :] <= lens[:, None])[:, None, None, :]
        ctx = AttnContext("decode", cache=cache, lens=lens, decode_mask=mask, decode_span=span, routing=routing)
        hidden = self.model(tokens[:, None], lens[:, None], ctx)
        return self.logits(hidden[:, 0])


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / T)[token] (and the entropy of that distribution), in float32.

    The one definition both engines use: rollout behaviour log-probs and trainer log-probs must agree.
    """
    scaled = logits.float()
    if temperature not in (0.0, 1.0):
        scaled = scaled / temperature
    logz = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logz
    entropy = None
    if with_entropy:
        probs = torch.softmax(scaled, dim=-1)
        entropy = logz - (probs * scaled).sum(-1)
    return logp, entropy


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def dtype_from_name(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if name not in table:
        raise ConfigError(f"unknown dtype {name!r}; use one of {sorted(table)}")
    return table[name]

