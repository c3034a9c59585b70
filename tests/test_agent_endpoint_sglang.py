"""An agent's requests through the rollout's endpoint reach SGLang as token ids on ``/generate`` (never the
server's own OpenAI route, which would re-tokenize), against the stand-in SGLang server; a weight update
between two calls leaves the first call's tokens at their version, and staleness counts from the first."""
from __future__ import annotations

import functools

from actors.engines.checkpoint import save_model
from actors.engines.sglang import SGLangEngine
from actors.engines.tokenizer import load_tokenizer
from actors.engines.torch_gen import TorchGenerationEngine
from actors.rollout.agent import AgentClient, run_agent
from actors.rollout.chat import template_of
from actors.rollout.episode import ENV_VERSION
from actors.rollout.openai_server import AgentEndpoint, EndpointLimits
from testsupport.bounded import run_bounded
from testsupport.sglang_standin import StandinThread
from testsupport.tiny_models import ARITH_TOKENIZER_DIR, tiny_model

run = functools.partial(run_bounded, timeout=90.0)
TOK = load_tokenizer(str(ARITH_TOKENIZER_DIR))


def test_agent_calls_reach_sglang_as_token_ids_across_a_weight_update(tmp_path):
    save_model(tiny_model(seed=5, vocab_size=TOK.vocab_size), str(tmp_path / "v1"))
    server = StandinThread(TorchGenerationEngine(model=tiny_model(seed=0, vocab_size=TOK.vocab_size))).start()
    requests_seen: list[list[int]] = []

    async def agent(client: AgentClient, task) -> None:
        oa = client.openai()
        messages = [{"role": "user", "content": task["prompt"]}]
        first = await oa.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=1.0)
        requests_seen.append(first.choices[0].model_extra["token_ids"])
        await engine.update_weights_from_disk(1, str(tmp_path / "v1"))   # new weights between two calls
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        second = await oa.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=1.0)
        requests_seen.append(second.choices[0].model_extra["token_ids"])

    engine = SGLangEngine(url=server.url)

    async def main():
        await engine.start()
        endpoint = AgentEndpoint(engine, TOK, template_of(TOK), EndpointLimits(max_new_tokens=6,
                                                                               stop_token_ids=TOK.eos_token_ids))
        await endpoint.start()
        try:
            return await run_agent(endpoint, agent, {"prompt": "Compute: 5+7"}, "ep", timeout_s=60, seed=3)
        finally:
            await endpoint.stop()
            await engine.stop()

    try:
        agent_run = run(main())
        log = server.server.request_log
    finally:
        server.stop()
    assert agent_run.error == "", agent_run.error
    routes = [entry[2].split()[0] for entry in log if entry[1] == "call"]
    assert "/generate" in routes and not any(r.startswith("/v1") for r in routes)
    [trajectory] = agent_run.trajectories
    trajectory.check()
    first, second = requests_seen
    assert trajectory.output_ids[:len(first)] == first and trajectory.output_ids[-len(second):] == second
    assert trajectory.versions[:len(first)] == [0] * len(first)
    assert trajectory.versions[-len(second):] == [1] * len(second)
    tail = trajectory.versions[len(first):-len(second)]
    assert tail and set(tail) == {ENV_VERSION} and trajectory.start_version == 0
