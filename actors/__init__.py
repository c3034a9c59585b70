"""Actors: the runtime (base: Actor, ActorSpec; run: the process entry; supervisor) and the RL actors."""
