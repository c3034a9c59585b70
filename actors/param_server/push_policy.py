"""The parameter server's push decisions as plain state: which rollouts an epoch of the rollout link is formed
of, when it is formed again, which version goes to whom, and who is left out for a while after a failure.

`PushPolicy` takes plain data (the rollouts' `RolloutWeights`, the newest stored version, clock readings) and
returns plain decisions; it sends nothing and reads no clock. actors/param_server/actor.py acts on its decisions
(forming the link, pushing, logging), and tools/plan/sim.py drives the same object in virtual time, so a
change to these rules shows in the planner's figures too.

The pusher's loop asks `next_action` and gets one of:

* `Wait`: before the first formation every live rollout is waited for (they start together), but only while
  none of those that said hello is behind the newest version (a late server joins when it says hello); after
  it, a formation needs at least one ready rollout (said hello, alive, not on probation).
* `Form`: no epoch is formed, one must be formed again (a member died, restarted or lost its server), or
  the ready set differs from the formed one. After a successful formation the loop goes on with
  `push_or_idle`, on the members just formed.
* `Push`: a formed member is behind the newest stored version and not still busy with a transfer. Versions
  that arrive while a push runs are coalesced: the next push sends only the newest (`takes`).
* `Idle`: nobody is behind.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

from transport.protocol import RolloutWeights


@dataclass(frozen=True)
class Wait:
    """Nothing can be formed yet: `no_hello` have not said hello, `dead` are not alive."""

    no_hello: list[str]
    dead: list[str]


@dataclass(frozen=True)
class Form:
    """Form a new epoch of the rollout link with `members` (`begin_formation` numbers it)."""

    members: list[str]


@dataclass(frozen=True)
class Push:
    """Send `version` to every member of the formed epoch (some of them are behind)."""

    version: int
    members: list[str]


@dataclass(frozen=True)
class Idle:
    """Every formed member holds the newest version or is busy receiving it."""


Action = Union[Wait, Form, Push, Idle]


@dataclass
class PushPolicy:
    """The parameter server's link and push state. `rollouts` is the per-rollout view the actor keeps up to
    date from hellos, heartbeats and acks (the same objects its status replies carry)."""

    rollouts: dict[str, RolloutWeights] = field(default_factory=dict)
    probation_s: float = 30.0
    epoch: int | None = None          # the formed epoch, None while none is formed
    next_epoch: int = 0
    need_reform: bool = False
    formed: list[str] = field(default_factory=list)      # the members of the formed epoch, in link order
    probation: dict[str, tuple[float, float]] = field(default_factory=dict)   # name -> (left out until, next period)
    last_good: set[str] = field(default_factory=set)     # the members of the last push that went through

    # --- who can take part --------------------------------------------------------------------------
    def ready(self, now: float) -> list[str]:
        """The rollouts an epoch is formed of now: said hello, alive, and not on probation."""
        return [n for n, s in self.rollouts.items()
                if s.hello and s.alive and self.probation.get(n, (0.0, 0.0))[0] <= now]

    def blockers(self) -> tuple[list[str], list[str]]:
        """(rollouts without a hello, rollouts not alive), each sorted."""
        no_hello = sorted(n for n, s in self.rollouts.items() if not s.hello)
        dead = sorted(n for n, s in self.rollouts.items() if not s.alive)
        return no_hello, dead

    # --- the decision -------------------------------------------------------------------------------
    def next_action(self, now: float, version: int, busy: Callable[[str], bool]) -> Action:
        """What the pusher does next, with `version` the newest stored one and `busy(name)` whether a
        transfer to that rollout is still running."""
        no_hello, dead = self.blockers()
        ready = self.ready(now)
        # Before the first formation every live rollout is waited for (they are starting), until a version
        # waits for those that said hello: a server still starting (minutes at 7B and up) joins late, and
        # must not keep the others from new weights. After the first formation, nobody is waited for.
        waiting = any(self.rollouts[n].version < version for n in ready)
        starting = self.next_epoch == 0 and any(n not in dead for n in no_hello) and not waiting
        if starting or not ready:
            return Wait(no_hello, dead)
        if self.epoch is None or self.need_reform or ready != self.formed:
            return Form(ready)
        return self.push_or_idle(version, busy)

    def push_or_idle(self, version: int, busy: Callable[[str], bool]) -> Push | Idle:
        """Push `version` to the formed epoch if one of its members is behind and not busy."""
        behind = [n for n in self.formed if self.rollouts[n].version < version and not busy(n)]
        return Push(version, list(self.formed)) if behind else Idle()

    @staticmethod
    def takes(version: int, current: int | None) -> bool:
        """A stored version becomes the one pushed unless it is no newer than the current one."""
        return current is None or version > current

    # --- what happened ------------------------------------------------------------------------------
    def begin_formation(self) -> int:
        """A formation starts: the epoch it forms (nothing is formed until `formation_done`)."""
        epoch = self.next_epoch
        self.next_epoch += 1
        self.epoch, self.formed = None, []
        return epoch

    def formation_done(self, epoch: int, members: list[str]) -> None:
        self.epoch, self.formed, self.need_reform = epoch, list(members), False

    def member_changed(self) -> None:
        """A member died, restarted or lost its server: a formed epoch must be formed again."""
        if self.epoch is not None:
            self.need_reform = True

    def said_hello(self, name: str) -> None:
        """A (re)started rollout's hello lets it in at once, whatever probation it was on."""
        self.probation.pop(name, None)

    def pushed_ok(self, members: list[str]) -> None:
        """A push reached every member and each ack passed its check."""
        self.last_good = set(members)
        for name in members:
            self.probation.pop(name, None)

    def failed_with(self, members: list[str], now: float, started: float | None = None) -> list[tuple[str, float]]:
        """A formation or push failed. If it had members the last good one did not (one back from a hang,
        its server perhaps still stuck in the transfer it was left out of), leave those out for a while,
        doubling each time, so that they cannot keep the others from their weights. A member that said hello
        after the transfer `started` is a new process, not a hung one: it was the reason the transfer
        stopped, and the next formation takes it in. Returns (name, seconds left out) of each put on
        probation."""
        newcomers = [n for n in members if n not in self.last_good
                     and (started is None or self.rollouts[n].hello_at < started)]
        if not newcomers or len(newcomers) == len(members):
            return []
        out = []
        for name in newcomers:
            period = self.probation.get(name, (0.0, self.probation_s / 2))[1] * 2
            self.probation[name] = (now + period, min(period, 16 * self.probation_s))
            out.append((name, period))
        return out
