"""actors.runtime.run's process helpers: the parent-death signal every actor process and launched server asks for."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from actors.runtime.run import parent_death_signal

# The child reads back its own parent-death signal (prctl PR_GET_PDEATHSIG = 2): 0 when none is set.
READ_BACK = ("import ctypes; value = ctypes.c_int(); "
             "ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(value)); print(value.value)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_the_parent_death_signal_gets_sigterm_when_its_parent_dies() -> None:
    set_signal = parent_death_signal()
    assert set_signal is not None
    with_signal = subprocess.run([sys.executable, "-c", READ_BACK], preexec_fn=set_signal, capture_output=True,
                                 text=True, timeout=60, check=True)
    without = subprocess.run([sys.executable, "-c", READ_BACK], capture_output=True, text=True, timeout=60,
                             check=True)
    assert int(with_signal.stdout) == signal.SIGTERM
    assert int(without.stdout) == 0
