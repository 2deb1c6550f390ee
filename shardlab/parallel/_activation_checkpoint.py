"""The one door to torch's composable activation checkpointing (a private module path in torch 2.13), with or
without torch's selective checkpointing inside.

Unlike `checkpoint_wrapper`, it keeps fully qualified names unchanged, so the plan's names, FSDP units
and checkpoints see the same model. `in_backward` tells a forward that runs inside autograd's backward (a
recomputation of checkpointed activations) from one that does not; `recomputing` tells what a recomputation runs
(the estimator prices it apart) from the rest of the backward.

Op-level selective checkpointing (`checkpoint(module, ops=True)`, torchtitan's `selective_ac_option="op"`) runs
the module's forward under torch's `create_selective_checkpoint_contexts` with `save_policy`: the outputs of the
expensive ops (`SAVED_OPS`, every other matmul) are kept, the cheap ones (norms, RoPE, activations, residual
adds) are recomputed in the backward. torch's replay is relaxed to the kept ops (`_Replay`): FSDP's hooks, which a
recomputation runs too, do other things in it than in the forward.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint as _checkpoint
from torch.distributed._composable.contract import _get_registry
from torch.utils.checkpoint import CheckpointPolicy, _CachedTorchDispatchMode, create_selective_checkpoint_contexts

__all__ = [
    "MATMULS",
    "SAVED_OPS",
    "checkpoint",
    "in_backward",
    "is_checkpointed",
    "is_op_checkpointed",
    "recomputing",
    "save_policy",
]


def _ops(*names: str) -> frozenset[Any]:
    """The named OpOverloads this torch build has (`namespace.op.overload`); the others are left out."""
    found = []
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and overload in packet.overloads():
            found.append(getattr(packet, overload))
    return frozenset(found)


MATMULS = _ops(
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._grouped_mm.default", "aten._scaled_mm.default"
)
"""Matmuls, of which every other one's output is kept (torchtitan counts aten.mm; addmm is a biased projection,
bmm and _grouped_mm transformers' stacked experts, _scaled_mm FP8's)."""
SAVED_OPS = MATMULS | _ops(
    # attention: every SDPA backend (CPU's flash kernel included) and the explicit math one
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._scaled_dot_product_attention_math.default",
    # collectives inside a block (TP+SP's all-gathers and reduce-scatters, CP's K/V all-gathers, EP's all-to-alls):
    # recomputing them would communicate again in the backward
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
    "_c10d_functional_autograd.all_gather_into_tensor.default",
    "_c10d_functional_autograd.reduce_scatter_tensor.default",
    "_c10d_functional_autograd.all_to_all_single.default",
    # a whole-tensor max: the scale of low-precision (float8) matmuls
    "aten.max.default",
)
"""Ops whose outputs op-level checkpointing keeps (matmuls: every other one); every other op is recomputed."""


def save_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh policy for one checkpointed forward (torchtitan's `_custom_policy`): MUST_SAVE the outputs of
    SAVED_OPS but every second matmul (the 1st, 3rd, ... are kept), PREFER_RECOMPUTE the rest. torch 2.13 asks it
    only in the forward and replays its decisions in order; older torch asks it again in the recomputation
    (`ctx.is_recompute`), which counts its matmuls apart, as torchtitan's does."""
    matmuls = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in MATMULS:
            recompute = bool(getattr(ctx, "is_recompute", False))
            matmuls[recompute] += 1
            return CheckpointPolicy.MUST_SAVE if matmuls[recompute] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Replay(_CachedTorchDispatchMode):
    """torch's replay of a selective checkpoint in the recomputation, which serves each kept output from the forward
    by (op, call index), except that an op that is never kept runs as it comes, where torch's would refuse one the
    forward did not run as often. FSDP's hooks run other bookkeeping ops in a recomputation than in the forward (a
    block's casts its inputs again; an FSDP unit inside a block, the experts under expert parallelism, gathers its
    weights and does not free them), and none of them is among SAVED_OPS."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func not in SAVED_OPS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _op_contexts() -> tuple[Any, Any]:
    """(the forward's context, the recomputation's) for one checkpointed forward, sharing what the forward keeps."""
    forward, replay = create_selective_checkpoint_contexts(save_policy())
    policy = getattr(replay, "policy_fn", None)  # torch < 2.13 asks the policy in the recomputation too
    return forward, _recomputation(_Replay(policy, replay.storage, replay.allow_cache_entry_mutation))


def _contexts() -> tuple[Any, Any]:
    """(the forward's context, the recomputation's) for one forward checkpointed whole."""
    return contextlib.nullcontext(), _recomputation(contextlib.nullcontext())


class _Depth(threading.local):
    recomputations = 0


_depth = _Depth()


@contextlib.contextmanager
def _recomputation(inner: Any) -> Iterator[None]:
    """`inner` (the recomputation's own context), with `recomputing` true inside: the thread that runs the backward
    runs the recomputation."""
    _depth.recomputations += 1
    try:
        with inner:
            yield
    finally:
        _depth.recomputations -= 1


def recomputing() -> bool:
    """Whether this thread is recomputing checkpointed activations: running a checkpointed forward again in the
    backward, ops that autograd Functions run (grad mode off) included."""
    return _depth.recomputations > 0


_op_checkpointed: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def checkpoint(module: nn.Module, ops: bool = False) -> nn.Module:
    """Recompute `module`'s activations in backward instead of keeping them; with `ops`, keep the outputs of
    SAVED_OPS (every other matmul) and recompute only the others (op-level selective checkpointing)."""
    if not ops:
        return _checkpoint(module, context_fn=_contexts)
    _op_checkpointed.add(module)
    return _checkpoint(module, context_fn=_op_contexts)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `checkpoint` was applied to this module (either way)."""
    return "checkpoint" in (_get_registry(module) or {})


def is_op_checkpointed(module: nn.Module) -> bool:
    """Whether `checkpoint(module, ops=True)` was applied to this module."""
    return module in _op_checkpointed


def in_backward() -> bool:
    """Whether this thread is running an autograd backward (FSDP asks torch the same way)."""
    return torch._C._current_graph_task_id() != -1
