"""MeshSpec: resolving -1, validation messages, rank <-> coordinate maths (pure, no process group).

The oracle for coordinates is `torch.arange(world).reshape(sizes)`: DeviceMesh lays ranks out row-major
over `AXES` (pp, dp_replicate, dp_shard, cp, tp), so rank r sits at the index where that tensor holds r.
Run: pytest tests/test_mesh.py -q
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from shardlab.sharding.mesh import AXES, FLAT_VIEWS, MeshSpec

# -- resolve ---------------------------------------------------------------------------------------

RESOLVE = [
    # (spec, world_size, expected axis sizes in AXES order)
    (MeshSpec(), 8, (1, 1, 8, 1, 1)),
    (MeshSpec(pp=-1, dp_shard=2, tp=2), 16, (4, 1, 2, 1, 2)),
    (MeshSpec(dp_replicate=-1, dp_shard=2), 8, (1, 4, 2, 1, 1)),
    (MeshSpec(dp_shard=-1, tp=2), 8, (1, 1, 4, 1, 2)),
    (MeshSpec(dp_shard=2, cp=-1, tp=2), 12, (1, 1, 2, 3, 2)),
    (MeshSpec(dp_shard=2, tp=-1), 8, (1, 1, 2, 1, 4)),
    (MeshSpec(dp_shard=-1, tp=8), 4096, (1, 1, 512, 1, 8)),
    (MeshSpec(dp_shard=3, tp=2), 6, (1, 1, 3, 1, 2)),  # already resolved and matching: returned as is
    (MeshSpec(dp_shard=1), 1, (1, 1, 1, 1, 1)),
]


@pytest.mark.parametrize(("spec", "world", "sizes"), RESOLVE)
def test_resolve(spec: MeshSpec, world: int, sizes: tuple[int, ...]) -> None:
    out = spec.resolve(world)
    assert out.axis_sizes == sizes
    assert out.is_resolved
    assert out.world_size == world
    assert out.axis_names == AXES


RESOLVE_ERRORS = [
    (
        MeshSpec(dp_shard=3, tp=2),
        8,
        "mesh: dp_shard=3 x tp=2 = 6 ranks but world_size is 8; change the axis sizes, or set one axis to -1 to fill the rest",
    ),
    (
        MeshSpec(dp_shard=1),
        2,
        "mesh: all axes 1 = 1 rank but world_size is 2; change the axis sizes, or set one axis to -1 to fill the rest",
    ),
    (
        MeshSpec(dp_shard=-1, tp=3),
        8,
        "mesh: dp_shard=-1 x tp=3 fixes 3 ranks, which does not divide world_size 8; change the axis sizes so that "
        "mesh.dp_shard=-1 can fill the rest",
    ),
    # ep is checked again once -1 is filled (msgspec.structs.replace re-runs __post_init__).
    (
        MeshSpec(dp_shard=-1, ep=3),
        8,
        "mesh.ep=3 does not divide dp_shard x cp = 8; ep borrows its ranks from dp_shard x cp, so pick an ep that divides it",
    ),
]


@pytest.mark.parametrize(("spec", "world", "message"), RESOLVE_ERRORS)
def test_resolve_errors(spec: MeshSpec, world: int, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        spec.resolve(world)


# -- construction errors ---------------------------------------------------------------------------

BUILD_ERRORS = [
    (
        dict(dp_shard=-1, tp=-1),
        "mesh: mesh.dp_shard and mesh.tp are all -1; at most one axis can fill the rest of the world",
    ),
    (dict(pp=-1, cp=-1, tp=-1), "mesh: mesh.pp and mesh.dp_shard and mesh.cp and mesh.tp are all -1"),
    (dict(tp=0), "mesh.tp=0: an axis size is >= 1, or -1 for the rest of the world"),
    (dict(dp_shard=-2), "mesh.dp_shard=-2: an axis size is >= 1, or -1 for the rest of the world"),
    (dict(dp_shard=4, ep=3), "mesh.ep=3 does not divide dp_shard x cp = 4; ep borrows its ranks from dp_shard x cp"),
    (dict(dp_shard=2, cp=3, ep=4), "mesh.ep=4 does not divide dp_shard x cp = 6"),
    (dict(dp_shard=4, ep=0), "mesh.ep=0: must be >= 1"),
]


@pytest.mark.parametrize(("kwargs", "message"), BUILD_ERRORS)
def test_build_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        MeshSpec(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(dp_shard=4, ep=2), dict(dp_shard=2, cp=2, ep=4), dict(dp_shard=8, ep=8)])
def test_ep_dividing_dp_shard_x_cp_is_accepted(kwargs: dict) -> None:
    spec = MeshSpec(**kwargs)
    assert spec.size("ep") == kwargs["ep"]
    assert spec.world_size == kwargs["dp_shard"] * kwargs.get("cp", 1)  # ep borrows ranks, adds none


def test_unresolved_mesh_has_no_world_size() -> None:
    with pytest.raises(ValueError, match=r"^mesh: has a -1 axis; call MeshSpec.resolve\(world_size\) first$"):
        MeshSpec(tp=2).world_size  # noqa: B018
    assert not MeshSpec(tp=2).is_resolved


# -- rank <-> coordinate ---------------------------------------------------------------------------

MESHES = [
    MeshSpec(dp_shard=1),
    MeshSpec(dp_shard=4),
    MeshSpec(dp_shard=2, tp=2),
    MeshSpec(dp_replicate=2, dp_shard=2),
    MeshSpec(dp_replicate=2, dp_shard=3, tp=2),
    MeshSpec(pp=2, dp_shard=2, cp=3, tp=2),
    MeshSpec(pp=3, dp_replicate=2, dp_shard=2, cp=2, tp=2),
]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.describe())
def test_rank_coordinate_round_trip_matches_row_major_arange(mesh: MeshSpec) -> None:
    grid = torch.arange(mesh.world_size).reshape(mesh.axis_sizes)
    for rank in range(mesh.world_size):
        coord = mesh.coordinate(rank)
        assert tuple(coord) == AXES
        assert grid[tuple(coord[a] for a in AXES)].item() == rank
        assert mesh.rank(**coord) == rank
    for index in itertools.product(*(range(s) for s in mesh.axis_sizes)):
        assert mesh.rank(**dict(zip(AXES, index))) == grid[index].item()


COORDINATES = [
    # (mesh, rank, coordinate of the axes > 1)
    (MeshSpec(dp_shard=2, tp=2), 0, dict(dp_shard=0, tp=0)),
    (MeshSpec(dp_shard=2, tp=2), 1, dict(dp_shard=0, tp=1)),  # tp is innermost: neighbours share a dp shard
    (MeshSpec(dp_shard=2, tp=2), 2, dict(dp_shard=1, tp=0)),
    (MeshSpec(dp_shard=2, tp=2), 3, dict(dp_shard=1, tp=1)),
    (MeshSpec(dp_replicate=2, dp_shard=3, tp=2), 7, dict(dp_replicate=1, dp_shard=0, tp=1)),
    (MeshSpec(pp=2, dp_shard=2, cp=3, tp=2), 23, dict(pp=1, dp_shard=1, cp=2, tp=1)),
    (MeshSpec(pp=2, dp_shard=2, cp=3, tp=2), 13, dict(pp=1, dp_shard=0, cp=0, tp=1)),
]


@pytest.mark.parametrize(("mesh", "rank", "coord"), COORDINATES)
def test_coordinate_table(mesh: MeshSpec, rank: int, coord: dict[str, int]) -> None:
    assert mesh.coordinate(rank) == {a: coord.get(a, 0) for a in AXES}
    assert mesh.rank(**coord) == rank  # omitted axes are 0


RANK_ERRORS = [
    (lambda m: m.coordinate(4), "rank 4 is outside the mesh of 4 ranks"),
    (lambda m: m.coordinate(-1), "rank -1 is outside the mesh of 4 ranks"),
    (lambda m: m.rank(tp=2), "coordinate tp=2 is outside mesh.tp=2"),
    (lambda m: m.rank(dp_shard=-1), "coordinate dp_shard=-1 is outside mesh.dp_shard=2"),
    (lambda m: m.rank(tq=1), "unknown mesh axes ['tq']; valid axes are pp, dp_replicate, dp_shard, cp, tp"),
    (lambda m: m.rank(dp=1), "unknown mesh axes ['dp']; valid axes are pp, dp_replicate, dp_shard, cp, tp"),
]


@pytest.mark.parametrize(("call", "message"), RANK_ERRORS)
def test_rank_errors(call, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        call(MeshSpec(dp_shard=2, tp=2))


# -- group_index -----------------------------------------------------------------------------------

GROUP_INDEX = [
    # (mesh, axes, expected group index for every rank 0..world-1)
    (MeshSpec(dp_shard=2, tp=2), ("dp_shard",), [0, 0, 1, 1]),
    (MeshSpec(dp_shard=2, tp=2), ("tp",), [0, 1, 0, 1]),
    (MeshSpec(dp_shard=2, tp=2), ("dp_shard", "tp"), [0, 1, 2, 3]),
    (MeshSpec(dp_shard=2, tp=2), ("tp", "dp_shard"), [0, 2, 1, 3]),  # major to minor as given
    (MeshSpec(dp_shard=2, tp=2), (), [0, 0, 0, 0]),
    (MeshSpec(dp_replicate=2, dp_shard=2, tp=2), ("dp_replicate", "dp_shard"), [0, 0, 1, 1, 2, 2, 3, 3]),
    (MeshSpec(dp_replicate=2, dp_shard=2, tp=2), ("dp_replicate",), [0, 0, 0, 0, 1, 1, 1, 1]),
    (MeshSpec(dp_shard=2, cp=2, tp=2), ("dp_shard", "cp"), [0, 0, 1, 1, 2, 2, 3, 3]),
]


@pytest.mark.parametrize(("mesh", "axes", "expected"), GROUP_INDEX)
def test_group_index(mesh: MeshSpec, axes: tuple[str, ...], expected: list[int]) -> None:
    assert [mesh.group_index(r, axes) for r in range(mesh.world_size)] == expected


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.describe())
def test_group_index_matches_flattened_arange(mesh: MeshSpec) -> None:
    # DeviceMesh._flatten: a rank's index in a flattened view is its position in the row-major sub-grid.
    grid = torch.arange(mesh.world_size).reshape(mesh.axis_sizes)
    for axes in FLAT_VIEWS.values():
        keep = [AXES.index(a) for a in axes]
        for rank in range(mesh.world_size):
            coord = mesh.coordinate(rank)
            sub = grid[tuple(slice(None) if i in keep else coord[a] for i, a in enumerate(AXES))].flatten()
            assert sub.tolist().index(rank) == mesh.group_index(rank, axes)


def test_group_index_accepts_flattened_view_names() -> None:
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=2)
    for rank in range(mesh.world_size):
        assert mesh.group_index(rank, ("dp",)) == mesh.group_index(rank, ("dp_replicate", "dp_shard"))


# -- size of axes and views ------------------------------------------------------------------------

SIZES = [
    # (mesh, axis or view, size)
    (MeshSpec(pp=2, dp_replicate=3, dp_shard=4, cp=5, tp=6, ep=4), "pp", 2),
    (MeshSpec(pp=2, dp_replicate=3, dp_shard=4, cp=5, tp=6, ep=4), "tp", 6),
    (MeshSpec(pp=2, dp_replicate=3, dp_shard=4, cp=5, tp=6, ep=4), "ep", 4),
    (MeshSpec(pp=2, dp_replicate=3, dp_shard=4, cp=5, tp=6, ep=4), "dp", 12),
    (MeshSpec(pp=2, dp_replicate=3, dp_shard=4, cp=5, tp=6, ep=4), "dp_shard_cp", 20),
    (MeshSpec(pp=2, dp_replicate=3, dp_shard=4, cp=5, tp=6, ep=4), "batch", 60),
    (MeshSpec(dp_shard=8), "dp", 8),
    (MeshSpec(dp_shard=8), "batch", 8),
    (MeshSpec(dp_shard=8), "tp", 1),
    (MeshSpec(tp=2), "dp_shard", -1),  # before resolve, the free axis reads -1
]


@pytest.mark.parametrize(("mesh", "axis", "size"), SIZES)
def test_size(mesh: MeshSpec, axis: str, size: int) -> None:
    assert mesh.size(axis) == size


def test_size_of_unknown_axis() -> None:
    with pytest.raises(
        ValueError,
        match=r"^unknown mesh axis 'tq'; valid axes are pp, dp_replicate, dp_shard, cp, tp, ep, dp, dp_shard_cp, batch$",
    ):
        MeshSpec(dp_shard=2).size("tq")


def test_flat_views_are_products_of_their_axes() -> None:
    mesh = MeshSpec(pp=2, dp_replicate=3, dp_shard=2, cp=2, tp=2)
    for view, axes in FLAT_VIEWS.items():
        assert mesh.size(view) == math.prod(mesh.size(a) for a in axes)


# -- describe ---------------------------------------------------------------------------------------

DESCRIBE = [
    (MeshSpec(dp_shard=2, tp=2), "dp_shard=2 x tp=2 (4 ranks)"),
    (MeshSpec(dp_replicate=2, dp_shard=2), "dp_replicate=2 x dp_shard=2 (4 ranks)"),
    (MeshSpec(dp_shard=4, ep=2), "dp_shard=4 x ep=2 (4 ranks)"),
    (MeshSpec(tp=2), "dp_shard=-1 x tp=2"),
    (MeshSpec(dp_shard=1), "1 rank"),
]


@pytest.mark.parametrize(("mesh", "text"), DESCRIBE)
def test_describe(mesh: MeshSpec, text: str) -> None:
    assert mesh.describe() == text
