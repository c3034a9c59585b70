"""`python -m tools.score`: one JSON line per input in order, rewards, summary, input errors, sandbox refusal."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from actors.reward.sandbox import SandboxStatus, probe_sandbox
from tools import score

needs_sandbox = pytest.mark.skipif(not probe_sandbox().available,
                                   reason=f"no bubblewrap sandbox here: {probe_sandbox().reason}")


def write_jsonl(path, rows) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def run_main(argv):
    out = io.StringIO()
    code = score.main(argv, stdout=out)
    return code, [json.loads(line) for line in out.getvalue().splitlines()]


def test_math_scores_in_input_order_with_rewards(tmp_path, capsys):
    rows = [
        {"response": r"so the answer is \boxed{\frac{1}{2}}.", "answer": "0.5"},
        {"response": r"\boxed{3}", "answer": "4"},
        {"response": "I think it is 4", "answer": "4"},
        {"response": r"\boxed{10\%}", "answer": ["10", "0.1"]},
    ]
    code, records = run_main(["math", write_jsonl(tmp_path / "m.jsonl", rows), "--workers", "2",
                              "--correct-reward", "1", "--wrong-reward", "0"])
    assert code == 0
    assert [r["correct"] for r in records] == [True, False, False, True]
    assert [r["reward"] for r in records] == [1.0, 0.0, 0.0, 1.0]
    assert records[0]["extracted"] == r"\frac{1}{2}" and records[2]["extracted"] is None
    assert "math: 2/4 correct (50.0%)" in capsys.readouterr().err


@needs_sandbox
def test_code_scores_every_detail_and_writes_an_output_file(tmp_path, capsys):
    rows = [
        {"program": "print(sum(map(int, input().split())))", "tests": [{"input": "1 2", "output": "3"}]},
        {"program": "print(4)", "tests": [{"input": "", "output": "3"}]},
        {"program": "raise ValueError('no')", "tests": [{"input": "", "output": "3"}]},
        {"program": "while True: pass", "tests": [{"input": "", "output": "3"}]},
        {"program": "def f(x):\n    return [x, x]", "mode": "functional",
         "tests": [{"fn_name": "f", "args": [[1]], "expected": [[1], [1]]}]},
    ]
    out_path = tmp_path / "scored.jsonl"
    code, _ = run_main(["code", write_jsonl(tmp_path / "c.jsonl", rows), "-o", str(out_path), "--workers", "2",
                        "--wall-time", "1", "--cpu-time", "1"])
    assert code == 0
    records = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [r["detail"] for r in records] == ["passed", "wrong_answer", "runtime_error", "timeout", "passed"]
    assert [r["passed"] for r in records] == [True, False, False, False, True]
    assert [r["reward"] for r in records] == [5.0, -5.0, -5.0, -5.0, 5.0]
    assert records[2]["message"].startswith("test 0: exit status 1: ValueError")
    assert all(r["tests_total"] == 1 for r in records)
    err = capsys.readouterr().err
    assert "code: 2/5 passed (40.0%)" in err and "timeout 1" in err and "wrong_answer 1" in err


@pytest.mark.parametrize("kind, rows, message", [
    ("math", [{"response": "x", "answer": "1"}, "", "{not json"], r"m.jsonl:3: not valid JSON"),
    ("math", [{"response": "x"}], r"m.jsonl:1: missing key 'answer'"),
    ("math", [{"response": 3, "answer": "1"}], r"m.jsonl:1: 'response' must be a string"),
    ("math", [{"response": "x", "answer": []}], r"m.jsonl:1: 'answer' must be a non-empty string"),
    ("math", ["[1, 2]"], r"m.jsonl:1: expected a JSON object, got list"),
    ("code", [{"program": "print(1)", "tests": [{"input": "", "output": "1"}]}, {"program": "print(1)"}],
     r"m.jsonl:2: missing key 'tests'"),
    ("code", [{"program": "print(1)", "tests": [{"input": "", "outptu": "1"}]}],
     r"m.jsonl:1: tests\[0\] is missing key 'output'"),
    ("code", [{"program": "print(1)", "tests": [{"input": "", "output": "1"}], "mode": "functional"}],
     r"m.jsonl:1: mode is 'functional'"),
])
def test_bad_lines_stop_the_run_naming_line_and_key(tmp_path, capsys, kind, rows, message):
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    with pytest.raises(score.ScoreInputError, match=message):
        score.read_items(path, kind)
    code, records = run_main([kind, path])
    assert code == 2 and records == []
    assert "error:" in capsys.readouterr().err


def test_missing_file_is_an_input_error(tmp_path):
    with pytest.raises(score.ScoreInputError, match="cannot open"):
        score.read_items(str(tmp_path / "absent.jsonl"), "math")


def test_code_is_refused_without_a_sandbox_unless_allowed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(score, "probe_sandbox", lambda: SandboxStatus(False, "bwrap not found"))
    path = write_jsonl(tmp_path / "c.jsonl", [{"program": "print(1)", "tests": [{"input": "", "output": "1"}]}])
    code, records = run_main(["code", path])
    assert code == 2 and records == []
    err = capsys.readouterr().err
    assert "refusing to run untrusted code" in err and "--allow-unsandboxed" in err


def test_command_line_entry_point(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"response": r"\boxed{2}", "answer": "2"}])
    done = subprocess.run([sys.executable, "-m", "tools.score", "math", path, "--workers", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"correct": True, "reward": 5.0, "extracted": "2", "reason": "equal_text"}
    assert "1/1 correct" in done.stderr
