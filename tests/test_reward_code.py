"""The code checker: test styles, output comparison, value comparison, verdicts and input errors."""
from __future__ import annotations

import textwrap

import pytest

from actors.reward.code_grader import (
    FUNCTIONAL,
    PASSED,
    RUNTIME_ERROR,
    STDIO,
    TIMEOUT,
    WRONG_ANSWER,
    TestSpecError,
    compare_output,
    detect_mode,
    grade_code,
    normalize_output,
    values_equal,
)
from actors.reward.sandbox import MiB, Sandbox, SandboxLimits, probe_sandbox

LIMITS = SandboxLimits(wall_time_s=1.5, cpu_time_s=1.0, memory_bytes=256 * MiB, output_bytes=64 * 1024)

needs_sandbox = pytest.mark.skipif(not probe_sandbox().available,
                                   reason=f"no bubblewrap sandbox here: {probe_sandbox().reason}")


def grade(program: str, tests: list[dict], mode: str | None = None):
    return grade_code(textwrap.dedent(program), tests, mode, sandbox=Sandbox(LIMITS))


# ---------------------------------------------------------------- output comparison (no processes)


@pytest.mark.parametrize("actual, expected", [
    ("3\n", "3"),
    ("3", "3\n\n\n"),
    ("a b  \r\nc\r\n", "a b\nc\n"),
    ("1.0000001\n", "1.0"),
    ("1000000.5", "1000000.0000001"),  # relative 1e-6
    ("0.0000005", "0"),  # absolute 1e-6
    ("1e3 2", "1000 2.0"),
    ("x  y", "x y"),  # tokens, so inner spacing does not matter
    ("", "\n"),
])
def test_outputs_that_match(actual, expected):
    assert compare_output(actual, expected) is None
    assert compare_output(expected, actual) is None


@pytest.mark.parametrize("actual, expected", [
    ("4\n", "3"),
    ("3\n4", "3"),  # an extra line
    ("3", "3\n4"),  # a missing line
    ("1.001", "1.0"),
    ("0.00001", "0"),
    ("1_000", "1000"),  # float() would accept these; decimal numbers only
    ("inf", "1e309"),
    ("nan", "nan1"),
    ("3 4", "3"),
    ("Yes", "yes"),
    ("3\n\n4", "3\n4"),  # inner blank lines count
])
def test_outputs_that_differ(actual, expected):
    assert compare_output(actual, expected) is not None
    assert compare_output(expected, actual) is not None


def test_difference_names_the_line():
    assert compare_output("1\n2\n3", "1\n2\n4") == "line 3: got '3', expected '4'"
    assert normalize_output("a \r\nb\r\n\r\n") == ["a", "b"]


@pytest.mark.parametrize("actual, expected", [
    ([1, 2], [1, 2]),
    (2, 2.0),
    (0.1 + 0.2, 0.3),
    ({"a": [1, {"b": None}]}, {"a": [1, {"b": None}]}),
    (True, True),
    (float("nan"), float("nan")),
    ("x", "x"),
])
def test_values_that_match(actual, expected):
    assert values_equal(actual, expected) and values_equal(expected, actual)


@pytest.mark.parametrize("actual, expected", [
    (True, 1),
    (False, 0),
    (1, 1.001),
    ([1, 2], [2, 1]),
    ([1], [1, 1]),
    ({"a": 1}, {"a": 1, "b": 2}),
    (None, 0),
    ("1", 1),
    ([True], [1]),
])
def test_values_that_differ(actual, expected):
    assert not values_equal(actual, expected) and not values_equal(expected, actual)


# ---------------------------------------------------------------- test specification errors


@pytest.mark.parametrize("tests, mode, message", [
    ([], None, "non-empty list"),
    ({"input": "1"}, None, "non-empty list"),
    (["x"], None, r"tests\[0\] must be an object"),
    ([{"input": "1"}], None, r"tests\[0\] is missing key 'output'"),
    ([{"input": 1, "output": "1"}], None, r"tests\[0\]\.input must be str"),
    ([{"foo": 1}], None, r"tests\[0\] has neither"),
    ([{"input": "", "output": ""}, {"fn_name": "f", "args": [], "expected": 1}], None, r"tests\[1\] is a functional"),
    ([{"fn_name": "f", "args": 1, "expected": 1}], None, r"tests\[0\]\.args must be list"),
    ([{"fn_name": "f", "args": []}], None, r"tests\[0\] is missing key 'expected'"),
    ([{"fn_name": "f", "args": [], "expected": 1}, {"fn_name": "g", "args": [], "expected": 1}], None, "one function"),
    ([{"input": "", "output": ""}], "functional", "mode is 'functional'"),
    ([{"input": "", "output": ""}], "python", "mode must be one of"),
])
def test_malformed_tests_raise_naming_the_fault(tests, mode, message):
    with pytest.raises(TestSpecError, match=message):
        detect_mode(tests, mode)
    with pytest.raises(TestSpecError, match=message):
        grade_code("print(1)", tests, mode, sandbox=Sandbox(LIMITS))


@needs_sandbox
def test_non_json_expected_value_is_a_spec_error():
    with pytest.raises(TestSpecError, match=r"tests\[0\]\.expected must be JSON data"):
        grade("def f():\n    return 1", [{"fn_name": "f", "args": [], "expected": {1, 2}}])


def test_modes_are_detected():
    assert detect_mode([{"input": "", "output": ""}]) == STDIO
    assert detect_mode([{"fn_name": "f", "args": [], "expected": None}], FUNCTIONAL) == FUNCTIONAL
    with pytest.raises(TestSpecError, match="program must be a string"):
        grade_code(b"print(1)", [{"input": "", "output": ""}])  # type: ignore[arg-type]


# ---------------------------------------------------------------- stdio programs in the sandbox


@needs_sandbox
def test_stdio_correct_program_passes_every_test():
    verdict = grade("""
        n = int(input())
        print(*[i * i for i in range(n)])
    """, [{"input": "3\n", "output": "0 1 4\n"}, {"input": "1", "output": "0"}, {"input": "0", "output": ""}])
    assert verdict.passed and verdict.detail == PASSED and verdict.tests_passed == verdict.tests_total == 3


@needs_sandbox
def test_stdio_stops_at_the_first_wrong_test():
    verdict = grade("print(int(input()) * 2)", [{"input": "1", "output": "2"}, {"input": "2", "output": "5"},
                                                {"input": "3", "output": "6"}])
    assert not verdict.passed and verdict.detail == WRONG_ANSWER and verdict.tests_passed == 1
    assert verdict.message == "test 1: line 1: got '4', expected '5'"


@needs_sandbox
def test_stdio_non_zero_exit_fails_even_with_the_right_output():
    verdict = grade("import sys\nprint(3)\nsys.exit(2)", [{"input": "", "output": "3"}])
    assert verdict.detail == RUNTIME_ERROR and "exit status 2" in verdict.message
    crash = grade("print(1 // 0)", [{"input": "", "output": "0"}])
    assert crash.detail == RUNTIME_ERROR and "ZeroDivisionError" in crash.message
    syntax = grade("def (:", [{"input": "", "output": ""}])
    assert syntax.detail == RUNTIME_ERROR and "SyntaxError" in syntax.message


@needs_sandbox
def test_stdio_timeout_fails():
    verdict = grade("import time\ntime.sleep(30)", [{"input": "", "output": ""}])
    assert verdict.detail == TIMEOUT and not verdict.passed


@needs_sandbox
def test_stdio_program_may_use_its_temp_dir_and_reads_crlf_input():
    verdict = grade("""
        import sys
        data = sys.stdin.read().split()
        with open("notes.txt", "w") as f:
            f.write(" ".join(reversed(data)))
        print(open("notes.txt").read())
    """, [{"input": "a\r\nb\r\n", "output": "b a\r\n"}])
    assert verdict.passed, verdict


# ---------------------------------------------------------------- function-call programs in the sandbox


@needs_sandbox
def test_functional_top_level_function_with_noisy_prints():
    verdict = grade("""
        print('{"value": 999}')  # prints cannot forge results: they go to stdout, not the result channel
        def pair(a, b):
            print("debug", a, b)
            return (a + b, a * b)
    """, [{"fn_name": "pair", "args": [2, 3], "expected": [5, 6]},
          {"fn_name": "pair", "args": [0.5, 0.5], "expected": [1.0, 0.25]}])
    assert verdict.passed, verdict


@needs_sandbox
def test_functional_solution_method_gets_a_fresh_instance():
    verdict = grade("""
        class Solution:
            def __init__(self):
                self.calls = 0
            def twoSum(self, nums, target):
                self.calls += 1
                seen = {}
                for i, x in enumerate(nums):
                    if target - x in seen:
                        return [seen[target - x], i]
                    seen[x] = i
            def count(self):
                return self.calls
    """, [{"fn_name": "twoSum", "args": [[2, 7, 11, 15], 9], "expected": [0, 1]},
          {"fn_name": "twoSum", "args": [[3, 2, 4], 6], "expected": [1, 2]}])
    assert verdict.passed, verdict


@needs_sandbox
def test_functional_bool_is_not_int_and_mismatch_is_reported():
    verdict = grade("def is_even(n):\n    return 1 if n % 2 == 0 else 0",
                    [{"fn_name": "is_even", "args": [2], "expected": True}])
    assert verdict.detail == WRONG_ANSWER and verdict.message == "test 0: got 1, expected true"


@needs_sandbox
def test_functional_results_never_use_the_objects_own_eq():
    verdict = grade("""
        class Anything:
            def __eq__(self, other):
                return True
        def solve(x):
            return Anything()
    """, [{"fn_name": "solve", "args": [1], "expected": 1}])
    assert verdict.detail == RUNTIME_ERROR and "not JSON data" in verdict.message
    subclass = grade("""
        class Sneaky(int):
            def __eq__(self, other):
                return True
        def solve(x):
            return Sneaky(7)
    """, [{"fn_name": "solve", "args": [1], "expected": 1}])
    assert subclass.detail == WRONG_ANSWER  # JSON sees the value 7, not the __eq__


@needs_sandbox
def test_functional_errors():
    missing = grade("def other():\n    return 1", [{"fn_name": "solve", "args": [], "expected": 1}])
    assert missing.detail == RUNTIME_ERROR and "no top-level function or Solution method" in missing.message
    raising = grade("def solve(x):\n    return [][x]", [{"fn_name": "solve", "args": [3], "expected": 1}])
    assert raising.detail == RUNTIME_ERROR and "IndexError" in raising.message
    exiting = grade("import os\ndef solve():\n    os._exit(0)", [{"fn_name": "solve", "args": [], "expected": 1}])
    assert exiting.detail == RUNTIME_ERROR and "ended before returning" in exiting.message
    at_import = grade("raise SystemExit(0)\ndef solve():\n    return 1", [{"fn_name": "solve", "args": [], "expected": 1}])
    assert at_import.detail == RUNTIME_ERROR and "while loading" in at_import.message


@needs_sandbox
def test_functional_stops_counting_at_the_first_wrong_call_and_times_out():
    verdict = grade("def sq(x):\n    return x * x if x < 3 else -1",
                    [{"fn_name": "sq", "args": [x], "expected": x * x} for x in range(5)])
    assert verdict.detail == WRONG_ANSWER and verdict.tests_passed == 3 and verdict.tests_total == 5
    slow = grade("def f(x):\n    while x:\n        pass\n    return 0",
                 [{"fn_name": "f", "args": [0], "expected": 0}, {"fn_name": "f", "args": [1], "expected": 0}])
    assert slow.detail == TIMEOUT and slow.tests_passed == 1
