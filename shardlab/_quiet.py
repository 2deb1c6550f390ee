"""Imports that log warnings about nothing a run does: torchao's (its CUDA kernels missing from a CPU build, torch's
pytree registration of its enums), which transformers' model classes import too wherever torchao is installed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

CHATTER = ("torchao", "torch.utils._pytree")
"""The loggers that warn while torchao is imported."""


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Within: those loggers report errors only; after: as they were."""
    loggers = [logging.getLogger(name) for name in CHATTER]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
