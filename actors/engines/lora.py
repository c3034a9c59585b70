"""LoRA: low-rank adapters on the linear layers of our models, trained with the base frozen.

A targeted ``nn.Linear`` of ``model.py``/``moe.py`` becomes a :class:`LoraLinear`: the same frozen ``weight``
and ``bias`` (so every base parameter keeps its Hugging Face name) plus two small trainable layers,
``lora_A`` (in -> rank) and ``lora_B`` (rank -> out), and ``y = x W^T + b + (alpha / rank) * B(A(dropout(x)))``.
B starts at zero, so the adapted model starts equal to its base (Hu et al., 2021; PEFT's LoraLayer does
the same). Targets are named as Hugging Face and PEFT name them: a module is targeted when its name is one
of ``target_modules`` or ends with ``.`` + one of them (``q_proj`` targets ``model.layers.3.self_attn.q_proj``).

An adapter's tensors travel and are stored under the module's name plus ``.lora_A.weight`` /
``.lora_B.weight``; on disk they follow PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``,
keys prefixed ``base_model.model.``), so ``peft.PeftModel.from_pretrained`` loads what we write. Beside them
``lora_base.json`` names the base model and a fingerprint of its config, so an adapter is never applied to
another base model. A trainer checkpoint of a LoRA run is such a directory (plus the trainer's state and the
base's config and tokenizer): it holds no base weights, which stay at ``model.path``.

The rollouts merge each adapter into their base weights (:func:`merged_weights`), from a kept copy of the base,
so a new adapter replaces the previous one instead of adding to it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .model import CONFIG_FILE, Qwen2Config, Qwen2ForCausalLM, load_config

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LORA_BASE = "lora_base.json"
PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class LoraError(ValueError):
    """A LoRA setting or adapter does not fit the model; the message names the key, layer or file."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_settings(cls, section: Any) -> LoraSpec | None:
        """The spec of a ``model.lora`` section (topology.experiment.LoraSection), None when unset."""
        if section is None:
            return None
        return cls(section.rank, section.alpha, section.dropout, tuple(section.target_modules))


def is_adapter_name(name: str) -> bool:
    return name.endswith(LORA_SUFFIXES)


def module_of(adapter_name: str) -> str:
    """``model.layers.0.self_attn.q_proj`` of ``model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return adapter_name.rsplit(".", 2)[0]


def _targeted(name: str, targets: Iterable[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def target_linears(model: nn.Module, spec: LoraSpec) -> list[tuple[str, nn.Linear]]:
    """The linear layers ``spec.target_modules`` names, in module order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, _LoraPart) and _targeted(name, spec.target_modules)]


def lora_problem(config: Qwen2Config, spec: LoraSpec) -> str | None:
    """One line saying why ``spec`` does not fit a model of ``config`` (None when it fits): targets that match
    no linear layer, or a rank above a targeted layer's smaller dimension."""
    model = Qwen2ForCausalLM.on_meta(config)
    targets = target_linears(model, spec)
    if not targets:
        kinds = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        return (f"model.lora.target_modules: {list(spec.target_modules)} match no linear layer of "
                f"{config.ARCHITECTURE} (its linear layers: {', '.join(kinds)})")
    unmatched = [t for t in spec.target_modules if not any(_targeted(name, [t]) for name, _ in targets)]
    if unmatched:
        return f"model.lora.target_modules: {unmatched} match no linear layer of {config.ARCHITECTURE}"
    if config.tie_word_embeddings and any(name == "lm_head" for name, _ in targets):
        return ("model.lora.target_modules: lm_head shares its weight with the embeddings in this model "
                "(tie_word_embeddings); adapt the other layers")
    for name, m in targets:
        if spec.rank > min(m.in_features, m.out_features):
            return (f"model.lora.rank: {spec.rank} exceeds layer {name} ({m.in_features} in, {m.out_features} out): "
                    f"at most {min(m.in_features, m.out_features)}")
    return None


class _LoraPart(nn.Linear):
    """lora_A or lora_B: a plain linear layer, never itself a target."""


class LoraLinear(nn.Linear):
    """A frozen linear layer plus a trainable low-rank update (the module docstring)."""

    def __init__(self, base: nn.Linear, spec: LoraSpec, initial_a: torch.Tensor) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias   # the base's own parameters: names and storage unchanged
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = _LoraPart(self.in_features, spec.rank, bias=False, **kw)
        self.lora_B = _LoraPart(spec.rank, self.out_features, bias=False, **kw)
        with torch.no_grad():
            self.lora_A.weight.copy_(initial_a)
            self.lora_B.weight.zero_()
        self.scaling = spec.scaling
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        return base + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def initial_adapter(config: Qwen2Config, spec: LoraSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """The adapter a new run starts from, under its wire names: each A drawn as PEFT's default (nn.Linear's
    uniform initialisation) from one generator seeded with ``seed``, target by target in module order; each B
    zero. Every trainer backend starts from it, so they start from the same adapter."""
    model = Qwen2ForCausalLM.on_meta(config)
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in target_linears(model, spec):
        bound = 1.0 / math.sqrt(m.in_features)
        out[name + ".lora_A.weight"] = torch.rand((spec.rank, m.in_features), generator=generator) * 2 * bound - bound
        out[name + ".lora_B.weight"] = torch.zeros(m.out_features, spec.rank)
    return out


def add_lora(model: Qwen2ForCausalLM, spec: LoraSpec, seed: int = 0) -> list[str]:
    """Freeze every parameter of ``model`` and put a LoRA adapter on each target (in place); the targets' names.
    The adapter starts as :func:`initial_adapter` of ``seed``."""
    problem = lora_problem(model.config, spec)
    if problem:
        raise LoraError(problem)
    model.requires_grad_(False)
    initial = initial_adapter(model.config, spec, seed)
    names = []
    for name, linear in target_linears(model, spec):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLinear(linear, spec, initial[name + ".lora_A.weight"]))
        names.append(name)
    return names


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under their wire names (module name + ``.lora_A.weight`` / ``.lora_B.weight``)."""
    return {name: p.detach() for name, p in model.named_parameters() if is_adapter_name(name)}


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter but the adapter's."""
    return {name: p.detach() for name, p in model.named_parameters() if not is_adapter_name(name)}


def split_adapter(named: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (A, B)} of an adapter's tensors; a module with only one of them is refused."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named.items():
        out.setdefault(module_of(name), {})[name.rsplit(".", 2)[1]] = t
    for module, parts in out.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise LoraError(f"adapter: module {module!r} has {sorted(parts)}, needs lora_A and lora_B")
    return {m: (p["lora_A"], p["lora_B"]) for m, p in out.items()}


def merged_weights(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor],
                   scaling: float) -> dict[str, torch.Tensor]:
    """``{module.weight: W + scaling * B @ A}`` for every module of ``adapter`` (``base`` keyed by the weights'
    names); new tensors in the base's dtype and device, the base untouched. The adapter must cover exactly the
    modules of ``base`` (all or nothing), with shapes that fit."""
    pairs = split_adapter(adapter)
    expected = {name.removesuffix(".weight") for name in base}
    if set(pairs) != expected:
        missing, extra = sorted(expected - set(pairs)), sorted(set(pairs) - expected)
        raise LoraError(f"adapter: covers other layers than the targets (missing {missing[:3]}, unexpected {extra[:3]})")
    out = {}
    for module, (a, b) in pairs.items():
        w = base[module + ".weight"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0] or a.shape[0] != b.shape[1]:
            raise LoraError(f"adapter: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, which do not fit its "
                            f"weight {tuple(w.shape)}")
        delta = (b.to(device=w.device, dtype=torch.float32) @ a.to(device=w.device, dtype=torch.float32)) * scaling
        out[module + ".weight"] = (w.float() + delta).to(w.dtype)
    return out


# --- on disk: PEFT's layout plus the base's identity -------------------------------------------------------

def base_fingerprint(config: Qwen2Config) -> str:
    """What identifies a base model for its adapters: its config, as Hugging Face writes it."""
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def is_adapter_dir(path: str | os.PathLike) -> bool:
    return os.path.exists(os.path.join(path, ADAPTER_CONFIG))


def write_adapter(out_dir: str, tensors: Mapping[str, torch.Tensor], spec: LoraSpec, base_path: str,
                  base_config: Qwen2Config | None) -> None:
    """An adapter directory PEFT loads (its LoraConfig keys; weights under PEFT's names) naming its base (with
    ``base_config``, lora_base.json too: resuming from it finds the base)."""
    os.makedirs(out_dir, exist_ok=True)
    save_file({PEFT_PREFIX + n: t.detach().to("cpu").contiguous() for n, t in tensors.items()},
              os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})   # as PEFT's save_pretrained
    targets = sorted({module_of(n).rsplit(".", 1)[-1] for n in tensors})
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
                   "lora_dropout": spec.dropout, "target_modules": targets, "bias": "none",
                   "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": str(base_path)}
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(peft_config, f, indent=2)
    if base_config is None:
        return
    with open(os.path.join(out_dir, LORA_BASE), "w", encoding="utf-8") as f:
        json.dump({"base_model": str(base_path), "base_fingerprint": base_fingerprint(base_config)}, f, indent=2)


def read_adapter(adapter_dir: str) -> tuple[LoraSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """(spec, tensors under our names, lora_base.json or {}) of an adapter directory."""
    try:
        with open(os.path.join(adapter_dir, ADAPTER_CONFIG), encoding="utf-8") as f:
            raw = json.load(f)
        spec = LoraSpec(int(raw["r"]), float(raw["lora_alpha"]), float(raw.get("lora_dropout", 0.0)),
                        tuple(raw["target_modules"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoraError(f"{adapter_dir}/{ADAPTER_CONFIG}: not a LoRA adapter config ({exc!r})") from None
    path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    if not os.path.exists(path):
        raise LoraError(f"{adapter_dir}: no {ADAPTER_WEIGHTS}")
    tensors = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            tensors[key.removeprefix(PEFT_PREFIX).replace(".default.weight", ".weight")] = f.get_tensor(key)
    base: dict[str, Any] = {}
    if os.path.exists(os.path.join(adapter_dir, LORA_BASE)):
        with open(os.path.join(adapter_dir, LORA_BASE), encoding="utf-8") as f:
            base = json.load(f)
    return spec, tensors, base


def adapter_problem(adapter_dir: str, base_config: Qwen2Config, spec: LoraSpec | None = None) -> str | None:
    """Why the adapter at ``adapter_dir`` cannot be applied to a base of ``base_config`` (or under ``spec``)."""
    try:
        theirs, tensors, base = read_adapter(adapter_dir)
    except LoraError as exc:
        return str(exc)
    fingerprint = base.get("base_fingerprint")
    if fingerprint is not None and fingerprint != base_fingerprint(base_config):
        return (f"{adapter_dir}: the adapter belongs to another base model ({base.get('base_model')}, config "
                f"fingerprint {fingerprint}; this base's is {base_fingerprint(base_config)})")
    if spec is not None and (theirs.rank, tuple(sorted(theirs.target_modules))) != (spec.rank, tuple(sorted(spec.target_modules))):
        return (f"{adapter_dir}: the adapter has rank {theirs.rank} on {list(theirs.target_modules)}, model.lora "
                f"asks for rank {spec.rank} on {list(spec.target_modules)}")
    problem = lora_problem(base_config, theirs)
    if problem:
        return f"{adapter_dir}: the adapter belongs to another base model ({problem})"
    model = Qwen2ForCausalLM.on_meta(base_config)
    add_lora(model, theirs)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if is_adapter_name(n)}
    for name, t in tensors.items():
        if shapes.get(name) != tuple(t.shape):
            return (f"{adapter_dir}: the adapter belongs to another base model (tensor {name} has shape "
                    f"{tuple(t.shape)}, this base expects {shapes.get(name)})")
    if set(shapes) != set(tensors):
        return f"{adapter_dir}: the adapter lacks {sorted(set(shapes) - set(tensors))[:3]}"
    return None


def resolve_start(model_dir: str, start_adapter: str | None = None) -> tuple[str, str | None]:
    """(base model directory, adapter directory or None) a LoRA run starts from ``model_dir``: a LoRA
    checkpoint directory names its base in lora_base.json and is its own adapter; a model directory is the
    base, with ``start_adapter`` (model.lora.adapter) if set."""
    if not is_adapter_dir(model_dir):
        return model_dir, start_adapter
    try:
        with open(os.path.join(model_dir, LORA_BASE), encoding="utf-8") as f:
            base = json.load(f)["base_model"]
    except (OSError, ValueError, KeyError) as exc:
        raise LoraError(f"{model_dir}: names no base model ({LORA_BASE}: {exc!r})") from None
    problem = adapter_problem(model_dir, load_config(base))
    if problem:
        raise LoraError(problem)
    return base, model_dir


def start_tensors(model_dir: str, start_adapter: str | None = None) -> list[tuple[str, torch.Tensor]] | None:
    """The adapter tensors a LoRA run at ``model_dir`` starts from (None: it starts from the base alone)."""
    _, adapter = resolve_start(model_dir, start_adapter)
    return None if adapter is None else sorted(read_adapter(adapter)[1].items())


def copy_base_config(base_dir: str, out_dir: str) -> None:
    """The base's config.json beside an adapter, so a checkpoint directory says what model it is."""
    with open(os.path.join(base_dir, CONFIG_FILE), "rb") as src, open(os.path.join(out_dir, CONFIG_FILE), "wb") as dst:
        dst.write(src.read())


def trainable_bytes(config: Qwen2Config, spec: LoraSpec) -> int:
    """float32 bytes of the adapter's parameters for a model of ``config`` (the memory estimate's input)."""
    model = Qwen2ForCausalLM.on_meta(config)
    return sum(4 * spec.rank * (m.in_features + m.out_features) for _, m in target_linears(model, spec))
