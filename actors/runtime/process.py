"""One handle for an actor process however it was started: a fresh interpreter (``asyncio`` subprocess) or
a fork of the start template that the launcher adopted (actors/runtime/template.py). The supervisor uses
only ``pid``, ``returncode`` (None while it runs; negative: the signal that ended it), ``wait()`` and
``send_signal()``, so restarts, "exit 0 = finished", a chaos kill -9 and the stop sequence do not depend on
how the process started."""
from __future__ import annotations

import asyncio
import os
from typing import Literal

__all__ = ["ActorProcess"]

# The exit code of an adopted child whose status another waiter in this process took (it cannot be known).
STATUS_TAKEN = 255


class ActorProcess:
    def __init__(self, pid: int, start: Literal["exec", "fork"], exited: asyncio.Future[int],
                 proc: asyncio.subprocess.Process | None = None) -> None:
        self.pid = pid
        self.start = start           # how it started: "exec" (a fresh interpreter) or "fork" (from the template)
        self._exited = exited
        self._proc = proc

    @classmethod
    def of_subprocess(cls, proc: asyncio.subprocess.Process) -> "ActorProcess":
        return cls(proc.pid, "exec", asyncio.ensure_future(proc.wait()), proc)

    @classmethod
    def adopted(cls, pid: int) -> "ActorProcess":
        """A child of this process that asyncio did not start (a forked actor reparented to us): its exit is
        seen through a pidfd on the running loop and its status reaped here, so nothing else may wait for it."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int] = loop.create_future()
        pidfd = os.pidfd_open(pid)

        def on_exit() -> None:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, code = pid, STATUS_TAKEN
            else:
                if done == 0:   # readable before the status is (it cannot be, but then wait for the next wakeup)
                    return
                code = os.waitstatus_to_exitcode(status)
            loop.remove_reader(pidfd)
            os.close(pidfd)
            if not exited.done():
                exited.set_result(code)

        loop.add_reader(pidfd, on_exit)
        return cls(pid, "fork", exited)

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        """Signal the process; ProcessLookupError once it has ended (as asyncio's Process)."""
        if self._proc is not None:
            self._proc.send_signal(sig)
        elif self.returncode is not None:
            raise ProcessLookupError(self.pid)
        else:
            os.kill(self.pid, sig)   # not reaped yet (only on_exit reaps it), so the pid is still ours
