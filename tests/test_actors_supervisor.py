"""Supervisor with real actor processes: ready, restart with backoff, give up, stragglers, affinity, msglog; actors
forked from the start template (the default) and started as fresh interpreters alike."""
from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from actors.runtime.base import Actor, ActorSpec, handles
from actors.runtime.supervisor import NotReadyError, Supervisor, SupervisorError
from testsupport.bounded import run_bounded, until as poll_until
from tools.plan.cpushare import actor_sample
from topology.settings import ActorSettings
from transport.bus import Bus
from transport.messages import Message, decode, message
from transport.msglog import read_log


@message("test.sup.info")
class InfoRequest(Message):
    pass


@message("test.sup.info_reply")
class InfoReply(Message):
    pid: int
    cores: list[int]
    omp: str
    threads: int = 0      # torch's intra-op threads
    parent: int = 0
    session: int = 0
    stdin: str = ""
    stdout: str = ""
    umask: int = 0
    tmp: str = ""         # tempfile.gettempdir()
    cwd: str = ""
    main: str = ""        # the __main__ module's name (what its multiprocessing workers import)


@message("test.sup.crash")
class Crash(Message):
    how: str = "exit"


@message("test.sup.note")
class Note(Message):
    n: int


class WorkerSettings(ActorSettings):
    crash_on_start: bool = False
    bad_setting_then_refuse_restart: bool = False
    hang_on_start: bool = False
    hang_on_drain: bool = False
    ready_when: str = ""          # a file: on_start waits until it exists (a server that takes long to come up)


class WorkerActor(Actor):
    """Behaviour chosen by settings: crash_on_start, hang_on_start, hang_on_drain."""

    Settings = WorkerSettings
    cfg: WorkerSettings

    async def on_start(self) -> None:
        if self.cfg.crash_on_start:
            print("worker: refusing to start (crash_on_start)", flush=True)
            os._exit(3)
        if self.cfg.bad_setting_then_refuse_restart:
            marker = self.run_dir / f"{self.name}.started"
            if marker.exists():   # like a stateful actor: a restart refuses to run
                raise RuntimeError(f"{self.name} was restarted inside a running launch")
            marker.write_text("")
            raise ValueError("algo.eta: must be >= 0, got -1")
        if self.cfg.hang_on_start:
            print("worker: stuck in on_start", flush=True)
            await asyncio.Event().wait()
        if self.cfg.ready_when:
            print("worker: waiting for its server", flush=True)
            await poll_until(lambda: os.path.exists(self.cfg.ready_when), 120, "the server to come up")

    async def on_drain(self) -> None:
        if self.cfg.hang_on_drain:
            await asyncio.Event().wait()

    @handles(InfoRequest)
    def info(self, msg: InfoRequest) -> InfoReply:
        import torch

        umask = os.umask(0)
        os.umask(umask)
        return InfoReply(os.getpid(), sorted(os.sched_getaffinity(0)), os.environ.get("OMP_NUM_THREADS", ""),
                         threads=torch.get_num_threads(), parent=os.getppid(), session=os.getsid(0),
                         stdin=os.readlink("/proc/self/fd/0"), stdout=os.readlink("/proc/self/fd/1"), umask=umask,
                         tmp=tempfile.gettempdir(), cwd=os.getcwd(), main=sys.modules["__main__"].__spec__.name)

    @handles(Note)
    def note(self, msg: Note) -> None:
        pass

    @handles(Crash)
    def crash(self, msg: Crash) -> None:
        if msg.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(5)


# Bounds far above what these starts take on a quiet machine: on one loaded by other work (a load average of 35
# on 2 cores) importing an actor's modules alone took 7 s, and a test that restarts an actor starts it 3 times.
# They end hangs; no test here depends on them running out.
START_BUDGET = 300.0
run = functools.partial(run_bounded, timeout=START_BUDGET + 60)
until = functools.partial(poll_until, timeout=120.0)


def spec(tmp_path: Any, name: str, **settings: Any) -> ActorSpec:
    env = settings.pop("env", {})
    return ActorSpec(name=name, cls="tests.test_actors_supervisor:WorkerActor", endpoint=f"ipc://{tmp_path}/s/{name}",
                     run_dir=str(tmp_path), settings={"log_console": False, **settings}, env=env)


async def client_for(tmp_path: Any, *names: str) -> Bus:
    return await Bus("client", "tcp://127.0.0.1:*", {n: f"ipc://{tmp_path}/s/{n}" for n in names},
                     heartbeat_interval=None).start()


@pytest.mark.parametrize("fork_start", [True, False], ids=["fork", "exec"])
def test_start_ready_affinity_env_and_clean_stop(tmp_path: Any, fork_start: bool) -> None:
    # Forked from the template or a fresh interpreter, an actor is the same process: the supervisor's child in
    # a session of its own, stdin /dev/null, its log as stdout, its TMPDIR, umask and cwd, and the thread count
    # its spec gives (OMP_NUM_THREADS, which torch caps at the machine's cores), though the template loaded torch
    # with one thread.
    async def main() -> None:
        cores = sorted(os.sched_getaffinity(0))
        sup = Supervisor([spec(tmp_path, "a", env={"AREAL_CPU_AFFINITY": str(cores[0]), "OMP_NUM_THREADS": "1"}),
                          spec(tmp_path, "b", env={"OMP_NUM_THREADS": "3"})], tmp_path, ready_timeout=START_BUDGET,
                         fork_start=fork_start)
        await sup.start()
        assert {c.proc.start for c in sup.children.values()} == {"fork" if fork_start else "exec"}
        client = await client_for(tmp_path, "a", "b")
        # an exec-started actor imports torch for its first answer (seconds on a loaded machine)
        a = await client.request("a", InfoRequest(), timeout=START_BUDGET)
        b = await client.request("b", InfoRequest(), timeout=START_BUDGET)
        assert a.cores == [cores[0]] and a.omp == "1" and a.threads == 1
        assert b.cores == cores and a.pid == sup.pids()["a"] and b.threads == min(3, os.cpu_count())
        root = str(Path(__file__).resolve().parents[1])
        for name, info in (("a", a), ("b", b)):
            assert (info.parent, info.session, info.stdin, info.umask, info.cwd, info.main) == \
                (os.getpid(), info.pid, os.devnull, 0o077, root, "actors.runtime.run"), info
            assert info.stdout == str(tmp_path / "logs" / f"{name}.out")
            assert info.tmp == (tmp_path / "tmpdirs" / name).read_text()
            # and tools.plan.cpushare tells it for an actor process, though a forked one has the template's cmdline
            assert actor_sample(info.pid, boot=0.0)[0] == str(tmp_path / "specs" / f"{name}.json")
        codes = await sup.stop()
        assert codes == {"a": 0, "b": 0}           # SIGTERM -> drain -> exit 0
        await client.close()

    run(main())


def test_restart_after_crash_with_backoff_and_report(tmp_path: Any) -> None:
    async def main() -> None:
        reports: list[tuple] = []
        sup = Supervisor([spec(tmp_path, "w")], tmp_path, backoff_initial=0.05, max_restarts=3,
                         on_restart=lambda name, n, code: reports.append((name, n, code)))
        await sup.start()
        client = await client_for(tmp_path, "w")
        first = (await client.request("w", InfoRequest(), timeout=10)).pid
        await client.send("w", Crash("exit"))
        await until(lambda: sup.restarts["w"] == 1 and sup.children["w"].ready)
        second = await client.request("w", InfoRequest(), timeout=10)    # same endpoint, new process
        assert second.pid != first and reports == [("w", 1, 5)]
        await client.send("w", Crash("kill"))
        await until(lambda: sup.restarts["w"] == 2 and sup.children["w"].ready)
        assert reports[-1] == ("w", 2, -signal.SIGKILL)
        await sup.stop()
        await client.close()

    run(main())


def test_an_actor_that_crashes_after_the_run_is_over_is_not_restarted(tmp_path: Any) -> None:
    async def main() -> None:
        over = [False]
        sup = Supervisor([spec(tmp_path, "w")], tmp_path, backoff_initial=0.05, run_over=lambda: over[0])
        await sup.start()
        client = await client_for(tmp_path, "w")
        await client.request("w", InfoRequest(), timeout=10)
        over[0] = True          # e.g. the trainer wrote FINISHED; the actor then dies on its way out
        await client.send("w", Crash("exit"))
        await until(lambda: sup.children["w"].finished)
        assert sup.restarts["w"] == 0 and sup.children["w"].last_exit == 5
        await sup.stop()
        await client.close()

    run(main())


def test_a_restarted_actor_still_running_after_the_run_ended_is_stopped(tmp_path: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A restarted reward actor was starting when the trainer finished the run: the RunFinished went to its
    # dead predecessor, so the new process waited for ever and the launcher with it (chaos kill_reward, CI).
    import actors.runtime.supervisor as supervisor_module
    monkeypatch.setattr(supervisor_module, "AFTER_RUN_GRACE_S", 0.2)

    async def main() -> None:
        over = [False]
        sup = Supervisor([spec(tmp_path, "w")], tmp_path, backoff_initial=0.05, run_over=lambda: over[0])
        await sup.start()
        client = await client_for(tmp_path, "w")
        await client.send("w", Crash("exit"))
        await until(lambda: sup.restarts["w"] == 1 and sup.children["w"].ready)
        over[0] = True          # the run ends; nobody tells the new process
        await until(lambda: sup.children["w"].finished)
        assert sup.children["w"].last_exit == 0     # SIGTERM is an actor's clean stop
        await sup.stop()
        await client.close()

    run(main())


def test_actors_still_running_after_the_run_ended_are_stopped_then_killed(tmp_path: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The trainer marked the run finished, then failed before telling anyone (trainer.0 in
    # test_pipeline_stages_each_send_their_own_layers_to_sglang_servers, once): the others waited for a
    # RunFinished that never came, and the launcher with them until the test's timeout.
    import actors.runtime.supervisor as supervisor_module
    monkeypatch.setattr(supervisor_module, "RUN_END_GRACE_S", 0.2)

    async def main() -> None:
        over = [False]
        sup = Supervisor([spec(tmp_path, "w"), spec(tmp_path, "deaf", hang_on_drain=True, drain_timeout=60)],
                         tmp_path, stop_timeout=1.0, run_over=lambda: over[0])
        await sup.start()
        over[0] = True          # the run ends; nobody tells them
        await until(lambda: all(c.finished for c in sup.children.values()))
        assert sup.children["w"].last_exit == 0                    # SIGTERM is an actor's clean stop
        assert sup.children["deaf"].last_exit == -signal.SIGKILL    # it did not stop: killed
        await sup.stop()

    run(main())


def test_gives_up_after_restart_limit_with_clear_message(tmp_path: Any) -> None:
    async def main() -> None:
        given_up: list[str] = []
        sup = Supervisor([spec(tmp_path, "ok"), spec(tmp_path, "bad", crash_on_start=True)], tmp_path,
                         backoff_initial=0.02, max_restarts=2, ready_timeout=START_BUDGET,
                         on_giveup=lambda name, why: given_up.append(name))
        with pytest.raises(SupervisorError) as err:
            await sup.start()
        text = str(err.value)
        assert "actor bad died 3 times" in text and "last exit code 3" in text
        assert "refusing to start" in text                     # its last log lines are in the message
        assert given_up == ["bad"] and sup.restarts["bad"] == 2
        assert all(pid is None for pid in sup.pids().values())   # the run was stopped, nothing left behind

    run(main())


def test_the_give_up_message_leads_with_the_first_failure(tmp_path: Any) -> None:
    # The first start failed on a bad setting; the restarts failed for another reason. The run's summary
    # once showed only the restarts' error, which hid the cause.
    async def main() -> None:
        sup = Supervisor([spec(tmp_path, "bad", bad_setting_then_refuse_restart=True)], tmp_path,
                         backoff_initial=0.02, max_restarts=1, ready_timeout=START_BUDGET)
        with pytest.raises(SupervisorError) as err:
            await sup.start()
        text = str(err.value)
        assert "its first failure: ValueError('algo.eta: must be >= 0, got -1')" in text, text
        assert text.index("first failure") < text.index("Last log lines")

    run(main())


def test_not_ready_names_the_actor_and_its_last_lines(tmp_path: Any) -> None:
    # A ready budget of 3 s failed this test on a loaded machine: "fine" was named too, and "stuck" had not
    # printed yet. The budget now runs out once "fine" is ready and "stuck" is stuck, whatever the machine's speed.
    async def main() -> None:
        sup = Supervisor([spec(tmp_path, "fine"), spec(tmp_path, "stuck", hang_on_start=True)], tmp_path,
                         ready_timeout=START_BUDGET, stop_timeout=5)
        starting = asyncio.ensure_future(sup.start())
        stuck_out = tmp_path / "logs" / "stuck.out"
        await until(lambda: sup.children["fine"].ready and stuck_out.exists()
                    and "stuck in on_start" in stuck_out.read_text(), what="fine ready and stuck stuck")
        sup.children["stuck"].ready_by = time.monotonic()   # its budget runs out now
        with pytest.raises(NotReadyError) as err:
            await starting
        text = str(err.value)
        assert f"stuck (running; ready budget {START_BUDGET:.0f}s)" in text and "stuck in on_start" in text
        assert "fine" not in text.split(":", 1)[1]
        assert all(pid is None for pid in sup.pids().values())

    run(main())


def test_stop_kills_stragglers(tmp_path: Any) -> None:
    async def main() -> None:
        sup = Supervisor([spec(tmp_path, "slowpoke", hang_on_drain=True, drain_timeout=60)], tmp_path,
                         stop_timeout=1.0)
        await sup.start()
        codes = await sup.stop()
        assert codes == {"slowpoke": -signal.SIGKILL}

    run(main())


def test_message_log_survives_a_crash(tmp_path: Any) -> None:
    async def main() -> None:
        sup = Supervisor([spec(tmp_path, "rec", message_log={"outbound": True})], tmp_path, backoff_initial=0.05)
        await sup.start()
        client = await client_for(tmp_path, "rec")
        for i in range(20):
            await client.send("rec", Note(i))
        await client.request("rec", InfoRequest(), timeout=10)        # all 20 notes were handled before this
        await client.send("rec", Crash("kill"))
        await until(lambda: sup.restarts["rec"] == 1 and sup.children["rec"].ready)
        await client.send("rec", Note(100))
        await client.request("rec", InfoRequest(), timeout=10)
        await sup.stop()
        await client.close()
        records, torn = read_log(tmp_path / "msglog" / "rec.msglog")
        assert torn is None
        seg0 = [decode(r.frames)[1] for r in records if r.kind == "in" and r.segment == 0]
        assert [m.n for m in seg0 if isinstance(m, Note)] == list(range(20))
        assert isinstance(seg0[-1], Crash)
        outs = [decode(r.frames)[1] for r in records if r.kind == "out" and r.segment == 0]
        assert len(outs) == 1 and isinstance(outs[0], InfoReply)
        seg1 = [decode(r.frames)[1] for r in records if r.kind == "in" and r.segment == 1]
        assert [type(m).__name__ for m in seg1] == ["Note", "InfoRequest"]

    run(main())


def test_each_actor_waits_its_own_ready_budget(tmp_path: Any) -> None:
    # One ready_timeout for all (120 s) stopped a run whose SGLang servers take minutes to load and capture
    # CUDA graphs; each actor now has the budget of what it starts.
    server_up = tmp_path / "server_up"

    async def main() -> None:
        # (ready_timeout is every other actor's budget: both have their own, so it can be short)
        sup = Supervisor([spec(tmp_path, "fast"), spec(tmp_path, "slow", ready_when=str(server_up))], tmp_path,
                         ready_timeout=2.0, ready_budgets={"slow": START_BUDGET, "fast": START_BUDGET})
        t0 = time.monotonic()
        starting = asyncio.ensure_future(sup.start())
        await until(lambda: sup.children["fast"].ready, what="fast to be ready")
        # the slow one's server comes up after ready_timeout: only its own budget counts
        await asyncio.sleep(max(0.0, 2.5 - (time.monotonic() - t0)))
        assert not starting.done()
        server_up.write_text("")
        await starting
        assert sup.children["slow"].ready
        await sup.stop()

    run(main())


def test_the_run_starts_with_enough_late_joiners_and_one_that_never_comes_up_is_reported(tmp_path: Any) -> None:
    # A rollout is ready only once its server is up. The run starts with enough of them; a late one joins
    # when its server is up; one whose server never comes up is reported and left down. Neither stops it.
    server_up = tmp_path / "server_up"

    async def main() -> dict[str, Any]:
        sup = Supervisor([spec(tmp_path, "r.0"), spec(tmp_path, "r.1", ready_when=str(server_up)),
                          spec(tmp_path, "r.2", crash_on_start=True), spec(tmp_path, "buffer")], tmp_path,
                         backoff_initial=0.02, max_restarts=1, ready_timeout=START_BUDGET, late_joiners={"r": 1})
        await sup.start()                                   # r.0 and buffer are ready: the run begins
        assert sup.children["r.0"].ready and sup.children["buffer"].ready and not sup.children["r.1"].ready
        running = asyncio.ensure_future(sup.run())
        await until(lambda: sup.children["r.2"].given_up, what="r.2 to be given up")
        server_up.write_text("")
        await until(lambda: sup.children["r.1"].ready, what="r.1 to join")
        assert not running.done()                           # the run goes on
        await sup.stop()
        await running
        return {"restarts": dict(sup.restarts)}

    out = run(main())
    assert out["restarts"]["r.2"] == 1


def test_a_late_joining_group_that_cannot_reach_its_number_stops_the_start(tmp_path: Any) -> None:
    async def main() -> None:
        sup = Supervisor([spec(tmp_path, "r.0"), spec(tmp_path, "r.1", crash_on_start=True),
                          spec(tmp_path, "r.2", crash_on_start=True)], tmp_path,
                         backoff_initial=0.02, max_restarts=1, ready_timeout=START_BUDGET, late_joiners={"r": 2})
        with pytest.raises(SupervisorError) as err:
            await sup.start()
        assert "r.1" in str(err.value) or "r.2" in str(err.value)
        assert all(pid is None for pid in sup.pids().values())

    run(main())


def test_a_run_that_ends_with_a_member_given_up_is_not_a_clean_exit(tmp_path: Any, capsys: Any) -> None:
    # A rollout given up for the rest of a run (its restarts failed) left the launcher's exit code at 0 and its
    # summary silent: a degraded run read as a clean one.
    from launch.local import supervise

    status, stop = tmp_path / "status.json", tmp_path / "stop"
    specs = [spec(tmp_path, "r.0").to_dict(), spec(tmp_path, "r.1", crash_on_start=True).to_dict()]

    async def main() -> int:
        running = asyncio.ensure_future(supervise(
            specs, tmp_path, {"backoff_initial": 0.02, "max_restarts": 1, "ready_timeout": START_BUDGET,
                              "late_joiners": {"r": 1}},
            title="t", progress=False, duration=None, node_of={}, status_file=status, stop_file=stop))

        def given_up() -> bool:
            try:
                return json.loads(status.read_text())["actors"]["r.1"]["state"] == "failed"
            except (OSError, ValueError, KeyError):
                return False
        await until(given_up, what="r.1 to be given up")
        stop.write_text("stop requested by the test")
        return await running

    assert run(main()) == 1
    assert "r.1 given up" in capsys.readouterr().out


def test_a_killed_start_template_loses_no_actor_and_later_starts_are_fresh_interpreters(tmp_path: Any) -> None:
    # The actors are the supervisor's children, not the template's: a kill -9 of the template leaves them
    # running, and a restart afterwards starts a fresh interpreter. An actor whose environment sets a variable
    # read as torch loads starts as a fresh interpreter from the first.
    async def main() -> None:
        sup = Supervisor([spec(tmp_path, "a"), spec(tmp_path, "b", env={"TORCH_SHOW_CPP_STACKTRACES": "1"})],
                         tmp_path, backoff_initial=0.05, ready_timeout=START_BUDGET)
        await sup.start()
        assert (sup.children["a"].proc.start, sup.children["b"].proc.start) == ("fork", "exec")
        client = await client_for(tmp_path, "a", "b")
        before = {n: (await client.request(n, InfoRequest(), timeout=START_BUDGET)).pid for n in ("a", "b")}
        template = sup.start_template_pid
        os.kill(template, signal.SIGKILL)
        await until(lambda: not os.path.exists(f"/proc/{template}"))   # reaped: it was our child
        assert {n: (await client.request(n, InfoRequest(), timeout=10)).pid for n in ("a", "b")} == before
        await client.send("a", Crash("kill"))
        await until(lambda: sup.restarts["a"] == 1 and sup.children["a"].ready)
        assert sup.children["a"].proc.start == "exec" and sup.children["a"].last_exit == -signal.SIGKILL
        assert (await client.request("a", InfoRequest(), timeout=START_BUDGET)).pid not in (before["a"], None)
        assert sup.start_template_pid is None
        assert await sup.stop() == {"a": 0, "b": 0}
        await client.close()

    run(main())


LAUNCHER = """
import asyncio, json, sys
from pathlib import Path
from actors.runtime.supervisor import Supervisor
from tests.test_actors_supervisor import spec

async def main():
    run_dir = Path(sys.argv[1])
    sup = Supervisor([spec(run_dir, "a")], run_dir, ready_timeout=300)
    await sup.start()
    (run_dir / "pids.json").write_text(json.dumps([sup.pids()["a"], sup.start_template_pid]))
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _ended(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def test_a_launcher_killed_with_9_takes_its_forked_actors_and_template_with_it(tmp_path: Any) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)],
                                cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        run(poll_until(lambda: (tmp_path / "pids.json").exists() or launcher.poll() is not None, START_BUDGET,
                       "the launcher to start its actor"))
        actor, template = json.loads((tmp_path / "pids.json").read_text())
        assert template is not None and not _ended(actor)
        launcher.kill()
        launcher.wait(timeout=60)
        run(poll_until(lambda: _ended(actor) and _ended(template), 120, "the actor and the template to end"))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=60)
    # the actor had its SIGTERM (a clean stop), not the kill
    stopping = [json.loads(line) for line in (tmp_path / "logs" / "a.jsonl").read_text().splitlines()
                if '"stopping"' in line]
    assert [e["reason"] for e in stopping] == ["signal SIGTERM"], stopping


def test_the_template_refuses_to_fork_beside_a_thread_and_names_load_time_variables() -> None:
    import threading

    from actors.runtime.template import fork_problem, load_time_differences

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        assert "Python" in (fork_problem() or "")
    finally:
        stop.set()
        thread.join(timeout=10)
    template = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/x"}
    assert load_time_differences(template, {**template, "OMP_NUM_THREADS": "4", "NCCL_DEBUG": "INFO"}) == []
    assert load_time_differences(template, {"PATH": "/bin", "LD_PRELOAD": "a.so", "PYTHONPATH": "/y"}) == \
        ["LD_PRELOAD", "PYTHONPATH"]


def test_a_hung_start_template_delays_one_start_and_later_starts_are_fresh_interpreters(tmp_path: Any,
                                                                                      monkeypatch: Any) -> None:
    # A stopped template never answers: the start that asked waits FORK_ANSWER_S (not the ready budget), the
    # template is killed, and that actor and every later one start as fresh interpreters; running actors go on.
    from actors.runtime import template as template_mod

    monkeypatch.setattr(template_mod, "FORK_ANSWER_S", 2.0)

    async def main() -> None:
        sup = Supervisor([spec(tmp_path, "a"), spec(tmp_path, "b")], tmp_path, backoff_initial=0.05,
                         ready_timeout=START_BUDGET)
        await sup.start()
        assert (sup.children["a"].proc.start, sup.children["b"].proc.start) == ("fork", "fork")
        client = await client_for(tmp_path, "a", "b")
        before = (await client.request("b", InfoRequest(), timeout=START_BUDGET)).pid
        template = sup.start_template_pid
        os.kill(template, signal.SIGSTOP)
        await client.send("a", Crash("kill"))
        await until(lambda: sup.restarts["a"] == 1 and sup.children["a"].ready)
        assert sup.children["a"].proc.start == "exec" and sup.start_template_pid is None
        await until(lambda: not os.path.exists(f"/proc/{template}"))   # killed and reaped
        assert (await client.request("b", InfoRequest(), timeout=START_BUDGET)).pid == before
        assert await sup.stop() == {"a": 0, "b": 0}
        await client.close()

    run(main())


def test_the_template_preloads_the_projects_actor_classes_and_can_still_fork() -> None:
    # In a fresh interpreter, as the template is: importing every class of the project must start no thread
    # (the template could not fork), and a user's class is left to its own actor.
    classes = ["actors.buffer:BufferActor", "actors.evaluator:EvalActor", "actors.param_server:ParamServerActor",
               "actors.reward.code:CodeReward", "actors.reward.math:MathReward", "actors.rollout:RolloutActor",
               "actors.trainer:TrainerActor", "actors.nowhere:Missing", "testsupport.local_actors:Echo"]
    code = ("import json, sys; from actors.runtime.template import fork_problem, preload; "
            f"loaded = preload({classes!r}); "
            "print(json.dumps([loaded, fork_problem(), 'testsupport.local_actors' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    loaded, problem, user_imported = json.loads(out.stdout.splitlines()[-1])
    assert loaded == classes[:7] and problem is None and not user_imported
