"""Independent calls run side by side in forked children, one per core: the estimator's probes of one layout.

A forked child is this process as it was (its fake world, models and caches), so the calls need not be picklable;
only what they return comes back, pickled through a pipe, and an error raised in a child is raised here. Where
there is no fork (not POSIX) or one core, the calls run here, in order.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_forked(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Each call's result, in order: the first runs here, as many others as there are cores to spare run at once in
    forked children."""
    spare = min(len(calls), cores()) - 1
    if spare < 1 or not hasattr(os, "fork"):
        return [call() for call in calls]
    children = [_fork(call) for call in calls[1 : 1 + spare]]
    try:
        first = calls[0]()
    finally:
        answers = [_answer(*child) for child in children]  # every child waited for, whatever happened here
    done = []
    for ok, value in answers:
        if not ok:
            raise value
        done.append(value)
    return [first, *done, *(call() for call in calls[1 + spare :])]


def _fork(call: Callable[[], T]) -> tuple[int, int]:
    read, write = os.pipe()
    pid = os.fork()
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
