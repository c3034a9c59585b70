"""Dynamic sampling (DAPO): drop prompt groups whose answers all got the same reward.

With group-normalised advantages such a group (all correct or all wrong) has zero advantage on every
token: it costs a forward/backward pass and teaches nothing, and it shrinks the effective batch. DAPO
keeps sampling until the batch holds B informative groups.

Accounting with the staleness gate (algo.staleness): the gate counts groups. A group dropped here never
counts as accepted: report it with `gate.finish(accepted=False, n=...)` when it comes back from reward,
or with `gate.discard(n)` if it had already been accepted, so that the gate admits a replacement instead of
waiting for a batch that can never fill.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from algo._validate import check_grouped_rewards


@dataclass(frozen=True)
class GroupFilter:
    keep: torch.Tensor  # bool [B] per answer: True where its group is informative
    kept_groups: torch.Tensor  # the group ids kept, ascending
    dropped_groups: torch.Tensor  # the group ids dropped, ascending

    @property
    def n_kept_groups(self) -> int:
        return int(self.kept_groups.numel())

    @property
    def n_dropped_groups(self) -> int:
        return int(self.dropped_groups.numel())


def filter_uniform_groups(rewards: torch.Tensor, group_ids: torch.Tensor, atol: float = 0.0) -> GroupFilter:
    """Keep the groups whose rewards spread by more than `atol` (max - min); drop the others.
    A group of a single answer is uniform by definition and is dropped."""
    r, gid = check_grouped_rewards(rewards, group_ids)
    if not atol >= 0:
        raise ValueError(f"atol: must be >= 0, got {atol}")
    if r.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return GroupFilter(torch.zeros(0, dtype=torch.bool), empty, empty)
    groups, inverse = torch.unique(gid, return_inverse=True)
    x = r.to(torch.float64)
    hi = torch.full((groups.numel(),), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, x, reduce="amax")
    lo = torch.full((groups.numel(),), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, x, reduce="amin")
    informative = (hi - lo) > atol
    return GroupFilter(keep=informative[inverse], kept_groups=groups[informative], dropped_groups=groups[~informative])

