"""Preemption: SIGTERM -> every rank finishes its step, the run saves that step and stops.

A cluster that takes nodes back sends SIGTERM, then SIGKILL after a grace period. While a `Preemption` is open,
SIGTERM only sets this rank's flag; after each step `requested()` all-reduces the flags (one int32, MAX), so a
signal that reaches the ranks at different moments (torch.distributed.run forwards it to each rank in turn; srun
signals every task itself) stops them all after the same step, whichever rank saw it. That is one small collective
per step, on a CPU gloo group: it waits for the other ranks' flags, which arrive as they finish the step that
their collectives already keep in step, and never for the device (a flag read on the GPU would stall the host
until the optimizer step has run). The loop then saves and raises `Preempted`.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType

import torch
import torch.distributed as dist


class Preempted(Exception):
    """The run stopped after `step` because a rank received `signal_name`; `checkpoint` holds that step."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint saved: {checkpoint}")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


_OPEN: list[Preemption] = []
"""The Preemptions open in this process (a run's loop holds one)."""


def request_stop() -> None:
    """Stop the open runs of this process as SIGTERM would (after the step every rank agrees on, with a save): for
    a launcher that runs a rank off the main thread, where no signal handler can be installed (Ray Train), and so
    passes SIGTERM on by other means."""
    for preemption in _OPEN:
        preemption.received = True


class Preemption:
    """A context manager: while open, SIGTERM sets a flag instead of ending the process; `requested()` reads
    every rank's flag at a step boundary.

    The handler can be installed from the main thread only; elsewhere SIGTERM keeps its usual effect, and
    `request_stop()` sets the flag instead. Open it on every rank or on none.
    """

    SIGNAL = signal.SIGTERM

    def __init__(self) -> None:
        self.received = False
        self._previous: object = None
        self._installed = False
        self._group: dist.ProcessGroup | None = None
        self._distributed = False

    def __enter__(self) -> Preemption:
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._distributed = True
            # the flag is a CPU tensor: a CUDA world (nccl alone) needs a gloo group for it
            self._group = None if "gloo" in dist.get_backend() else dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.SIGNAL, self._on_signal)
            self._installed = True
        _OPEN.append(self)
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def requested(self) -> bool:
        """Whether any rank has received SIGTERM (collective: every rank calls it after every step)."""
        if not self._distributed:
            return self.received
        flag = torch.tensor([int(self.received)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self in _OPEN:
            _OPEN.remove(self)
        if self._installed:
            # None: the previous handler was not set from Python; the default is the closest
            signal.signal(self.SIGNAL, signal.SIG_DFL if self._previous is None else self._previous)
            self._installed = False
