"""ShardlabError, and how any error reads as one line.

A ShardlabError is about what the user gave (a config field, a flag, a file): its message names it and the fix, and
a restart would meet it again, so the launcher never retries it. Any other exception is a fault: one line with its
type and the place it was raised, and under `--max-restarts` the ranks start again. `SHARDLAB_DEBUG=1` (or a verb's
`--debug`) shows the tracebacks instead.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from pathlib import Path

DEBUG_ENV = "SHARDLAB_DEBUG"
"""Set to 1 for every error's full traceback (and torch.distributed.run's own report)."""
TRACEBACK_ENV = "SHARDLAB_TRACEBACK"
"""The older name of DEBUG_ENV, still read."""
HINT = f"; rerun with {DEBUG_ENV}=1 for the traceback"


class ShardlabError(ValueError):
    """A bad value the user gave: one line naming the field (or flag, or file) and the fix."""


def debugging(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return any(env.get(name, "") not in ("", "0") for name in (DEBUG_ENV, TRACEBACK_ENV))


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (a shardlab error's summary; a longer explanation follows it)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else ""


def one_line(err: BaseException) -> str:
    """A ShardlabError's first line; for anything else its type, first line and where it was raised, and the hint."""
    if isinstance(err, ShardlabError):
        return first_line(err)
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {_short(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    message = first_line(err)
    return f"{type(err).__name__}{': ' + message if message else ''}{where}{'' if debugging() else HINT}"


def _short(filename: str) -> str:
    """A source file as a reader finds it: from `shardlab/` or a package in site-packages, else the whole path."""
    path = Path(filename)
    parts = path.parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    package = Path(__file__).resolve().parent
    try:
        return str(path.resolve().relative_to(package.parent))
    except ValueError:
        return filename
