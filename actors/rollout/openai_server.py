"""An OpenAI-compatible endpoint over a rollout's generation engine, one key per episode.

Agents written against the OpenAI API (the ``openai`` package, or any HTTP client) talk to the model here;
the rollout keeps the exact tokens (actors/rollout/conversation.py). Routes:

* ``POST /v1/chat/completions``: ``messages`` (system, user, assistant with ``tool_calls``, tool), ``tools``
  (function tools; rendered by the model's chat template, calls parsed from the model's text in the Qwen
  format), ``n``, ``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop`` (strings
  that are one token each), ``seed``, ``logprobs``;
* ``POST /v1/completions``: ``prompt`` as text or token ids, the same sampling fields;
* ``GET /v1/models``.

Every request is token ids to the engine (`GenerationEngine.generate`; on SGLang that is its ``/generate``
route with ``input_ids``, never its own OpenAI route, so the server never re-tokenizes). Choices carry, besides
OpenAI's fields, ``token_ids`` and ``weight_versions`` of what was sampled.

It listens on loopback (or a unix socket) and answers only a key `AgentEndpoint.open` issued
(``Authorization: Bearer KEY``): a key is one episode, refused with 401 if unknown and 410 once the episode
ended (`close`). Closing aborts the episode's requests in flight; their tokens so far are kept in the
trajectory and the request is answered 410. Every malformed request is one 400 line naming the field.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

from actors.engines.base import EngineError, GenerationEngine, GenerationRequest, RequestError, SamplingParams
from actors.rollout.chat import TOOL_CALL_STOPS, TOOL_FORMATS, ChatError, ChatTemplate, validate_messages, validate_tools
from actors.rollout.conversation import Conversation, ConversationError, Prepared
from actors.rollout.episode import Codec, turn_seed

MODEL_NAME = "policy"
# Connections waiting to be accepted. A rollout starts a whole batch of episodes at once (hundreds of connections)
# on the event loop that also accepts them; past the listen queue (aiohttp's default is 128) the kernel drops or
# resets connections, and agents fail on a healthy endpoint. The kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 4096
_SAMPLING_KEYS = {"temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "n", "seed", "logprobs",
                  "top_logprobs", "stream", "model", "user", "tool_choice", "parallel_tool_calls", "frequency_penalty",
                  "presence_penalty", "echo", "response_format", "stream_options", "metadata"}
CHAT_KEYS = _SAMPLING_KEYS | {"messages", "tools"}
COMPLETION_KEYS = _SAMPLING_KEYS | {"prompt"}


class HTTPFailure(Exception):
    """A request answered with an error: HTTP status, OpenAI error type, one line naming the cause."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclasses.dataclass
class Episode:
    """One key's conversation and what the endpoint knows of it."""

    key: str
    name: str
    conversation: Conversation
    seed: int | None
    in_flight: set[str] = dataclasses.field(default_factory=set)
    requests: int = 0
    ended: str = ""                   # why it ended ("" while open)
    idle: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


@dataclasses.dataclass(frozen=True)
class EndpointLimits:
    """``max_new_tokens``: the most tokens one request samples (a request's ``max_tokens`` may lower it);
    ``max_context``: tokens of a whole context (None: the engine's limit); ``stop_token_ids``: the model's end
    of turn, always a stop; ``close_timeout_s``: bound on waiting for aborted requests when an episode ends."""

    max_new_tokens: int = 256
    max_context: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    close_timeout_s: float = 10.0


class AgentEndpoint:
    """The HTTP endpoint of one rollout (see the module docstring). ``start`` before `open`; `stop` at the end."""

    def __init__(self, engine: GenerationEngine, codec: Codec, template: ChatTemplate | None,
                 limits: EndpointLimits = EndpointLimits(), tool_format: str = "qwen") -> None:
        self.engine, self.codec, self.template, self.limits = engine, codec, template, limits
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool format {tool_format!r} is not one of {list(TOOL_FORMATS)}")
        self.tool_format = tool_format
        self.tool_stop_ids: list[int] = []   # the format's call ends: stops while tools are offered, kept in the text
        for stop in TOOL_CALL_STOPS[tool_format]:
            ids = codec.encode(stop)
            if len(ids) != 1:
                raise ValueError(f"tool format {tool_format!r}: its call end {stop!r} is {len(ids)} tokens here, not one")
            self.tool_stop_ids += ids
        self.episodes: dict[str, Episode] = {}
        self.ended: dict[str, str] = {}    # key -> why its episode ended (answers 410 after it)
        self.counters: dict[str, float] = {"calls": 0, "errors": 0, "overhead_s": 0.0, "engine_s": 0.0}
        self._runner: web.AppRunner | None = None
        self.base_url = ""
        self._ids = itertools.count()

    # ------------------------------------------------------------------------------------- lifecycle

    async def start(self, host: str = "127.0.0.1", port: int = 0, unix_path: str | None = None) -> str:
        """Serve on ``host:port`` (port 0: any free one) or a unix socket; returns the base URL (…/v1)."""
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"host {host!r}: the agent endpoint listens on loopback only")
        # aiohttp is imported where the endpoint is served, not with the rollout actor's module: every launch
        # imports that module to check its class, and aiohttp is 0.4 s of CPU to import.
        from aiohttp import web

        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        if unix_path is not None:
            await self.serve_unix(unix_path)
            self.base_url = "http://localhost/v1"
        else:
            await web.TCPSite(self._runner, host, port, backlog=LISTEN_BACKLOG).start()
            bound = self._runner.addresses[0]
            self.base_url = f"http://{host}:{bound[1]}/v1"
        return self.base_url

    async def serve_unix(self, path: str) -> None:
        """Serve on the unix socket ``path`` as well (what a sandboxed agent program reaches, bound in)."""
        assert self._runner is not None, "start the endpoint first"
        from aiohttp import web

        await web.UnixSite(self._runner, path, backlog=LISTEN_BACKLOG).start()

    async def stop(self) -> None:
        for key in list(self.episodes):
            await self.close(key, "endpoint stopped")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, name: str, seed: int | None = None) -> str:
        """A new episode; returns its key (the agent's API key)."""
        key = "ep-" + secrets.token_urlsafe(18)
        self.episodes[key] = Episode(key, name, Conversation(self.codec, self.template, self.tool_format), seed)
        return key

    async def close(self, key: str, cause: str = "done") -> Conversation:
        """End an episode: later requests with its key are refused (410), requests in flight are aborted (their
        tokens so far stay in the trajectory). Returns its conversation."""
        episode = self.episodes.pop(key)
        episode.ended = cause
        self.ended[key] = cause
        if len(self.ended) > 100_000:   # bounded: keys are never issued twice
            self.ended.clear()
        for rid in list(episode.in_flight):
            await self.engine.abort(rid)
        try:
            await asyncio.wait_for(episode.idle.wait(), self.limits.close_timeout_s)
        except TimeoutError:
            pass   # the engine did not let them go in time; whatever they return later is still recorded
        return episode.conversation

    def stats(self) -> dict[str, float]:
        calls = max(self.counters["calls"], 1)
        return {**self.counters, "overhead_ms_per_call": round(1000 * self.counters["overhead_s"] / calls, 3)}

    # ---------------------------------------------------------------------------------------- routes

    async def _models(self, request: web.Request) -> web.Response:
        from aiohttp import web

        self._episode(request)
        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._serve(request, CHAT_KEYS, self._chat_body)

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._serve(request, COMPLETION_KEYS, self._completion_body)

    async def _serve(self, request: web.Request, keys: set[str], handle: Any) -> web.Response:
        from aiohttp import web

        t0 = time.perf_counter()
        engine_s = [0.0]
        try:
            episode = self._episode(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise HTTPFailure(400, "invalid_request_error", "the request body is not JSON") from None
            if not isinstance(body, dict):
                raise HTTPFailure(400, "invalid_request_error", "the request body must be a JSON object")
            unknown = sorted(set(body) - keys)
            if unknown:
                raise HTTPFailure(400, "invalid_request_error", f"unknown field(s) {unknown}")
            if body.get("stream"):
                raise HTTPFailure(400, "invalid_request_error", "stream: streaming is not served")
            answer = await handle(episode, body, engine_s)
            return web.json_response(answer)
        except HTTPFailure as exc:
            self.counters["errors"] += 1
            return web.json_response({"error": {"message": str(exc), "type": exc.kind, "code": exc.status}},
                                     status=exc.status)
        finally:
            self.counters["calls"] += 1
            self.counters["engine_s"] += engine_s[0]
            self.counters["overhead_s"] += time.perf_counter() - t0 - engine_s[0]

    def _episode(self, request: web.Request) -> Episode:
        auth = request.headers.get("Authorization", "")
        key = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else ""
        if key in self.ended:
            raise HTTPFailure(410, "episode_ended", f"the episode of this key has ended: {self.ended[key]}")
        episode = self.episodes.get(key)
        if episode is None:
            raise HTTPFailure(401, "authentication_error", "unknown key (Authorization: Bearer <episode key>)")
        return episode

    # ------------------------------------------------------------------------------------------ chat

    async def _chat_body(self, episode: Episode, body: dict[str, Any], engine_s: list[float]) -> dict[str, Any]:
        try:
            messages = validate_messages(body.get("messages"))
            tools = validate_tools(body.get("tools"))
        except ChatError as exc:
            raise HTTPFailure(400, "invalid_request_error", str(exc)) from None
        sampling, n, logprobs = self._sampling(body)
        try:
            prepared = episode.conversation.prepare_chat(messages, tools)
        except (ChatError, ConversationError) as exc:
            raise HTTPFailure(400, "invalid_request_error", str(exc)) from None
        stops = sampling.stop_token_ids
        if tools and self.tool_stop_ids:
            sampling = dataclasses.replace(sampling, stop_token_ids=(*stops, *(i for i in self.tool_stop_ids
                                                                                if i not in stops)))
        results = await self._generate(episode, prepared, sampling, n, engine_s)
        replies = episode.conversation.record_chat(prepared, messages, results, stops, tools)
        self._ended_meanwhile(episode)
        choices = []
        for i, (result, reply) in enumerate(zip(results, replies)):
            finish = "tool_calls" if reply.get("tool_calls") else result.finish_reason
            choice: dict[str, Any] = {"index": i, "message": {**reply, "content": reply["content"] or None},
                                      "finish_reason": finish, "logprobs": None,
                                      "token_ids": list(result.output_ids), "weight_versions": list(result.versions)}
            if logprobs:
                choice["logprobs"] = {"content": [
                    {"token": self._token_text(t), "logprob": lp, "bytes": list(self._token_text(t).encode()),
                     "top_logprobs": []} for t, lp in zip(result.output_ids, result.logprobs)]}
            choices.append(choice)
        return {"id": f"chatcmpl-{episode.name}-{episode.requests}", "object": "chat.completion",
                "created": int(time.time()), "model": MODEL_NAME, "choices": choices,
                "usage": self._usage(prepared, results), "matched": prepared.matched}

    # ----------------------------------------------------------------------------------- completions

    async def _completion_body(self, episode: Episode, body: dict[str, Any], engine_s: list[float]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = getattr(self.codec, "vocab_size", None)
            if vocab is not None and not all(0 <= t < vocab for t in prompt):
                raise HTTPFailure(400, "invalid_request_error", f"prompt: token ids must be within [0, {vocab})")
        elif not isinstance(prompt, str) or not prompt:
            raise HTTPFailure(400, "invalid_request_error", "prompt: expected a non-empty string or list of token ids")
        sampling, n, logprobs = self._sampling(body)
        try:
            prepared = episode.conversation.prepare_completion(prompt)
        except ConversationError as exc:
            raise HTTPFailure(400, "invalid_request_error", str(exc)) from None
        results = await self._generate(episode, prepared, sampling, n, engine_s)
        texts = episode.conversation.record_completion(prepared, results, sampling.stop_token_ids)
        self._ended_meanwhile(episode)
        choices = []
        for i, (result, text) in enumerate(zip(results, texts)):
            choice: dict[str, Any] = {"index": i, "text": text, "finish_reason": result.finish_reason, "logprobs": None,
                                      "token_ids": list(result.output_ids), "weight_versions": list(result.versions)}
            if logprobs:
                choice["logprobs"] = {"tokens": [self._token_text(t) for t in result.output_ids],
                                      "token_logprobs": list(result.logprobs), "top_logprobs": None}
            choices.append(choice)
        return {"id": f"cmpl-{episode.name}-{episode.requests}", "object": "text_completion",
                "created": int(time.time()), "model": MODEL_NAME, "choices": choices,
                "usage": self._usage(prepared, results), "matched": prepared.matched}

    # ---------------------------------------------------------------------------------------- shared

    def _sampling(self, body: dict[str, Any]) -> tuple[SamplingParams, int, bool]:
        """The request's sampling fields as the engine's, its ``n`` and whether it asks for log-probs."""
        def number(key: str, default: float) -> float:
            value = body.get(key, default)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise HTTPFailure(400, "invalid_request_error", f"{key}: expected a number, got {value!r}")
            return float(value)

        n = number("n", 1)
        if n != int(n) or not 1 <= n <= 64:
            raise HTTPFailure(400, "invalid_request_error", f"n: expected an integer within [1, 64], got {body['n']!r}")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = self.limits.max_new_tokens
        if asked is not None:
            if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
                raise HTTPFailure(400, "invalid_request_error", f"max_tokens: expected an integer >= 1, got {asked!r}")
            max_new = min(max_new, asked)
        stops = body.get("stop")
        stops = [stops] if isinstance(stops, str) else (stops or [])
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise HTTPFailure(400, "invalid_request_error", "stop: expected a string or a list of strings")
        stop_ids = list(self.limits.stop_token_ids)
        for s in stops:
            ids = self.codec.encode(s)
            if len(ids) != 1:
                raise HTTPFailure(400, "invalid_request_error",
                                  f"stop: {s!r} is {len(ids)} tokens; the engine stops on single tokens only")
            stop_ids += [i for i in ids if i not in stop_ids]
        top = body.get("top_logprobs")
        if top not in (None, 0):
            raise HTTPFailure(400, "invalid_request_error", "top_logprobs: only 0 is served (the sampled token's own)")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise HTTPFailure(400, "invalid_request_error", f"seed: expected an integer, got {seed!r}")
        try:
            sampling = SamplingParams(temperature=number("temperature", 1.0), top_p=number("top_p", 1.0),
                                      max_new_tokens=max_new, stop_token_ids=tuple(stop_ids), seed=seed)
        except RequestError as exc:
            raise HTTPFailure(400, "invalid_request_error", str(exc)) from None
        # chat: a boolean; completions: how many alternatives (0 included), of which only the sampled token's
        # own is served
        return sampling, int(n), body.get("logprobs") is not None and body.get("logprobs") is not False

    async def _generate(self, episode: Episode, prepared: Prepared, sampling: SamplingParams, n: int,
                        engine_s: list[float]) -> list[Any]:
        """The engine's answers to the prepared context; the branch is released (its tail taken back) if the
        engine refuses it, and the answer is an error line either way."""
        conversation = episode.conversation
        room = (self.limits.max_context - len(prepared.context)) if self.limits.max_context else sampling.max_new_tokens
        if room < 1:
            conversation.release(prepared)
            raise HTTPFailure(400, "context_length_exceeded",
                              f"the context of {len(prepared.context)} tokens leaves no room under "
                              f"max_context={self.limits.max_context}")
        episode.requests += 1
        seed = sampling.seed if sampling.seed is not None else turn_seed(episode.seed, 0, episode.requests)
        sampling = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room), seed=seed)
        rid = f"{episode.name}/r{episode.requests}"
        episode.in_flight.add(rid)
        episode.idle.clear()
        t0 = time.perf_counter()
        try:
            return await self.engine.generate(GenerationRequest(rid, tuple(prepared.context), sampling, n))
        except RequestError as exc:
            conversation.release(prepared)
            raise HTTPFailure(400, "invalid_request_error", str(exc)) from None
        except EngineError as exc:
            conversation.release(prepared)
            raise HTTPFailure(503, "engine_error", str(exc)) from None
        except BaseException:
            conversation.release(prepared)
            raise
        finally:
            engine_s[0] += time.perf_counter() - t0
            episode.in_flight.discard(rid)
            if not episode.in_flight:
                episode.idle.set()

    @staticmethod
    def _ended_meanwhile(episode: Episode) -> None:
        if episode.ended:   # its tokens are recorded; the agent learns the episode is over
            raise HTTPFailure(410, "episode_ended", f"the episode ended during this request: {episode.ended}")

    def _token_text(self, token: int) -> str:
        try:
            return self.codec.decode([token], skip_special_tokens=False)  # type: ignore[call-arg]
        except TypeError:
            return self.codec.decode([token])

    @staticmethod
    def _usage(prepared: Prepared, results: Sequence[Any]) -> dict[str, int]:
        completion = sum(len(r.output_ids) for r in results)
        return {"prompt_tokens": len(prepared.context), "completion_tokens": completion,
                "total_tokens": len(prepared.context) + completion}
