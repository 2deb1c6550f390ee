"""Fault points: named moments of a run where a test makes it die as `kill -9` would, to check what survives.

env SHARDLAB_FAULT_AT=<point>:<step>[@<rank>] arms one moment; `fault_point` ends the process there at once
(os._exit: no cleanup, nothing flushed) on that rank (default 0), on a run's first attempt only
(TORCHELASTIC_RESTART_COUNT unset or 0), so a restarted run gets past it:

    step:N   step N has updated the weights; nothing of it is saved or logged yet
    save:N   rank 0 has written step N's checkpoint files and manifest, not yet committed (renamed) them
    log:N    rank 0 has written half of step N's line of metrics.jsonl
    tokenize a dataset's tokenization has written its first batch of rows (1,000) to its cache and not the rest
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.distributed as dist

FAULT_ENV = "SHARDLAB_FAULT_AT"
EXIT_FAULT = 17
"""The exit code of a process that a fault point ended."""


def armed(name: str) -> bool:
    """Whether env SHARDLAB_FAULT_AT names the moment `name` (e.g. "log:4") on this rank, on a first attempt."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    point, _, rank = wanted.partition("@")
    return point == name and int(rank or 0) == (dist.get_rank() if dist.is_initialized() else 0)


def fault_point(name: str, before: Callable[[], None] | None = None) -> None:
    """End the process here if the moment `name` is armed; `before` runs first (e.g. writes half a line)."""
    if armed(name):
        if before is not None:
            before()
        os._exit(EXIT_FAULT)
