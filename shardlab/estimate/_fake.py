"""The one door to torch's private fake process group and fake tensors (estimates without devices or memory).

`fake_world(N)` makes this process rank 0 of an N-rank world whose collectives return at once; tensors
made under `fake_tensors()` have shapes, dtypes and devices but no data. Together they run the real
`apply` and a real forward/backward of any size on a laptop. `forget_dtensor_dispatch` lets a dispatch mode
see every local op of a DTensor op, `cached_sharding_propagation` keeps that from recomputing DTensor's sharding
decisions for every op, and `inferring_dtensor_shapes` tells it which ops only infer shapes;
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Rank `rank` of a fake world of `world_size` ranks, for the duration of the block."""
    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group already exists; estimate in a process that is not training")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_tensors() -> FakeTensorMode:
    """A mode in which new tensors are fake; real inputs (a DeviceMesh's rank table) are allowed."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def forget_dtensor_dispatch() -> None:
    """Empty DTensor's C++ dispatch cache: on a hit it runs the local op where no Python mode sees it."""
    torch._C._clear_DTensor_sharding_propagator_cache()


@contextlib.contextmanager
def cached_sharding_propagation() -> Iterator[None]:
    """DTensor's sharding propagation, cached per op schema for the duration of the block (one fake world).

    After `forget_dtensor_dispatch` every op misses DTensor's C++ cache, and on such a miss DTensor propagates
    uncached (the C++ cache would subsume its Python one): the same decision, made again for every op of every
    block. Here each op schema is propagated once; the local ops still run where a dispatch mode sees them. The cache
    lives only as long as the block: a schema names its mesh by value, and an equal mesh of a later fake world has
    other process groups."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    uncached = propagator.propagate_op_sharding_non_cached
    decided: dict[Any, Any] = {}  # torch's private OpSchema -> OutputSharding

    def propagate(op_schema: Any) -> Any:
        try:
            hash(op_schema)
        except TypeError:  # a schema that cannot be hashed
            return uncached(op_schema)
        if op_schema not in decided:
            decided[op_schema] = uncached(op_schema)
        return decided[op_schema]

    propagator.propagate_op_sharding_non_cached = propagate  # shadows the method for this block
    try:
        yield
    finally:
        del propagator.propagate_op_sharding_non_cached


def inferring_dtensor_shapes() -> bool:
    """True inside DTensor's shape inference, which runs each op on global-shaped fake tensors (uncached, after
    `forget_dtensor_dispatch`): those ops compute nothing on any rank."""
    frame = sys._getframe(1)
    for _ in range(8):  # it calls the op directly: a few frames up from the dispatch mode that asks
        if frame is None:
            return False
        if frame.f_code.co_name == "_propagate_tensor_meta_non_cached":
            return True
        frame = frame.f_back
    return False
