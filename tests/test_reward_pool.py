"""RewardPool: results in order, hard timeouts, crash replacement, retry-once, counters, the async
API not blocking the event loop, closing, bad arguments, and math grading through the workers.

The functions below run inside worker processes, which import this module by name.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import time

import pytest

from actors.reward.math_grader import POOL_PRELOAD, MathVerdict, grade_math, math_reward
from actors.reward.pool import PoolClosedError, RewardPool, TaskFailure

pytestmark = pytest.mark.timeout(120)

# The limit of items that answer at once: long enough for a worker a loaded machine does not schedule for
# seconds, so that only the items meant to time out do.
QUICK_S = 30.0
CORPUS_PATH = pathlib.Path(__file__).parent / "data" / "math_cases.jsonl"


# ---------------------------------------------------------------- functions run by the workers

def square(x: int) -> int:
    return x * x


def worker_pid(_: int) -> int:
    return os.getpid()


def hang_forever(_: int) -> None:
    while True:  # a busy loop, like sympy stuck in simplify; only SIGKILL ends it
        pass


def exit_abruptly(code: int) -> None:
    os._exit(code)


def kill_self(_: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash_first_time(marker: str) -> str:
    """Crashes the worker on its first call for a marker path, succeeds on the retry."""
    path = pathlib.Path(marker)
    if not path.exists():
        path.write_text("crashed once")
        os._exit(7)
    return "recovered"


def hang_first_time(marker: str) -> str:
    path = pathlib.Path(marker)
    if not path.exists():
        path.write_text("hung once")
        while True:
            pass
    return "recovered"


def raise_value_error(n: int) -> None:
    raise ValueError(f"bad item {n}")


def return_unpicklable(_: int) -> object:
    return lambda: None


def allocate_bytes(n: int) -> int:
    return len(bytearray(n))


def wait_for_file(path: str, limit_s: float) -> str:
    """Polls (bounded) until the parent's event loop creates `path`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return pathlib.Path(path).read_text()
        time.sleep(0.005)
    return "never appeared"


def slow_grade(response: str, answer: str) -> MathVerdict:
    while True:  # stands in for a sympy check that never finishes
        pass


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def pool():
    with RewardPool(2, timeout=20.0) as shared:
        yield shared


# ---------------------------------------------------------------- tests

def test_map_returns_results_in_input_order(pool: RewardPool) -> None:
    before = pool.stats()["done"]
    assert pool.map(square, [(i,) for i in range(40)]) == [i * i for i in range(40)]
    assert pool.stats()["done"] == before + 40


def test_function_by_import_path(pool: RewardPool) -> None:
    assert pool.map("math:gcd", [(12, 18), (7, 5)]) == [6, 1]
    assert pool.map("test_reward_pool:square", [(3,)]) == [9]


def test_items_run_in_parallel_on_distinct_workers(pool: RewardPool) -> None:
    pids = set(pool.map(worker_pid, [(i,) for i in range(20)]))
    assert pids and os.getpid() not in pids


def test_hung_item_is_killed_retried_once_then_failed() -> None:
    # Only the hanging item has the short limit: a quick item given 0.3 s too timed out on a loaded machine.
    with RewardPool(1, timeout=0.3) as p:
        [first_pid] = p.map(worker_pid, [(0,)], timeout=QUICK_S)
        [result] = p.map(hang_forever, [(0,)])
        assert isinstance(result, TaskFailure)
        assert (result.kind, result.attempts) == ("timeout", 2)
        stats = p.stats()
        assert (stats["timeouts"], stats["retries"], stats["failures"], stats["crashes"]) == (2, 1, 1, 0)
        # The killed worker was replaced: the pool keeps working, on a new process.
        [after_pid] = p.map(worker_pid, [(0,)], timeout=QUICK_S)
        assert after_pid != first_pid
        assert p.map(square, [(5,)], timeout=QUICK_S) == [25]
        assert p.stats()["workers_started"] == 3


def test_crashing_worker_is_replaced_and_item_failed_after_one_retry() -> None:
    with RewardPool(1, timeout=20.0) as p:
        results = p.map(exit_abruptly, [(3,)]) + p.map(kill_self, [(0,)])
        assert [(r.kind, r.attempts) for r in results] == [("crash", 2), ("crash", 2)]
        assert "exit code 3" in results[0].detail
        assert "exit code -9" in results[1].detail
        stats = p.stats()
        assert (stats["crashes"], stats["retries"], stats["failures"], stats["done"]) == (4, 2, 2, 0)
        assert p.map(square, [(6,)]) == [36]


def test_item_that_crashes_once_succeeds_on_retry(tmp_path: pathlib.Path) -> None:
    with RewardPool(1, timeout=20.0) as p:
        assert p.map(crash_first_time, [(str(tmp_path / "c"),)]) == ["recovered"]
        # the retry must answer within the limit: 3 s, not 0.3 s, so that a loaded machine does not time it out too
        assert p.map(hang_first_time, [(str(tmp_path / "h"),)], timeout=3.0) == ["recovered"]
        stats = p.stats()
        assert (stats["crashes"], stats["timeouts"], stats["retries"], stats["done"], stats["failures"]) == \
            (1, 1, 2, 2, 0)


def test_no_item_is_lost_when_failures_mix_with_work() -> None:
    with RewardPool(2, timeout=QUICK_S) as p:
        calls = [(square, (i,)) for i in range(12)]
        calls[3] = (hang_forever, (0,))
        calls[7] = (exit_abruptly, (1,))
        # the hanging item alone has a short limit (every item had 0.5 s: a loaded machine timed out squares)
        futures = [p.submit(fn, *args, timeout=0.5 if fn is hang_forever else None) for fn, args in calls]
        results = [f.result(timeout=60) for f in futures]
        for i, result in enumerate(results):
            if i == 3:
                assert result.kind == "timeout"
            elif i == 7:
                assert result.kind == "crash"
            else:
                assert result == i * i
        stats = p.stats()
        assert stats["done"] + stats["failures"] == len(calls)


def test_function_exception_is_a_typed_failure_without_retry(pool: RewardPool) -> None:
    before = pool.stats()
    [result] = pool.map(raise_value_error, [(3,)])
    assert isinstance(result, TaskFailure) and not result
    assert (result.kind, result.attempts) == ("error", 1)
    assert "ValueError: bad item 3" in result.detail
    after = pool.stats()
    assert after["errors"] == before["errors"] + 1 and after["retries"] == before["retries"]


def test_unpicklable_result_and_unknown_function_are_errors(pool: RewardPool) -> None:
    [unpicklable] = pool.map(return_unpicklable, [(0,)])
    assert unpicklable.kind == "error" and "could not be sent back" in unpicklable.detail
    [missing] = pool.map("no_such_module_xyz:f", [()])
    assert missing.kind == "error" and "ModuleNotFoundError" in missing.detail
    assert pool.map(square, [(2,)]) == [4]


def test_memory_limit_turns_a_memory_bomb_into_an_error() -> None:
    with RewardPool(1, timeout=20.0, memory_limit_bytes=1 << 30) as p:
        [bomb, fine] = p.map(allocate_bytes, [(4 << 30,), (1 << 20,)])
        assert bomb.kind == "error" and "MemoryError" in bomb.detail
        assert fine == 1 << 20


def test_workers_are_recycled_after_max_tasks() -> None:
    with RewardPool(1, timeout=20.0, max_tasks_per_worker=2) as p:
        pids = [p.map(worker_pid, [(i,)])[0] for i in range(6)]
        assert len(set(pids)) == 3
        assert p.stats()["workers_started"] >= 3


def test_async_run_does_not_block_the_event_loop(pool: RewardPool, tmp_path: pathlib.Path) -> None:
    signal_file = tmp_path / "go"

    async def scenario() -> str:
        waiting = asyncio.ensure_future(pool.run(wait_for_file, str(signal_file), 30.0))
        # The worker can only finish after this coroutine runs on the loop while run() is pending.
        await asyncio.sleep(0)
        assert not waiting.done()
        # written whole, then named: a worker that saw the name could otherwise read the file still empty
        signal_file.with_suffix(".part").write_text("loop is free")
        signal_file.with_suffix(".part").rename(signal_file)
        return await asyncio.wait_for(waiting, 60)

    assert asyncio.run(scenario()) == "loop is free"


def test_async_run_many_concurrently(pool: RewardPool) -> None:
    async def scenario() -> list[int]:
        return await asyncio.gather(*(pool.run(square, i) for i in range(30)))

    assert asyncio.run(scenario()) == [i * i for i in range(30)]


def test_async_context_manager_closes() -> None:
    async def scenario() -> RewardPool:
        async with RewardPool(1, timeout=5.0) as p:
            assert await p.run(square, 4) == 16
        return p

    closed = asyncio.run(scenario())
    with pytest.raises(PoolClosedError):
        closed.submit(square, 1)


def test_close_fails_unfinished_items_instead_of_losing_them() -> None:
    p = RewardPool(1, timeout=60.0)
    running = p.submit(hang_forever, 0)
    queued = p.submit(square, 3)
    p.close()
    for future in (running, queued):
        result = future.result(timeout=30)
        assert isinstance(result, TaskFailure) and result.kind == "closed"
    with pytest.raises(PoolClosedError):
        p.submit(square, 1)


@pytest.mark.parametrize("kwargs,message", [
    ({"workers": 0}, "workers must be a positive integer"),
    ({"workers": 1, "timeout": 0}, "timeout must be positive"),
    ({"workers": 1, "retries": -1}, "retries must be a non-negative integer"),
    ({"workers": 1, "context": "fork"}, "context must be 'forkserver' or 'spawn'"),
    ({"workers": 1, "max_tasks_per_worker": 0}, "max_tasks_per_worker must be positive"),
])
def test_bad_pool_settings_name_the_setting(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RewardPool(**kwargs)


def test_bad_submissions_name_the_cause(pool: RewardPool) -> None:
    with pytest.raises(ValueError, match="not importable by a worker"):
        pool.submit(lambda: 1)
    with pytest.raises(ValueError, match="not of the form 'module:function'"):
        pool.submit("square")
    with pytest.raises(ValueError, match="timeout must be positive"):
        pool.submit(square, 1, timeout=-1)


def test_spawn_context_works_too() -> None:
    with RewardPool(1, timeout=30.0, context="spawn") as p:
        assert p.map(square, [(7,)]) == [49]


# ---------------------------------------------------------------- math grading in the workers

def test_math_grading_in_workers_matches_in_process() -> None:
    cases = [json.loads(line) for line in CORPUS_PATH.read_text().splitlines()[::3]]
    args = [(c["response"], c["answer"]) for c in cases]
    with RewardPool(2, timeout=20.0, preload=POOL_PRELOAD) as p:
        remote = p.map(grade_math, args)
    assert remote == [grade_math(*a) for a in args]
    assert [v.correct for v in remote] == [c["correct"] for c in cases]


def test_math_check_timeout_scores_wrong_and_is_counted() -> None:
    async def scenario(p: RewardPool) -> list[float]:
        outcomes = await asyncio.gather(p.run(slow_grade, r"\boxed{1}", "1", timeout=0.3),
                                        p.run(grade_math, r"\boxed{1}", "1", timeout=20.0))
        return [math_reward(o if isinstance(o, MathVerdict) else None) for o in outcomes]

    with RewardPool(2, timeout=20.0) as p:
        assert asyncio.run(scenario(p)) == [-5.0, 5.0]
        assert p.stats()["timeouts"] == 2 and p.stats()["failures"] == 1


def test_workers_that_cannot_start_break_the_pool_instead_of_respawning_forever() -> None:
    with RewardPool(1, timeout=5.0, preload=["no_such_module_for_pool_test"]) as p:
        try:
            future = p.submit(square, 2)
        except PoolClosedError as exc:  # the pool may already have given up
            assert "broken" in str(exc)
        else:
            result = future.result(timeout=60)
            assert result.kind in ("start_failed", "closed") and not result
        with pytest.raises(PoolClosedError, match="workers in a row died before becoming ready"):
            for _ in range(200):  # bounded: the dispatcher marks the pool broken within a few starts
                p.submit(square, 2).result(timeout=60)
        assert p.stats()["workers_started"] == 3
