"""Independent calls run side by side in forked children, one per core: the estimator's probes of one layout, the
runs that count a model's block for the floors.

A forked child is this process as it was (its fake world, models and caches), so the calls need not be picklable;
only what they return comes back, pickled through a pipe, and an error raised in a child is raised here. The calls
are dealt round the cores: this process runs every n-th one, beginning with the first, and each other core a forked
child running its share in order. A call that runs calls side by side itself gets the cores of its share (one of 2
cores: its calls run in order, in its process, where the caches it filled are). Where there is no fork (not POSIX)
or one core, the calls run here, in order; and so where a forked child could not run a backward (this process has run
one where a GPU is, e.g. trained on it: `_autograd_fork`), with the same results. A child that refuses all the same
has its share run here.
"""

from __future__ import annotations

import gc
import os
import pickle
from collections.abc import Callable, Sequence
from typing import TypeVar

from shardlab.estimate._autograd_fork import backward_here, fork_breaks_autograd, refused

T = TypeVar("T")

_share: int | None = None
"""The cores this process's calls may use, while it runs a share of calls side by side (None: all of them)."""


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_forked(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Each call's result, in order: dealt round the cores this process may use, here and in forked children."""
    available = cores() if _share is None else _share
    n = min(len(calls), available)
    if n < 2 or not hasattr(os, "fork") or fork_breaks_autograd():
        return [call() for call in calls]
    shares = [calls[i::n] for i in range(n)]
    share = max(1, available // n)
    children = [_fork(lambda mine=mine: _child_share(mine, share)) for mine in shares[1:]]
    try:
        here = _run_share(shares[0], share)
    finally:
        answers = [_answer(*child) for child in children]  # every child waited for, whatever happened here
    done = [here]
    for mine, (ok, value) in zip(shares[1:], answers, strict=True):
        if not ok and refused(value):  # the engine's threads were there after all: this share runs here
            ok, value = True, _run_share(mine, share)
        if not ok:
            raise value
        done.append(value)
    return [done[i % n][i // n] for i in range(len(calls))]


def _run_share(calls: Sequence[Callable[[], T]], share: int) -> list[T]:
    """`calls` in order, each running calls of its own side by side on `share` cores."""
    global _share
    before, _share = _share, share
    try:
        return [call() for call in calls]
    finally:
        _share = before


def _child_share(calls: Sequence[Callable[[], T]], share: int) -> list[T]:
    """A forked child's share, after a backward that raises the engine's refusal as itself (a call could make
    something else of it: the block counts take a RuntimeError for an op fake tensors cannot run)."""
    backward_here()
    return _run_share(calls, share)


def _fork(call: Callable[[], T]) -> tuple[int, int]:
    read, write = os.pipe()
    # The child never collects what it inherits: a finalizer of this process's uncollected garbage (an object of a
    # library whose threads did not follow the fork) could crash it. gc.freeze, as Python's docs advise before a fork.
    gc.freeze()
    pid = -1
    try:
        pid = os.fork()
    finally:
        if pid != 0:  # here (or no child): collect as before
            gc.unfreeze()
    if pid == 0:  # the child: run, send back, leave without running the parent's exit handlers
        os.close(read)
        try:
            try:
                sent = pickle.dumps((True, call()))
            except BaseException as err:  # every error goes back to the parent, raised there
                sent = pickle.dumps((False, _sendable(err)))
            with os.fdopen(write, "wb") as pipe:
                pipe.write(sent)
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def _answer(pid: int, read: int) -> tuple[bool, object]:
    """(True, what the child's call returned) or (False, the error it raised), once the child has exited."""
    with os.fdopen(read, "rb") as pipe:
        sent = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not sent:
        return False, RuntimeError(f"a forked child died before it answered (wait status {status})")
    return pickle.loads(sent)


def _sendable(err: BaseException) -> BaseException:
    """`err`, or where it cannot be pickled, a RuntimeError with its message."""
    try:
        pickle.dumps(err)
    except Exception:  # an error type whose arguments do not pickle
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err
