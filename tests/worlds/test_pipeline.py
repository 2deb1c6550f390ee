"""Pipeline parallelism against one process (issue 4, slice 2): fp32, same seed and global batch, 10 steps;
loss and gradient norm of every step within 1e-5. pp 2 with GPipe and 1F1B (2, 4 and 8 micro batches, with
activation checkpointing), and pp 2 x FSDP 2 on 4 ranks. Each rank holds only its stage's parameters."""

import pytest

from shardlab.config import MeshSpec
from shardlab.loop import build_model

from ._harness import run_world
from .layouts import assert_matches, curves, tiny

PP2, PP2_FSDP2 = MeshSpec(pp=2, dp_shard=1), MeshSpec(pp=2, dp_shard=2)
LAYOUTS_2 = {
    "pp2-gpipe-mb2": tiny(PP2, pp_schedule="gpipe"),
    "pp2-1f1b-mb4": tiny(PP2, pp_microbatches=4),
    "pp2-1f1b-mb8-ac_full": tiny(PP2, pp_microbatches=8, activation_checkpoint="full"),
}
LAYOUTS_4 = {
    "pp2_fsdp2-1f1b-mb2": tiny(PP2_FSDP2),
    "pp2_fsdp2-gpipe-mb4-ac_selective": tiny(PP2_FSDP2, pp_schedule="gpipe", pp_microbatches=4,
                                             activation_checkpoint="selective"),
}  # fmt: skip


def stage_params(rank, world_size):
    """Rank r holds stage r // (world / pp)'s parameters and nothing else (names as in the whole model)."""
    cfg = LAYOUTS_2["pp2-gpipe-mb2"] if world_size == 2 else LAYOUTS_4["pp2_fsdp2-1f1b-mb2"]
    model, plan, mesh = build_model(cfg)
    stage = plan.pipeline.stages[mesh["pp"].get_local_rank()]
    return sorted(n for n, _ in model.named_parameters()) == sorted(
        p.fqn for p in plan.params if p.stage == stage.index
    )


def run_2(rank, world_size):
    return {name: curves(cfg) for name, cfg in LAYOUTS_2.items()}


def run_4(rank, world_size):
    return {name: curves(cfg) for name, cfg in LAYOUTS_4.items()}


@pytest.fixture(scope="module")
def world2():
    return run_world(2, [stage_params, run_2], timeout_s=400)


@pytest.fixture(scope="module")
def world4():
    return run_world(4, [stage_params, run_4], timeout_s=400)


@pytest.mark.world
def test_each_rank_holds_its_stage(world2, world4):
    for world in (world2, world4):
        assert all(world.value(stage_params, rank=r) for r in range(world.world_size))


@pytest.mark.world
@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_pp2_matches_single_process(world2, reference, layout):
    assert_matches(world2.value(run_2)[layout], reference, layout)


@pytest.mark.world
@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_pp2_fsdp2_matches_single_process(world4, reference, layout):
    assert_matches(world4.value(run_4)[layout], reference, layout)
