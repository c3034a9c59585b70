"""`python -m tools.replay LOG`: read a message log; `--into MODULE:Class`: replay it into a fresh actor.

Printing: one line per record (index, time since the segment start, direction, kind, sender/peer, fields),
filtered with ``--type KIND`` and ``--sender NAME`` (repeatable), ``--dir in|out``, ``--limit N``, or one
JSON object per line with ``--json``. Buckets moved on bulk links print as kind ``bulk`` with their header, a
link's formations as ``link_formed``.
A torn last record is reported and skipped.

Replaying: a fresh instance of the class is built from the spec stored in the log (run_dir replaced by a
temporary directory, message logging off, ``--set KEY=VALUE`` applied to its settings) with a ReplayBus
instead of the network and a ReplayLink for every bulk link. ``on_start`` and ``on_ready`` run, then the
recorded inbound messages and replies of the chosen segment are delivered in log order, each once the actor
has sent, stream by stream, what the original had sent before it arrived (see docs/transport.md). What
the actor sends is compared, per (cause, peer) stream in order, with what the original sent (wire bodies
without their VOLATILE fields, tensors by sha256, link buckets by header); the first divergence is reported
naming the inbound message that caused it, the outbound message and its first differing field. A wait is
bounded by ``--idle-timeout``: a replay never hangs. With ``--set`` the whole log is delivered even past a
divergence, and a replayed trainer's metrics print beside the recorded run's (offline re-training).
Exit status: 0 identical, 1 divergence, 2 usage or log errors.

The package, by job: ``records`` reads and prints a log; ``driver`` builds the actor and feeds it the log;
``doubles`` stands in for its bus, its bulk links and its threads; ``compare`` finds the first divergence;
``metrics`` prints a replayed trainer's metrics beside the recorded run's; ``cli`` is the command line.
"""
from __future__ import annotations

import transport.protocol  # noqa: F401  (registers the rl.* message kinds so records decode)

from .cli import main
from .compare import Divergence
from .doubles import ReplayError
from .driver import ReplayResult, replay_into

__all__ = ["main", "replay_into", "ReplayResult", "Divergence", "ReplayError"]
