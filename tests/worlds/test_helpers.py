"""shard / constrain / visualize on a real 4-rank mesh: each rank holds exactly the block JAX's rule gives it."""

import pytest
import torch

from shardlab import MeshSpec, P, constrain, make_mesh, shard, visualize, visualize_spec
from shardlab.spec import block

from ._harness import run_world

MESH = MeshSpec(dp_shard=2, tp=2)
SPECS = [P("tp", "dp_shard"), P(("tp", "dp_shard"), None), P(("dp_shard", "tp"), None), P(None, "tp"), P()]


def shard_gives_jax_blocks(rank, world_size):
    mesh = make_mesh(MESH)
    full = torch.arange(64.0).reshape(8, 8)
    for spec in SPECS:
        x = shard(full, mesh, spec)
        want = full[block(spec, MESH, full.shape, MESH.coordinate(rank))]
        assert torch.equal(x.to_local(), want), (spec, rank, x.to_local(), want)
        assert torch.equal(x.full_tensor(), full), spec


def constrain_redistributes(rank, world_size):
    mesh = make_mesh(MESH)
    full = torch.arange(64.0).reshape(8, 8)
    x = shard(full, mesh, P("tp", None))
    y = constrain(x, P(None, "tp"))
    assert torch.equal(y.to_local(), full[block(P(None, "tp"), MESH, full.shape, MESH.coordinate(rank))])
    assert torch.equal(y.full_tensor(), full)
    plain = torch.ones(3)
    assert constrain(plain, P("tp")) is plain
    tp_only = shard(full, mesh["tp"], P("tp", None))  # a slice of the mesh works too
    assert tp_only.to_local().shape == (4, 8)


def visualize_matches_spec(rank, world_size):
    mesh = make_mesh(MESH)
    out = {}
    for spec in SPECS:
        text = visualize(shard(torch.zeros(8, 8), mesh, spec))
        assert text == visualize_spec((8, 8), spec, MESH), text
        out[repr(spec)] = text
    return out


CHECKS = [shard_gives_jax_blocks, constrain_redistributes, visualize_matches_spec]


@pytest.fixture(scope="module")
def world4():
    return run_world(4, CHECKS, timeout_s=200)


@pytest.mark.world
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_helpers(world4, check):
    world4.raise_for(check)


@pytest.mark.world
def test_visualize_draws_ranks(world4):
    drawn = world4.value(visualize_matches_spec)["P('tp', 'dp_shard')"]
    assert drawn.splitlines()[2] == "│ rank 0 │ rank 2 │"
