"""Episodes through the SGLang client against the stand-in SGLang server: each turn continues from the token
ids of the context (prompt, generated and observation tokens; never re-tokenized text), and a weight update
between turns leaves the first turn's tokens at their version while the next turn is the new weights' own
continuation."""
from __future__ import annotations

import functools
from actors.engines.base import GenerationRequest, SamplingParams
from actors.engines.checkpoint import save_model
from actors.engines.sglang import SGLangEngine
from actors.engines.torch_gen import TorchGenerationEngine
from actors.rollout.episode import ENV_VERSION, Environment, EpisodeLimits, run_episodes
from testsupport.bounded import run_bounded
from testsupport.scripted_engine import IntCodec
from testsupport.sglang_standin import StandinThread
from testsupport.tiny_models import greedy_reference, random_sequences, tiny_model

run = functools.partial(run_bounded, timeout=60.0)
VOCAB = 97
OBSERVATION = [5, 7]




class UpdatingTool(Environment):
    """Answers the first marker-ended turn with OBSERVATION after moving the server to new weights (a weight
    update between turns); the episode's later turns are answers."""

    def __init__(self, marker: int, engine: SGLangEngine, new_weights: str) -> None:
        self.turn_end = (str(marker),)
        self.engine, self.new_weights = engine, new_weights
        self.calls = 0

    async def step(self, turn_text: str, ended_by: str) -> str | None:
        self.calls += 1
        if self.calls > 1 or ended_by == "stop":
            return None
        await self.engine.update_weights_from_disk(1, self.new_weights)
        return IntCodec().decode(OBSERVATION)


def test_sglang_episode_continues_from_token_ids_across_a_weight_update(tmp_path):
    old_model, new_model = tiny_model(seed=0), tiny_model(seed=5)
    save_model(new_model, str(tmp_path / "v1"))
    prompt = random_sequences(1, 5, 10, VOCAB, seed=3)[0]
    marker = greedy_reference(old_model, prompt, 1)[0]   # greedy turn 1 is this one token: the tool call
    server = StandinThread(TorchGenerationEngine(model=tiny_model(seed=0))).start()

    async def main():
        engine = SGLangEngine(url=server.url)
        await engine.start()
        envs = []

        def make_env() -> Environment:
            envs.append(UpdatingTool(marker, engine, str(tmp_path / "v1")))
            return envs[-1]
        try:
            request = GenerationRequest("g", tuple(prompt), SamplingParams(temperature=0.0, max_new_tokens=6), 1)
            [trajectory] = await run_episodes(engine, request, make_env, IntCodec(),
                                              EpisodeLimits(max_turns=3, max_tokens=64, env_timeout_s=30))
            return trajectory, engine.version
        finally:
            await engine.stop()

    try:
        trajectory, version = run(main())
    finally:
        server.stop()
    trajectory.check()
    assert [t.ended_by for t in trajectory.turns][0] == str(marker) and len(trajectory.turns) >= 2
    turn2 = trajectory.output_ids[1 + len(OBSERVATION):1 + len(OBSERVATION) + trajectory.turns[1].generated]
    # Turn 2 is the new weights' greedy continuation of the exact token context (prompt, call, observation).
    assert turn2 == greedy_reference(new_model, list(prompt) + [marker] + OBSERVATION, len(turn2))
    assert trajectory.output_ids[:1 + len(OBSERVATION)] == [marker] + OBSERVATION
    assert trajectory.versions[:1 + len(OBSERVATION)] == [0] + [ENV_VERSION] * len(OBSERVATION)
    assert trajectory.loss_mask[:1 + len(OBSERVATION)] == [1, 0, 0]
    assert set(trajectory.versions[1 + len(OBSERVATION):]) == {1} and version == 1
    assert trajectory.start_version == 0   # staleness counts from the episode's first token
