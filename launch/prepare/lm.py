"""What the supervised warm start (`tools.sft`) and evaluation (`tools.eval`) share.

* model directories: `load_or_init` loads a Hugging Face-layout directory, or initialises the model
  randomly from its config.json (with a seed) when the directory has no weights yet;
* supervised examples: `SFTExample` (prompt tokens + response tokens ending in eos), built from dataset
  records with worked solutions (`examples_from_records`; a record with ``transcripts``, an episode's
  turns and observations, gives one example per transcript whose observation tokens are never trained) or
  from {"prompt", "response"} JSON lines (`read_pairs`), and packed into padding-free micro-batches whose
  `loss_mask` covers only the trained response tokens (`pack_examples`);
* batched generation (`agenerate`, `generate`) and grading (`grade_many`), re-exported from
  `actors/evaluator/evaluation.py`, where the evaluator actor shares them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from actors.dataset import DatasetError, OnError, Record
from actors.engines.base import PackedBatch
from actors.engines.checkpoint import has_weights, load_config, load_model
from actors.engines.model import Qwen2ForCausalLM
from actors.engines.tokenizer import LoadedTokenizer
from algo.packing import allocate_micro_batches


class LMToolError(ValueError):
    """A model directory, example or setting the tools cannot use; the message names the cause."""


# --- model directories ---------------------------------------------------------------------------

def load_or_init(model_dir: str | Path, seed: int = 0, device: str = "cpu") -> tuple[Qwen2ForCausalLM, bool]:
    """(model in float32 on `device`, whether it was randomly initialised because there were no weights)."""
    model_dir = str(model_dir)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise LMToolError(f"{model_dir}: not a model directory (no config.json)")
    if has_weights(model_dir):
        return load_model(model_dir, device=device), False
    model = Qwen2ForCausalLM(load_config(model_dir)).init_weights(seed)
    return model.to(device), True


# --- supervised examples -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One training sequence: the prompt (no loss) followed by the response, which ends with eos."""

    source: str                      # query id (with solution index) or "file:line", for error messages
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    level: int | None = None
    # Per response token, 1 if trained, 0 if not (an environment's observation); None: every token is trained.
    response_mask: tuple[int, ...] | None = None

    @property
    def trained_tokens(self) -> int:
        return len(self.response_ids) if self.response_mask is None else sum(self.response_mask)

    @property
    def tokens(self) -> list[int]:
        return list(self.prompt_ids) + list(self.response_ids)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def _eos(tokenizer: LoadedTokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise LMToolError("the tokenizer names no eos token (generation_config.json / tokenizer_config.json)")
    return tokenizer.eos_token_id


def make_example(tokenizer: LoadedTokenizer, source: str, prompt: str, response: str,
                 level: int | None = None) -> SFTExample:
    prompt_ids = tokenizer.encode(prompt)
    response_ids = tokenizer.encode(response)
    if not prompt_ids:
        raise LMToolError(f"{source}: the prompt encodes to no tokens")
    if not response_ids:
        raise LMToolError(f"{source}: the response encodes to no tokens")
    return SFTExample(source, tuple(prompt_ids), tuple(response_ids) + (_eos(tokenizer),), level)


TRANSCRIPT_ROLES = ("model", "env")


def transcript_example(tokenizer: LoadedTokenizer, source: str, prompt: str, segments: object,
                       level: int | None = None) -> SFTExample:
    """An episode's demonstration as one example: ``segments`` are ``{"role": "model" | "env", "text": str}``,
    model first and last, alternating. Each segment is tokenized on its own, as an episode appends them
    (generated tokens, then the observation's encoding), and eos follows the last model segment; the
    environment's tokens get loss mask 0."""
    def bad(reason: str) -> LMToolError:
        return LMToolError(f"{source}: transcript {reason}")

    if not isinstance(segments, list) or not segments:
        raise bad(f"must be a non-empty list of segments, got {segments!r:.60}")
    ids: list[int] = []
    mask: list[int] = []
    for j, seg in enumerate(segments):
        if not isinstance(seg, dict) or set(seg) != {"role", "text"}:
            raise bad(f"segment {j}: expected {{'role', 'text'}}, got {seg!r:.60}")
        want = TRANSCRIPT_ROLES[j % 2]
        if seg["role"] != want:
            raise bad(f"segment {j}: role {seg['role']!r}, expected {want!r} (model and env alternate, model first)")
        if not isinstance(seg["text"], str) or not seg["text"]:
            raise bad(f"segment {j}: text must be a non-empty string")
        piece = tokenizer.encode(seg["text"])
        ids += piece
        mask += [1 if want == "model" else 0] * len(piece)
    if len(segments) % 2 == 0:
        raise bad("must end with a model segment (the answer)")
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise LMToolError(f"{source}: the prompt encodes to no tokens")
    return SFTExample(source, tuple(prompt_ids), tuple(ids) + (_eos(tokenizer),), level, tuple(mask) + (1,))


def examples_from_records(records: Sequence[Record], tokenizer: LoadedTokenizer) -> list[SFTExample]:
    """One example per worked solution of every record (records without solutions give none); a record with
    ``transcripts`` gives one example per transcript instead (`transcript_example`)."""
    out = []
    for rec in records:
        transcripts = rec.extra.get("transcripts")
        if transcripts is not None:
            if not isinstance(transcripts, list) or not transcripts:
                raise LMToolError(f"{rec.query_id}: transcripts must be a non-empty list, got {transcripts!r:.60}")
            for i, segments in enumerate(transcripts):
                source = rec.query_id if len(transcripts) == 1 else f"{rec.query_id}#{i}"
                out.append(transcript_example(tokenizer, source, rec.prompt, segments, rec.level))
            continue
        for i, solution in enumerate(rec.solutions):
            source = rec.query_id if len(rec.solutions) == 1 else f"{rec.query_id}#{i}"
            out.append(make_example(tokenizer, source, rec.prompt, solution, rec.level))
    return out


@dataclasses.dataclass(frozen=True)
class Pair:
    source: str
    prompt: str
    response: str
    level: int | None = None


def read_pairs(path: str | Path, on_error: OnError = "fail") -> tuple[list[Pair], list[DatasetError]]:
    """{"prompt": str, "response": str, "level"?: int} lines; bad lines raise (or are skipped with
    on_error="skip") as `actors.dataset.DatasetError` naming the file, line and field."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(path, None, "no such file")
    pairs: list[Pair] = []
    skipped: list[DatasetError] = []
    with path.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(path, line_no, f"not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise DatasetError(path, line_no, f"expected a JSON object, got {type(obj).__name__}")
                for key in ("prompt", "response"):
                    value = obj.get(key)
                    if not isinstance(value, str) or not value:
                        raise DatasetError(path, line_no, f"expected a non-empty string, got {value!r:.60}", key)
                level = obj.get("level")
                if level is not None and (isinstance(level, bool) or not isinstance(level, int) or level < 0):
                    raise DatasetError(path, line_no, f"expected a non-negative integer, got {level!r}", "level")
            except DatasetError as err:
                if on_error == "fail":
                    raise
                skipped.append(err)
                continue
            pairs.append(Pair(f"{path.name}:{line_no}", obj["prompt"], obj["response"], level))
    if not pairs:
        detail = f" ({len(skipped)} malformed lines skipped, first: {skipped[0]})" if skipped else ""
        raise DatasetError(path, None, f"no usable prompt/response pairs{detail}")
    return pairs, skipped


def is_pairs_file(path: str | Path) -> bool:
    """True when the first non-blank line is an object with "response" and without "solutions"."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(obj, dict) and "response" in obj and "solutions" not in obj
    return False


def pack_examples(examples: Sequence[SFTExample], max_tokens: int) -> list[PackedBatch]:
    """Padding-free micro-batches of at most max_tokens tokens, balanced by `allocate_micro_batches`;
    `fields["loss_mask"]` is 1 on response tokens (the eos included) and 0 on the prompt and on the
    response tokens an example's `response_mask` leaves out."""
    if not examples:
        raise LMToolError("pack_examples: no examples")
    too_long = [e for e in examples if len(e) > max_tokens]
    if too_long:
        e = too_long[0]
        raise LMToolError(f"{e.source}: {len(e)} tokens do not fit a micro-batch of {max_tokens} tokens "
                          "(raise --max-tokens-per-mb)")
    groups = allocate_micro_batches([len(e) for e in examples], max_tokens)
    batches = []
    for group in groups:
        chosen = [examples[i] for i in group]
        masks = [[0.0] * len(e.prompt_ids) + ([1.0] * len(e.response_ids) if e.response_mask is None
                                               else [float(m) for m in e.response_mask]) for e in chosen]
        batches.append(PackedBatch.from_sequences([e.tokens for e in chosen], {"loss_mask": masks}))
    return batches


def batch_stream(n: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless batches of indices into n examples: successive seeded permutations (an epoch is one
    permutation; a batch may straddle two epochs), so every example is seen once per epoch."""
    if n < 1 or batch_size < 1:
        raise LMToolError(f"batch_stream: need n >= 1 and batch_size >= 1, got n={n}, batch_size={batch_size}")
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        while len(order) < batch_size:
            perm = list(range(n))
            rng.shuffle(perm)
            order.extend(perm)
        yield order[:batch_size]
        del order[:batch_size]

