"""P -> placements: every rank holds the block JAX's NamedSharding gives it (checked without a process group).

The oracle is `spec.block` (JAX semantics: a dim's block index is the mixed-radix number of its axes'
coordinates, major first); torch's side is simulated by applying each placement's own split, left
to right over mesh dims, exactly as `distribute_tensor` does.
"""

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardlab.sharding import _strided
from shardlab.sharding.mesh import AXES, MeshSpec
from shardlab.sharding.spec import P, block, check_shape, dim_of, expand, local_shape, placements, spec_from_placements


def torch_local(global_t: torch.Tensor, spec: P, mesh: MeshSpec, coord: dict[str, int]) -> torch.Tensor:
    t = global_t
    for axis, p in zip(AXES, placements(spec, mesh)):
        if _strided.shard_dim(p) is not None:
            t = _strided.local_chunk(p, t, mesh.size(axis), coord[axis])
    return t


def assert_matches_jax(spec: P, mesh: MeshSpec, shape: tuple[int, ...]) -> None:
    g = torch.arange(math.prod(shape)).reshape(shape)
    for rank in range(mesh.world_size):
        coord = mesh.coordinate(rank)
        want = g[block(spec, mesh, shape, coord)]
        got = torch_local(g, spec, mesh, coord)
        assert torch.equal(got, want), (
            f"{spec} rank {rank} {coord}: {got.flatten().tolist()} != {want.flatten().tolist()}"
        )


MESHES = [
    MeshSpec(dp_shard=2, tp=2),
    MeshSpec(dp_replicate=2, dp_shard=3, tp=2),
    MeshSpec(pp=2, dp_shard=2, cp=3, tp=2),
]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.describe())
def test_every_order_of_every_axis_subset_on_one_dim(mesh):
    axes = [a for a in AXES if mesh.size(a) > 1]
    for k in range(1, len(axes) + 1):
        for subset in itertools.combinations(axes, k):
            for order in itertools.permutations(subset):
                n = math.prod(mesh.size(a) for a in order)
                assert_matches_jax(P(order, None), mesh, (n * 2, 3))
                assert_matches_jax(P(None, order), mesh, (3, n))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.describe())
def test_axes_split_over_two_dims(mesh):
    axes = [a for a in AXES if mesh.size(a) > 1]
    for a, b, c in itertools.permutations(axes, 3):
        spec = P((c, a), b)
        shape = (mesh.size(a) * mesh.size(c) * 2, mesh.size(b))
        assert_matches_jax(spec, mesh, shape)


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (P(None, None), (Replicate(),) * 5),
        (P("tp", None), (Replicate(),) * 4 + (Shard(0),)),
        (P(None, "tp"), (Replicate(),) * 4 + (Shard(1),)),
        (P(("dp_shard", "tp")), (Replicate(), Replicate(), Shard(0), Replicate(), Shard(0))),
        (P(("tp", "dp_shard")), (Replicate(), Replicate(), _strided.strided_shard(0, 2), Replicate(), Shard(0))),
        (P("dp_shard", "tp"), (Replicate(), Replicate(), Shard(0), Replicate(), Shard(1))),
        (P("dp"), (Replicate(), Replicate(), Shard(0), Replicate(), Replicate())),
    ],
)
def test_lowering_table(spec, want):
    assert placements(spec, MeshSpec(dp_shard=2, tp=2)) == want


def test_fsdp_over_tp_is_the_strided_layout_torch_builds():
    """fully_shard over a colwise TP weight gives (_StridedShard(0, sf=tp), Shard(0)), as torch itself places it."""
    mesh = MeshSpec(dp_shard=2, tp=2)
    got = placements(P("tp", None).with_minor(0, ("dp_shard",)), mesh)
    assert got[2] == _strided.strided_shard(0, 2) and got[4] == Shard(0)


def test_size_one_axes_lower_to_replicate():
    assert placements(P("tp"), MeshSpec(dp_shard=4, tp=1)) == (Replicate(),) * 5


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.describe())
def test_placements_round_trip_to_spec(mesh):
    axes = [a for a in AXES if mesh.size(a) > 1]
    for order in itertools.permutations(axes, 2):
        spec = P(order, None)
        assert spec_from_placements(placements(spec, mesh), mesh, 2) == spec


def test_entries_normalize_like_jax():
    assert P(("tp",), ()) == P("tp", None)
    assert P(["dp_shard", "tp"]).axes(0) == ("dp_shard", "tp")
    assert repr(P("tp", None)) == "P('tp', None)"
    with pytest.raises(TypeError, match="expected None, an axis name"):
        P(3)


@pytest.mark.parametrize(
    "spec",
    [(), (None,), ("tp", None), (None, "tp"), (("tp",), None), (None, ("dp_shard", "tp")), (["tp", "cp"], None),
     (("dp_shard",), ()), ("tpx", "tp"), (("cp", "dp_shard"), "tp", None)],
)  # fmt: skip
def test_dim_of_a_raw_spec_is_that_of_its_p(spec):
    for axis in ("tp", "cp", "dp_shard", "dp_replicate"):
        assert dim_of(spec, axis) == P(*spec).dim_of(axis), (spec, axis)


def test_flat_views_expand():
    assert expand(P("batch", None), MeshSpec(dp_shard=2, tp=2)) == P(("dp_replicate", "dp_shard", "cp"), None)


def test_unknown_axis_is_an_error():
    with pytest.raises(ValueError, match=r"w: unknown mesh axis 'model'.*valid axes are pp, dp_replicate"):
        placements(P("model"), MeshSpec(dp_shard=2), name="w")


def test_axis_used_twice_is_an_error():
    with pytest.raises(ValueError, match="mesh axis 'tp' is used twice"):
        placements(P("tp", "tp"), MeshSpec(tp=2))
    with pytest.raises(ValueError, match="mesh axis 'dp_shard' is used twice"):
        placements(P("dp", "dp_shard"), MeshSpec(dp_shard=2))


def test_uneven_dim_is_an_error_naming_tensor_dim_and_sizes():
    with pytest.raises(ValueError, match=r"layers.3.mlp.w1.weight: dim 0 \(size 11\) is not divisible by tp=2"):
        check_shape(P("tp", None), MeshSpec(tp=2), (11, 4), name="layers.3.mlp.w1.weight")
    with pytest.raises(ValueError, match="has 3 entries but the tensor has 2 dims"):
        check_shape(P(None, None, "tp"), MeshSpec(tp=2), (4, 4))


def test_local_shape_pads_like_torch_chunk():
    mesh = MeshSpec(dp_shard=3, tp=2)
    assert local_shape(P(("tp", "dp_shard"), None), mesh, (12, 5)) == (2, 5)
    assert local_shape(P("dp_shard"), mesh, (10,)) == (4,)
