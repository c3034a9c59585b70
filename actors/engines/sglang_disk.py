"""Buckets that passed through the rollout process reach an SGLang server through its file system: written
as a Hugging Face checkpoint directory that /update_weights_from_disk loads (the path when the server does
not join the trainer's group itself, ``weights_via_server: false``)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .base import WeightBucket
from .checkpoint import SINGLE_FILE, write_weights_file

__all__ = ["write_checkpoint"]


def write_checkpoint(path: Path, buckets: list[WeightBucket], model_dir: str | None) -> None:
    """``buckets`` as ``path``/model.safetensors, with the config and tokenizer files of ``model_dir``; written
    beside and renamed into place, so a server never loads half a checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {n: t.contiguous() for bucket in buckets for n, t in bucket}
    write_weights_file(tensors, str(tmp / SINGLE_FILE))
    if model_dir:
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            src = Path(model_dir) / name
            if src.exists():
                shutil.copy(src, tmp / name)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
