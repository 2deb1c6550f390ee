"""shard / constrain / shard_map / visualize on a real 4-rank mesh: each rank holds exactly the block JAX's rule
gives it."""

import pytest
import torch

from shardlab import MeshSpec, P, constrain, make_mesh, shard, shard_map, visualize, visualize_spec
from shardlab.sharding.spec import block

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


def shard_map_runs_on_blocks(rank, world_size):
    """Experts as a shard_map: 4 experts' weights and their rows split over tp (2 per rank), each rank multiplies
    its blocks. Forward and gradients equal the unsharded ones; x arrives replicated and is redistributed."""
    mesh = make_mesh(MESH)
    torch.manual_seed(0)
    x, w = torch.randn(4, 5, 6, requires_grad=True), torch.randn(4, 6, 3, requires_grad=True)
    torch.bmm(x, w).square().sum().backward()
    experts = P("tp", None, None)
    f = shard_map(torch.bmm, mesh, in_specs=(experts, experts), out_specs=experts)
    xs = shard(x.detach(), mesh, P()).requires_grad_()
    ws = shard(w.detach(), mesh, experts).requires_grad_()
    y = f(xs, ws)
    assert y.to_local().shape == (2, 5, 3) and y.placements[-1].is_shard(0)
    torch.testing.assert_close(y.full_tensor(), torch.bmm(x, w))
    y.full_tensor().square().sum().backward()  # a Partial scalar's backward took 18 s on gloo
    torch.testing.assert_close(ws.grad.full_tensor(), w.grad)
    torch.testing.assert_close(xs.grad.full_tensor(), x.grad)
    both = shard_map(lambda a, n: (a + n, n * 2), mesh, (P("tp", None), None), (P("tp", None), None))
    a, twice = both(shard(torch.zeros(4, 2), mesh, P("tp", None)), 3)
    assert torch.equal(a.full_tensor(), torch.full((4, 2), 3.0)) and twice == 6
    blocks = shard_map(torch.neg, mesh, (experts,), experts)(torch.ones(2, 5, 6))  # plain: this rank's block
    assert blocks.shape == (4, 5, 6) and torch.equal(blocks.to_local(), -torch.ones(2, 5, 6))
    with pytest.raises(ValueError, match="2 arguments but 1 in_specs"):
        shard_map(torch.neg, mesh, (P(),), P())(xs, xs)


CHECKS = [shard_gives_jax_blocks, constrain_redistributes, visualize_matches_spec, shard_map_runs_on_blocks]


@pytest.fixture(scope="module")
def world4(shared_world4):
    return shared_world4


@pytest.mark.world
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_helpers(world4, check):
    world4.raise_for(check)


@pytest.mark.world
def test_visualize_draws_ranks(world4):
    drawn = world4.value(visualize_matches_spec)["P('tp', 'dp_shard')"]
    assert drawn.splitlines()[2] == "│ rank 0 │ rank 2 │"
