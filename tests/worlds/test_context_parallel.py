"""Context parallelism against one process: fp32, same seed and global batch, layouts.STEPS steps; loss and
gradient norm of every step within tolerance. cp 2 on 2 ranks; cp 2 x FSDP 2, cp 2 x TP 2 (+SP, loss
parallel), HSDP (2 replicas) x cp 2 and pp 2 x cp 2 (cp inside pipeline stages) on 4. Placements are the plan's; a cp 2 checkpoint continues on one
process. Each cp rank holds sequence chunks r and 2 cp - 1 - r; attention all-gathers K and V. Packed rows with
document masks: cp 2 on 2 ranks and pp 2 x cp 2 on 4 match one process packing the same documents."""

from pathlib import Path

import pytest

from shardlab.config import MeshSpec
from shardlab.training.checkpoint import step_dir

from ._harness import run_world
from .layouts import (
    MID,
    TOL,
    assert_matches,
    ckpt,
    continue_from,
    curves,
    layout_curves,
    packed,
    placements_match_plan,
    tiny,
    write_documents,
)

LAYOUTS_2 = {"cp2": tiny(MeshSpec(dp_shard=1, cp=2))}
LAYOUTS_4 = {
    "cp2_fsdp2": tiny(MeshSpec(dp_shard=2, cp=2)),
    "cp2_tp2_sp": tiny(MeshSpec(dp_shard=1, cp=2, tp=2)),
    "hsdp2_cp2": tiny(MeshSpec(dp_replicate=2, dp_shard=1, cp=2)),
    "pp2_cp2-1f1b": tiny(MeshSpec(pp=2, dp_shard=1, cp=2)),  # every stage gets the rank's positions
}
LAYOUTS = {2: LAYOUTS_2, 4: LAYOUTS_4}


def run(rank, world_size, tmp):
    return layout_curves(LAYOUTS[world_size])


PACKED = {2: {"cp2-docs": MeshSpec(dp_shard=1, cp=2)}, 4: {"pp2_cp2-docs": MeshSpec(pp=2, dp_shard=1, cp=2)}}
"""Layouts that train on packed rows with document masks (the documents are written into the world's tmp)."""


def run_packed(rank, world_size, tmp):
    return {name: curves(packed(tiny(mesh), Path(tmp) / "docs.jsonl")) for name, mesh in PACKED[world_size].items()}


def placements(rank, world_size, tmp):
    for cfg in LAYOUTS[world_size].values():
        placements_match_plan(rank, world_size, cfg)


def cp2_checkpoint(rank, world_size, tmp):
    """cp 2 saves at step MID (committed), for one process to continue."""
    curves_cfg = ckpt(LAYOUTS_2["cp2"], Path(tmp) / "cp2", every=MID)
    return curves(curves_cfg, until=MID)["loss"]


def prepare(tmp: Path) -> None:
    """Before the world starts: the documents of the packed layouts."""
    tmp.mkdir(parents=True, exist_ok=True)
    write_documents(tmp / "docs.jsonl")


CHECKS_2 = [run, placements, cp2_checkpoint, run_packed]
CHECKS_4 = [run, placements, run_packed]


@pytest.fixture(scope="module")
def tmp(shared_tmp) -> Path:
    return shared_tmp / "context"  # what the shared worlds gave this module's checks


@pytest.fixture(scope="module")
def world2(shared_world2):
    return shared_world2


@pytest.fixture(scope="module")
def world4(tmp):
    return run_world(4, CHECKS_4, timeout_s=400, tmp=str(tmp))


@pytest.fixture(scope="module")
def packed_reference(tmp):
    ref = curves(packed(tiny(), tmp / "docs.jsonl"))
    assert ref["loss"][-1] < ref["loss"][0] - 0.5, "the packed reference loss should fall"
    return ref


@pytest.mark.world
@pytest.mark.parametrize(("ranks", "layout"), [(n, name) for n, layouts in PACKED.items() for name in layouts])
def test_packed_rows_match_single_process(request, packed_reference, ranks, layout):
    assert_matches(request.getfixturevalue(f"world{ranks}").value(run_packed)[layout], packed_reference, layout)


@pytest.mark.world
@pytest.mark.parametrize(("ranks", "layout"), [(n, name) for n, layouts in LAYOUTS.items() for name in layouts])
def test_matches_single_process(request, reference, ranks, layout):
    assert_matches(request.getfixturevalue(f"world{ranks}").value(run)[layout], reference, layout)


@pytest.mark.world
def test_placements_match_plan(world2, world4):
    world2.raise_for(placements)
    world4.raise_for(placements)


@pytest.mark.world
def test_cp2_checkpoint_continues_on_one_process(world2, tmp, reference):
    world2.raise_for(cp2_checkpoint)
    got = continue_from(tiny(), tmp / "one", step_dir(tmp / "cp2" / "checkpoints", MID))
    assert max(abs(a - b) for a, b in zip(got, reference["loss"][MID:], strict=True)) <= TOL, (got, reference["loss"])
