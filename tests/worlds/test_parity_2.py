"""Parity on 2 CPU ranks (gloo) against one process: fp32, same seed and global batch, layouts.STEPS steps; loss and
gradient norm of every step within 1e-5. FSDP 2, TP 2, TP 2 + SP, activation checkpointing none / full /
selective, loss parallel on and off, tied embeddings; optimizer groups (no decay on norms, a scaled learning rate
on the embeddings) on TP 2 and FSDP 2; the predicted placements are the real ones."""

import msgspec
import pytest

from shardlab.config import MeshSpec, OptimConfig

from .layouts import assert_matches, curves, placements_match_plan, tied, tiny

FSDP2, TP2 = MeshSpec(dp_shard=2), MeshSpec(dp_shard=1, tp=2)
LAYOUTS = {
    **{f"fsdp2-ac_{ac}": tiny(FSDP2, activation_checkpoint=ac) for ac in ("none", "full", "selective")},
    **{f"tp2-ac_{ac}": tiny(TP2, sequence_parallel=False, activation_checkpoint=ac) for ac in ("none", "full")},
    **{f"tp2_sp-ac_{ac}": tiny(TP2, activation_checkpoint=ac) for ac in ("none", "full", "selective")},
    "tp2_sp-no_loss_parallel": tiny(TP2, loss_parallel=False),
    "tp2-no_sp-no_loss_parallel": tiny(TP2, sequence_parallel=False, loss_parallel=False),
}
TIED = {"tied-tp2_sp": tied(tiny(TP2)), "tied-fsdp2": tied(tiny(FSDP2))}
GROUPS = OptimConfig(lr=1e-2, warmup_steps=2, no_decay=("**norm.weight",), lr_scales=(("**embed_tokens.weight", 0.3),))
"""Optimizer groups: under TP without SP the norms are plain tensors, a group of their own beside the DTensors."""


def grouped(cfg):
    return msgspec.structs.replace(cfg, optim=GROUPS)


OPTIM = {"groups-tp2": grouped(tiny(TP2, sequence_parallel=False)), "groups-fsdp2": grouped(tiny(FSDP2))}


def placements(rank, world_size):
    for cfg in (tiny(FSDP2), tiny(TP2), tiny(TP2, sequence_parallel=False), tied(tiny(TP2))):
        placements_match_plan(rank, world_size, cfg)


def run(rank, world_size):
    return {name: curves(cfg) for name, cfg in {**LAYOUTS, **TIED, **OPTIM}.items()}


CHECKS = [placements, run]


@pytest.fixture(scope="module")
def world2(shared_world2):
    return shared_world2


@pytest.mark.world
def test_placements_match_plan(world2):
    world2.raise_for(placements)


@pytest.mark.world
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_single_process(world2, reference, layout):
    assert_matches(world2.value(run)[layout], reference, layout)


@pytest.mark.world
@pytest.mark.parametrize("layout", list(TIED))
def test_tied_embeddings_match_single_process(world2, layout):
    """A tied embedding/lm_head stays one tensor under TP (re-tied after parallelize_module) and FSDP (root unit)."""
    assert_matches(world2.value(run)[layout], curves(tied(tiny())), layout)


@pytest.mark.world
@pytest.mark.parametrize("layout", list(OPTIM))
def test_optimizer_groups_match_single_process(world2, reference, layout):
    want = curves(grouped(tiny()))
    assert_matches(world2.value(run)[layout], want, layout)
    assert want["loss"] != reference["loss"], "the groups should change the curve"
