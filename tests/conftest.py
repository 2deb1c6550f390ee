"""One intra-op thread per test process, and tests marked `gpu` skipped without a CUDA device; nothing else is
global.

The tests' tensors are tiny: a second OpenMP thread buys nothing on them, and on a machine whose cores are busy (2
cores, gloo ranks or other jobs) it spins waiting for them and makes the run several times slower. Set before torch
is imported, so subprocesses (the CLI's first process) get it too; gloo ranks set their own.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: pure test runs stay free of the torch import

    if not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
