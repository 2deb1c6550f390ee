"""The loss every path shares (the step, pipeline stages, evaluation): summed token cross-entropy, reduced over the
ranks that hold different tokens.

Sums, not means: each rank sums its tokens' losses and the step or evaluation divides once by the global batch's
token count, so the result does not depend on how the tokens are spread over ranks, micro batches and stages.

Plain (not vocab-sharded) logits go through the cross-entropy in chunks of rows (`CHUNK_ELEMENTS` logits each in
fp32), never whole: a micro batch's fp32 logits at a 128k vocabulary are GiBs. The step lets the backward write
each chunk's gradient (softmax - one-hot, 0 on ignored tokens) into the logits themselves (`reuse_logits`), so a
micro batch holds one logits-sized buffer from its forward to its backward. Elsewhere the forward computes the
gradient into a buffer of the logits' dtype, the only thing it keeps, and the backward scales it in place. Loss and
gradients are F.cross_entropy's (to fp32 rounding). Without gradients (evaluation) only the loss is computed. Under
loss parallel the logits are vocab-sharded DTensors and torch's vocab-parallel `F.cross_entropy` runs as it always
did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from shardlab.data.loader import IGNORE_INDEX

CHUNK_ELEMENTS = 1 << 25
"""Logits per chunk of rows that the loss holds in fp32 at once (128 MiB; at least one row): 261 rows of a 128,256
vocabulary."""


class ChunkCounter(Protocol):
    """What counts the ops of a run whose values nobody reads (the estimator's, on fake tensors): the loss's middle
    chunks, which run the same ops on the same shapes, run once there and are counted as many times as they are."""

    def begin(self) -> None:
        """The ops from here on are one middle chunk's."""

    def repeat(self, times: int) -> None:
        """The ops since `begin` run `times` more times."""


_counter: ChunkCounter | None = None


@contextlib.contextmanager
def chunks_counted_by(counter: ChunkCounter) -> Iterator[None]:
    """Within it, the chunked loss runs its first chunk, one middle chunk and its last (which may be shorter), and
    tells `counter` how often the middle one repeats: the same ops as every chunk, at a tenth of the dispatches for a
    128k vocabulary. Its values and gradients are then wrong: for fake tensors only."""
    global _counter
    before, _counter = _counter, counter
    try:
        yield
    finally:
        _counter = before


def _chunk_starts(n: int, rows: int) -> Iterator[int]:
    """The first row of each chunk of `rows` rows of `n`; under `chunks_counted_by`, of the first, one middle chunk
    (counted for all) and the last."""
    starts, counter = range(0, n, rows), _counter
    if counter is None or len(starts) < 4:
        yield from starts
        return
    yield starts[0]
    counter.begin()
    yield starts[1]
    counter.repeat(len(starts) - 3)
    yield starts[-1]


def summed_loss(logits: torch.Tensor, labels: torch.Tensor, reuse_logits: bool = False) -> torch.Tensor:
    """Cross-entropy summed over the tokens whose label is not IGNORE_INDEX, in fp32: [b, s, vocab] and [b, s]
    (vocab-sharded DTensor logits under loss parallel give a replicated DTensor).

    Plain logits go through in chunks of rows (the module's docstring). Drop every reference to the logits before
    the backward, or they stay alive beside their gradient; the backward runs once (no retain_graph).
    reuse_logits: the caller will not read the logits again, so the backward may write their gradient into their
    memory (where no autograd node needs their values: `_reusable`); a micro batch then holds one logits-sized
    buffer, the logits themselves, from the forward to the backward."""
    if isinstance(logits, DTensor):  # loss parallel: torch's vocab-parallel cross-entropy
        return F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
        )
    flat, targets = logits.flatten(0, 1), labels.flatten()
    if torch.is_grad_enabled() and flat.requires_grad:
        if reuse_logits and _reusable(flat):
            return _CrossEntropyIntoLogits.apply(flat, targets)
        return _ChunkedCrossEntropy.apply(flat, targets)
    with torch.no_grad():
        return chunked_cross_entropy(flat, targets)


_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "AliasBackward0", "ReshapeAliasBackward0"})
_OUTPUT_NOT_SAVED = frozenset({
    "MmBackward0", "AddmmBackward0", "BmmBackward0", "ToCopyBackward0", "MulBackward0", "MulBackward1",
    "DivBackward0", "DivBackward1", "AddBackward0", "AddBackward1", "SubBackward0",
})  # fmt: skip
"""Producers of logits whose backward reads their inputs, not their output (a matmul, a cast, a scaling)."""


def _reusable(logits: torch.Tensor) -> bool:
    """Whether the logits' memory may take their gradient: made (through views) by an op whose backward does not
    read its output, not a leaf. Any other producer keeps its output intact (the gradient then gets a buffer)."""
    node = logits.grad_fn
    while node is not None and type(node).__name__ in _VIEWS:
        node = node.next_functions[0][0]
    return node is not None and type(node).__name__ in _OUTPUT_NOT_SAVED


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 cross-entropy of logits [n, vocab] (any float dtype) against labels [n], summed over the labels
    other than IGNORE_INDEX, `CHUNK_ELEMENTS` logits at a time. With `grad` (the logits' shape, any float dtype), also
    writes d loss / d logits into it: softmax - one-hot, 0 on ignored rows, in fp32, rounded once to grad's dtype."""
    n, vocab = logits.shape
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    rows = max(1, CHUNK_ELEMENTS // max(1, vocab))
    for start in _chunk_starts(n, rows):
        x, y = logits[start : start + rows], labels[start : start + rows]
        keep = (y != IGNORE_INDEX)[:, None]
        target = torch.where(keep, y[:, None], 0)
        top = x.amax(-1, keepdim=True).float()
        # exp(x - max) in fp32: straight into an fp32 gradient buffer, else into one chunk-sized buffer
        into = grad[start : start + rows] if grad is not None and grad.dtype == torch.float32 else None
        work = torch.sub(x, top, out=into) if into is not None else torch.sub(x, top)  # promoted to fp32
        work.exp_()
        sums = work.sum(-1, keepdim=True)
        token_loss = sums.log() + top - x.gather(-1, target).float()  # log-sum-exp - the target's logit
        total += torch.where(keep, token_loss, 0.0).sum()
        if grad is not None:
            work.mul_(torch.where(keep, sums.reciprocal(), 0.0))  # softmax on kept rows, 0 on ignored ones
            work.scatter_add_(-1, target, -keep.to(work.dtype))
            if into is None:
                grad[start : start + rows].copy_(work)
    return total


class _ChunkedCrossEntropy(torch.autograd.Function):
    """`chunked_cross_entropy` with its gradient computed in the forward; the logits are not saved."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ctx.grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        return chunked_cross_entropy(logits, labels, ctx.grad)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError("summed_loss: its backward ran twice (retain_graph); the gradient is used in place")
        return grad.mul_(grad_loss), None


class _CrossEntropyIntoLogits(torch.autograd.Function):
    """`chunked_cross_entropy` whose backward writes the gradient into the logits' own memory, chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, labels)
        ctx.used = False
        return chunked_cross_entropy(logits, labels)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.used:
            raise RuntimeError("summed_loss: its backward ran twice (retain_graph); the gradient is used in place")
        ctx.used = True
        logits, labels = ctx.saved_tensors
        chunked_cross_entropy(logits, labels, grad=logits)  # each chunk is read before it is overwritten
        return logits.mul_(grad_loss), None


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
