"""One fingerprint for a set of named weights, so trainer, parameter server and rollouts can prove
they hold the same version (DESIGN.md section 9: after a transfer of version K every rollout's weights
hash to the trainer's hash for version K)."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def weights_hash(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, bytes) in name order; independent of bucketing and device."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]
