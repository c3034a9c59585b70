"""Agents written as ordinary code, which the rollout runs for every group (``actors.rollout.settings.agent``)."""
