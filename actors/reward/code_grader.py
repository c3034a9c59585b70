"""Grade a program against unit tests, running it in the bubblewrap sandbox.

Two test styles, never mixed in one task:

* stdio: `{"input": str, "output": str}`. The program runs once per test with `input` on stdin. Output
  lines compare after CRLF -> LF, right-stripping each line and dropping trailing blank lines; lines that
  still differ match when their whitespace-separated tokens are equal or both are decimal numbers within
  1e-6 (absolute or relative).
* functional: `{"fn_name": str, "args": list, "expected": any}`. A harness imports the program as a
  module, calls the top-level function (or the method of a fresh `Solution()`) with `*args`, and writes
  each result as JSON on a separate channel (fd $RESULT_FD), so the program's prints cannot corrupt
  results. Results compare as plain JSON data: a tuple equals a list, a bool is not an int, floats within
  1e-6, and never through the returned object's own `__eq__` (an object that is not JSON data fails).
  The expected values never enter the sandbox, so a program cannot read them from the harness.

A task passes when every test passes; grading stops at the first failing test. A non-zero exit, a signal,
a timeout or an output flood fails. `grade_code` never raises for anything the program does; malformed
tests raise `TestSpecError` naming the test index and key.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Sequence
from typing import Any

from actors.reward.sandbox import RunResult, Sandbox, SandboxLimits, SandboxUnavailable

STDIO = "stdio"
FUNCTIONAL = "functional"
MODES = (STDIO, FUNCTIONAL)
FLOAT_TOLERANCE = 1e-6

# Verdict details, also the vocabulary of tools.score's `detail` field.
PASSED = "passed"
WRONG_ANSWER = "wrong_answer"
RUNTIME_ERROR = "runtime_error"
TIMEOUT = "timeout"
MEMORY_LIMIT = "memory_limit"
OUTPUT_LIMIT = "output_limit"
BLOCKED = "blocked"  # the sandbox is unavailable and unsandboxed execution was not allowed
DETAILS = (PASSED, WRONG_ANSWER, RUNTIME_ERROR, TIMEOUT, MEMORY_LIMIT, OUTPUT_LIMIT, BLOCKED)

_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_MESSAGE_CHARS = 300


class TestSpecError(ValueError):
    """The tests of a task are malformed; the message names the test index and key."""

    __test__ = False  # not a pytest test class despite the name


@dataclasses.dataclass(frozen=True)
class CodeVerdict:
    passed: bool
    detail: str  # one of DETAILS
    tests_passed: int
    tests_total: int
    message: str = ""  # short human-readable reason: first differing line, error tail, ...
    elapsed_s: float = 0.0
    sandboxed: bool = True


# The function-call runner. It runs under the sandbox's (system) Python, so it sticks to the stdlib and
# syntax every Python 3 accepts.
HARNESS = r'''
import importlib.util, json, os, sys

def describe(exc):
    return "%s: %s" % (type(exc).__name__, str(exc)[:200])

def main():
    channel = os.fdopen(int(os.environ["RESULT_FD"]), "w")
    os.environ.pop("RESULT_FD", None)
    request = json.load(sys.stdin)
    sys.stdin = open(os.devnull)
    def emit(record):
        channel.write(json.dumps(record) + "\n")
        channel.flush()
    spec = importlib.util.spec_from_file_location("solution", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    sys.modules["solution"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        emit({"error": "while loading the program: " + describe(exc)})
        return
    name = request["fn_name"]
    for args in request["calls"]:
        target = getattr(module, name, None)
        if not callable(target):
            cls = getattr(module, "Solution", None)
            if cls is None:
                emit({"error": "no top-level function or Solution method named %r" % name})
                return
            try:
                target = getattr(cls(), name)
            except BaseException as exc:
                emit({"error": "Solution().%s: %s" % (name, describe(exc))})
                return
        try:
            value = target(*args)
        except BaseException as exc:
            emit({"error": describe(exc)})
            return
        try:
            text = json.dumps(value)
        except BaseException as exc:
            emit({"error": "result is not JSON data (%s): %s" % (type(value).__name__, describe(exc))})
            return
        channel.write('{"value": ' + text + "}\n")
        channel.flush()

main()
'''


def detect_mode(tests: Sequence[Any], mode: str | None = None) -> str:
    """Validate `tests` and return their style; `mode` forces one. Raises TestSpecError naming the fault."""
    if mode is not None and mode not in MODES:
        raise TestSpecError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(tests, (list, tuple)) or not tests:
        raise TestSpecError(f"tests must be a non-empty list, got {type(tests).__name__}"
                            + (" (empty)" if isinstance(tests, (list, tuple)) else ""))
    styles = []
    for index, test in enumerate(tests):
        if not isinstance(test, dict):
            raise TestSpecError(f"tests[{index}] must be an object, got {type(test).__name__}")
        if "fn_name" in test:
            _check_keys(test, index, {"fn_name": str, "args": list}, required_any="expected")
            styles.append(FUNCTIONAL)
        elif "input" in test or "output" in test:
            _check_keys(test, index, {"input": str, "output": str})
            styles.append(STDIO)
        else:
            raise TestSpecError(f"tests[{index}] has neither 'input'/'output' nor 'fn_name'/'args'/'expected' "
                                f"(keys: {sorted(test)})")
        if styles[index] != styles[0]:
            raise TestSpecError(f"tests[{index}] is a {styles[index]} test but tests[0] is {styles[0]}; "
                                "one task uses one style")
    found = styles[0]
    if mode is not None and mode != found:
        raise TestSpecError(f"mode is {mode!r} but tests[0] is a {found} test")
    if found == FUNCTIONAL:
        names = {test["fn_name"] for test in tests}
        if len(names) > 1:
            raise TestSpecError(f"functional tests must call one function, got fn_name values {sorted(names)}")
    return found


def _check_keys(test: dict, index: int, types: dict[str, type], required_any: str | None = None) -> None:
    for key, kind in types.items():
        if key not in test:
            raise TestSpecError(f"tests[{index}] is missing key {key!r}")
        if not isinstance(test[key], kind):
            raise TestSpecError(f"tests[{index}].{key} must be {kind.__name__}, got {type(test[key]).__name__}")
    if required_any is not None and required_any not in test:
        raise TestSpecError(f"tests[{index}] is missing key {required_any!r}")


def grade_code(
    program: str,
    tests: Sequence[dict],
    mode: str | None = None,
    *,
    sandbox: Sandbox | None = None,
    limits: SandboxLimits | None = None,
) -> CodeVerdict:
    """Run `program` (Python source) against `tests`; see the module docstring for the rules.

    `limits` apply to each run (one run per stdio test; one run for all calls of a functional task).
    If the sandbox is unavailable and `sandbox.allow_unsandboxed` is false, the verdict is `blocked`.
    """
    if not isinstance(program, str):
        raise TestSpecError(f"program must be a string, got {type(program).__name__}")
    style = detect_mode(tests, mode)
    sandbox = sandbox or Sandbox()
    started = time.monotonic()
    try:
        if style == STDIO:
            verdict = _grade_stdio(program, tests, sandbox, limits)
        else:
            verdict = _grade_functional(program, tests, sandbox, limits)
    except SandboxUnavailable as exc:
        verdict = CodeVerdict(False, BLOCKED, 0, len(tests), str(exc), sandboxed=False)
    return dataclasses.replace(verdict, elapsed_s=time.monotonic() - started)


def _grade_stdio(program: str, tests: Sequence[dict], sandbox: Sandbox, limits: SandboxLimits | None
                 ) -> CodeVerdict:
    files = {"prog.py": program.encode()}
    sandboxed = True
    for index, test in enumerate(tests):
        run = sandbox.run(["{python}", "-I", "-B", "{files}/prog.py"], files=files,
                          stdin=test["input"].encode(), limits=limits)
        sandboxed = run.sandboxed
        failure = _run_failure(run)
        if failure is not None:
            detail, message = failure
            return CodeVerdict(False, detail, index, len(tests), f"test {index}: {message}", sandboxed=sandboxed)
        actual = run.stdout.decode(errors="replace")
        difference = compare_output(actual, test["output"])
        if difference is not None:
            return CodeVerdict(False, WRONG_ANSWER, index, len(tests), f"test {index}: {difference}",
                               sandboxed=sandboxed)
    return CodeVerdict(True, PASSED, len(tests), len(tests), sandboxed=sandboxed)


def _grade_functional(program: str, tests: Sequence[dict], sandbox: Sandbox, limits: SandboxLimits | None
                      ) -> CodeVerdict:
    request = {"fn_name": tests[0]["fn_name"], "calls": [test["args"] for test in tests]}
    try:
        stdin = json.dumps(request).encode()
    except (TypeError, ValueError) as exc:
        raise TestSpecError(f"tests args must be JSON data: {exc}") from exc
    expected_values = []
    for index, test in enumerate(tests):  # checked before anything runs
        try:
            expected_values.append(json.loads(json.dumps(test["expected"])))
        except (TypeError, ValueError) as exc:
            raise TestSpecError(f"tests[{index}].expected must be JSON data: {exc}") from exc
    run = sandbox.run(["{python}", "-I", "-B", "{files}/harness.py", "{files}/prog.py"],
                      files={"prog.py": program.encode(), "harness.py": HARNESS.encode()},
                      stdin=stdin, limits=limits)
    records = []
    for line in run.result.decode(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break  # a torn last line after a kill
        except RecursionError:  # the program chose how deep its result nests
            records.append({"error": "result is nested too deeply to read"})
            break
    for index, test in enumerate(tests):
        if index >= len(records):
            failure = _run_failure(run) or (RUNTIME_ERROR, "the program ended before returning a result")
            return CodeVerdict(False, failure[0], index, len(tests), f"test {index}: {failure[1]}",
                               sandboxed=run.sandboxed)
        record = records[index]
        if not isinstance(record, dict) or "value" not in record:
            error = record.get("error", "malformed result") if isinstance(record, dict) else "malformed result"
            detail = MEMORY_LIMIT if "MemoryError" in str(error) else RUNTIME_ERROR
            return CodeVerdict(False, detail, index, len(tests), f"test {index}: {str(error)[:_MESSAGE_CHARS]}",
                               sandboxed=run.sandboxed)
        expected = expected_values[index]
        try:
            equal = values_equal(record["value"], expected)
            got = "" if equal else json.dumps(record["value"])[:120]
        except RecursionError:
            equal, got = False, "a result nested too deeply to compare"
        if not equal:
            want = json.dumps(expected)[:120]
            return CodeVerdict(False, WRONG_ANSWER, index, len(tests), f"test {index}: got {got}, expected {want}",
                               sandboxed=run.sandboxed)
    failure = _run_failure(run)
    if failure is not None:  # every result right, but the process then crashed, hung or flooded
        return CodeVerdict(False, failure[0], len(tests), len(tests), failure[1], sandboxed=run.sandboxed)
    return CodeVerdict(True, PASSED, len(tests), len(tests), sandboxed=run.sandboxed)


def _run_failure(run: RunResult) -> tuple[str, str] | None:
    """Why a run failed as a process (detail, message), or None if it exited cleanly."""
    stderr_tail = run.stderr.decode(errors="replace").strip()[-_MESSAGE_CHARS:]
    if run.output_limited:
        return OUTPUT_LIMIT, "output exceeded the limit"
    if run.timed_out:
        return TIMEOUT, f"wall time exceeded ({run.wall_s:.2f} s)"
    if run.cpu_limited:
        return TIMEOUT, f"CPU time exceeded ({run.signal_name}, {run.cpu_s or 0:.2f} s CPU)"
    if run.returncode != 0:
        if "MemoryError" in stderr_tail:
            return MEMORY_LIMIT, stderr_tail.splitlines()[-1]
        cause = run.signal_name or f"exit status {run.returncode}"
        last = stderr_tail.splitlines()[-1] if stderr_tail else ""
        return RUNTIME_ERROR, f"{cause}: {last}" if last else cause
    return None


def normalize_output(text: str) -> list[str]:
    """Lines after CRLF -> LF, right-stripping and dropping trailing blank lines."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def compare_output(actual: str, expected: str) -> str | None:
    """None when the outputs match, else a short description of the first difference."""
    got, want = normalize_output(actual), normalize_output(expected)
    for number, (line_got, line_want) in enumerate(zip(got, want), start=1):
        if line_got != line_want and not _tokens_match(line_got, line_want):
            return f"line {number}: got {line_got[:80]!r}, expected {line_want[:80]!r}"
    if len(got) != len(want):
        return f"got {len(got)} lines, expected {len(want)}"
    return None


def _tokens_match(line_got: str, line_want: str) -> bool:
    tokens_got, tokens_want = line_got.split(), line_want.split()
    if len(tokens_got) != len(tokens_want):
        return False
    for token_got, token_want in zip(tokens_got, tokens_want):
        if token_got == token_want:
            continue
        # Only plain decimal numbers: float() would also accept "1_000", "inf" and "nan".
        if not (_NUMBER.fullmatch(token_got) and _NUMBER.fullmatch(token_want)):
            return False
        if not _floats_close(float(token_got), float(token_want)):
            return False
    return True


def _floats_close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)


def values_equal(actual: Any, expected: Any) -> bool:
    """Structural equality of JSON data: bools only equal bools, numbers compare by value (floats within
    1e-6), lists element-wise, objects key-wise."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        if isinstance(expected, int) and isinstance(actual, int):
            return actual == expected
        if math.isnan(expected) or math.isnan(actual):
            return math.isnan(expected) and math.isnan(actual)
        return _floats_close(float(actual), float(expected))
    if isinstance(expected, list) and isinstance(actual, list):
        return len(actual) == len(expected) and all(values_equal(a, e) for a, e in zip(actual, expected))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return actual.keys() == expected.keys() and all(values_equal(actual[k], expected[k]) for k in expected)
    return type(actual) is type(expected) and actual == expected
