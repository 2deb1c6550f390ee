"""The one door to Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`): what `relaunch` starts dies with the
process the user started. torchrun's agent is killed when that process dies, and each rank when its agent dies, so a
`kill -9` of the user's process leaves no rank holding the devices. Other systems have no such signal: there nothing
is asked.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from shardlab._process import alive

LAUNCHER_ENV = "SHARDLAB_LAUNCHER_PID"
"""The process the user started (which `relaunch` ran torchrun from), for the ranks to check at start."""
_PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
"""Looked up once here: `relaunch` calls `die_with_parent` between fork and exec, where loading a library could wait
on a lock another thread of the parent held at the fork."""


def die_with_parent(launcher: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits; if the process the user started (`launcher`) is
    already gone (it died before the request could be made), exit now."""
    if _PRCTL is None:
        return
    if _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if not alive(launcher):
        os.kill(os.getpid(), signal.SIGKILL)
