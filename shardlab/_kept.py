"""`kept`: a pure function's results kept by its arguments, where they can be hashed.

Planning one model on hundreds of meshes (a search) asks the same questions of the same rules again and again (which
rule covers `layers.17.attention.wq`); the answers depend on the arguments alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

A = ParamSpec("A")
R = TypeVar("R")


def kept(fn: Callable[A, R]) -> Callable[A, R]:
    """`fn`, its results kept (the last 8192) by its arguments; called afresh where one cannot be hashed (a struct
    built with lists where tuples are declared)."""
    cached = functools.lru_cache(maxsize=8192)(fn)

    @functools.wraps(fn)
    def call(*args: A.args, **kwargs: A.kwargs) -> R:
        try:
            hash((args, tuple(kwargs.items())))
        except TypeError:
            return fn(*args, **kwargs)
        return cached(*args, **kwargs)

    return call
