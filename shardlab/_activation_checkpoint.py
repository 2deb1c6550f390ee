"""The one door to torch's composable activation checkpointing (a private module path in torch 2.13).

Unlike `checkpoint_wrapper`, it keeps fully qualified names unchanged, so the plan's names, FSDP units
and checkpoints see the same model. `in_backward` tells a forward that runs inside autograd's backward (a
recomputation of checkpointed activations) from one that does not.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable import checkpoint as _checkpoint
from torch.distributed._composable.contract import _get_registry

__all__ = ["checkpoint", "in_backward", "is_checkpointed"]


def checkpoint(module: nn.Module) -> nn.Module:
    """Recompute `module`'s activations in backward instead of keeping them."""
    return _checkpoint(module)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `checkpoint` was applied to this module."""
    return "checkpoint" in (_get_registry(module) or {})


def in_backward() -> bool:
    """Whether this thread is running an autograd backward (FSDP asks torch the same way)."""
    return torch._C._current_graph_task_id() != -1
