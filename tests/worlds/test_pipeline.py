"""Pipeline parallelism against one process: fp32, same seed and global batch, layouts.STEPS steps;
loss and gradient norm of every step within 1e-5. pp 2 with GPipe and 1F1B (2, 4 and 8 micro batches, with
activation checkpointing) and, with 2 stages per rank, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble and DualPipeV; pp 2 x FSDP 2 (also interleaved and ZB-V, with one FSDP root per stage) and pp 2 x TP 2
(+SP, loss parallel) on 4 ranks, the latter also interleaved; pp 2 x dp_shard 2 x tp 2 on 8. Each rank holds only its stages' parameters.
Checkpoints: a pp 2 run stopped at step MID and resumed is bitwise the uninterrupted one; its checkpoint
continues on one process, and a one-process checkpoint continues on pp 2, within 1e-5."""

from pathlib import Path

import msgspec
import pytest

from shardlab.config import Config, MeshSpec
from shardlab.training.checkpoint import step_dir
from shardlab.training.loop import build_model

from ._harness import run_world
from .layouts import MID, TOL, assert_matches, ckpt, continue_from, curves, layout_curves, tiny

PP2, PP2_FSDP2 = MeshSpec(pp=2, dp_shard=1), MeshSpec(pp=2, dp_shard=2)


def deep(mesh: MeshSpec = MeshSpec(dp_shard=1), **plan: object) -> Config:
    """The parity model with 4 blocks: 2 stages per rank at pp 2."""
    cfg = tiny(mesh, **plan)
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, n_layers=4))


SEVERAL_STAGES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
LAYOUTS_2 = {
    **{f"pp2x2-{s}-mb4": deep(PP2, pp_schedule=s, pp_stages_per_rank=2) for s in SEVERAL_STAGES},
    "pp2-gpipe-mb2": tiny(PP2, pp_schedule="gpipe"),
    "pp2-1f1b-mb4": tiny(PP2, pp_microbatches=4),
    "pp2-1f1b-mb8-ac_full": tiny(PP2, pp_microbatches=8, activation_checkpoint="full"),
}
LAYOUTS_4 = {
    "pp2_fsdp2-1f1b-mb2": tiny(PP2_FSDP2),
    "pp2_tp2_sp-1f1b-mb2": tiny(MeshSpec(pp=2, dp_shard=1, tp=2)),
    "pp2x2_tp2_sp-interleaved_1f1b-mb4": deep(MeshSpec(pp=2, dp_shard=1, tp=2), pp_schedule="interleaved_1f1b",
                                              pp_stages_per_rank=2),
    "pp2_fsdp2-gpipe-mb4-ac_selective": tiny(PP2_FSDP2, pp_schedule="gpipe", pp_microbatches=4,
                                             activation_checkpoint="selective"),
    "pp2x2_fsdp2-interleaved_1f1b-mb4": deep(PP2_FSDP2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2),
    "pp2x2_fsdp2-zbv_zero_bubble-mb4-no_reshard": deep(PP2_FSDP2, pp_schedule="zbv_zero_bubble", pp_stages_per_rank=2,
                                                       reshard_after_forward=False),
}  # fmt: skip


def stage_params(rank, world_size, tmp):
    """Rank r holds stage r // (world / pp)'s parameters and nothing else (names as in the whole model)."""
    cfg = LAYOUTS_2["pp2-gpipe-mb2"] if world_size == 2 else LAYOUTS_4["pp2_fsdp2-1f1b-mb2"]
    model, plan, mesh = build_model(cfg)
    stage = plan.pipeline.stages[mesh["pp"].get_local_rank()]
    return sorted(n for n, _ in model.named_parameters()) == sorted(
        p.fqn for p in plan.params if p.stage == stage.index
    )


LAYOUTS_8 = {"pp2_fsdp2_tp2_sp-1f1b-mb2": tiny(MeshSpec(pp=2, dp_shard=2, tp=2))}


def pp2_checkpoint(rank, world_size, tmp):
    """Stop after step MID (saving it), then resume on pp 2: the losses of all steps. Also continue a one-process
    checkpoint of step MID (written by the test before the world starts) on pp 2: the losses of steps after it."""
    cfg = ckpt(LAYOUTS_2["pp2-1f1b-mb4"], Path(tmp) / "pp2", every=MID)
    split = curves(cfg, until=MID)["loss"] + curves(cfg)["loss"]
    from_one = continue_from(
        LAYOUTS_2["pp2-1f1b-mb4"], Path(tmp) / "from_one", step_dir(Path(tmp) / "one" / "checkpoints", MID)
    )
    return {"split": split, "from_one": from_one}


LAYOUTS = {2: LAYOUTS_2, 4: LAYOUTS_4, 8: LAYOUTS_8}


def run(rank, world_size, tmp):
    return layout_curves(LAYOUTS[world_size])


@pytest.fixture(scope="module")
def reference_deep():
    return curves(deep())


def prepare(tmp: Path) -> None:
    """Before the world starts: a one-process checkpoint of step MID for pp 2 to continue."""
    curves(ckpt(tiny(), tmp / "one", every=MID), until=MID)


CHECKS_2 = [stage_params, run, pp2_checkpoint]
CHECKS_4 = [stage_params, run]


@pytest.fixture(scope="module")
def tmp(shared_tmp) -> Path:
    return shared_tmp / "pipeline"  # what the shared worlds gave this module's checks


@pytest.fixture(scope="module")
def world2(shared_world2):
    return shared_world2


@pytest.fixture(scope="module")
def world4(tmp):
    return run_world(4, CHECKS_4, timeout_s=400, tmp=str(tmp))


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    return run_world(8, [run], timeout_s=400, tmp=str(tmp_path_factory.mktemp("pipeline8")))


@pytest.mark.world
def test_each_rank_holds_its_stage(world2, world4):
    for world in (world2, world4):
        assert all(world.value(stage_params, rank=r) for r in range(world.world_size))


@pytest.mark.world
@pytest.mark.parametrize(("ranks", "layout"), [(n, name) for n, layouts in LAYOUTS.items() for name in layouts])
def test_matches_single_process(request, reference, reference_deep, ranks, layout):
    """pp 2 on 2 ranks (every schedule); pp 2 x FSDP 2 and pp 2 x TP 2 on 4; pp 2 x dp_shard 2 x tp 2 (+SP, loss
    parallel) on 8. Layouts with 2 stages per rank run the 4-block model, against its own one-process run."""
    want = reference_deep if LAYOUTS[ranks][layout].model.n_layers == 4 else reference
    assert_matches(request.getfixturevalue(f"world{ranks}").value(run)[layout], want, layout)


@pytest.mark.world
def test_pp2_resume_is_bitwise(world2):
    assert world2.value(pp2_checkpoint)["split"] == world2.value(run)["pp2-1f1b-mb4"]["loss"]


@pytest.mark.world
def test_one_process_checkpoint_continues_on_pp2(world2, reference):
    got = world2.value(pp2_checkpoint)["from_one"]
    assert max(abs(a - b) for a, b in zip(got, reference["loss"][MID:], strict=True)) <= TOL, (got, reference["loss"])


@pytest.mark.world
def test_pp2_checkpoint_continues_on_one_process(world2, tmp, reference):
    world2.raise_for(pp2_checkpoint)
    got = continue_from(tiny(), tmp / "one", step_dir(tmp / "pp2" / "checkpoints", MID))
    assert max(abs(a - b) for a, b in zip(got, reference["loss"][MID:], strict=True)) <= TOL, (got, reference["loss"])
