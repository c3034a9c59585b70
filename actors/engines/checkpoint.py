"""Hugging Face checkpoint layout: config.json + model.safetensors, or shards with an index.

What we write loads in `transformers` (Qwen2/Qwen3/Qwen3MoeForCausalLM.from_pretrained) and what
`transformers`' save_pretrained writes (or a downloaded model of those families) loads here. Tied embeddings are stored once, under
`model.embed_tokens.weight`, as Hugging Face does.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .lora import (ADAPTER_CONFIG, LoraError, adapter_problem, merged_weights, module_of, read_adapter,
                   resolve_start)
from .model import CONFIG_FILE, ConfigError, Qwen2Config, Qwen2ForCausalLM, dtype_from_name, load_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


class CheckpointError(ValueError):
    """A model directory is missing a file, or its tensors do not match the config; names the file/key."""


def shard_file_name(index: int, count: int) -> str:
    """The name of shard ``index`` (from 0) of ``count``, as Hugging Face numbers them (from 1)."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_weights_file(tensors: dict[str, torch.Tensor], path: str) -> None:
    """One safetensors file of contiguous CPU tensors, with the metadata Hugging Face's save_pretrained
    writes (``{"format": "pt"}``), which transformers checks when it loads the file."""
    save_file(tensors, path, metadata={"format": "pt"})


def write_weights_index(out_dir: str, weight_map: dict[str, str], metadata: dict[str, int]) -> None:
    """``model.safetensors.index.json``: which shard holds each tensor (``weight_map``)."""
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": metadata, "weight_map": weight_map}, f, indent=2)


def has_weights(model_dir: str | os.PathLike) -> bool:
    """Whether a model directory holds weights: one safetensors file, the index of its shards, or (a LoRA
    checkpoint, which load_model loads onto the base it names) an adapter."""
    return any(os.path.exists(os.path.join(model_dir, f)) for f in (SINGLE_FILE, INDEX_FILE, ADAPTER_CONFIG))


def _weight_files(model_dir: str) -> list[str]:
    single = os.path.join(model_dir, SINGLE_FILE)
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index}: invalid JSON at line {e.lineno}: {e.msg}") from None
        except (KeyError, TypeError):
            raise CheckpointError(f"{index}: missing key 'weight_map'") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.exists(os.path.join(model_dir, name)):
                raise CheckpointError(f"{index}: shard {name!r} listed in weight_map does not exist")
        return [os.path.join(model_dir, name) for name in files]
    if os.path.exists(single):
        return [single]
    raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} found")


def iter_checkpoint_tensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) for every tensor in the directory's safetensors files, one file at a time."""
    for path in _weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# Buffers old checkpoints carry that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def assign_weights(model: Qwen2ForCausalLM, named: Iterable[tuple[str, torch.Tensor]], strict: bool = True,
                   source: str = "weights") -> set[str]:
    """Copy named tensors into the model's parameters (cast to its dtype/device); returns names set.

    With strict, every parameter must be given (a tied lm_head may be absent) and no unknown name may appear.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in named:
            if _expected(model, params, name, tuple(tensor.shape), source):
                params[name].copy_(tensor)
                seen.add(name)
    if strict:
        _check_complete(model, params, seen, source)
    return seen


def _expected(model: Qwen2ForCausalLM, params: dict[str, torch.nn.Parameter], name: str, shape: tuple[int, ...],
              source: str) -> bool:
    """Whether checkpoint tensor ``name`` of ``shape`` is to be loaded into ``params`` (False: it is skipped);
    raises when the model has no such parameter or another shape."""
    if name.endswith(_IGNORED_SUFFIXES):
        return False
    if name not in params:
        raise CheckpointError(f"{source}: unexpected tensor {name!r} (not a parameter of "
                              f"{model.config.ARCHITECTURE} with this config.json)")
    if model.config.tie_word_embeddings and name == "lm_head.weight":
        return False  # the same tensor as model.embed_tokens.weight
    if shape != tuple(params[name].shape):
        raise CheckpointError(f"{source}: tensor {name!r} has shape {shape}, the config expects "
                              f"{tuple(params[name].shape)}")
    return True


def _check_complete(model: Qwen2ForCausalLM, params: dict[str, torch.nn.Parameter], seen: set[str], source: str) -> None:
    expected = set(params) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    missing = sorted(expected - seen)
    if missing:
        raise CheckpointError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def check_checkpoint(model_dir: str) -> Qwen2Config:
    """The directory's config, once every tensor of its weight files has the name and shape that config gives
    it and none is missing (read from the files' headers: no tensor is loaded). Raises ConfigError or
    CheckpointError with one line naming what does not fit."""
    config = load_config(model_dir)
    model = Qwen2ForCausalLM.on_meta(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    for path in _weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if _expected(model, params, name, tuple(f.get_slice(name).get_shape()), model_dir):
                    seen.add(name)
    _check_complete(model, params, seen, model_dir)
    return config


def load_model(model_dir: str, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu") -> Qwen2ForCausalLM:
    """Build the model from config.json and load its safetensors weights (single file or shards); a LoRA
    checkpoint directory gives its base with its adapter merged (lora.py)."""
    if os.path.exists(os.path.join(model_dir, ADAPTER_CONFIG)):
        return load_merged(model_dir, dtype, device)
    config = load_config(model_dir)
    if dtype is None:
        dtype = torch.float32
    elif isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    model = Qwen2ForCausalLM.on_meta(config).materialise(device, dtype)
    assign_weights(model, iter_checkpoint_tensors(model_dir), strict=True, source=model_dir)
    return model.eval()


def load_merged(adapter_dir: str, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
                base_dir: str | None = None) -> Qwen2ForCausalLM:
    """The base a LoRA checkpoint directory names (or ``base_dir``), with its adapter merged into its weights:
    a plain model, as lora.py describes."""
    try:
        if base_dir is None:
            base_dir = resolve_start(adapter_dir)[0]
        problem = adapter_problem(adapter_dir, load_config(base_dir))
        if problem:
            raise CheckpointError(problem)
        spec, tensors, _ = read_adapter(adapter_dir)
    except LoraError as exc:
        raise CheckpointError(str(exc)) from None
    model = load_model(base_dir, dtype, device)
    params = dict(model.named_parameters())
    base = {module_of(n) + ".weight": params[module_of(n) + ".weight"].detach() for n in tensors}
    with torch.no_grad():
        for name, tensor in merged_weights(base, tensors, spec.scaling).items():
            params[name].copy_(tensor)
    return model


def hf_state_dict(model: Qwen2ForCausalLM) -> dict[str, torch.Tensor]:
    """Parameters under their Hugging Face names; a tied lm_head is left out, as Hugging Face does."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def save_model(model: Qwen2ForCausalLM, out_dir: str, max_shard_bytes: int | None = None,
               dtype: torch.dtype | None = None) -> list[str]:
    """Write config.json and the weights (sharded with an index when larger than max_shard_bytes)."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype else v).to("cpu").contiguous() for k, v in hf_state_dict(model).items()}
    config = model.config.to_dict()
    config["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in os.listdir(out_dir):  # a previous save with another sharding must not leave files behind
        if stale == SINGLE_FILE or stale == INDEX_FILE or (stale.startswith("model-") and stale.endswith(".safetensors")):
            os.remove(os.path.join(out_dir, stale))
    written = []
    if len(shards) == 1:
        write_weights_file(shards[0], os.path.join(out_dir, SINGLE_FILE))
        written.append(SINGLE_FILE)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = shard_file_name(i, len(shards))
            write_weights_file(shard, os.path.join(out_dir, name))
            weight_map.update({k: name for k in shard})
            written.append(name)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        write_weights_index(out_dir, weight_map, {"total_size": total})
        written.append(INDEX_FILE)
    with open(os.path.join(out_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    written.append(CONFIG_FILE)
    return written


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group named tensors into lists of about bucket_bytes (a tensor larger than that gets its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def read_tokenizer_files(model_dir: str) -> dict[str, bytes]:
    """The tokenizer files of ``model_dir``, read once so that every checkpoint a trainer writes carries them,
    even after the directory it started from is gone (a resumed run's start checkpoint is rotated away)."""
    files = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                files[name] = f.read()
    return files


def write_tokenizer_files(files: dict[str, bytes], out_dir: str) -> None:
    for name, data in files.items():
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)


__all__ = ["CheckpointError", "ConfigError", "has_weights", "check_checkpoint", "load_config", "load_model", "load_merged",
           "save_model", "hf_state_dict", "CONFIG_FILE",
           "assign_weights", "iter_checkpoint_tensors", "bucketize", "TOKENIZER_FILES", "read_tokenizer_files",
           "write_tokenizer_files", "shard_file_name", "write_weights_file", "write_weights_index"]
