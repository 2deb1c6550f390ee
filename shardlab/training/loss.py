"""The loss every path shares (the step, pipeline stages, evaluation): summed token cross-entropy, reduced over the
ranks that hold different tokens.

Sums, not means: each rank sums its tokens' losses and the step or evaluation divides once by the global batch's
token count, so the result does not depend on how the tokens are spread over ranks, micro batches and stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from shardlab.data.loader import IGNORE_INDEX


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the tokens whose label is not IGNORE_INDEX, in fp32: [b, s, vocab] and [b, s]
    (vocab-sharded DTensor logits under loss parallel give a replicated DTensor)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def scaled(loss: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """`loss * scale`, where the scale may be a 0-dim tensor kept on the device (the step does not read its token
    count back to the host): under loss parallel the loss is a replicated DTensor, which takes such a scale as a
    replicated DTensor on its mesh."""
    if not isinstance(scale, torch.Tensor):
        return loss * scale
    scale = scale.to(loss.dtype)
    if isinstance(loss, DTensor):
        scale = DTensor.from_local(scale, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
    return loss * scale


def counted(labels: torch.Tensor) -> torch.Tensor:
    """How many tokens take part in the loss (labels other than IGNORE_INDEX), as a float64 scalar."""
    return (labels != IGNORE_INDEX).sum().to(torch.float64)


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A loss's value as a plain tensor (under loss parallel it is a replicated DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`t` summed over `group` in place (None: this rank alone)."""
    if group is not None:
        dist.all_reduce(t, group=group)
    return t
