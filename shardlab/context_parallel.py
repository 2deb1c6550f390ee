"""Context parallelism: each `cp` rank holds a slice of every sequence, and attention gathers the keys.

`context_plan` is the planner's part (which attention modules, which algorithm); the rest runs at train time.

Causal attention makes late tokens costlier than early ones, so the sequence is cut into 2 cp chunks and
cp rank r holds chunks r and 2 cp - 1 - r (a head and a tail): every rank does the same work. The step
takes each rank's tokens, labels and positions with `cp_positions`; RoPE reads the positions, the loss
and the token count are reduced over all ranks holding different tokens, as without cp.

Attention runs anywhere (CPU included): each rank all-gathers K and V over cp with autograd-aware
functional collectives (the Llama 3 paper's choice; the backward reduce-scatters their gradients) and
masks by position. torch's ring attention (`context_parallel`) has sharding strategies only for CUDA's
attention kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardlab._base import Frozen
from shardlab.mesh import MeshSpec
from shardlab.packing import document_ids, document_mask
from shardlab.rules import Rules, matches

try:
    from torch.distributed._functional_collectives import all_gather_single_autograd
except ImportError:  # torch < 2.13 (GPU images that ship an older build) names it all_gather_tensor_autograd
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as all_gather_single_autograd

Attend = Callable[..., torch.Tensor]
"""attend(q, k, v, positions, *, scale=None, window=None) -> the attention output [b, heads, s, head_dim]."""


class ContextPlan(Frozen):
    """Context parallelism (mesh.cp > 1): how each cp rank's attention sees the whole sequence."""

    attention: Literal["all_gather_kv"]
    """all_gather_kv: gather K and V over cp and mask by position (shardlab.context_parallel; runs on every backend)."""
    modules: tuple[str, ...]
    """The attention modules whose `attend` is replaced. Each cp rank holds sequence chunks r and 2 cp - 1 - r,
    so causal attention costs every rank the same (shardlab.context_parallel)."""


def context_plan(modules: dict[str, nn.Module], mesh: MeshSpec, rules: Rules) -> ContextPlan | None:
    """The plan's context parallelism for `modules` (fqn -> module): None when mesh.cp is 1."""
    if mesh.cp == 1:
        return None
    attention = tuple(f for f in modules if any(matches(g, f) for g in rules.attention))
    if not attention:
        raise ValueError(
            f"mesh.cp={mesh.cp} needs rules.attention to name the attention modules whose `attend` context "
            "parallelism replaces (e.g. 'model.layers.*.self_attn')"
        )
    missing = [f for f in attention if not hasattr(modules[f], "attend")]
    if missing:
        raise ValueError(
            f"mesh.cp={mesh.cp}: {missing[0]} has no `attend(q, k, v, positions)` to replace; context "
            "parallelism needs the model's attention to call it"
        )
    return ContextPlan(attention="all_gather_kv", modules=attention)


def cp_positions(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The sequence positions cp rank `rank` holds, in order: chunk `rank`, then chunk 2 cp - 1 - rank."""
    if seq_len % (2 * cp):
        raise ValueError(f"train.seq_len={seq_len} must be divisible by 2 x mesh.cp = {2 * cp} (two chunks per rank)")
    chunk = seq_len // (2 * cp)
    head, tail = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat((torch.arange(head, head + chunk), torch.arange(tail, tail + chunk))).to(device)


def all_gather_attention(group: dist.ProcessGroup) -> Attend:
    """An `Attention.attend` for a cp group: gather every rank's K and V (in rank order, with their positions)
    and let each local query see the keys at or before its own position. Packed rows' positions ([b, s] in their
    documents, `shardlab.packing`) are gathered too, so a query sees only the keys of its own document."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered: dict[tuple[int, torch.device], torch.Tensor] = {}  # every rank's positions, in rank order

    def order(seq_len: int, device: torch.device) -> torch.Tensor:
        if (seq_len, device) not in gathered:
            gathered[seq_len, device] = torch.cat([cp_positions(seq_len, cp, r, device) for r in range(cp)])
        return gathered[seq_len, device]

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        *,
        scale: float | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """positions: [s_local] (sequence positions) or [b or 1, s_local] (positions in documents); scale: of the
        scores (default head_dim ** -0.5); window: a query sees only the `window` keys ending at its own position
        (sliding-window attention), None: all keys at or before it."""
        seq_len = positions.shape[-1] * cp
        k = all_gather_single_autograd(k.contiguous(), gather_dim=2, group=group)
        v = all_gather_single_autograd(v.contiguous(), gather_dim=2, group=group)
        keys = order(seq_len, positions.device)  # where each gathered key sits in the sequence
        if positions.dim() == 1:
            behind = positions[:, None] - keys[None, :]  # [local queries, all keys]: how far back each key is
            mask = (behind >= 0) if window is None else (behind >= 0) & (behind < window)
        else:
            k_positions = all_gather_single_autograd(positions.contiguous(), gather_dim=1, group=group)
            whole = torch.empty_like(k_positions)
            whole[:, keys] = k_positions  # the rows in sequence order: documents are counted along them
            docs = document_ids(whole)
            mine = cp_positions(seq_len, cp, rank, positions.device)
            mask = document_mask(positions, k_positions, docs[:, mine], docs[:, keys], window)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5 if scale is None else scale
        )

    return attend
