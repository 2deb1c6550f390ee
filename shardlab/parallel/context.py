"""Context parallelism at run time: the attention each cp rank runs over the whole sequence's keys.

Each rank all-gathers K and V over cp with autograd-aware functional collectives (the Llama 3 paper's choice; the
backward reduce-scatters their gradients) and masks by position, so it runs on every backend. Which modules and which
positions each rank holds are the plan's (shardlab.sharding.context).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlab.data.packing import document_ids, document_mask
from shardlab.models.provider import Attend
from shardlab.sharding.context import cp_positions

try:
    from torch.distributed._functional_collectives import all_gather_single_autograd
except ImportError:  # torch < 2.13 (GPU images that ship an older build) names it all_gather_tensor_autograd
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as all_gather_single_autograd


def all_gather_attention(group: dist.ProcessGroup) -> Attend:
    """The `attend` a cp group's attention modules are called with (`shardlab.models.provider.Attend`): gather
    every rank's K and V (in rank order, with their positions) and let each local query see the keys at or before
    its own position. Packed rows' positions ([b, s] in their documents, `shardlab.data.packing`) are gathered too,
    so a query sees only the keys of its own document."""
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
