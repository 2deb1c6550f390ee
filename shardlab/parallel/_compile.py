"""The one door to torch.compile of a block, and the private functional-collectives API it needs.

A TP style outside the block (the embedding's rowwise output, a norm's sequence-parallel input) hands the block an
AsyncCollectiveTensor: the redistribute has not been waited on yet. torch 2.13's AOTAutograd resolves such an input
to its plain data before tracing, so the compiled block returns no gradient for it and the layers before it get
none. `compile_block` therefore compiles the block's `forward` only and waits for those inputs in a pre-hook that
runs eagerly, through `wait_tensor`, whose gradient passes through. The block's own hooks (TP's, activation
checkpointing's, FSDP's) run eagerly around the compiled forward, as FSDP's do under `module.compile()` anyway.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor

__all__ = ["compile_block", "is_compiled"]


def compile_block(block: nn.Module) -> None:
    """torch.compile `block.forward` (inductor), after a pre-hook that waits for pending collectives on its inputs."""
    block.register_forward_pre_hook(_wait_inputs, with_kwargs=True)
    block.forward = torch.compile(block.forward, dynamic=False)


def is_compiled(block: nn.Module) -> bool:
    """Whether `compile_block` compiled this block."""
    return hasattr(block.__dict__.get("forward"), "_torchdynamo_orig_callable")


def _wait(x: Any) -> Any:
    return wait_tensor(x) if isinstance(x, AsyncCollectiveTensor) else x


def _wait_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(_wait(a) for a in args), {k: _wait(v) for k, v in kwargs.items()}
