"""Loss parity on 2 CPU ranks (gloo): FSDP 2, TP 2, TP 2 + SP, each with activation checkpointing off and
on, against one process: fp32, same seed and global batch, 10 steps, max |loss difference| <= 1e-5."""

import functools

import pytest

from shardlab.config import MeshSpec

from ._harness import run_world
from .layouts import STEPS, TOL, layout_losses, losses, placements_match_plan, tied, tiny

LAYOUTS = {
    f"{name}-ac_{ac}": tiny(mesh, activation_checkpoint=ac, **opts)
    for name, mesh, opts in [
        ("fsdp2", MeshSpec(dp_shard=2), {}),
        ("tp2", MeshSpec(dp_shard=1, tp=2), {"sequence_parallel": False}),
        ("tp2_sp", MeshSpec(dp_shard=1, tp=2), {"sequence_parallel": True}),
    ]
    for ac in ("none", "full")
}

TIED = {
    "tied-tp2_sp": tied(tiny(MeshSpec(dp_shard=1, tp=2))),
    "tied-fsdp2": tied(tiny(MeshSpec(dp_shard=2))),
}

run_layouts = functools.partial(layout_losses, layouts={**LAYOUTS, **TIED})
run_layouts.__name__ = "run_layouts"


def fsdp_tp_placements(rank, world_size):
    placements_match_plan(rank, world_size, tiny(MeshSpec(dp_shard=2)))
    placements_match_plan(rank, world_size, tiny(MeshSpec(dp_shard=1, tp=2)))


def run(rank, world_size):
    return run_layouts()


CHECKS = [fsdp_tp_placements, run]


@pytest.fixture(scope="module")
def world2():
    return run_world(2, CHECKS, timeout_s=400)


@pytest.fixture(scope="module")
def reference():
    return losses(tiny())


@pytest.mark.world
def test_placements_match_plan(world2):
    world2.raise_for(fsdp_tp_placements)


@pytest.mark.world
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_matches_single_process(world2, reference, layout):
    world2.raise_for(run)
    got = world2.value(run)[layout]
    assert len(got) == STEPS
    diff = max(abs(a - b) for a, b in zip(got, reference))
    assert diff <= TOL, f"{layout}: max |loss diff| {diff:.2e} > {TOL}; {got} vs {reference}"
    assert reference[-1] < reference[0]


@pytest.mark.world
@pytest.mark.parametrize("layout", list(TIED))
def test_tied_embeddings_match_single_process(world2, layout):
    """A tied embedding/lm_head stays one tensor under TP (re-tied after parallelize_module) and FSDP (root unit)."""
    world2.raise_for(run)
    got = world2.value(run)[layout]
    reference = losses(tied(tiny()))
    diff = max(abs(a - b) for a, b in zip(got, reference))
    assert diff <= TOL, f"{layout}: max |loss diff| {diff:.2e} > {TOL}; {got} vs {reference}"
