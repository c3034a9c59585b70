"""Dynamic sampling (DAPO): drop prompt groups whose answers all got the same reward.

With group-normalised advantages such a group (all correct or all wrong) has zero advantage on every
token: it costs a forward/backward pass and teaches nothing, and it shrinks the effective batch. DAPO
keeps sampling until the batch holds B informative groups.

Groups are judged one at a time, as each comes back scored. Accounting with the staleness gate
(algo.staleness): the gate counts groups. A group dropped here never counts as accepted: report it with
`gate.finish(accepted=False)` when it comes back from reward, so that the gate admits a replacement instead
of waiting for a batch that can never fill.
"""
from __future__ import annotations

from typing import Sequence

import torch

from algo._validate import as_tensor, check_finite


def is_uniform(rewards: torch.Tensor | Sequence[float], atol: float = 0.0) -> bool:
    """True when one group's rewards spread by no more than `atol` (max - min): every answer got the same
    reward and the group teaches nothing. A group of one answer (or none) is uniform by definition."""
    r = as_tensor("rewards", rewards, dtype=torch.float64)
    if r.dim() != 1:
        raise ValueError(f"rewards: must be 1-D [answers], got shape {tuple(r.shape)}")
    check_finite("rewards", r)
    if not atol >= 0:
        raise ValueError(f"atol: must be >= 0, got {atol}")
    return r.numel() < 2 or float(r.max() - r.min()) <= atol
