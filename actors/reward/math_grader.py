"""Math answer checking: is the last boxed answer of a response equal to the reference answer?

`grade_math(response, answer)` is a pure function (no processes, no I/O). It is CPU-bound and,
through sympy, can take unbounded time on hostile input, so the reward actor and tools run it
inside `RewardPool` workers with a hard timeout; a timeout scores as wrong.

Safety: model text is never evaluated. sympy's `parse_latex` needs the antlr4 runtime 4.11 (the
installed one is 4.13, which it rejects) and `parse_expr` runs Python `eval`, so neither is used.
`_LatexParser` below is a small recursive-descent parser that builds sympy objects directly from
a whitelisted token set; anything else is a parse error and the answer falls back to text
comparison. Numbers whose construction would explode (huge powers and factorials) are refused
while parsing.

The policy (docs/reward-math.md has the full list and the rationale):
- only the last `\\boxed{...}` (or `\\boxed 5`) counts; none, empty or unclosed is wrong;
- formatting is ignored ($, \\left/\\right, spacing, \\text{}, \\dfrac, \\frac12, units, ...);
- a percent sign may be dropped or read as a hundredth; with no % anywhere a factor 100 is wrong;
- exact values must be equal; a decimal approximation of an exact value passes only with six
  correct significant digits, and only for magnitudes in [1e-4, 1e6) (outside: exact only);
- tuples are ordered, sets and solution lists unordered, intervals keep their ends, unions
  compare as sets, matrices entry by entry, equations up to a non-zero factor;
- one multiple-choice letter; several letters, or hedged answers (`7 or 8`, `\\pm`) are wrong
  when the reference is a single value.
"""
from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction
from typing import Any

__all__ = [
    "DEFAULT_CORRECT_REWARD",
    "DEFAULT_WRONG_REWARD",
    "MathGradeInputError",
    "MathVerdict",
    "POOL_PRELOAD",
    "extract_boxed",
    "grade_math",
    "grade_math_fast",
    "math_reward",
    "normalize_answer",
]

# What a worker pool that runs grade_math imports before its workers report ready: sympy is imported by the
# checks that need it, not with this module (the fast path, a reward actor and the launcher never need it:
# about 1 s of CPU per process), and preloaded so that the first sympy check does not pay the import against
# its item's timeout.
POOL_PRELOAD = ("sympy", __name__)

DEFAULT_CORRECT_REWARD = 5.0
DEFAULT_WRONG_REWARD = -5.0

# A decimal approximation must carry this many correct significant digits.
APPROX_SIGNIFICANT_DIGITS = 6
# Outside this magnitude range values are compared exactly (a relative tolerance would let
# 2^100 match 1.26765e30 and 1e-20 match 0).
APPROX_MIN_MAGNITUDE = 1e-4
APPROX_MAX_MAGNITUDE = 1e6
# Limits that keep parsing itself bounded: numbers beyond these are refused, not built.
MAX_NUMBER_DIGITS = 2000
MAX_INPUT_CHARS = 2000


class MathGradeInputError(ValueError):
    """The caller passed something that is not a response string and reference answer(s)."""


@dataclasses.dataclass(frozen=True)
class MathVerdict:
    """correct: the scored outcome. extracted: the boxed text found (None if none).
    reason: a short tag, e.g. "equal_text", "equal_number", "equal_symbolic", "no_box",
    "unclosed_box", "empty_box", "mismatch", "hedged", "unit_mismatch"."""

    correct: bool
    extracted: str | None
    reason: str


def math_reward(verdict: MathVerdict | None, correct: float = DEFAULT_CORRECT_REWARD,
                wrong: float = DEFAULT_WRONG_REWARD) -> float:
    """The sequence reward; a verdict of None (the check timed out or crashed) scores as wrong."""
    return correct if verdict is not None and verdict.correct else wrong


# --------------------------------------------------------------------------- boxed extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")


def extract_boxed(text: str) -> tuple[str | None, str]:
    """The content of the last `\\boxed`, and a reason: "ok", "no_box", "empty_box", "unclosed_box"."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None, "no_box"
    pos = starts[-1]
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    if pos >= len(text):
        return None, "unclosed_box"
    if text[pos] != "{":
        # `\boxed 5`: the argument is the following run of non-space characters.
        match = re.match(r"[^\s$]+", text[pos:])
        if not match:
            return None, "empty_box"
        content = match.group(0)
    else:
        depth, i = 0, pos
        while i < len(text):
            ch = text[i]
            if ch == "\\":
                i += 2  # an escaped brace (`\{` in a set) does not open or close the box
                continue
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        else:
            return None, "unclosed_box"
        content = text[pos + 1:i]
    if not content.strip() or not normalize_answer(content):
        return None, "empty_box"
    return content.strip(), "ok"


# --------------------------------------------------------------------------- normalisation

_TEXT_COMMANDS = r"(?:text|textbf|textit|textrm|texttt|mathrm|mathbf|mathit|mathsf|mbox|hbox|operatorname|emph)"
_TEXT_GROUP = re.compile(r"\\" + _TEXT_COMMANDS + r"\s*\{([^{}]*)\}")
_SPACING = re.compile(r"(?<!\\)\\(?:,|;|:|!| |quad|qquad|thinspace|medspace|thickspace|enspace)(?![a-zA-Z])|~")
_UNICODE = {"−": "-", "–": "-", "×": r"\times ", "·": r"\cdot ", "÷": r"\div ", "π": r"\pi ",
            "∞": r"\infty ", "√": r"\sqrt", "≤": r"\le ", "≥": r"\ge ", "∪": r"\cup ", "±": r"\pm ",
            "\u00a0": " ", "\u2009": " "}
_COMMAND_ALIASES = [(re.compile(r"\\[dt]frac(?![a-zA-Z])"), r"\\frac"), (re.compile(r"\\leq(?![a-zA-Z])"), r"\\le"),
                    (re.compile(r"\\geq(?![a-zA-Z])"), r"\\ge"), (re.compile(r"\\neq(?![a-zA-Z])"), r"\\ne"),
                    (re.compile(r"\\varnothing(?![a-zA-Z])"), r"\\emptyset"),
                    (re.compile(r"\\(?:bigl|bigr|Bigl|Bigr|biggl|biggr|Biggl|Biggr|big|Big|bigg|Bigg)(?![a-zA-Z])"), ""),
                    (re.compile(r"\\(?:displaystyle|textstyle|scriptstyle|limits)(?![a-zA-Z])"), "")]


def normalize_answer(text: str) -> str:
    """Formatting-free form of an answer string (math content and units kept)."""
    s = text  # no strip yet: a trailing `\ ` is a spacing command, not a backslash
    for k, v in _UNICODE.items():
        s = s.replace(k, v)
    s = s.replace("\\$", "\x00")  # an escaped dollar is currency, not math mode
    s = re.sub(r"\\\(|\\\)|\\\[|\\\]|\$", " ", s)
    s = s.replace("\x00", "\\$")
    s = re.sub(r"\\(?:left|right)\s*\.", "", s)
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)
    for pattern, repl in _COMMAND_ALIASES:
        s = pattern.sub(repl, s)
    # Thousands groups written with a thin space or {,}: 1\,000 and 1{,}000 read as 1,000.
    s = re.sub(r"(?<=\d)(?:,\\!|\{,\}|\\!|\\,|\\ )(?=\d{3}(?!\d))", ",", s)
    s = _SPACING.sub(" ", s)
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"(?:\s|\\\\)*[.;]$", "", s).strip()  # a trailing period ends the sentence
    return s


def _unwrap_text(s: str) -> str:
    for _ in range(5):
        new = _TEXT_GROUP.sub(lambda m: m.group(1), s)
        if new == s:
            break
        s = new
    return s


def _compact(s: str) -> str:
    return re.sub(r"\s+", "", _unwrap_text(s))


# --------------------------------------------------------------------------- word numbers, units

_SMALL_NUMBERS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * (i + 2) for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}


def _word_number(s: str) -> int | None:
    words = re.split(r"[\s-]+", s.strip().lower().replace(" and ", " "))
    if not words or not all(w in _SMALL_NUMBERS or w in _TENS or w in _SCALES for w in words):
        return None
    total = current = 0
    for w in words:
        if w in _SMALL_NUMBERS:
            current += _SMALL_NUMBERS[w]
        elif w in _TENS:
            current += _TENS[w]
        elif w == "hundred":
            current = max(current, 1) * 100
        else:
            total += max(current, 1) * _SCALES[w]
            current = 0
    return total + current


_UNIT_WORDS = {
    "cm", "mm", "km", "m", "meter", "meters", "metre", "metres", "centimeter", "centimeters", "kilometer",
    "kilometers", "inch", "inches", "in", "ft", "foot", "feet", "yard", "yards", "mile", "miles", "mph",
    "second", "seconds", "sec", "s", "minute", "minutes", "min", "hour", "hours", "hr", "hrs", "day", "days",
    "week", "weeks", "month", "months", "year", "years", "dollar", "dollars", "cent", "cents", "unit", "units",
    "degree", "degrees", "radian", "radians", "rad", "kg", "g", "gram", "grams", "pound", "pounds", "lb", "lbs",
    "liter", "liters", "litre", "l", "ml", "gallon", "gallons", "square", "sq", "cubic", "people", "students",
    "ways", "points", "handshakes", "games", "times", "marbles", "apples", "coins", "cookies", "pages",
}
_UNIT_ALIASES = {"meters": "m", "meter": "m", "metre": "m", "metres": "m", "centimeter": "cm",
                 "centimeters": "cm", "kilometer": "km", "kilometers": "km", "inches": "inch", "in": "inch",
                 "ft": "foot", "feet": "foot", "seconds": "s", "second": "s", "sec": "s", "minutes": "min",
                 "minute": "min", "hours": "h", "hour": "h", "hr": "h", "hrs": "h", "degrees": "degree",
                 "radians": "rad", "radian": "rad", "dollars": "dollar", "cents": "cent", "units": "unit",
                 "grams": "g", "gram": "g", "pounds": "lb", "pound": "lb", "lbs": "lb", "liters": "l",
                 "liter": "l", "litre": "l", "sq": "square"}
_DEGREE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![a-zA-Z])|\\circ(?![a-zA-Z])")
_TRAILING_TEXT_UNIT = re.compile(r"\\" + _TEXT_COMMANDS + r"\s*\{\s*([a-zA-Z][a-zA-Z .]*)\}\s*(\^\s*\{?\d\}?)?$")
_TRAILING_WORD_UNIT = re.compile(r"(?<![a-zA-Z\\])((?:[a-zA-Z]+\s+)*[a-zA-Z]+)\s*(\^\s*\{?\d\}?)?$")


def _canonical_unit(words: str, power: str | None) -> str:
    parts = [_UNIT_ALIASES.get(w, w) for w in words.lower().replace(".", " ").split()]
    unit = " ".join(parts)
    if power:
        unit += "^" + re.sub(r"[^\d]", "", power)
    return unit


def _split_unit(s: str) -> tuple[str, str | None]:
    """Split a trailing unit off a numeric answer: `5 \\text{ cm}^2` -> ("5", "cm^2")."""
    unit = None
    if _DEGREE.search(s):
        s = _DEGREE.sub("", s).strip()
        unit = "degree"
    if s.startswith("\\$"):
        s, unit = s[2:].strip(), unit or "dollar"
    match = _TRAILING_TEXT_UNIT.search(s)
    if match and match.start() > 0:
        rest = s[:match.start()].strip()
        if rest and _word_number(match.group(1)) is None:
            return rest, _canonical_unit(match.group(1), match.group(2))
    match = _TRAILING_WORD_UNIT.search(s)
    if match and match.start() > 0:
        words = match.group(1).lower().split()
        rest = s[:match.start()].strip()
        # Only known unit words, and only after a number: `5x` is an expression, `5 cm` a length.
        if rest and re.search(r"[\d}]$", rest) and all(w in _UNIT_WORDS for w in words) \
                and (len(words) > 1 or len(words[0]) > 1 or match.group(0)[0] == " " or s[match.start() - 1] == " "):
            return rest, _canonical_unit(match.group(1), match.group(2))
    return s, unit


# --------------------------------------------------------------------------- plain numbers (no sympy)

_PLAIN_NUMBER = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)$")
_PLAIN_FRACTION = re.compile(r"^([+-]?)(?:\\frac(?:\{(\d+)\}|(\d))(?:\{(\d+)\}|(\d))|(\d+)\s*/\s*(\d+))$")
_MIXED_NUMBER = re.compile(r"^([+-]?)(\d+)\s*(?:\\frac\s*\{(\d+)\}\s*\{(\d+)\}|\\frac\s*(\d)(\d)|\s(\d+)\s*/\s*(\d+))$")
_THOUSANDS = re.compile(r"^([+-]?\d{1,3}(?:,\d{3})+)(\.\d+)?$")
# A number with thousands separators at the start of an answer, and no other top-level comma.
_THOUSANDS_PREFIX = re.compile(r"^(?:\\\$)?\s*[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])[^,]*$")
_MEMBERSHIP = re.compile(r"^[a-zA-Z]\s*\\in(?![a-zA-Z])\s*(.+)$")


@dataclasses.dataclass(frozen=True)
class _Number:
    """An exactly known rational; `decimal_digits` is set when it was written as a decimal."""

    value: Fraction
    significant_digits: int | None = None   # for written decimals: how many were given
    last_place: Fraction | None = None       # value of one unit in the last written digit


def _plain_number(s: str) -> _Number | None:
    original = s.strip()
    s = re.sub(r"^([+-])\s+", r"\1", original)
    if _THOUSANDS.match(s.replace(" ", "")):
        s = s.replace(" ", "").replace(",", "")
    m = _PLAIN_NUMBER.match(s)
    if m:
        body = m.group(2)
        if len(body) > MAX_NUMBER_DIGITS:
            return None
        value = Fraction(body) * (-1 if m.group(1) == "-" else 1)
        if "." not in body:
            return _Number(value)
        int_part, frac_part = body.split(".")
        digits = (int_part + frac_part).lstrip("0")
        return _Number(value, max(len(digits), 1), Fraction(1, 10 ** len(frac_part)))
    m = _PLAIN_FRACTION.match(s)
    if m:
        num = m.group(2) or m.group(3) or m.group(6)
        den = m.group(4) or m.group(5) or m.group(7)
        if int(den) == 0 or len(num) + len(den) > MAX_NUMBER_DIGITS:
            return None
        return _Number(Fraction(int(num), int(den)) * (-1 if m.group(1) == "-" else 1))
    m = _MIXED_NUMBER.match(original)
    if m:
        whole = int(m.group(2))
        num, den = next((int(a), int(b)) for a, b in ((m.group(3), m.group(4)), (m.group(5), m.group(6)),
                                                      (m.group(7), m.group(8))) if a is not None)
        if den == 0 or num >= den:
            return None
        return _Number((whole + Fraction(num, den)) * (-1 if m.group(1) == "-" else 1))
    return None


def _approx_agrees(approx: _Number, exact: float) -> bool:
    """A written decimal agrees with an exact value to the digits it shows (at least six)."""
    if approx.significant_digits is None or approx.last_place is None:
        return False
    if approx.significant_digits < APPROX_SIGNIFICANT_DIGITS:
        return False
    if not (APPROX_MIN_MAGNITUDE <= abs(exact) < APPROX_MAX_MAGNITUDE):
        return False
    # The written digits are the exact value rounded, or truncated, at the last written place.
    written = float(approx.value / approx.last_place)
    scaled = exact / float(approx.last_place)
    slack = 1e-9 * max(1.0, abs(scaled))
    rounded = abs(written - scaled) <= 0.5 + slack
    truncated = 0 <= (scaled - written) * (1 if exact >= 0 else -1) < 1 - slack
    return rounded or truncated


# --------------------------------------------------------------------------- structured answers


@dataclasses.dataclass
class _Scalar:
    text: str
    percent: bool = False
    unit: str | None = None
    number: _Number | None = None   # set when the scalar is a plain number
    expr: Any = None                # sympy expression, parsed lazily
    parsed: bool = False


@dataclasses.dataclass
class _Seq:
    kind: str                       # "tuple" (ordered, with delimiters), "set", "list"
    items: list
    open: str = ""
    close: str = ""
    hedged: bool = False            # came from "or" / \pm: alternatives, not a list of solutions


@dataclasses.dataclass
class _Union:
    parts: list


@dataclasses.dataclass
class _Matrix:
    rows: list


@dataclasses.dataclass
class _Equation:
    lhs: str
    rhs_text: str
    rhs: Any
    lhs_is_variable: bool


@dataclasses.dataclass
class _Choice:
    letters: str


_MATRIX = re.compile(r"^\\begin\{([pbvBV]?matrix|array)\}(?:\{[^{}]*\})?(.*)\\end\{\1\}$", re.S)
_VARIABLE = re.compile(r"^(?:[a-zA-Z](?:_\{?\w+\}?)?(?:\([a-z]\))?|\\[a-zA-Z]+|\((?:\s*[a-zA-Z]\s*,)+\s*[a-zA-Z]\s*\))$")
_CHOICE = re.compile(r"^\(?([A-J])\)?$")
_CHOICE_PREFIX = re.compile(r"^\(([A-J])\)")
_OPENERS, _CLOSERS = "([{", ")]}"
_WORD = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{3,}")


def _split_top(s: str, separators: tuple[str, ...]) -> list[str]:
    """Split at separators that are outside every bracket."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        ch = s[i]
        if ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth -= 1
        elif depth == 0:
            for sep in separators:
                if s.startswith(sep, i):
                    parts.append(s[start:i])
                    i += len(sep)
                    start = i
                    break
            else:
                i += 1
                continue
            continue
        i += 1
    parts.append(s[start:])
    return [p.strip() for p in parts]


def _enclosed(s: str) -> bool:
    """True when s[0] opens a bracket group that closes exactly at s[-1]."""
    if len(s) < 2 or s[0] not in _OPENERS or s[-1] not in _CLOSERS:
        return False
    depth = 0
    for i, ch in enumerate(s):
        if ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth -= 1
            if depth == 0 and i != len(s) - 1:
                return False
    return depth == 0


def _parse_answer(s: str, depth: int = 0) -> Any:
    s = s.strip()
    if depth > 6:
        return _Scalar(s)
    matrix = _MATRIX.match(s)
    if matrix:
        rows = [r for r in re.split(r"\\\\", matrix.group(2)) if r.strip()]
        return _Matrix([[_parse_answer(c, depth + 1) for c in r.split("&")] for r in rows])
    choice = _CHOICE.match(_compact(s))
    if choice:
        return _Choice(choice.group(1))
    equals = _split_top(s, ("=",))
    if len(equals) == 2 and equals[0] and equals[1]:
        lhs, rhs = equals
        return _Equation(lhs, rhs, _parse_answer(rhs, depth + 1), bool(_VARIABLE.match(lhs.replace(" ", ""))))
    membership = _MEMBERSHIP.match(s)
    if membership:
        return _parse_answer(membership.group(1), depth + 1)
    union = _split_top(s, ("\\cup",))
    if len(union) > 1:
        return _Union([_parse_answer(p, depth + 1) for p in union])
    alternatives = _split_top(s, (" or ", "\\text{ or }", "\\text{or}", "\\or "))
    if len(alternatives) > 1:
        return _Seq("list", [_parse_answer(p, depth + 1) for p in alternatives], hedged=True)
    conjunction = _split_top(s, (" and ", "\\text{ and }", "\\text{and}"))
    if len(conjunction) > 1:
        return _Seq("list", [_parse_answer(p, depth + 1) for p in conjunction])
    if "\\pm" in s or "\\mp" in s:
        plus = s.replace("\\pm", "+").replace("\\mp", "-").replace("+-", "-")
        minus = s.replace("\\pm", "-").replace("\\mp", "+").replace("+-", "-").replace("--", "+")
        plus, minus = re.sub(r"^\s*\+", "", plus), re.sub(r"^\s*\+", "", minus)
        return _Seq("list", [_parse_answer(plus, depth + 1), _parse_answer(minus, depth + 1)], hedged=True)
    if s.startswith("\\{") and s.endswith("\\}") and _enclosed(s[1:-2] + "}"):
        return _Seq("set", [_parse_answer(p, depth + 1) for p in _split_top(s[2:-2], (",",)) if p])
    if _enclosed(s):
        items = _split_top(s[1:-1], (",",))
        if len(items) > 1 and s[0] == "{" and s[-1] == "}":
            return _Seq("set", [_parse_answer(p, depth + 1) for p in items if p])
        if len(items) > 1:
            return _Seq("tuple", [_parse_answer(p, depth + 1) for p in items], s[0], s[-1])
    if not _THOUSANDS_PREFIX.match(s):
        items = _split_top(s, (",", ";"))
        if len(items) > 1:
            return _Seq("list", [_parse_answer(p, depth + 1) for p in items if p])
    return _make_scalar(s)


def _make_scalar(s: str) -> _Scalar:
    percent = bool(re.search(r"\\?%\s*$", s))
    if percent:
        s = re.sub(r"\s*\\?%\s*$", "", s)
    s, unit = _split_unit(s)
    if re.search(r"\\?%\s*$", s):
        percent, s = True, re.sub(r"\s*\\?%\s*$", "", s)
    s = _unwrap_text(s).strip()
    words = _word_number(s)
    if words is not None:
        s = str(words)
    if _THOUSANDS.match(s.replace(" ", "")):
        s = s.replace(" ", "").replace(",", "")
    elif _THOUSANDS_PREFIX.match(s):
        s = re.sub(r"(?<=\d),(?=\d{3})", "", s)
    return _Scalar(s, percent=percent, unit=unit, number=_plain_number(s))


# --------------------------------------------------------------------------- comparison


class _Undecided(Exception):
    """The fast path cannot decide without sympy."""


@dataclasses.dataclass
class _Outcome:
    equal: bool
    reason: str


def _compare(a: Any, b: Any, use_sympy: bool) -> _Outcome:
    """a: the response's answer, b: the reference's. Raises _Undecided when sympy is needed."""
    if isinstance(a, _Choice) or isinstance(b, _Choice):
        if isinstance(a, _Choice) and isinstance(b, _Choice):
            return _Outcome(a.letters == b.letters, "equal_choice" if a.letters == b.letters else "mismatch")
        if isinstance(b, _Choice) and isinstance(a, _Scalar):
            # "(B) 12" names choice B; "B, C" and "BC" name several and are wrong.
            compact = _compact(a.text)
            prefix = _CHOICE_PREFIX.match(compact)
            if prefix and not re.search(r"\([A-J]\)|^\([A-J]\)[A-J]$", compact[3:] or compact):
                return _Outcome(prefix.group(1) == b.letters, "equal_choice" if prefix.group(1) == b.letters else "mismatch")
        if isinstance(b, _Choice) and isinstance(a, _Seq):
            return _Outcome(False, "several_choices")
        return _Outcome(False, "mismatch")
    if isinstance(a, _Equation) and isinstance(b, _Equation):
        if a.lhs_is_variable and b.lhs_is_variable and _compact(a.lhs) == _compact(b.lhs):
            return _compare(a.rhs, b.rhs, use_sympy)
        return _compare_equations(a, b, use_sympy)
    if isinstance(a, _Equation) and a.lhs_is_variable:
        return _compare(a.rhs, b, use_sympy)
    if isinstance(b, _Equation) and b.lhs_is_variable:
        return _compare(a, b.rhs, use_sympy)
    if isinstance(a, _Seq) and a.hedged and not (isinstance(b, _Seq) and len(b.items) == len(a.items)):
        return _Outcome(False, "hedged")
    if isinstance(a, _Seq) and isinstance(b, _Seq):
        return _compare_seqs(a, b, use_sympy)
    if isinstance(a, (_Union, _Seq)) or isinstance(b, (_Union, _Seq)):
        return _compare_sets(a, b, use_sympy)
    if isinstance(a, _Matrix) and isinstance(b, _Matrix):
        if [len(r) for r in a.rows] != [len(r) for r in b.rows]:
            return _Outcome(False, "shape_mismatch")
        for ra, rb in zip(a.rows, b.rows):
            for ca, cb in zip(ra, rb):
                if not _compare(ca, cb, use_sympy).equal:
                    return _Outcome(False, "mismatch")
        return _Outcome(True, "equal_matrix")
    if isinstance(a, _Scalar) and isinstance(b, _Scalar):
        return _compare_scalars(a, b, use_sympy)
    return _Outcome(False, "mismatch")


def _compare_seqs(a: _Seq, b: _Seq, use_sympy: bool) -> _Outcome:
    if len(a.items) != len(b.items):
        return _Outcome(False, "length_mismatch")
    if a.kind == "tuple" or b.kind == "tuple":
        # Ordered, and the delimiters matter: (1, 2] is not (1, 2), [1, 2] is not (1, 2).
        if a.kind != b.kind or a.open != b.open or a.close != b.close:
            return _Outcome(False, "delimiter_mismatch")
        for x, y in zip(a.items, b.items):
            if not _compare(x, y, use_sympy).equal:
                return _Outcome(False, "mismatch")
        return _Outcome(True, "equal_tuple")
    unused = list(b.items)
    for x in a.items:
        for j, y in enumerate(unused):
            if _compare(x, y, use_sympy).equal:
                del unused[j]
                break
        else:
            return _Outcome(False, "mismatch")
    return _Outcome(True, "equal_set")


def _compare_sets(a: Any, b: Any, use_sympy: bool) -> _Outcome:
    """Unions (and intervals against unions) compare as point sets."""
    if not use_sympy:
        raise _Undecided
    sa, sb = _to_sympy_set(a), _to_sympy_set(b)
    if sa is None or sb is None:
        if isinstance(a, _Union) and isinstance(b, _Union):
            return _compare_seqs(_Seq("list", a.parts), _Seq("list", b.parts), use_sympy)
        return _Outcome(False, "mismatch")
    import sympy

    equal = sa == sb or sympy.simplify(sympy.Complement(sa, sb)) == sympy.S.EmptySet and \
        sympy.simplify(sympy.Complement(sb, sa)) == sympy.S.EmptySet
    return _Outcome(bool(equal), "equal_set" if equal else "mismatch")


def _to_sympy_set(x: Any) -> Any:
    import sympy

    if isinstance(x, _Union):
        parts = [_to_sympy_set(p) for p in x.parts]
        return None if any(p is None for p in parts) else sympy.Union(*parts)
    if isinstance(x, _Seq) and x.kind == "tuple" and len(x.items) == 2:
        lo, hi = (_scalar_expr(i) for i in x.items)
        if lo is None or hi is None or not (lo.is_real or lo.is_infinite) or not (hi.is_real or hi.is_infinite):
            return None
        return sympy.Interval(lo, hi, left_open=x.open == "(", right_open=x.close == ")")
    if isinstance(x, _Seq) and x.kind == "set":
        items = [_scalar_expr(i) for i in x.items]
        return None if any(i is None for i in items) else sympy.FiniteSet(*items)
    if isinstance(x, _Scalar) and _compact(x.text) in ("\\emptyset", "\\{\\}"):
        return sympy.S.EmptySet
    if isinstance(x, _Scalar) and _compact(x.text) in ("\\mathbbR", "\\mathbb{R}", "R"):
        return sympy.S.Reals
    return None


def _scalar_expr(x: Any) -> Any:
    if not isinstance(x, _Scalar) or x.percent or x.unit:
        return None
    return _sympy_of(x)


def _sympy_of(x: _Scalar) -> Any:
    if not x.parsed:
        x.parsed = True
        if _WORD.search(x.text):  # a word is text, not a product of single-letter symbols
            x.expr = None
            return None
        if x.number is not None:  # keeps mixed numbers (3\frac12 = 7/2) consistent with the fast path
            x.expr = _rational(x.number.value)
            return x.expr
        try:
            x.expr = _LatexParser(x.text).parse()
        except _ParseError:
            x.expr = None
    return x.expr


def _compare_scalars(a: _Scalar, b: _Scalar, use_sympy: bool) -> _Outcome:
    if a.unit and b.unit and a.unit != b.unit:
        return _Outcome(False, "unit_mismatch")
    # With a % on one side, that side may mean v or v/100; with none, values must be equal.
    scales = [Fraction(1)]
    if a.percent != b.percent:
        scales.append(Fraction(1, 100) if a.percent else Fraction(100))
    if _compact(a.text) == _compact(b.text):
        return _Outcome(True, "equal_text")
    if a.number is not None and b.number is not None:
        for scale in scales:
            if a.number.value * scale == b.number.value:
                return _Outcome(True, "equal_number")
        for scale in scales:
            if _approx_agrees(dataclasses.replace(a.number, value=a.number.value * scale,
                                                  last_place=(a.number.last_place or 0) * scale),
                              float(b.number.value)):
                return _Outcome(True, "equal_approx")
            # The other way round: a reference written as a decimal approximates an exact answer.
            if _approx_agrees(b.number, float(a.number.value * scale)):
                return _Outcome(True, "equal_approx")
        return _Outcome(False, "mismatch")
    if not use_sympy:
        raise _Undecided
    ea, eb = _sympy_of(a), _sympy_of(b)
    if ea is None or eb is None:
        equal = _compact(a.text).lower() == _compact(b.text).lower()
        return _Outcome(equal, "equal_text" if equal else ("unparsed" if ea is None else "mismatch"))
    for scale in scales:
        if _sympy_equal(ea * _rational(scale), eb):
            return _Outcome(True, "equal_symbolic")
    # A decimal response against an exact irrational: six significant digits.
    if a.number is not None and a.number.last_place is not None and not eb.free_symbols:
        value = _numeric(eb)
        if value is not None:
            for scale in scales:
                scaled = dataclasses.replace(a.number, value=a.number.value * scale,
                                             last_place=a.number.last_place * scale)
                if _approx_agrees(scaled, value):
                    return _Outcome(True, "equal_approx")
    # An exact answer against a reference written as a decimal: the same six digits, the other way.
    if b.number is not None and b.number.last_place is not None and not ea.free_symbols:
        value = _numeric(ea)
        if value is not None:
            for scale in scales:
                if _approx_agrees(b.number, value * float(scale)):
                    return _Outcome(True, "equal_approx")
    return _Outcome(False, "mismatch")


def _rational(f: Fraction) -> Any:
    import sympy

    return sympy.Rational(f.numerator, f.denominator)


def _numeric(expr: Any) -> float | None:
    try:
        value = complex(expr.evalf(30))
    except (TypeError, ValueError, OverflowError):
        return None
    if value.imag != 0 or not math.isfinite(value.real):
        return None
    return value.real


# Points at which expressions with free symbols are compared before trying to simplify;
# fixed so that grading is deterministic.
_PROBE_VALUES = (0.6180339887, -1.3247179572, 2.7182818285, 0.3183098862)


def _sympy_equal(x: Any, y: Any) -> bool:
    """Exact equality of two sympy expressions, decided numerically where sympy cannot prove it.

    With free symbols: equal when the difference vanishes to 30 digits at four fixed probe points
    (different closed forms disagree almost everywhere, so a coincidence at all four is
    negligible; branch differences like sqrt(x^2) vs x are caught by the negative probe).
    Constants: equal when the difference is zero to 40 digits relative to the operands, which is
    exact for any practical purpose and, being relative, keeps 1e-50 distinct from 0.
    """
    import sympy

    try:
        if x == y:
            return True
        diff = x - y
        if diff == 0:
            return True
        if x.is_Rational and y.is_Rational:
            return False
        symbols = sorted(diff.free_symbols, key=str)
        if symbols:
            if sympy.expand(diff) == 0:
                return True
            for k in range(len(_PROBE_VALUES)):
                point = {s: sympy.Float(_PROBE_VALUES[(k + i) % len(_PROBE_VALUES)] * (1 + i), 30)
                         for i, s in enumerate(symbols)}
                d = complex(diff.evalf(30, subs=point))
                scale = max(1.0, abs(complex(x.evalf(30, subs=point))))
                if not math.isfinite(abs(d)) or abs(d) > 1e-20 * scale:
                    return False
            return True
        d = abs(complex(diff.evalf(60)))
        scale = max(abs(complex(x.evalf(60))), abs(complex(y.evalf(60))))
        return math.isfinite(d) and scale > 0 and d <= 1e-40 * scale
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, AttributeError, RecursionError):
        return False


def _compare_equations(a: _Equation, b: _Equation, use_sympy: bool) -> _Outcome:
    """Equations are equal when lhs - rhs agree up to a non-zero constant factor."""
    if _compact(a.lhs) == _compact(b.lhs) and _compact(a.rhs_text) == _compact(b.rhs_text):
        return _Outcome(True, "equal_text")
    if not use_sympy:
        raise _Undecided
    import sympy

    parts = []
    for text in (a.lhs, a.rhs_text, b.lhs, b.rhs_text):
        try:
            parts.append(_LatexParser(_unwrap_text(text)).parse())
        except _ParseError:
            return _Outcome(False, "unparsed")
    da, db = parts[0] - parts[1], parts[2] - parts[3]
    if db == 0 or da == 0:
        return _Outcome(da == db, "equal_equation" if da == db else "mismatch")
    try:
        ratio = sympy.cancel(sympy.together(da / db))
        if ratio.free_symbols:
            ratio = sympy.simplify(ratio)
    except (TypeError, ValueError, ZeroDivisionError, RecursionError):
        return _Outcome(False, "mismatch")
    equal = not ratio.free_symbols and ratio != 0 and ratio.is_finite is not False
    return _Outcome(bool(equal), "equal_equation" if equal else "mismatch")


# --------------------------------------------------------------------------- the LaTeX parser


class _ParseError(Exception):
    pass


_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\\[a-zA-Z]+|\\[{}|])|([a-zA-Z])|([-+*/^_()\[\]{}|!,']))")
_CONSTANTS = {"pi": "pi", "infty": "oo", "infinity": "oo", "e": "E"}
_GREEK = set("alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi "
             "rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega".split())
_FUNCTIONS = {"sin": "sin", "cos": "cos", "tan": "tan", "cot": "cot", "sec": "sec", "csc": "csc",
              "arcsin": "asin", "arccos": "acos", "arctan": "atan", "sinh": "sinh", "cosh": "cosh",
              "tanh": "tanh", "ln": "log", "log": "log", "exp": "exp"}


class _LatexParser:
    """Recursive descent over a whitelisted LaTeX math subset, building sympy objects directly.

    expr   := term (('+' | '-') term)*
    term   := unary (('*' | '/' | \\cdot | \\times | \\div)? unary)*     (juxtaposition multiplies)
    unary  := ('+' | '-') unary | power
    power  := postfix ('^' argument)?
    postfix:= primary '!'*
    """

    def __init__(self, text: str) -> None:
        if len(text) > MAX_INPUT_CHARS:
            raise _ParseError("answer too long")
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise _ParseError(f"unexpected character {text[pos]!r}")
            kind = ("num", "cmd", "letter", "op")[m.lastindex - 1]
            self.tokens.append((kind, m.group(m.lastindex)))
            pos = m.end()
        self.i = 0
        import sympy

        self.sp = sympy

    def parse(self) -> Any:
        if not self.tokens:
            raise _ParseError("empty")
        expr = self.expr()
        if self.i != len(self.tokens):
            raise _ParseError(f"unexpected {self.tokens[self.i][1]!r}")
        return expr

    # -- token helpers
    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (value is not None and tok[1] != value):
            raise _ParseError(f"expected {value!r}")
        self.i += 1
        return tok

    def accept(self, value: str) -> bool:
        tok = self.peek()
        if tok is not None and tok[1] == value:
            self.i += 1
            return True
        return False

    # -- grammar
    def expr(self) -> Any:
        value = self.term()
        while True:
            if self.accept("+"):
                value = value + self.term()
            elif self.accept("-"):
                value = value - self.term()
            else:
                return value

    def term(self) -> Any:
        value = self.unary()
        while True:
            tok = self.peek()
            if tok is None:
                return value
            if tok[1] in ("*", "\\cdot", "\\times"):
                self.i += 1
                value = value * self.unary()
            elif tok[1] in ("/", "\\div"):
                self.i += 1
                divisor = self.unary()
                if divisor == 0:
                    raise _ParseError("division by zero")
                value = value / divisor
            elif self.starts_primary(tok):
                value = value * self.power()
            else:
                return value

    def starts_primary(self, tok: tuple[str, str]) -> bool:
        kind, text = tok
        if kind in ("num", "letter"):
            return True
        if kind == "cmd":
            return text not in ("\\cdot", "\\times", "\\div", "\\right", "\\}", "\\rfloor", "\\rceil", "\\|")
        return text in ("(", "[", "{")

    def unary(self) -> Any:
        if self.accept("-"):
            return -self.unary()
        if self.accept("+"):
            return self.unary()
        return self.power()

    def power(self) -> Any:
        base = self.postfix()
        if self.accept("^"):
            exponent = self.argument()
            return self.safe_pow(base, exponent)
        return base

    def safe_pow(self, base: Any, exponent: Any) -> Any:
        sp = self.sp
        if base.is_number and exponent.is_number and exponent.is_real:
            try:
                magnitude = abs(float(exponent)) * max(math.log10(max(abs(complex(base.evalf(15))), 1e-300)), 1.0)
            except (TypeError, ValueError, OverflowError):
                raise _ParseError("unevaluable power") from None
            if magnitude > MAX_NUMBER_DIGITS:
                raise _ParseError("number too large")
        if base == 0 and exponent.is_number and exponent.is_negative:
            raise _ParseError("division by zero")
        return sp.Pow(base, exponent)

    def postfix(self) -> Any:
        value = self.primary()
        while self.accept("!"):
            if not (value.is_Integer and 0 <= int(value) <= 500):
                raise _ParseError("factorial of a non-integer or of a number too large")
            value = self.sp.factorial(value)
        return value

    def argument(self) -> Any:
        """One macro argument: a braced group, or one digit, letter or command."""
        tok = self.peek()
        if tok is None:
            raise _ParseError("missing argument")
        if tok[1] == "{":
            self.i += 1
            value = self.expr()
            self.take("}")
            return value
        if tok[0] == "num":
            # `\frac12` and `x^23`: an unbraced argument is a single digit.
            self.i += 1
            if len(tok[1]) > 1:
                self.tokens.insert(self.i, ("num", tok[1][1:]))
            if tok[1][0] == ".":
                raise _ParseError("bad argument")
            return self.sp.Integer(int(tok[1][0]))
        if tok[1] == "-":
            self.i += 1
            return -self.argument()
        return self.primary()

    def number(self, text: str) -> Any:
        if len(text) > MAX_NUMBER_DIGITS:
            raise _ParseError("number too long")
        if "." in text:
            return self.sp.Rational(text.rstrip(".") or "0")
        return self.sp.Integer(int(text))

    def primary(self) -> Any:
        sp = self.sp
        tok = self.peek()
        if tok is None:
            raise _ParseError("unexpected end")
        kind, text = tok
        self.i += 1
        if kind == "num":
            return self.number(text)
        if kind == "letter":
            if text == "e":
                return sp.E
            if text == "i":
                return sp.I
            return self.subscripted(text)
        if text in ("(", "[", "{"):
            close = {"(": ")", "[": "]", "{": "}"}[text]
            value = self.expr()
            self.take(close)
            return value
        if text == "|":
            value = self.expr()
            self.take("|")
            return sp.Abs(value)
        if kind != "cmd":
            raise _ParseError(f"unexpected {text!r}")
        name = text[1:]
        if name in ("frac", "cfrac"):
            numerator, denominator = self.argument(), self.argument()
            if denominator == 0:
                raise _ParseError("division by zero")
            return numerator / denominator
        if name == "binom":
            n, k = self.argument(), self.argument()
            return sp.binomial(n, k)
        if name == "sqrt":
            if self.accept("["):
                index = self.expr()
                self.take("]")
                return sp.root(self.argument(), index)
            return sp.sqrt(self.argument())
        if name in _CONSTANTS:
            return getattr(sp, _CONSTANTS[name]) if _CONSTANTS[name] != "E" else sp.E
        if name in _GREEK:
            return self.subscripted(name)
        if name in ("lfloor", "lceil"):
            value = self.expr()
            self.take("\\r" + name[1:])
            return sp.floor(value) if name == "lfloor" else sp.ceiling(value)
        if name in _FUNCTIONS:
            return self.function(name)
        raise _ParseError(f"unsupported command \\{name}")

    def subscripted(self, name: str) -> Any:
        if self.accept("_"):
            tok = self.peek()
            if tok is None:
                raise _ParseError("missing subscript")
            if tok[1] == "{":
                self.i += 1
                parts = []
                while not self.accept("}"):
                    part = self.take()
                    parts.append(part[1])
                    if len(parts) > 20:
                        raise _ParseError("subscript too long")
                sub = "".join(parts)
            else:
                self.i += 1
                sub = tok[1][0] if tok[0] == "num" else tok[1]
                if tok[0] == "num" and len(tok[1]) > 1:
                    self.tokens.insert(self.i, ("num", tok[1][1:]))
            name = f"{name}_{sub}"
        return self.sp.Symbol(name)

    def function(self, name: str) -> Any:
        sp = self.sp
        power = None
        base = None
        if name == "log" and self.accept("_"):
            base = self.argument()
        if self.accept("^"):
            power = self.argument()
        tok = self.peek()
        if tok is not None and tok[1] in ("(", "[", "{"):
            arg = self.primary()
        else:
            # `\sin 2x`: the argument runs over the juxtaposed factors that follow.
            arg = self.power()
            while self.peek() is not None and self.starts_primary(self.peek()) and self.peek()[0] != "cmd":
                arg = arg * self.power()
        fn = getattr(sp, _FUNCTIONS[name])
        value = sp.log(arg, base) if base is not None else fn(arg)
        if power is not None:
            if power == -1 and name in ("sin", "cos", "tan"):
                value = getattr(sp, "a" + name)(arg)
            else:
                value = self.safe_pow(value, power)
        return value


# --------------------------------------------------------------------------- entry points


def _check_inputs(response: Any, answer: Any) -> list[str]:
    if not isinstance(response, str):
        raise MathGradeInputError(f"response must be a string, got {type(response).__name__}")
    answers = [answer] if isinstance(answer, str) else answer
    if not isinstance(answers, (list, tuple)) or not answers:
        raise MathGradeInputError(f"answer must be a string or a non-empty list of strings, got {answer!r:.80}")
    for k, item in enumerate(answers):
        if not isinstance(item, str) or not item.strip():
            raise MathGradeInputError(f"answer[{k}] must be a non-empty string, got {item!r:.80}")
    return list(answers)


def _reference_text(answer: str) -> str:
    """References may be written boxed or bare."""
    content, reason = extract_boxed(answer)
    return content if reason == "ok" else answer


def _grade(response: str, answer: str | list[str], use_sympy: bool) -> MathVerdict:
    answers = _check_inputs(response, answer)
    extracted, reason = extract_boxed(response)
    if extracted is None:
        return MathVerdict(False, None, reason)
    mine = normalize_answer(extracted)
    if len(mine) > MAX_INPUT_CHARS:
        return MathVerdict(False, extracted, "too_long")
    last = _Outcome(False, "mismatch")
    for reference in answers:
        theirs = normalize_answer(_reference_text(reference))
        if _compact(mine) == _compact(theirs):
            return MathVerdict(True, extracted, "equal_text")
        outcome = _compare(_parse_answer(mine), _parse_answer(theirs), use_sympy)
        if outcome.equal:
            return MathVerdict(True, extracted, outcome.reason)
        last = outcome
    return MathVerdict(False, extracted, last.reason)


def grade_math(response: str, answer: str | list[str]) -> MathVerdict:
    """Grade the last boxed answer of `response` against `answer` (or any of several answers).

    Pure and deterministic, but may be slow on hostile input (sympy): run it in a RewardPool
    worker with a timeout. Raises MathGradeInputError for inputs of the wrong type.
    """
    return _grade(response, answer, use_sympy=True)


def grade_math_fast(response: str, answer: str | list[str]) -> MathVerdict | None:
    """The verdict when it can be reached without sympy (text and plain-number comparisons, missing
    boxes), else None. Bounded time (regular expressions and fractions only), so a caller may use
    it to skip the worker pool for the easy majority of items."""
    try:
        return _grade(response, answer, use_sympy=False)
    except _Undecided:
        return None
