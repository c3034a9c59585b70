"""What every actor process runs on: the Actor base class and its spec (base), the process entry
(run: `python -m actors.runtime.run SPEC.json`), the supervisor that starts and restarts actor processes,
the one off-loop helper for blocking collectives (threads) and checkpoint recovery (recovery)."""
