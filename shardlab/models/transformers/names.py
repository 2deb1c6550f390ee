"""Where a transformers model's parameters sit in its checkpoints, read off transformers' own conversion.

transformers renames some tensors on load (Mixtral's `block_sparse_moe` -> `mlp`) and merges others (each expert's
`w1` and `w3` -> one stacked `gate_up_proj` [E, 2 I, H]); `save_pretrained` reverts both. Rather than restate
those rules, shardlab runs transformers' `revert_weight_conversion` on an index marker of each parameter (its
first two dims, one number per row) and reads from the result which checkpoint tensor holds which rows. What
comes back is what `shardlab.hf.io` and `shardlab.hf.export` read and write: one name, or for a stacked weight one
entry per expert, each a name or the names whose rows are concatenated into that expert's slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardlab._errors import ShardlabError
from shardlab.models.provider import HFNames


def checkpoint_names(model: nn.Module, name: str, shape: Sequence[int]) -> HFNames:
    """The checkpoint tensor(s) of parameter `name` of `model` (a transformers model, e.g. on the meta device)."""
    from transformers.core_model_loading import revert_weight_conversion

    marker = _marker(shape)
    try:
        out: dict[str, Any] = revert_weight_conversion(model, {name: marker})
    except Exception as e:  # transformers' own error on a conversion it cannot revert
        raise ShardlabError(f"{name}: transformers cannot map it to its checkpoint names ({e})") from None
    if list(out) == [name] or (len(out) == 1 and torch.equal(next(iter(out.values())), marker)):
        return next(iter(out))
    if len(shape) < 3:
        raise ShardlabError(
            f"{name}: transformers converts it on load ({', '.join(sorted(out))}), which shardlab does not read yet"
        )
    return _stacked(name, shape, out)


def _marker(shape: Sequence[int]) -> torch.Tensor:
    """Row indices over the first two dims of a 3-dim or larger parameter ([E, K, 1]); one number otherwise."""
    if len(shape) < 3:
        return torch.zeros((1,) * len(shape), dtype=torch.int64)
    e, k = shape[0], shape[1]
    return torch.arange(e * k, dtype=torch.int64).view(e, k, 1)


def _stacked(name: str, shape: Sequence[int], out: dict[str, Any]) -> tuple[str | tuple[str, ...], ...]:
    """Per expert (dim 0), the names holding its rows (dim 1) in order; an error unless they tile the rows."""
    experts, rows = shape[0], shape[1]
    pieces: dict[int, list[tuple[int, str]]] = {e: [] for e in range(experts)}
    for stored, value in out.items():
        flat = value.reshape(-1) if isinstance(value, torch.Tensor) else None
        if flat is None or value.dim() != 2 or value.shape[1] != 1 or flat.numel() == 0:
            return _unreadable(name, out)
        e, first = divmod(int(flat[0]), rows)
        if not torch.equal(flat, torch.arange(e * rows + first, e * rows + first + flat.numel())):
            return _unreadable(name, out)
        pieces[e].append((first, stored))
    result: list[str | tuple[str, ...]] = []
    for e in range(experts):
        parts = sorted(pieces[e])
        size = rows // max(len(parts), 1)
        if not parts or [f for f, _ in parts] != [i * size for i in range(len(parts))] or size * len(parts) != rows:
            return _unreadable(name, out)
        names = tuple(n for _, n in parts)
        result.append(names[0] if len(names) == 1 else names)
    return tuple(result)


def _unreadable(name: str, out: dict[str, Any]) -> tuple[str, ...]:
    raise ShardlabError(
        f"{name}: transformers stores it as {', '.join(sorted(out)[:3])}... in a way shardlab does not read yet "
        "(it reads experts stacked along dim 0, each from one tensor or from equal row blocks)"
    )
