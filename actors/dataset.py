"""JSON-lines datasets: reading, validating and reporting bad lines.

One loader for every consumer (the buffer's prompts, the supervised warm start, evaluation) and for
both our generated task (`tools/make_task.py`) and users' files in AReaL's layout. A line is one
JSON object:

=============  ==========================  =====================================================
field          type                        meaning
=============  ==========================  =====================================================
``query_id``   string (an integer is        unique within the file
               accepted and stringified)
``prompt``     non-empty string            what the model is given
``answer``     string or number            the final answer the reward checks; when absent, every
                                           solution's answer is accepted (AReaL's math data carry
                                           only solutions): its last ``\\boxed{...}``, else, as
                                           AReaL's reward reads a solution, the text after "the
                                           answer is", else its last number
``solutions``  list of non-empty strings   worked solutions (supervised targets), optional
``level``      non-negative integer         difficulty level, optional
=============  ==========================  =====================================================

Other fields are kept in ``Record.extra``.

Other layouts are read through a `Layout`, the field mapping of the config's ``data`` section
(``data.layout``, ``data.fields``, ``data.id2info``, ``data.prompt_template``; `Layout.from_settings`):

===========  ==========================================================================================
layout       what a line holds
===========  ==========================================================================================
``areal``    the table above (the default): our generated task, the tutorial's ``boba_106k_0319.jsonl``
             and ``orz-zero_56k_0319.jsonl`` (``query_id``, ``prompt``, ``solutions`` of boxed answers,
             ``task``), v0.1's ``prompts_for_r1_distilled.jsonl`` (``query_id``, ``prompt``) with
             ``data.id2info``
``areal_eval`` AReaL's evaluation files (``evaluation/data/<name>/test.jsonl``: aime24, aime25, amc23,
             math_500, ...): the prompt is the first of ``question``, ``problem``, ``Question``, ``input``
             the line has (AReaL's ``parse_question``), the answer its ``answer`` (a number is
             stringified), else the last ``\\boxed{...}`` of its ``solution``; the line number is the id
``gsm8k``    ``question`` and ``answer``, whose final answer follows ``####``; the line number is the id
``math``     ``problem`` and a worked ``solution`` whose last ``\\boxed{...}`` is the answer (an ``answer``
             field, as MATH-500 has, wins), ``level`` as ``"Level 3"``; the line number is the id
===========  ==========================================================================================

``data.fields`` renames any field of the chosen layout (``{prompt: input, query_id: uid}``); naming
``query_id: null`` numbers lines instead. ``data.id2info`` names AReaL's answer file, a JSON object
``{query_id: {"solutions": [...]}}`` for prompt files that carry none: a prompt whose id is missing there is
an error on its line. ``data.prompt_template`` wraps every prompt (``{prompt}`` marks where it goes, or it names
one of AReaL's templates: ``topology.experiment.PROMPT_TEMPLATES``), for base models that need the
instructions around the question; a prompt that already carries a template (the template's own text before
or after ``{prompt}``, or an assistant-turn marker such as ``<｜Assistant｜>`` or ``Assistant: <think>``: AReaL's
released prompt files come templated) is used as it is, and `Dataset.templated_as_is` counts those. Errors
name the file's own field names.

A path that does not exist is also looked for under the name ``wget`` gives the tutorial's downloads
(``boba_106k_0319.jsonl?download=true``): `resolve_data_path`.

A malformed line (bad JSON, a bad field, bytes that are not
UTF-8, a line longer than ``max_line_bytes``) raises `DatasetError` naming the file, the line number and
the cause; with ``on_error="skip"`` it is counted and skipped instead (named in one warning), unless more than
``max_bad_share`` of the file's lines are malformed (then the file is refused as a whole). A line over the
length limit is never held in memory whole: it is read past in chunks. `sniff_file` says when a file is
empty, binary or compressed before any line is read.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import structlog
from pydantic import ValidationError

from topology.experiment import DEFAULT_MAX_LINE_BYTES, DataSection, prompt_template_text
from topology.schema import problem_lines

log = structlog.get_logger("dataset")

OnError = Literal["skip", "fail"]
SHOWN_SKIPS = 5   # skipped lines named in the load's one warning (the count says how many in all)
Require = Literal["answer", "solutions", "none"]
LAYOUT_FIELDS = ("query_id", "prompt", "answer", "solutions", "solution", "level")
# A prompt of the longest recipes (32k tokens) is well under 1 MiB of text; a longer line is a broken file.


class DatasetError(ValueError):
    """A dataset line (or file) that cannot be used; the message names file, line and cause."""

    def __init__(self, path: str | Path, line_no: int | None, reason: str, field_name: str | None = None):
        self.path, self.line_no, self.reason, self.field = str(path), line_no, reason, field_name
        where = f"{self.path}:{line_no}" if line_no is not None else self.path
        what = f"field {field_name!r}: " if field_name else ""
        super().__init__(f"{where}: {what}{reason}")


@dataclass(frozen=True)
class Layout:
    """Where a line keeps each field of a `Record` (None: the line has no such field), and what to do to it."""

    query_id: str | None = "query_id"     # None: the line number is the id
    prompt: str = "prompt"
    prompt_fallbacks: tuple[str, ...] = ()  # fields tried in order when the line has no `prompt`
    answer: str | None = "answer"
    solutions: str | None = "solutions"   # a list of worked solutions
    solution: str | None = None           # one worked solution (a string)
    level: str | None = "level"
    answer_after: str | None = None       # the answer is the text after the last occurrence of this marker
    id2info: str | None = None            # AReaL's answer file: {query_id: {"solutions": [...]}}
    prompt_template: str | None = None    # "{prompt}" is replaced by the line's prompt

    def __post_init__(self) -> None:
        if self.prompt_template is not None and "{prompt}" not in self.prompt_template:
            raise ValueError(f"prompt_template: must contain {{prompt}}, got {_short(self.prompt_template)}")

    @classmethod
    def from_settings(cls, data: DataSection | dict[str, Any] | None, *, test: bool = False) -> "Layout":
        """The layout the config's ``data`` section describes (topology.experiment.DataSection declares the keys;
        a mapping is read through that model, so its problems name their keys). ``test``: the layout of
        ``data.test``, which is ``data.test_layout`` (with only the prompt template) when that is set."""
        if not isinstance(data, DataSection):
            try:
                data = DataSection.model_validate(data or {})
            except ValidationError as exc:
                raise ValueError("; ".join(problem_lines(exc, "data", DataSection))) from None
        template = {"prompt_template": prompt_template_text(data.prompt_template)} if data.prompt_template else {}
        if test and data.test_layout is not None:
            return replace(LAYOUTS[data.test_layout], **template)
        # exclude_unset: `query_id: null` in the file means "number the lines", not "the layout's field"
        fields = data.fields.model_dump(exclude_unset=True) if data.fields is not None else {}
        if "prompt" in fields and not fields["prompt"]:
            raise ValueError("data.fields.prompt: every line needs a prompt field")
        extra = {k: getattr(data, k) for k in ("answer_after", "id2info") if getattr(data, k) is not None}
        return replace(LAYOUTS[data.layout], **fields, **extra, **template)

    @property
    def consumed(self) -> tuple[str, ...]:
        """The line's fields this layout reads (the rest go to `Record.extra`)."""
        return tuple(n for n in (self.query_id, self.prompt, *self.prompt_fallbacks, self.answer, self.solutions,
                                 self.solution, self.level) if n is not None)


LAYOUTS: dict[str, Layout] = {
    "areal": Layout(),
    "gsm8k": Layout(query_id=None, prompt="question", answer="answer", solutions=None, level=None,
                    answer_after="####"),
    "math": Layout(query_id=None, prompt="problem", answer="answer", solutions=None, solution="solution"),
    # AReaL's evaluation/data/<name>/test.jsonl (tag v0.2.0): evaluation/parser.py's parse_question takes the
    # first of these fields, parse_ground_truth the `answer` (math_500 also has a worked `solution`)
    "areal_eval": Layout(query_id=None, prompt="question", prompt_fallbacks=("problem", "Question", "input"),
                         answer="answer", solutions=None, solution="solution"),
}
AREAL = LAYOUTS["areal"]
_MATH_LEVEL = re.compile(r"Level (\d+|\?)")


def load_id2info(path: str | Path) -> dict[str, list[str]]:
    """AReaL's answer file: query id -> its worked solutions (at least one, each a non-empty string)."""
    path = resolve_data_path(path)
    if not path.is_file():
        raise DatasetError(path, None, f"no such file (data.id2info), nor {path.name}{DOWNLOAD_SUFFIX}")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(path, None, f"not a JSON file ({e})") from None
    if not isinstance(doc, dict):
        raise DatasetError(path, None, f"expected a JSON object of query ids, got {type(doc).__name__}")
    out: dict[str, list[str]] = {}
    for qid, info in doc.items():
        sols = info.get("solutions") if isinstance(info, dict) else None
        if not isinstance(sols, list) or not sols or not all(isinstance(x, str) and x for x in sols):
            raise DatasetError(path, None, f"entry {qid!r}: expected {{\"solutions\": [non-empty strings]}}, got "
                               f"{_short(info)}")
        out[str(qid)] = sols
    return out


@dataclass(frozen=True)
class Record:
    """One validated dataset entry."""

    query_id: str
    prompt: str
    answer: str | None
    solutions: tuple[str, ...] = ()
    level: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    line_no: int | None = field(default=None, compare=False)   # where it was read (tools.filter_data copies the line)
    # Every reference answer the reward accepts, `answer` first: the line's answer alone when it has one, else
    # the answer of each of its solutions (AReaL accepts a response matching any of them). Derived from the
    # line, so it takes no part in equality.
    answers: tuple[str, ...] = field(default=(), compare=False)

    @property
    def references(self) -> tuple[str, ...]:
        """The answers a response is graded against (`answers`, or `answer` for a record built by hand)."""
        return self.answers or ((self.answer,) if self.answer is not None else ())

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON line would hold it (round-trips through `parse_record`)."""
        out: dict[str, Any] = {"query_id": self.query_id, "prompt": self.prompt}
        if self.answer is not None:
            out["answer"] = self.answer
        if self.solutions:
            out["solutions"] = list(self.solutions)
        if self.level is not None:
            out["level"] = self.level
        out.update(self.extra)
        return out


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` in ``text``, or None: the math grader's own extraction, so a
    reference answer taken from a worked solution is read exactly as answers are graded."""
    from actors.reward.math_grader import extract_boxed  # here: only records without an answer need the grader

    return extract_boxed(text)[0]


_ANSWER_IS = ("he answer is", "final answer is")
_NUMBER = re.compile(r"-?\d*\.?\d+")


def solution_answer(text: str) -> str | None:
    """The reference answer of one worked solution, read as AReaL's reward reads a solution (its
    math_verify_utils_qwen.py calls parser.py's ``extract_answer(solution, use_last_number=True)``; tag v0.2.0,
    parser.py lines 503-549; v0.1.1 the same): the last ``\\boxed{...}``; else the text after the last
    "the answer is" / "final answer is"; else the last number (commas dropped). None when there is none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    for marker in _ANSWER_IS:
        if marker in text:
            tail = re.sub(r"\n\s*", "", text.rsplit(marker, 1)[1]).strip()
            tail = tail[:-1] if tail.endswith(".") else tail      # the sentence's full stop, as AReaL drops it
            return tail.strip().strip("$").strip() or None
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


# An assistant turn already opened: the prompt carries a chat or zero-style template (AReaL's released prompt
# files do; AReaL's loaders tokenize the prompt as it is).
ASSISTANT_TURN_MARKERS = ("<｜Assistant｜>", "<|im_start|>assistant", "Assistant: <think>", "\nAssistant:")


def already_templated(prompt: str, template: str) -> bool:
    """Whether `prompt` already carries a template: `template`'s own text before or after {prompt} (at least
    eight characters of it, stripped), or an assistant-turn marker."""
    head, _, tail = template.partition("{prompt}")
    own = [part.strip() for part in (head, tail) if len(part.strip()) >= 8]
    return any(part in prompt for part in own) or any(m in prompt for m in ASSISTANT_TURN_MARKERS)


DOWNLOAD_SUFFIX = "?download=true"


def resolve_data_path(path: str | Path) -> Path:
    """`path`, or, when no such file exists, the same name with ``?download=true``: what ``wget URL?download=true``
    (the tutorial's download commands) saves. The bare path when neither exists (the caller reports it)."""
    path = Path(path)
    if path.exists():
        return path
    downloaded = path.with_name(path.name + DOWNLOAD_SUFFIX)
    return downloaded if downloaded.exists() else path


def parse_record(obj: Any, *, path: str | Path = "<memory>", line_no: int | None = None,
                 require: Require = "answer", layout: Layout = AREAL,
                 id2info: dict[str, list[str]] | None = None, notes: dict[str, int] | None = None) -> Record:
    """Validates one decoded JSON value read through `layout`; raises `DatasetError` naming the offending
    field as the file spells it. ``id2info`` (`load_id2info`) supplies solutions the line lacks. ``notes``
    counts what was done to the line ("templated_as_is": a prompt that already carried a template)."""
    def bad(reason: str, name: str | None = None) -> DatasetError:
        return DatasetError(path, line_no, reason, name)

    if not isinstance(obj, dict):
        raise bad(f"expected a JSON object, got {type(obj).__name__}")
    prompt_field = next((n for n in (layout.prompt, *layout.prompt_fallbacks) if n in obj), None)
    if prompt_field is None:
        alternatives = f" (nor {', '.join(repr(n) for n in layout.prompt_fallbacks)})" if layout.prompt_fallbacks else ""
        raise bad(f"missing{alternatives}", layout.prompt)
    if layout.query_id is not None and layout.query_id not in obj:
        raise bad("missing", layout.query_id)
    if layout.query_id is None:
        if line_no is None:
            raise bad("this layout numbers lines for ids, and no line number was given")
        query_id: Any = str(line_no)
    else:
        query_id = obj[layout.query_id]
    # bool is an int subclass; an id of `true` is a mistake, not a number.
    if isinstance(query_id, bool) or not isinstance(query_id, (str, int)) or query_id == "":
        raise bad(f"expected a non-empty string, got {query_id!r}", layout.query_id)
    prompt = obj[prompt_field]
    if not isinstance(prompt, str) or not prompt:
        raise bad(f"expected a non-empty string, got {_short(prompt)}", prompt_field)
    if layout.prompt_template is not None:
        if already_templated(prompt, layout.prompt_template):   # wrapping it again would nest two templates
            if notes is not None:
                notes["templated_as_is"] = notes.get("templated_as_is", 0) + 1
        else:
            prompt = layout.prompt_template.replace("{prompt}", prompt)

    solutions = obj.get(layout.solutions, []) if layout.solutions else []
    if not isinstance(solutions, list) or not all(isinstance(s, str) and s for s in solutions):
        raise bad(f"expected a list of non-empty strings, got {_short(solutions)}", layout.solutions)
    if layout.solution is not None and layout.solution in obj:
        text = obj[layout.solution]
        if not isinstance(text, str) or not text:
            raise bad(f"expected a non-empty string, got {_short(text)}", layout.solution)
        solutions = [text, *solutions]
    if not solutions and id2info is not None:
        if str(query_id) not in id2info:
            raise bad(f"{str(query_id)!r} has no entry in the answer file (data.id2info: {layout.id2info})",
                      layout.query_id)
        solutions = id2info[str(query_id)]

    answer = obj.get(layout.answer) if layout.answer else None
    answers: tuple[str, ...] = ()
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or answer == "":
            raise bad(f"expected a non-empty string or a number, got {_short(answer)}", layout.answer)
        answer = str(answer)
        if layout.answer_after is not None:
            if layout.answer_after not in answer:
                raise bad(f"no {layout.answer_after!r} before the final answer in {_short(answer)}", layout.answer)
            answer = answer.rsplit(layout.answer_after, 1)[1].strip().replace(",", "")
            if not answer:
                raise bad(f"nothing after {layout.answer_after!r}", layout.answer)
        answers = (answer,)
    elif solutions:
        answers = tuple(dict.fromkeys(a for a in map(solution_answer, solutions) if a is not None))
        answer = answers[0] if answers else None

    level = obj.get(layout.level) if layout.level else None
    if isinstance(level, str) and (m := _MATH_LEVEL.fullmatch(level)):   # MATH spells levels "Level 3"
        level = None if m.group(1) == "?" else int(m.group(1))
    if level is not None and (isinstance(level, bool) or not isinstance(level, int) or level < 0):
        raise bad(f"expected a non-negative integer, got {level!r}", layout.level)

    if require == "answer" and answer is None:
        raise bad("missing, and no solution with an answer (\\boxed{...}, 'the answer is', or a number) to take "
                  "it from", layout.answer or layout.solution or layout.solutions)
    if require == "solutions" and not solutions:
        raise bad("missing or empty: this use needs worked solutions", layout.solutions or layout.solution)

    extra = {k: v for k, v in obj.items() if k not in layout.consumed}
    return Record(str(query_id), prompt, answer, tuple(solutions), level, extra, line_no, answers)


def sniff_file(path: str | Path) -> str | None:
    """Why `path` cannot be a JSON-lines file at all, judged by its first bytes (empty, binary, compressed),
    or None."""
    with open(path, "rb") as f:
        head = f.read(8192)
    if not head:
        return "the file is empty"
    for magic, kind in ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
                        (b"PK\x03\x04", "zip")):
        if head.startswith(magic):
            return f"the file is {kind}-compressed, not JSON lines: decompress it first"
    if (nul := head.find(b"\x00")) >= 0:
        return f"a binary file, not JSON lines (a NUL byte at offset {nul})"
    return None


def iter_jsonl(path: str | Path, *, require: Require = "answer", on_error: OnError = "fail",
               on_skip: Callable[[DatasetError], None] | None = None,
               max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, layout: Layout = AREAL,
               notes: dict[str, int] | None = None, max_lines: int | None = None) -> Iterator[Record]:
    """Streams validated records read through `layout` (`path` through `resolve_data_path`); blank lines are
    ignored, duplicate query ids are errors. A broken ``layout.id2info`` file is an error whatever
    ``on_error`` says. ``notes``: see `parse_record`. ``max_lines``: read no further than that many lines
    (a sample)."""
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
    if require not in ("answer", "solutions", "none"):
        raise ValueError(f"require must be 'answer', 'solutions' or 'none', got {require!r}")
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    path = resolve_data_path(path)
    if not path.is_file():
        raise DatasetError(path, None, f"no such file, nor {path.name}{DOWNLOAD_SUFFIX}")
    id2info = load_id2info(layout.id2info) if layout.id2info else None
    seen: dict[str, int] = {}
    for line_no, raw in _lines(path, max_line_bytes):
        if max_lines is not None and line_no > max_lines:
            return
        try:
            if raw is None:
                raise DatasetError(path, line_no, f"longer than max_line_bytes ({max_line_bytes} bytes; the "
                                   f"data.max_line_bytes setting)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(path, line_no, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(path, line_no, f"not valid JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise DatasetError(path, line_no, "not usable JSON (nested too deeply)") from None
            rec = parse_record(obj, path=path, line_no=line_no, require=require, layout=layout, id2info=id2info,
                               notes=notes)
            if rec.query_id in seen:
                raise DatasetError(path, line_no, f"duplicate {rec.query_id!r} (first on line "
                                   f"{seen[rec.query_id]})", layout.query_id)
        except DatasetError as err:
            if on_error == "fail":
                raise
            if on_skip is not None:   # the caller counts them and says so once (a file of bad lines is one error)
                on_skip(err)
            else:
                log.warning("dataset_line_skipped", path=str(path), line=line_no, field=err.field,
                            reason=err.reason)
            continue
        seen[rec.query_id] = line_no
        yield rec


def _lines(path: Path, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, the line's bytes) for each line; None for a line over `max_bytes`, read past in chunks
    so that it never sits in memory whole."""
    with path.open("rb") as f:
        line_no = 0
        while True:
            raw = f.readline(max_bytes + 1)
            if not raw:
                return
            line_no += 1
            if len(raw) > max_bytes and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(1 << 20)
                yield line_no, None
                continue
            yield line_no, raw


@dataclass
class Dataset:
    """A whole file in memory, with what was skipped while reading it."""

    path: str
    records: list[Record]
    skipped: list[DatasetError] = field(default_factory=list)
    templated_as_is: int = 0    # prompts used as they are: they already carried a template (data.prompt_template)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __getitem__(self, index: int) -> Record:
        return self.records[index]

    @property
    def n_skipped(self) -> int:
        return len(self.skipped)

    def levels(self) -> list[int]:
        return sorted({r.level for r in self.records if r.level is not None})

    def filter(self, levels: Iterable[int] | None = None, with_solutions: bool = False) -> "Dataset":
        """The records of the given levels (all when None), optionally only those with solutions."""
        wanted = None if levels is None else set(levels)
        kept = [r for r in self.records
                if (wanted is None or r.level in wanted) and (r.solutions or not with_solutions)]
        return Dataset(self.path, kept, list(self.skipped), self.templated_as_is)


def detect_layout(path: str | Path) -> Layout:
    """The layout of a file read without a configured one (tools.eval's benchmarks), from its first line: a
    ``query_id`` and ``prompt`` is AReaL's training layout; a ``question`` whose ``answer`` holds ``####`` is
    GSM8K's; any other line is AReaL's evaluation layout (``areal_eval``). A file whose first line is not a JSON
    object is read as ``areal``, whose loader then reports that line."""
    path = resolve_data_path(path)
    first: Any = None
    if path.is_file():
        with path.open("rb") as f:
            for raw in f:
                if raw.strip():
                    try:
                        first = json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                        pass
                    break
    if not isinstance(first, dict) or ("query_id" in first and "prompt" in first):
        return AREAL
    if "question" in first and "####" in str(first.get("answer", "")):
        return LAYOUTS["gsm8k"]
    return LAYOUTS["areal_eval"]


def within_prompt_cap(prompt_ids: Sequence[Sequence[int]], cap: int | None) -> list[int]:
    """Indices of the prompts of at most `cap` tokens (all when `cap` is None). AReaL leaves longer prompts out
    of training rather than cutting them (``dataset.max_prompt_len``: realhf/impl/dataset/math_code_dataset.py
    at v0.2.0 and prompt_dataset.py at v0.1.1 keep ``length <= max_length``)."""
    return [i for i, ids in enumerate(prompt_ids) if cap is None or len(ids) <= cap]


def load_dataset(path: str | Path, *, require: Require = "answer", on_error: OnError = "fail",
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, layout: Layout = AREAL,
                 max_bad_share: float = 1.0, max_lines: int | None = None) -> Dataset:
    """Reads a JSON-lines file through `layout`. ``require``: "answer" (RL, eval), "solutions" (SFT) or "none".

    Raises `DatasetError` on the first bad line when ``on_error="fail"``; with "skip" bad lines are
    logged and counted in ``Dataset.skipped``, and the file is an error when it has no usable line at all or
    more than ``max_bad_share`` of its lines are bad. ``max_lines``: read only that many lines (a sample).
    """
    if (resolved := resolve_data_path(path)).is_file() and (why := sniff_file(resolved)):
        raise DatasetError(resolved, None, why)
    skipped: list[DatasetError] = []
    notes: dict[str, int] = {}
    records = list(iter_jsonl(path, require=require, on_error=on_error, on_skip=skipped.append,
                              max_line_bytes=max_line_bytes, layout=layout, notes=notes, max_lines=max_lines))
    if not records:
        detail = f" ({len(skipped)} malformed lines skipped, first: {skipped[0]})" if skipped else ""
        raise DatasetError(path, None, f"no usable records{detail}")
    if skipped and len(skipped) > max_bad_share * (len(records) + len(skipped)):
        raise DatasetError(path, None, f"{len(skipped)} of {len(records) + len(skipped)} lines are malformed, "
                           f"more than data.max_bad_share ({max_bad_share:g}) allows; first: {skipped[0]}")
    if skipped:
        log.warning("dataset_loaded_with_skips", path=str(path), records=len(records), skipped=len(skipped),
                    first=[str(err) for err in skipped[:SHOWN_SKIPS]])
    as_is = notes.get("templated_as_is", 0)
    if as_is:
        log.info("dataset_prompts_already_templated", path=str(path), prompts=as_is,
                 note="data.prompt_template not applied to prompts that already carry a template")
    return Dataset(str(resolved), records, skipped, as_is)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
