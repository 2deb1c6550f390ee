"""plan.compile (torch.compile of each block, inductor on CPU) against the eager one-process run on 4 gloo ranks: fp32,
layouts.STEPS steps, loss within 1e-5 and gradient norm within 1e-4. shardlab's Llama on HSDP 2 x 2 with full
activation checkpointing, PP 2 x FSDP 2 (1F1B) and CP 2 x TP 2 (+SP, loss parallel; the all-gather attention inside
the compiled block). transformers' models compile through the same per-block path (measured on FSDP 2 x TP 2 with
transformers' Llama); each of their compiles costs the suite about a minute, so none is here.

Compiling costs tens of seconds per block graph, so these layouts join the shared 4-rank world; layouts whose blocks
trace to the same graph reuse dynamo's and inductor's compiled code within the rank process."""

import pytest
import torch

from shardlab.config import MeshSpec

from .layouts import assert_matches, curves, tiny, with_plan

LAYOUTS = {
    "hsdp2x2-ac_full": MeshSpec(dp_replicate=2, dp_shard=2),
    "pp2xfsdp2": MeshSpec(pp=2, dp_shard=2),  # the same block graph as HSDP's: compiled once
    "cp2xtp2": MeshSpec(dp_shard=1, cp=2, tp=2),
}


def layout(name: str, mesh: MeshSpec):
    cfg = tiny(mesh, compile=True)
    return with_plan(cfg, activation_checkpoint="full") if name.endswith("ac_full") else cfg


def run(rank, world_size, tmp):
    """Every layout, compiled; a layout that exhausted dynamo's recompile limit would run eagerly, so it fails."""
    from torch._dynamo.utils import counters

    torch._dynamo.config.fail_on_recompile_limit_hit = True
    counters.clear()
    out = {name: curves(layout(name, mesh)) for name, mesh in LAYOUTS.items()}
    return out, counters["stats"]["unique_graphs"]


CHECKS = [run]


@pytest.fixture(scope="module")
def world4(shared_world4):
    return shared_world4


@pytest.mark.world
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_eager_single_process(world4, reference, name):
    got, graphs = world4.value(run)
    assert graphs > 0, "dynamo compiled no graph"
    assert_matches(got[name], reference, f"compiled {name}")
