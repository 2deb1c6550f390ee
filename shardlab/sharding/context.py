"""Context parallelism: each `cp` rank holds a slice of every sequence, and attention gathers the keys.

This is the planner's part, pure data: which attention modules, which algorithm (`context_plan`), and which positions
each rank holds (`cp_positions`). The attention that runs is shardlab.parallel.context.

Causal attention makes late tokens costlier than early ones, so the sequence is cut into 2 cp chunks and
cp rank r holds chunks r and 2 cp - 1 - r (a head and a tail): every rank does the same work. The step
takes each rank's tokens, labels and positions with `cp_positions`; RoPE reads the positions, the loss
and the token count are reduced over all ranks holding different tokens, as without cp.

Attention runs anywhere (CPU included): each rank all-gathers K and V over cp and masks by position. torch's ring
attention (`context_parallel`) has sharding strategies only for CUDA's attention kernels.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from shardlab._base import Frozen
from shardlab._errors import ShardlabError
from shardlab.sharding.mesh import MeshSpec
from shardlab.sharding.rules import Rules, matching_any, takes_keyword


class ContextPlan(Frozen):
    """Context parallelism (mesh.cp > 1): how each cp rank's attention sees the whole sequence."""

    attention: Literal["all_gather_kv"]
    """all_gather_kv: gather K and V over cp and mask by position (shardlab.parallel.context; runs on every backend)."""
    modules: tuple[str, ...]
    """The attention modules that get the keyword `attend` with each call. Each cp rank holds sequence chunks r and
    2 cp - 1 - r, so causal attention costs every rank the same (shardlab.sharding.context)."""


def context_plan(modules: dict[str, nn.Module], mesh: MeshSpec, rules: Rules) -> ContextPlan | None:
    """The plan's context parallelism for `modules` (fqn -> module): None when mesh.cp is 1."""
    if mesh.cp == 1:
        return None
    attention = matching_any(rules.attention, tuple(modules))
    if not attention:
        raise ShardlabError(
            f"mesh.cp={mesh.cp} needs rules.attention to name the attention modules that take context "
            "parallelism's `attend` (e.g. 'model.layers.*.self_attn')"
        )
    missing = [f for f in attention if not takes_keyword(modules[f], "attend")]
    if missing:
        raise ShardlabError(
            f"mesh.cp={mesh.cp}: {missing[0]}'s forward takes no keyword `attend(q, k, v, positions)`; context "
            "parallelism needs the model's attention to take one and call it"
        )
    return ContextPlan(attention="all_gather_kv", modules=attention)


def cp_positions(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The sequence positions cp rank `rank` holds, in order: chunk `rank`, then chunk 2 cp - 1 - rank."""
    if seq_len % (2 * cp):
        raise ShardlabError(
            f"train.seq_len={seq_len} must be divisible by 2 x mesh.cp = {2 * cp} (two chunks per rank)"
        )
    chunk = seq_len // (2 * cp)
    head, tail = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat((torch.arange(head, head + chunk), torch.arange(tail, tail + chunk))).to(device)
