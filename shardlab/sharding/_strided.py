"""The one door to torch's private `_StridedShard` placement.

A tensor dim split over several mesh axes in an order other than the mesh's needs it: DTensor
applies placements left to right over mesh dims, and `_StridedShard(dim, split_factor=k)` says
"this dim was already split into k pieces by later mesh dims before this one".
"""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Placement, Shard, _StridedShard

__all__ = ["is_strided", "local_chunk", "shard_dim", "split_factor", "strided_shard"]


def strided_shard(dim: int, split_factor: int) -> Placement:
    return _StridedShard(dim, split_factor=split_factor)


def is_strided(placement: Placement) -> bool:
    return isinstance(placement, _StridedShard)


def split_factor(placement: Placement) -> int:
    """1 for a plain Shard, the split factor for a _StridedShard."""
    return int(placement.split_factor) if isinstance(placement, _StridedShard) else 1


def shard_dim(placement: Placement) -> int | None:
    """The tensor dim a Shard or _StridedShard splits; None for Replicate/Partial."""
    return placement.dim if isinstance(placement, Shard | _StridedShard) else None


def local_chunk(placement: Placement, tensor, num_chunks: int, index: int):
    """The piece of `tensor` a Shard/_StridedShard leaves at `index` of a mesh dim of `num_chunks` (no comms)."""
    chunks, _ = placement._split_tensor(tensor, num_chunks, with_padding=False, contiguous=True)
    return chunks[index]
