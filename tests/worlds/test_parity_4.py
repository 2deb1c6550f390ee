"""Loss parity on 4 CPU ranks (gloo): HSDP 2x2 and FSDP 2 x TP 2 (+SP, loss parallel), activation
checkpointing none / full / selective, against one process (fp32, 10 steps, max |diff| <= 1e-5).
bf16 mixed precision runs on FSDP 2 x TP 2 and stays close."""

import pytest

from shardlab.config import MeshSpec

from ._harness import run_world
from .layouts import STEPS, TOL, losses, placements_match_plan, sharded_init_trains, tiny, with_micro_batch

LAYOUTS = {
    **{
        f"hsdp2x2-ac_{ac}": tiny(MeshSpec(dp_replicate=2, dp_shard=2), activation_checkpoint=ac)
        for ac in ("none", "full")
    },
    **{
        f"fsdp2xtp2-ac_{ac}": tiny(MeshSpec(dp_shard=2, tp=2), activation_checkpoint=ac)
        for ac in ("none", "full", "selective")
    },
    # gradient accumulation (2 micro batches of 1 sequence per rank) changes nothing either
    "fsdp4-accum2": with_micro_batch(tiny(MeshSpec(dp_shard=4)), 1),
}
BF16 = tiny(MeshSpec(dp_shard=2, tp=2), param_dtype="bfloat16")


def placements(rank, world_size):
    placements_match_plan(rank, world_size, tiny(MeshSpec(dp_shard=2, tp=2)))
    placements_match_plan(rank, world_size, tiny(MeshSpec(dp_replicate=2, dp_shard=2)))


def run(rank, world_size):
    return {name: losses(cfg) for name, cfg in LAYOUTS.items()}


def run_bf16(rank, world_size):
    return losses(BF16)


def sharded_init(rank, world_size):
    return {
        "hsdp2x2": sharded_init_trains(rank, world_size, tiny(MeshSpec(dp_replicate=2, dp_shard=2))),
        "fsdp2xtp2": sharded_init_trains(rank, world_size, tiny(MeshSpec(dp_shard=2, tp=2))),
    }


CHECKS = [placements, run, run_bf16, sharded_init]


@pytest.fixture(scope="module")
def world4():
    return run_world(4, CHECKS, timeout_s=500)


@pytest.fixture(scope="module")
def reference():
    return losses(tiny())


@pytest.mark.world
def test_placements_match_plan(world4):
    world4.raise_for(placements)


@pytest.mark.world
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_matches_single_process(world4, reference, layout):
    world4.raise_for(run)
    got = world4.value(run)[layout]
    assert len(got) == STEPS
    diff = max(abs(a - b) for a, b in zip(got, reference))
    assert diff <= TOL, f"{layout}: max |loss diff| {diff:.2e} > {TOL}; {got} vs {reference}"
    assert reference[-1] < reference[0] - 0.1, "the reference loss should fall"


@pytest.mark.world
def test_bf16_mixed_precision_stays_close(world4, reference):
    world4.raise_for(run_bf16)
    got = world4.value(run_bf16)
    diff = max(abs(a - b) for a, b in zip(got, reference))
    assert 0 < diff < 0.05, f"bf16 differs from fp32 by {diff:.3g}"


@pytest.mark.world
@pytest.mark.parametrize("layout", ["hsdp2x2", "fsdp2xtp2"])
def test_sharded_init_trains(world4, layout):
    """Initialising shards on the meta-device plan (for models larger than one device) trains too."""
    got = world4.value(sharded_init)[layout]
    assert got[-1] < got[0] - 0.5, got
