"""PartitionSpec with JAX semantics -> DTensor placements, exactly or not at all.

`P("tp", None)` has one entry per tensor dim: None (replicated), a mesh axis, or a tuple of axes
(major to minor, as in `jax.sharding.PartitionSpec`). `placements(spec, mesh)` lowers it to one
DTensor placement per mesh axis, so each rank holds the block JAX's `NamedSharding` gives it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardlab._errors import ShardlabError
from shardlab.sharding import _strided
from shardlab.sharding.mesh import ExpertMeshSpec, MeshSpec

Entry = str | tuple[str, ...] | None
Spec = tuple[Entry, ...]
"""A PartitionSpec as plain data (how plans store it)."""
Mesh = MeshSpec | ExpertMeshSpec
"""The main mesh, or the expert mesh whose axes expert weights name (`MeshSpec.experts`)."""


class P(tuple):
    """A PartitionSpec: one entry per tensor dim; an entry is None, an axis name, or a tuple of axes.

    >>> P(("tp", "dp_shard"), None)     # dim 0 split over tp (major) then dp_shard (minor)
    P(('tp', 'dp_shard'), None)
    """

    def __new__(cls, *entries: Entry | Sequence[str]) -> P:
        return super().__new__(cls, (_normalize(e) for e in entries))

    def __repr__(self) -> str:
        return f"P({', '.join(repr(e) for e in self)})"

    def axes(self, dim: int) -> tuple[str, ...]:
        """Mesh axes of one dim, major to minor (empty when replicated)."""
        e = self[dim]
        return () if e is None else (e,) if isinstance(e, str) else e

    @property
    def used_axes(self) -> tuple[str, ...]:
        return tuple(a for d in range(len(self)) for a in self.axes(d))

    def dim_of(self, axis: str) -> int | None:
        """The tensor dim that `axis` splits, or None."""
        return dim_of(self, axis)

    def with_minor(self, dim: int, axes: tuple[str, ...]) -> P:
        """The same spec with `axes` appended (as minor) to dim `dim`, e.g. FSDP's dp_shard on dim 0."""
        entries = list(self)
        entries[dim] = self.axes(dim) + axes
        return P(*entries)


def dim_of(spec: Sequence[Entry | Sequence[str]], axis: str) -> int | None:
    """The dim of `spec` (a PartitionSpec's entries, normalized or not) that `axis` splits, or None: as
    `P(*spec).dim_of(axis)` without building the P (a search asks this of every parameter of hundreds of plans)."""
    for d, e in enumerate(spec):
        if e is not None and (e == axis if isinstance(e, str) else axis in e):
            return d
    return None


def _normalize(entry: object) -> Entry:
    if entry is None:
        return None
    if isinstance(entry, str):
        return entry
    if isinstance(entry, Sequence):
        names = tuple(entry)
        if not all(isinstance(a, str) for a in names):
            raise TypeError(f"PartitionSpec entry {entry!r}: a tuple entry holds axis names (str) only")
        return None if not names else names[0] if len(names) == 1 else names
    raise TypeError(f"PartitionSpec entry {entry!r}: expected None, an axis name, or a tuple of axis names")


def expand(spec: P, mesh: Mesh, *, name: str = "spec") -> P:
    """Replace flattened views (`dp`, `dp_shard_cp`, `batch`) by their axes; check names and reuse."""
    entries = []
    views, names = mesh.flat_views, mesh.axis_names
    for d in range(len(spec)):
        axes: list[str] = []
        for a in spec.axes(d):
            if a in views:
                axes.extend(views[a])
            elif a in names:
                axes.append(a)
            else:
                raise ShardlabError(
                    f"{name}: unknown mesh axis {a!r} in {spec!r}; valid axes are {', '.join(names + tuple(views))}"
                )
        entries.append(tuple(axes))
    out = P(*entries)
    seen = [a for a in out.used_axes]
    twice = sorted({a for a in seen if seen.count(a) > 1})
    if twice:
        raise ShardlabError(f"{name}: mesh axis {twice[0]!r} is used twice in {spec!r}; an axis can shard one dim once")
    return out


def check_shape(
    spec: P, mesh: Mesh, shape: Sequence[int], *, name: str = "tensor", skip_dims: tuple[int, ...] = ()
) -> None:
    """Raise when the spec has more entries than dims, or a dim is not divisible by its axes' sizes."""
    if len(spec) > len(shape):
        raise ShardlabError(
            f"{name}: {spec!r} has {len(spec)} entries but the tensor has {len(shape)} dims {tuple(shape)}"
        )
    for d in range(len(spec)):
        n = math.prod(mesh.size(a) for a in spec.axes(d))
        if d not in skip_dims and shape[d] % n:
            axes = " x ".join(f"{a}={mesh.size(a)}" for a in spec.axes(d))
            raise ShardlabError(
                f"{name}: dim {d} (size {shape[d]}) is not divisible by {axes}; pick axis sizes that divide it"
            )


def placements(spec: P, mesh: Mesh, *, name: str = "spec") -> tuple[Placement, ...]:
    """Lower a spec to one placement per mesh axis (`mesh.axis_names` order).

    DTensor shards left to right over mesh dims (earlier mesh dims are major). A dim whose axes are
    not in mesh order needs `_StridedShard`: an axis gets split_factor = the product of the sizes
    of the axes that come later in the mesh but are more major in the spec. Size-1 axes lower to
    Replicate (the same layout). With mesh (dp_shard=2, tp=2):

    >>> placements(P(("tp", "dp_shard")), MeshSpec(dp_shard=2, tp=2))[2:]   # doctest: +SKIP
    (_StridedShard(dim=0, sf=2), Replicate(), Shard(dim=0))
    """
    spec = expand(spec, mesh, name=name)
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    out: list[Placement] = [Replicate() for _ in mesh.axis_names]
    for d in range(len(spec)):
        axes = [a for a in spec.axes(d) if mesh.size(a) > 1]
        for j, a in enumerate(axes):
            sf = math.prod(mesh.size(b) for b in axes[:j] if order[b] > order[a])
            out[order[a]] = Shard(d) if sf == 1 else _strided.strided_shard(d, sf)
    return tuple(out)


def spec_from_placements(placements_: Sequence[Placement], mesh: Mesh, ndim: int) -> P:
    """Inverse of `placements` (over all mesh axes): which axes split which dim, in which order."""
    by_dim: dict[int, list[str]] = {}
    for axis, p in zip(mesh.axis_names, placements_):
        dim = _strided.shard_dim(p)
        if dim is not None:
            by_dim.setdefault(dim % ndim, []).append(axis)
        elif not p.is_replicate():
            raise ShardlabError(f"placement {p} on axis {axis!r} has no PartitionSpec form (only Shard/Replicate do)")
    entries: list[Entry] = [None] * ndim
    for dim, axes in by_dim.items():
        for order in itertools.permutations(axes):
            trial = [None] * ndim
            trial[dim] = order
            if placements(P(*trial), mesh) == tuple(
                p if _strided.shard_dim(p) == dim or p.is_replicate() else Replicate() for p in placements_
            ):
                entries[dim] = order
                break
        else:
            raise ShardlabError(
                f"placements {tuple(placements_)} split dim {dim} in no order a PartitionSpec can state"
            )
    return P(*entries)


def local_shape(spec: P, mesh: Mesh, shape: Sequence[int]) -> tuple[int, ...]:
    """Largest per-rank block shape (ceil division: torch pads the first shards when uneven)."""
    spec = expand(spec, mesh)
    return tuple(
        -(-n // math.prod(mesh.size(a) for a in spec.axes(d))) if d < len(spec) else n for d, n in enumerate(shape)
    )


def block(spec: P, mesh: Mesh, shape: Sequence[int], coordinate: dict[str, int]) -> tuple[slice, ...]:
    """The block of the global tensor held at a mesh coordinate (JAX `NamedSharding` semantics).

    Dim d's block index is the mixed-radix number of the coordinates of its axes, major first;
    blocks follow torch.chunk sizes (ceil), so an uneven tail block is shorter.
    """
    spec = expand(spec, mesh)
    out = []
    for d, n in enumerate(shape):
        axes = spec.axes(d) if d < len(spec) else ()
        index, count = 0, 1
        for a in axes:
            index = index * mesh.size(a) + coordinate[a]
            count *= mesh.size(a)
        size = -(-n // count)
        out.append(slice(min(index * size, n), min((index + 1) * size, n)))
    return tuple(out)
