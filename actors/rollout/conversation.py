"""Token in, token out: the exact token ids of an agent's conversations, whatever text the agent sends back.

An agent talks to the model in OpenAI messages (actors/rollout/openai_server.py); the model reads and writes
tokens. A `Conversation` is one episode's side of that: it keeps, per branch, the token ids the model was
given and sampled (an episode `Trajectory`: generated tokens with their log-probs and weight versions, loss
mask 1; everything else, loss mask 0 and version -1), and turns each new request's messages into the next
context without ever re-tokenizing what the model wrote:

1. The request's messages are matched, message by message, against what each branch holds after each of its
   replies (`chat.same_message`: the reply as the agent echoes it back). The longest match is the parent.
2. The request is rendered with the model's chat template. If that text starts with the decoded parent
   tokens, only the rest (the new tool results or user messages, and the generation prompt) is tokenized and
   appended: the context is the parent's tokens, exactly, plus the new tail.
3. If it does not (drift: the template renders the model's earlier turns differently from what the model
   wrote, e.g. re-serialised tool-call JSON), the parent's tokens are kept as they are and only the new
   messages' own text (the full rendering past the rendering of the matched messages) is tokenized. The event
   is counted (``drift``). Where even that cannot be told apart, the request starts a new trajectory from
   its full rendering, whose tokens are all prompt (never trained), also counted.
4. A request with no parent (a first request, or a history the model did not write) starts a new branch
   from its rendering. A parent that is not its branch's latest state, or is busy with another request,
   forks: the branch's tokens up to that point are copied into a new trajectory (a conversation that
   branches becomes separate trajectories), and so do the extra samples of a request with ``n`` > 1.

Plain completions (``/v1/completions``) use the same branches on token ids: a prompt given as ids extends the
branch whose context it starts with; a prompt given as text extends the branch whose decoded context it
starts with, tokenizing only the rest.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from actors.engines.base import GenerationResult
from actors.rollout.chat import ChatTemplate, parse_tool_calls, same_message
from actors.rollout.episode import Codec, Trajectory, Turn


@dataclasses.dataclass
class Checkpoint:
    """A state a branch passed through: its first ``length`` context tokens hold exactly ``messages``."""

    messages: list[dict[str, Any]]
    length: int


@dataclasses.dataclass
class Branch:
    """One trajectory of a conversation and the message states along it."""

    trajectory: Trajectory
    checkpoints: list[Checkpoint] = dataclasses.field(default_factory=list)
    busy: bool = False

    def fork(self, length: int) -> "Branch":
        """A new branch holding this one's first ``length`` context tokens (and the states within them)."""
        t = self.trajectory
        cut = length - len(t.prompt_ids)
        turns, kept = [], 0
        for turn in t.turns:   # turns wholly inside the copied tokens
            kept += turn.generated + turn.observation_tokens
            if kept > cut:
                break
            turns.append(copy.copy(turn))
        trajectory = Trajectory(list(t.prompt_ids), t.output_ids[:cut], t.loss_mask[:cut], t.logprobs[:cut],
                                t.versions[:cut], turns)
        return Branch(trajectory, [c for c in self.checkpoints if c.length <= length])


@dataclasses.dataclass
class Prepared:
    """What a request continues from: the branch that takes its answer, the exact context, how it was found."""

    branch: Branch
    context: list[int]
    tail_tokens: int          # tokens this request added (rendered and tokenized from the agent's messages)
    matched: str              # "new", "extend", "fork", "drift" or "rerendered"
    before: int | None = None # the branch's context length before the tail (None: a branch of its own)


class ConversationError(ValueError):
    """A request that cannot continue this conversation; the message says why."""


class Conversation:
    """One episode's branches. Not thread-safe: one event loop calls it, and `prepare` marks the branch busy
    until `record` or `release`."""

    def __init__(self, codec: Codec, template: ChatTemplate | None, tool_format: str = "qwen") -> None:
        self.codec, self.template, self.tool_format = codec, template, tool_format
        self.branches: list[Branch] = []
        self.counters = {"requests": 0, "drift": 0, "rerendered": 0, "forks": 0, "tool_calls": 0}

    # ------------------------------------------------------------------------------------------- chat

    def prepare_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Prepared:
        """The context of a chat request (see the module docstring); ChatError from rendering."""
        if self.template is None:
            raise ConversationError("the model has no chat template (tokenizer_config.json has no chat_template)")
        self.counters["requests"] += 1
        rendered = self.template.render(messages, tools, add_generation_prompt=True)
        parent, checkpoint = self._parent(messages)
        if parent is None or checkpoint is None:
            if any(m["role"] == "assistant" for m in messages):
                self.counters["rerendered"] += 1   # assistant text the model did not write here: prompt only
            return self._new_branch(self.codec.encode(rendered), "new")
        held = parent.trajectory.context[:checkpoint.length]
        held_text = self._decode(held)
        if rendered.startswith(held_text):
            tail, matched = rendered[len(held_text):], "extend"
        else:
            self.counters["drift"] += 1
            before = self.template.render(messages[:len(checkpoint.messages)], tools, add_generation_prompt=False)
            if not rendered.startswith(before):
                # The template renders the earlier messages differently once more follow: nothing tells the new
                # messages' text apart. A new trajectory of prompt tokens; the model's own stay in the parent.
                self.counters["rerendered"] += 1
                return self._new_branch(self.codec.encode(rendered), "rerendered")
            tail, matched = rendered[len(before):], "drift"
        tail_ids = self.codec.encode(tail)
        branch = self._take(parent, checkpoint.length)
        if matched == "extend" and branch is not parent:
            matched = "fork"
        return self._extend(branch, tail_ids, tail, matched)

    def _extend(self, branch: Branch, tail_ids: list[int], tail: str, matched: str) -> Prepared:
        before = len(branch.trajectory.context)
        branch.trajectory.add_observation(tail_ids)
        if branch.trajectory.turns:
            last = branch.trajectory.turns[-1]
            last.observation, last.observation_tokens = tail, len(tail_ids)
        branch.busy = True
        return Prepared(branch, branch.trajectory.context, len(tail_ids), matched, before)

    def _parent(self, messages: list[dict[str, Any]]) -> tuple[Branch | None, Checkpoint | None]:
        """The branch and state holding the longest prefix of ``messages`` that ends on a model reply; among
        equally long ones, a state that is its branch's latest and free (extended in place, not forked)."""
        best: tuple[Branch | None, Checkpoint | None] = (None, None)
        best_rank = (-1, False)
        for branch in self.branches:
            for checkpoint in branch.checkpoints:
                held = checkpoint.messages
                if len(held) > len(messages) or not all(same_message(s, k) for s, k in zip(messages, held)):
                    continue
                free = not branch.busy and checkpoint.length == len(branch.trajectory.context)
                if (len(held), free) > best_rank:
                    best, best_rank = (branch, checkpoint), (len(held), free)
        return best

    def _take(self, parent: Branch, length: int) -> Branch:
        """The branch a request from ``parent``'s first ``length`` tokens goes on: the parent itself when that
        is its latest state and it is free, else a fork."""
        if not parent.busy and length == len(parent.trajectory.context):
            return parent
        self.counters["forks"] += 1
        fork = parent.fork(length)
        self.branches.append(fork)
        return fork

    def _new_branch(self, prompt_ids: list[int], matched: str) -> Prepared:
        if not prompt_ids:
            raise ConversationError("the request renders to no tokens")
        branch = Branch(Trajectory(list(prompt_ids)), busy=True)
        self.branches.append(branch)
        return Prepared(branch, list(prompt_ids), len(prompt_ids), matched)

    def _decode(self, ids: Sequence[int]) -> str:
        try:
            return self.codec.decode(ids, skip_special_tokens=False)  # type: ignore[call-arg]
        except TypeError:   # a codec without special tokens to skip
            return self.codec.decode(ids)

    def record_chat(self, prepared: Prepared, messages: list[dict[str, Any]], results: list[GenerationResult],
                    stop_ids: Sequence[int] = (), tools: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """Append each sample's tokens (sample 0 on the request's branch, the others on forks of it) and return
        the reply messages, in OpenAI form, in sample order. ``stop_ids``: the stops left out of the replies'
        text; ``tools``: the request's (the tool format may need them)."""
        replies = []
        for result, branch in zip(results, self._sample_branches(prepared, len(results))):
            text = self._reply_text(result, stop_ids)
            content, calls = parse_tool_calls(text, self.tool_format, tools)
            self.counters["tool_calls"] += len(calls)
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = calls
            self._append(branch, result, text, "tool_calls" if calls else None)
            branch.checkpoints.append(Checkpoint([*messages, reply], len(branch.trajectory.context)))
            replies.append(reply)
        return replies

    # ------------------------------------------------------------------------------------ completions

    def prepare_completion(self, prompt: str | list[int]) -> Prepared:
        """The context of a plain completion: the branch whose exact context the prompt extends, else new."""
        self.counters["requests"] += 1
        for branch in reversed(self.branches):
            held = branch.trajectory.context
            if branch.busy:
                continue
            if isinstance(prompt, list):
                if prompt[:len(held)] != held:
                    continue
                tail_ids = prompt[len(held):]
            else:
                held_text = self._decode(held)
                if not prompt.startswith(held_text):
                    continue
                tail_ids = self.codec.encode(prompt[len(held_text):])
            return self._extend(branch, list(tail_ids), self.codec.decode(tail_ids), "extend")
        ids = list(prompt) if isinstance(prompt, list) else self.codec.encode(prompt)
        return self._new_branch(ids, "new")

    def record_completion(self, prepared: Prepared, results: list[GenerationResult],
                          stop_ids: Sequence[int] = ()) -> list[str]:
        texts = []
        for result, branch in zip(results, self._sample_branches(prepared, len(results))):
            texts.append(self._reply_text(result, stop_ids))
            self._append(branch, result, texts[-1], None)
        return texts

    # ------------------------------------------------------------------------------------------ shared

    def _sample_branches(self, prepared: Prepared, n: int) -> list[Branch]:
        """Sample 0 goes on the request's branch; each other sample on a copy of it taken before any is added."""
        length = len(prepared.context)
        others = [prepared.branch.fork(length) for _ in range(n - 1)]
        self.branches.extend(others)
        self.counters["forks"] += len(others)
        prepared.branch.busy = False
        return [prepared.branch, *others]

    def _reply_text(self, result: GenerationResult, stop_ids: Sequence[int]) -> str:
        """The sample's text without the stop token that ended it (the end of turn is the template's, a stop
        sequence is not returned, as OpenAI's servers do), special tokens kept (Qwen's ``<tool_call>``)."""
        ids = result.output_ids
        if result.finish_reason == "stop" and ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        return self._decode(ids)

    @staticmethod
    def _append(branch: Branch, result: GenerationResult, text: str, ended_by: str | None) -> None:
        branch.trajectory.add_generated(result)
        branch.trajectory.turns.append(Turn(generated=len(result.output_ids), finish_reason=result.finish_reason,
                                            ended_by=ended_by or result.finish_reason, text=text))

    def release(self, prepared: Prepared) -> None:
        """A request that produced no tokens (refused by the engine, or the episode ended first): what it added
        is taken back and its branch is free again."""
        branch = prepared.branch
        branch.busy = False
        if prepared.before is None:
            self.branches.remove(branch)
            return
        t, cut = branch.trajectory, prepared.before - len(branch.trajectory.prompt_ids)
        del t.output_ids[cut:], t.loss_mask[cut:], t.logprobs[cut:], t.versions[cut:]
        if t.turns:
            t.turns[-1].observation, t.turns[-1].observation_tokens = None, 0

    def trajectories(self) -> list[Trajectory]:
        """One per branch that holds generated tokens, in the order the branches began."""
        return [b.trajectory for b in self.branches if b.trajectory.generated_tokens]
