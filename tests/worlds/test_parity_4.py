"""Parity on 4 CPU ranks (gloo) against one process (fp32, layouts.STEPS steps, loss and grad norm within 1e-5):
HSDP 2x2 and FSDP 2 x TP 2 (+SP, loss parallel), activation checkpointing none / full / selective,
gradient accumulation, FSDP 4; bf16 mixed precision stays close; sharded init is refused on CPU."""

import msgspec
import pytest

from shardlab.config import MeshSpec
from shardlab.loop import build_model

from ._harness import run_world
from .layouts import assert_matches, curves, placements_match_plan, tied, tiny, with_micro_batch

HSDP, FSDP_TP = MeshSpec(dp_replicate=2, dp_shard=2), MeshSpec(dp_shard=2, tp=2)
LAYOUTS = {
    **{f"hsdp2x2-ac_{ac}": tiny(HSDP, activation_checkpoint=ac) for ac in ("none", "full", "selective")},
    **{f"fsdp2xtp2-ac_{ac}": tiny(FSDP_TP, activation_checkpoint=ac) for ac in ("none", "full", "selective")},
    "fsdp2xtp2-no_sp": tiny(FSDP_TP, sequence_parallel=False),
    # gradient accumulation (micro batches of 1 sequence per rank) changes nothing either
    "fsdp4-accum2": with_micro_batch(tiny(MeshSpec(dp_shard=4)), 1),
    "hsdp2x2-accum2": with_micro_batch(tiny(HSDP), 1),
    "fsdp2xtp2-accum4": with_micro_batch(tiny(FSDP_TP), 1),
}
TIED = {"tied-fsdp2xtp2": tied(tiny(FSDP_TP))}
BF16 = tiny(FSDP_TP, param_dtype="bfloat16")


def placements(rank, world_size):
    for cfg in (tiny(FSDP_TP), tiny(HSDP), tiny(FSDP_TP, sequence_parallel=False), tied(tiny(FSDP_TP))):
        placements_match_plan(rank, world_size, cfg)


def run(rank, world_size):
    return {name: curves(cfg) for name, cfg in {**LAYOUTS, **TIED}.items()}


def run_bf16(rank, world_size):
    return curves(BF16)


def sharded_init_needs_cuda(rank, world_size):
    cfg = tiny(FSDP_TP)
    cfg = msgspec.structs.replace(cfg, train=msgspec.structs.replace(cfg.train, init="sharded"))
    with pytest.raises(ValueError, match=r"train\.init='sharded' needs CUDA"):
        build_model(cfg)


CHECKS = [placements, run, run_bf16, sharded_init_needs_cuda]


@pytest.fixture(scope="module")
def world4():
    return run_world(4, CHECKS, timeout_s=600)


@pytest.mark.world
def test_placements_match_plan(world4):
    world4.raise_for(placements)


@pytest.mark.world
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_single_process(world4, reference, layout):
    assert_matches(world4.value(run)[layout], reference, layout)


@pytest.mark.world
def test_tied_embeddings_under_fsdp_x_tp(world4):
    assert_matches(world4.value(run)["tied-fsdp2xtp2"], curves(tied(tiny())), "tied-fsdp2xtp2")


@pytest.mark.world
def test_bf16_mixed_precision_stays_close(world4, reference):
    got = world4.value(run_bf16)["loss"]
    diff = max(abs(a - b) for a, b in zip(got, reference["loss"]))
    assert 0 < diff < 0.05, f"bf16 differs from fp32 by {diff:.3g}"


@pytest.mark.world
def test_sharded_init_is_refused_on_cpu(world4):
    world4.raise_for(sharded_init_needs_cuda)
