"""A model's training FLOPs per token: the analytic count (6N + attention) and torch's count of every module on the
meta device. Providers report the first; metrics, the planner's stage split and the estimator use both."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def flops_per_token(n_params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward: 6N for the weights plus 12 * L * dim * S for attention
    scores and values (PaLM, Chowdhery et al. 2022, appendix B); `dim` is the attention width (heads x
    head_dim). Whether N includes the embedding table is the caller's choice; its lookup costs no FLOPs.
    """
    return 6.0 * n_params + 12.0 * n_layers * dim * seq_len


def module_flops(
    model: nn.Module, sample: torch.Tensor, forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]
) -> dict[str, float]:
    """Training FLOPs per token (forward + backward) of every module, by fqn, from torch's FlopCounterMode on one
    forward (`forward(model, sample)`: the logits) and backward of `sample` (on the meta device it costs no memory).
    Attention counts as the kernel the device picks computes it (on meta: the math kernel, full S^2 with no causal
    saving). The whole model's total is under the key "" (it includes what no submodule runs)."""
    counter = FlopCounterMode(display=False)
    with counter:
        forward(model, sample).float().sum().backward()
    for p in model.parameters():
        p.grad = None
    tokens = sample.numel()
    out = {
        name.partition(".")[2]: sum(ops.values()) / tokens
        for name, ops in counter.get_flop_counts().items()
        if "." in name
    }
    return out | {"": counter.get_total_flops() / tokens}
