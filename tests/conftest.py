"""Skips tests marked `gpu` when there is no CUDA device; nothing else is global."""

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: pure test runs stay free of the torch import

    if not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
