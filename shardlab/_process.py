"""Whether a process lives, by its id: for what a process leaves behind it (a launcher's ranks, a tokenization's
partial cache) to be told apart from what a live one is still using."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True
