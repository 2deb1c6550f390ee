"""Whether a child forked from this process could still run a backward: the one place that knows how torch tells.

torch's autograd engine starts a thread per device the first time a backward runs where an accelerator is visible
(even a backward on CPU or fake tensors: it counts the devices, not the tensors), and a pool thread for deep
reentrant backwards; when it starts either it registers a fork handler, and a child forked after that refuses any
backward ("Unable to handle autograd's threading in combination with fork-based multiprocessing"). torch exposes no
flag for it, so this reads the signs: a CUDA context (which no forked child can use either), and the engine's device
threads by the name it gives them ("pt_autograd_<device>", torch/csrc/autograd/engine.cpp `thread_init`). Where a
child refuses all the same (a reentrant pool thread has no such name), `backward_here` raises the refusal in it before
any call could make something else of it, `refused` recognises it, and from then on this process is known not to
fork: the engine's threads never stop.
"""

from __future__ import annotations

import os

import torch

_THREAD_PREFIX = "pt_autograd_"
"""How torch's autograd engine names its device threads (engine.cpp, `Engine::thread_init`)."""
_REFUSAL = "Autograd-and-Fork"
"""In the error a forked child's backward raises when the engine had started threads before the fork."""
_refused = False
"""A forked child has refused a backward: this process never forks calls again."""


def fork_breaks_autograd() -> bool:
    """Whether a child forked now could not run a backward (or touch the GPU): then calls run here, in order."""
    return _refused or torch.cuda.is_initialized() or _engine_threads_started()


def refused(err: object) -> bool:
    """Whether `err`, raised in a forked child, is the engine refusing a backward there; remembered if so."""
    global _refused
    if isinstance(err, RuntimeError) and _REFUSAL in str(err):
        _refused = True
        return True
    return False


def backward_here() -> None:
    """A backward of one number: in a forked child, raises the engine's refusal where it refuses (only that)."""
    try:
        with torch.inference_mode(False), torch.enable_grad():
            one = torch.ones((), requires_grad=True)
            (one * 1).backward()
    except RuntimeError as err:
        if _REFUSAL in str(err):
            raise


def _engine_threads_started() -> bool:
    """Whether one of this process's threads is an autograd device thread; where threads cannot be listed (no
    /proc), whether an accelerator is there for the engine to start them (the safe side: calls then run in order)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return torch.accelerator.is_available()
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().startswith(_THREAD_PREFIX):
                    return True
        except OSError:  # the thread ended while we looked
            continue
    return False
