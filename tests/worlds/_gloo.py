"""One gloo transport device per rank process, shared by every process group the rank creates.

torch gives each gloo process group a device of its own, and each device runs a thread that wakes every 10 ms
(gloo's tcp loop polls with a 10 ms timeout). A real run builds one mesh, a handful of groups; a world that runs
dozens of layouts builds hundreds, and 4 ranks x hundreds of threads waking 100 times a second on 2 cores made
its later checks several times slower than the same checks in a fresh world (a 40-mesh rank: its matmuls 6x,
its all-reduces 5x slower). Gloo's devices serve any number of groups, so the ranks share one. The one module
that touches these private torch names (the `_Options` of ProcessGroupGloo, distributed_c10d's reference to it).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroupGloo

_device: list[ProcessGroupGloo.Device] = []


class _SharedDeviceGloo(ProcessGroupGloo):
    """ProcessGroupGloo as distributed_c10d builds it (store, rank, size, timeout), on the process's one device."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta = timedelta(minutes=30)) -> None:
        if not _device:
            _device.append(ProcessGroupGloo.create_default_device())
        options = ProcessGroupGloo._Options()
        options._devices = _device
        options._timeout = timeout
        super().__init__(store, rank, size, options)


def share_one_device() -> None:
    """Call in a rank before its first process group: every gloo group it creates then shares one device."""
    c10d.ProcessGroupGloo = _SharedDeviceGloo
