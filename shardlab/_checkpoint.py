"""The one door to torch's composable activation checkpointing (a private module path in torch 2.13).

Unlike `checkpoint_wrapper`, it keeps fully qualified names unchanged, so the plan's names, FSDP units
and checkpoints see the same model.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint as _checkpoint
from torch.distributed._composable.contract import _get_registry

__all__ = ["checkpoint", "is_checkpointed"]


def checkpoint(module: nn.Module) -> nn.Module:
    """Recompute `module`'s activations in backward instead of keeping them."""
    return _checkpoint(module)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `checkpoint` was applied to this module."""
    return "checkpoint" in (_get_registry(module) or {})
