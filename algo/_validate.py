"""Input checks shared by the algo modules.

Every public function in algo/ validates its tensors here so that a NaN coming out of a reward
function or a log-prob computation fails loudly at the boundary, with the argument named, instead of
silently poisoning a training step.
"""
from __future__ import annotations

from typing import Sequence

import torch


def as_tensor(name: str, value: object, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Return `value` as a tensor (no copy when it already is one); name the argument on failure."""
    if isinstance(value, torch.Tensor):
        return value if dtype is None else value.to(dtype)
    try:
        return torch.as_tensor(value, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name}: cannot be read as a tensor ({exc})") from exc


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError naming `name` if `tensor` holds NaN or +-inf."""
    if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
        n_nan = int(torch.isnan(tensor).sum())
        n_inf = int(torch.isinf(tensor).sum())
        raise ValueError(f"{name}: contains non-finite values ({n_nan} NaN, {n_inf} inf)")


def check_same_shape(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Raise ValueError if the tensors do not all share the first one's shape."""
    ref = tensors[0].shape
    for name, tensor in zip(names[1:], tensors[1:]):
        if tensor.shape != ref:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match {names[0]} shape {tuple(ref)}")


def check_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """Return `mask` as a bool tensor; only 0/1 (or bool) values are accepted."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        check_finite(name, mask)
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name}: a mask must hold only 0 and 1")
    return mask.bool()


def check_cu_seqlens(name: str, cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Validate cumulative sequence lengths [0, l0, l0+l1, ...]; return them as int64."""
    cu = as_tensor(name, cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name}: must be a 1-D tensor starting with 0")
    if cu.is_floating_point():
        raise ValueError(f"{name}: must be an integer tensor, got {cu.dtype}")
    cu = cu.to(torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name}: must start with 0, got {int(cu[0])}")
    if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name}: must be non-decreasing")
    if total is not None and int(cu[-1]) != total:
        raise ValueError(f"{name}: ends at {int(cu[-1])} but the token stream has {total} tokens")
    return cu


def check_grouped_rewards(rewards: object, group_ids: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-answer rewards [B] (finite) and the integer group id of each answer, same shape."""
    r = as_tensor("rewards", rewards)
    gid = as_tensor("group_ids", group_ids)
    if r.dim() != 1:
        raise ValueError(f"rewards: must be 1-D [B], got shape {tuple(r.shape)}")
    check_finite("rewards", r)
    if gid.shape != r.shape:
        raise ValueError(f"group_ids: shape {tuple(gid.shape)} does not match rewards shape {tuple(r.shape)}")
    if gid.is_floating_point() or gid.dtype == torch.bool:
        raise ValueError(f"group_ids: must be an integer tensor, got {gid.dtype}")
    return r, gid
