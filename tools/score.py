"""`python -m tools.score {math,code} FILE.jsonl`: score answers offline with the reward checkers.

math: lines `{"response": str, "answer": str | [str, ...]}` -> `{"correct": bool, "reward": float, "extracted": ...,
"reason": ...}`. code: lines `{"program": str, "tests": [...], "mode": "stdio"|"functional" (optional)}` ->
`{"passed": bool, "reward": float, "detail": str, "message": str, "tests_passed": int, "tests_total": int}`.

One output line per input line, in input order, on stdout or `-o FILE`; a summary goes to stderr. Items run
in parallel in the reward worker pool (hard per-item timeouts; a hung or crashed check scores as wrong and
is counted); math answers that the grader settles without sympy (`grade_math_fast`) skip the pool. Every input line is validated before anything runs; a bad line stops the run with an error
naming the file, line number and key. Code runs only in the bubblewrap sandbox unless
`--allow-unsandboxed` is given.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from actors.reward.code_grader import TestSpecError, detect_mode
from actors.reward.pool import RewardPool, TaskFailure
from actors.reward.sandbox import MiB, Sandbox, SandboxLimits, probe_sandbox

MATH_GRADER = "actors.reward.math_grader:grade_math"
CODE_GRADER = "actors.reward.code_grader:grade_code"


class ScoreInputError(ValueError):
    """An input line is not valid JSON or lacks a field; the message names file, line and key."""


def read_items(path: str, kind: str) -> list[dict[str, Any]]:
    """Parse and validate every line of a JSONL file (blank lines are skipped)."""
    items = []
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise ScoreInputError(f"{path}: cannot open: {exc.strerror}") from exc
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise ScoreInputError(f"{where}: not valid JSON: {exc}") from exc
            if not isinstance(item, dict):
                raise ScoreInputError(f"{where}: expected a JSON object, got {type(item).__name__}")
            items.append(_validate(item, kind, where))
    return items


def _validate(item: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    fields = ("response", "answer") if kind == "math" else ("program", "tests")
    for key in fields:
        if key not in item:
            raise ScoreInputError(f"{where}: missing key {key!r}")
    if kind == "math":
        if not isinstance(item["response"], str):
            raise ScoreInputError(f"{where}: 'response' must be a string, got {type(item['response']).__name__}")
        answer = item["answer"]
        answers = answer if isinstance(answer, list) else [answer]
        if not answers or not all(isinstance(one, str) and one.strip() for one in answers):
            raise ScoreInputError(f"{where}: 'answer' must be a non-empty string or list of them, got {answer!r:.80}")
        return item
    if not isinstance(item["program"], str):
        raise ScoreInputError(f"{where}: 'program' must be a string, got {type(item['program']).__name__}")
    try:
        detect_mode(item["tests"], item.get("mode"))
    except TestSpecError as exc:
        raise ScoreInputError(f"{where}: {exc}") from exc
    return item


def _math_record(result: Any, rewards: tuple[float, float]) -> dict[str, Any]:
    if isinstance(result, TaskFailure):
        return {"correct": False, "reward": rewards[1], "extracted": None,
                "reason": f"checker {result.kind}: {result.detail.splitlines()[0] if result.detail else ''}"}
    correct = bool(result.correct)
    return {"correct": correct, "reward": rewards[0] if correct else rewards[1],
            "extracted": result.extracted, "reason": result.reason}


def _code_record(result: Any, rewards: tuple[float, float], n_tests: int) -> dict[str, Any]:
    if isinstance(result, TaskFailure):
        detail = "timeout" if result.kind == "timeout" else "checker_error"
        return {"passed": False, "reward": rewards[1], "detail": detail,
                "message": f"checker {result.kind}: {result.detail.splitlines()[0] if result.detail else ''}",
                "tests_passed": 0, "tests_total": n_tests}
    return {"passed": result.passed, "reward": rewards[0] if result.passed else rewards[1],
            "detail": result.detail, "message": result.message,
            "tests_passed": result.tests_passed, "tests_total": result.tests_total}


def score(kind: str, items: Sequence[dict[str, Any]], *, workers: int, rewards: tuple[float, float] = (5.0, -5.0),
          math_timeout_s: float = 10.0, limits: SandboxLimits | None = None,
          allow_unsandboxed: bool = False) -> list[dict[str, Any]]:
    """Score validated items in a worker pool; one record per item, in order."""
    if kind == "math":
        math_grader = importlib.import_module("actors.reward.math_grader")  # fail here, not in every worker
        # The grader's sympy-free path is bounded in time and settles most answers in well under a
        # millisecond, less than a round trip to a worker; only the undecided rest goes to the pool.
        results: list[Any] = [math_grader.grade_math_fast(item["response"], item["answer"]) for item in items]
        undecided = [index for index, result in enumerate(results) if result is None]
        if undecided:
            with RewardPool(min(workers, len(undecided)), timeout=math_timeout_s,
                            preload=math_grader.POOL_PRELOAD) as pool:
                futures = [pool.submit(MATH_GRADER, items[i]["response"], items[i]["answer"]) for i in undecided]
                for index, future in zip(undecided, futures):
                    results[index] = future.result()
        return [_math_record(result, rewards) for result in results]
    limits = limits or SandboxLimits()
    sandbox = Sandbox(limits, allow_unsandboxed=allow_unsandboxed)
    with RewardPool(workers, preload=["actors.reward.code_grader"]) as pool:
        futures = []
        for item in items:
            # The sandbox bounds every run; the pool deadline is only the backstop for a wedged worker.
            budget = len(item["tests"]) * (limits.wall_time_s + 1.0) + 10.0
            futures.append(pool.submit(CODE_GRADER, item["program"], item["tests"], item.get("mode"),
                                       sandbox=sandbox, timeout=budget))
        return [_code_record(future.result(), rewards, len(item["tests"])) for future, item in zip(futures, items)]


def summarize(kind: str, records: Sequence[dict[str, Any]], elapsed_s: float) -> str:
    key = "correct" if kind == "math" else "passed"
    good = sum(1 for record in records if record[key])
    total = len(records)
    share = f"{100.0 * good / total:.1f}%" if total else "n/a"
    line = f"{kind}: {good}/{total} {key} ({share}) in {elapsed_s:.2f} s"
    if kind == "code":
        details = collections.Counter(record["detail"] for record in records)
        line += "; " + ", ".join(f"{name} {count}" for name, count in sorted(details.items()))
    else:
        failures = sum(1 for record in records if str(record.get("reason", "")).startswith("checker "))
        if failures:
            line += f"; {failures} checker timeouts/crashes scored as wrong"
    return line


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.score", description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("math", "code"), help="which checker")
    parser.add_argument("file", help="input JSONL file")
    parser.add_argument("-o", "--output", help="write JSONL here instead of stdout")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--correct-reward", type=float, default=5.0)
    parser.add_argument("--wrong-reward", type=float, default=-5.0)
    parser.add_argument("--math-timeout", type=float, default=10.0, help="seconds per math check")
    parser.add_argument("--wall-time", type=float, default=SandboxLimits.wall_time_s,
                        help="seconds of wall time per program run")
    parser.add_argument("--cpu-time", type=float, default=SandboxLimits.cpu_time_s,
                        help="seconds of CPU time per program run")
    parser.add_argument("--memory-mb", type=int, default=SandboxLimits.memory_bytes // MiB,
                        help="address-space limit per process of a program run, MiB")
    parser.add_argument("--allow-unsandboxed", action="store_true",
                        help="run programs without bubblewrap if no sandbox works (unsafe)")
    args = parser.parse_args(list(argv))
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    return args


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        items = read_items(args.file, args.kind)
    except ScoreInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    limits = None
    if args.kind == "code":
        try:
            limits = dataclasses.replace(SandboxLimits(), wall_time_s=args.wall_time, cpu_time_s=args.cpu_time,
                                         memory_bytes=args.memory_mb * MiB)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        status = probe_sandbox()
        if not status.available and not args.allow_unsandboxed:
            print(f"error: refusing to run untrusted code: no working bubblewrap sandbox ({status.reason}); "
                  "pass --allow-unsandboxed to run programs without isolation", file=sys.stderr)
            return 2
        if not status.available:
            print(f"warning: running programs WITHOUT a sandbox ({status.reason})", file=sys.stderr)
    started = time.monotonic()
    try:
        records = score(args.kind, items, workers=args.workers, rewards=(args.correct_reward, args.wrong_reward),
                        math_timeout_s=args.math_timeout, limits=limits, allow_unsandboxed=args.allow_unsandboxed)
    except ModuleNotFoundError as exc:
        print(f"error: the {args.kind} checker is not available: {exc}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - started
    out = open(args.output, "w", encoding="utf-8") if args.output else (stdout or sys.stdout)
    try:
        for record in records:
            out.write(json.dumps(record) + "\n")
    finally:
        if args.output:
            out.close()
    print(summarize(args.kind, records, elapsed), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
