"""Micro batches under HSDP: the replicas' all-reduce of the gradients once per step, not once per micro batch.

FSDP reduce-scatters each micro batch's gradients over the shard group and, under HSDP, all-reduces the result over
the replicas (dp_replicate, the axis that usually crosses nodes). With m micro batches that all-reduce runs m times
for one update. FSDP2 can instead sum each micro batch's reduce-scattered shards in reduce_dtype and all-reduce the
sum in the last backward (`FSDPModule.set_requires_all_reduce`): the same gradients (to fp32 rounding), 1 / m of
the replicas' traffic. The plan says where (`FsdpPlan.all_reduce_once`); the step runs each micro batch in
`all_reduced_if`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule


@contextlib.contextmanager
def all_reduced_if(model: nn.Module, last: bool) -> Iterator[None]:
    """Within it, the backward of `model`'s FSDP modules all-reduces gradients over the replicas only if `last`
    (the step's last micro batch; earlier ones are summed until then). Afterwards every module all-reduces again,
    as FSDP does by default, whatever was raised."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_requires_all_reduce(last, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.set_requires_all_reduce(True, recurse=False)
