"""Actors: the runtime every actor process runs on (runtime/), one package per RL actor (buffer, rollout,
trainer, param_server, evaluator, reward: each an actor.py and the parts that serve only it), and the parts
more than one actor uses (batch, dataset, weights, engines/, weight_sync/)."""
