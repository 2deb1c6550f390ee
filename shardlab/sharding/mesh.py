"""MeshSpec: named axes, sizes, flattened views and rank <-> coordinate maths, as pure data.

No process group and no torch: the planner and the config validate against it on a laptop. The torch
DeviceMesh it describes is built by `shardlab.parallel.device_mesh.make_mesh`.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from shardlab._base import Frozen
from shardlab._errors import ShardlabError

AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The real mesh axes, outermost first; `ep` borrows ranks from `dp_shard x cp`."""

FLAT_VIEWS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "batch": ("dp_replicate", "dp_shard", "cp"),
}
"""Flattened views over several axes, named like axes (the loss is reduced over `batch`)."""

EXPERT_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
"""The expert mesh: the same ranks, with dp_shard x cp cut into (dp_shard_mod_ep, ep) as torchtitan does. Expert
weights are sharded over ep (their tokens travel there by all-to-all) and FSDP shards them over the rest."""

_AXIS_NAMES = frozenset((*AXES, "ep"))

Size = Annotated[int, msgspec.Meta(ge=-1)]


class MeshSpec(Frozen):
    """Sizes of the named mesh axes. Exactly one axis may be -1: "the rest of the world"."""

    pp: Size = 1
    """Pipeline-parallel stages: each pp rank runs its own blocks of the model."""
    dp_replicate: Size = 1
    """Data-parallel replicas (HSDP's replicate axis): parameters are replicated across it."""
    dp_shard: Size = -1
    """Data-parallel shards (FSDP): parameters, grads and optimizer state are sharded across it."""
    cp: Size = 1
    """Context parallel: every sequence is sharded across it (FSDP shards over dp_shard x cp)."""
    tp: Size = 1
    """Tensor parallel (with sequence parallel for norms when plan.sequence_parallel)."""
    ep: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Expert parallel: the minor ep ranks of dp_shard x cp each hold 1/ep of every MoE layer's experts."""

    def check(self) -> None:
        sizes = {a: getattr(self, a) for a in AXES}
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise ShardlabError(f"mesh.{axis}={size}: an axis size is >= 1, or -1 for the rest of the world")
        free = [a for a, s in sizes.items() if s == -1]
        if len(free) > 1:
            raise ShardlabError(
                f"mesh: {' and '.join('mesh.' + a for a in free)} are all -1; at most one axis can fill the rest of the world"
            )
        if self.ep < 1:
            raise ShardlabError(f"mesh.ep={self.ep}: must be >= 1")
        if not free and self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise ShardlabError(
                f"mesh.ep={self.ep} does not divide dp_shard x cp = {self.dp_shard * self.cp}; "
                "ep borrows its ranks from dp_shard x cp, so pick an ep that divides it"
            )

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The dims of the mesh `make_mesh` builds, in order (size-1 axes included)."""
        return AXES

    @property
    def flat_views(self) -> dict[str, tuple[str, ...]]:
        return FLAT_VIEWS

    @property
    def experts(self) -> ExpertMeshSpec:
        """The expert mesh over the same ranks (EXPERT_AXES): dp_shard x cp = dp_shard_mod_ep x ep."""
        if not self.is_resolved:
            raise ShardlabError("mesh: has a -1 axis; call MeshSpec.resolve(world_size) first")
        return ExpertMeshSpec(
            pp=self.pp, dp_replicate=self.dp_replicate, dp_shard_mod_ep=self.dp_shard * self.cp // self.ep,
            ep=self.ep, tp=self.tp,
        )  # fmt: skip

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        """Sizes in `axis_names` order; -1 only before `resolve`."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def is_resolved(self) -> bool:
        return -1 not in self.axis_sizes

    @property
    def world_size(self) -> int:
        if not self.is_resolved:
            raise ShardlabError("mesh: has a -1 axis; call MeshSpec.resolve(world_size) first")
        return math.prod(self.axis_sizes)

    def size(self, axis: str) -> int:
        """Size of an axis or of a flattened view (`dp`, `dp_shard_cp`, `batch`)."""
        if axis in _AXIS_NAMES:  # a search asks millions of times: no generator, no recursion
            return getattr(self, axis)
        view = FLAT_VIEWS.get(axis)
        if view is None:
            raise ShardlabError(
                f"unknown mesh axis {axis!r}; valid axes are {', '.join(AXES + ('ep',) + tuple(FLAT_VIEWS))}"
            )
        size = 1
        for a in view:
            size *= getattr(self, a)
        return size

    def resolve(self, world_size: int) -> MeshSpec:
        """Fill the -1 axis from `world_size`; error when the sizes cannot make that world."""
        fixed = math.prod(s for s in self.axis_sizes if s != -1)
        described = " x ".join(f"{a}={s}" for a, s in zip(AXES, self.axis_sizes) if s != 1)
        if self.is_resolved:
            if fixed != world_size:
                raise ShardlabError(
                    f"mesh: {described or 'all axes 1'} = {fixed} rank{'s' if fixed > 1 else ''} but world_size is {world_size}; "
                    "change the axis sizes, or set one axis to -1 to fill the rest"
                )
            return self
        free = AXES[self.axis_sizes.index(-1)]
        if world_size % fixed:
            raise ShardlabError(
                f"mesh: {described} fixes {fixed} ranks, which does not divide world_size {world_size}; "
                f"change the axis sizes so that mesh.{free}=-1 can fill the rest"
            )
        return msgspec.structs.replace(self, **{free: world_size // fixed})

    def coordinate(self, rank: int) -> dict[str, int]:
        """Mesh coordinate of a global rank (row-major over `axis_names`, like DeviceMesh)."""
        return _row_major(rank, AXES, self.axis_sizes)

    def rank(self, **coordinate: int) -> int:
        """Global rank at a coordinate; omitted axes are 0."""
        unknown = set(coordinate) - set(AXES)
        if unknown:
            raise ShardlabError(f"unknown mesh axes {sorted(unknown)}; valid axes are {', '.join(AXES)}")
        rank = 0
        for axis, size in zip(AXES, self.axis_sizes):
            c = coordinate.get(axis, 0)
            if not 0 <= c < size:
                raise ShardlabError(f"coordinate {axis}={c} is outside mesh.{axis}={size}")
            rank = rank * size + c
        return rank

    def group_index(self, rank: int, axes: tuple[str, ...]) -> int:
        """Index of `rank` within the flattened `axes` (major to minor), e.g. its data-parallel rank."""
        coord = self.coordinate(rank)
        index = 0
        for axis in (a for name in axes for a in FLAT_VIEWS.get(name, (name,))):
            index = index * self.size(axis) + coord[axis]
        return index

    def describe(self) -> str:
        """Compact form for logs and errors: `dp_shard=2 x tp=2 (4 ranks)`."""
        parts = [f"{a}={s}" for a, s in zip(AXES, self.axis_sizes) if s != 1]
        if self.ep != 1:
            parts.append(f"ep={self.ep}")
        if not parts:
            return "1 rank" if self.is_resolved else "all axes 1"
        total = f" ({self.world_size} ranks)" if self.is_resolved else ""
        return " x ".join(parts) + total


class ExpertMeshSpec(Frozen):
    """Sizes of the expert mesh's axes (EXPERT_AXES), made by `MeshSpec.experts`: the specs of expert weights
    name these axes, and `spec.placements` lowers them over this mesh as over the main one."""

    pp: int
    dp_replicate: int
    dp_shard_mod_ep: int
    """dp_shard x cp / ep: the ranks that hold the same experts (FSDP shards them over these)."""
    ep: int
    tp: int

    @property
    def axis_names(self) -> tuple[str, ...]:
        return EXPERT_AXES

    @property
    def flat_views(self) -> dict[str, tuple[str, ...]]:
        return {}

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in EXPERT_AXES)

    def size(self, axis: str) -> int:
        if axis not in EXPERT_AXES:
            raise ShardlabError(f"unknown expert mesh axis {axis!r}; valid axes are {', '.join(EXPERT_AXES)}")
        return getattr(self, axis)

    @property
    def world_size(self) -> int:
        return math.prod(self.axis_sizes)

    def coordinate(self, rank: int) -> dict[str, int]:
        """Expert mesh coordinate of a global rank: row-major over EXPERT_AXES, as `make_mesh` unflattens it."""
        return _row_major(rank, EXPERT_AXES, self.axis_sizes)

    def describe(self) -> str:
        """`expert mesh dp_shard_mod_ep=2 x ep=2 (4 ranks)`."""
        parts = [f"{a}={s}" for a, s in zip(EXPERT_AXES, self.axis_sizes) if s != 1]
        return f"expert mesh {' x '.join(parts) or 'of 1 rank'} ({self.world_size} ranks)"


def _row_major(rank: int, names: tuple[str, ...], sizes: tuple[int, ...]) -> dict[str, int]:
    world = math.prod(sizes)
    if not 0 <= rank < world:
        raise ShardlabError(f"rank {rank} is outside the mesh of {world} ranks")
    coord = {}
    for axis, size in reversed(list(zip(names, sizes))):
        rank, coord[axis] = divmod(rank, size)
    return {a: coord[a] for a in names}
