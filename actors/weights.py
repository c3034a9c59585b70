"""One fingerprint for a set of named weights, so trainer, parameter server and rollouts can prove
they hold the same version (after a transfer of version K every rollout's weights hash to the trainer's
hash for version K: docs/architecture.md, "Invariants").

The fingerprint is built from one digest per tensor, so parts of the model hashed where they live (the
stages of a pipeline-parallel trainer) combine into the same hash as the whole model hashed in one place."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

TensorDigest = tuple[str, str, tuple[int, ...], str]   # name, dtype, shape, sha256 of the bytes


def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorDigest]:
    out = []
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out.append((name, str(t.dtype), tuple(t.shape), hashlib.sha256(data).hexdigest()))
    return out


def combine_digests(digests: Iterable[TensorDigest]) -> str:
    """The weights hash of tensors digested anywhere: name order, independent of bucketing and device."""
    h = hashlib.sha256()
    for name, dtype, shape, digest in sorted(digests, key=lambda d: d[0]):
        h.update(f"{name}|{dtype}|{tuple(shape)}|{digest}|".encode())
    return h.hexdigest()[:32]


def weights_hash(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    return combine_digests(tensor_digests(named))
