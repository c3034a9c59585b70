"""The code reward's ``sandbox`` settings are a typed section like every other: a misspelt or out-of-range
limit is refused with its path when the settings are read (at launch), not when the actor starts."""
from __future__ import annotations

import pytest

from actors.reward.code import CodeReward
from actors.reward.sandbox import SandboxLimits
from topology.settings import CodeRewardSettings, SettingsError, read_settings


def test_a_misspelt_sandbox_limit_is_refused_with_did_you_mean() -> None:
    with pytest.raises(SettingsError, match=r"settings\.sandbox\.wall_time: unknown key \(did you mean 'wall_time_s'\?\)"):
        read_settings(CodeReward, {"sandbox": {"wall_time": 2.0}}, "reward")


def test_a_non_positive_sandbox_limit_is_refused_with_its_path() -> None:
    with pytest.raises(SettingsError, match=r"settings\.sandbox\.memory_bytes"):
        read_settings(CodeReward, {"sandbox": {"memory_bytes": 0}}, "reward")


def test_the_limits_left_out_keep_the_sandboxs_defaults() -> None:
    cfg = read_settings(CodeReward, {"sandbox": {"wall_time_s": 3.5}}, "reward")
    assert isinstance(cfg, CodeRewardSettings)
    limits = SandboxLimits(**cfg.sandbox.model_dump(exclude_none=True))
    assert limits == SandboxLimits(wall_time_s=3.5)
