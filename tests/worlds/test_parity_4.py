"""Parity on 4 CPU ranks (gloo) against one process (fp32, layouts.STEPS steps, loss and grad norm within 1e-5):
HSDP 2x2 and FSDP 2 x TP 2 (+SP, loss parallel; none / full / selective /
op), gradient accumulation, FSDP 4; bf16 mixed precision stays close; sharded init is refused on CPU. Held-out
evaluation gives the one-process numbers on FSDP 2 x TP 2 (+SP, loss parallel) and PP 2 x FSDP 2. HSDP accumulating
micro batches all-reduces over the replicas as often as with one micro batch."""

import msgspec
import pytest
import torch.distributed as dist

from shardlab.config import EvalConfig, MeshSpec
from shardlab.training.loop import build_model, train

from .layouts import STEPS, assert_matches, curves, placements_match_plan, tied, tiny, with_micro_batch

HSDP, FSDP_TP = MeshSpec(dp_replicate=2, dp_shard=2), MeshSpec(dp_shard=2, tp=2)
LAYOUTS = {
    "hsdp2x2-ac_none": tiny(HSDP),  # full checkpointing re-gathers as under FSDP: fsdp2xtp2 here, fsdp2 on 2 ranks
    **{f"fsdp2xtp2-ac_{ac}": tiny(FSDP_TP, activation_checkpoint=ac) for ac in ("none", "full", "selective", "op")},
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


EVAL = {"fsdp2xtp2": FSDP_TP, "pp2xfsdp2": MeshSpec(pp=2, dp_shard=2)}
"""Layouts whose held-out evaluation (every 2 steps, 2 batches of the training data's last documents) is checked."""


def evaluated(mesh: MeshSpec = MeshSpec(dp_shard=1)):
    cfg = tiny(mesh)
    return msgspec.structs.replace(cfg, eval=EvalConfig(every=2, steps=2))


def run_eval(rank, world_size):
    out = {}
    for name, mesh in EVAL.items():
        history = train(evaluated(mesh), write=False)
        out[name] = {key: [m[key] for m in history if key in m] for key in ("loss", "eval_loss")}
    return out


def all_reduces(rank, world_size):
    """The all-reduces each group of ranks ran over a run of HSDP 2 x 2, by the group's ranks: in one micro batch
    per step and in 2 (the plan's all_reduce_once)."""
    return {micro: _all_reduces(with_micro_batch(tiny(HSDP), 2 // micro), world_size) for micro in (1, 2)}


def _all_reduces(cfg, world_size: int) -> dict[str, int]:
    seen: dict[str, int] = {}
    original = dist.all_reduce

    def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
        seen[str(ranks)] = seen.get(str(ranks), 0) + 1
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counted
    try:
        train(cfg, write=False)
    finally:
        dist.all_reduce = original
    return seen


CHECKS = [placements, run, run_bf16, sharded_init_needs_cuda, run_eval, all_reduces]


@pytest.fixture(scope="module")
def world4(shared_world4):
    return shared_world4


@pytest.mark.world
def test_placements_match_plan(world4):
    world4.raise_for(placements)


@pytest.mark.world
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_single_process(world4, reference, layout):
    assert_matches(world4.value(run)[layout], reference, layout)


@pytest.mark.world
def test_hsdp_micro_batches_all_reduce_over_the_replicas_once_per_step(world4):
    """HSDP 2 x 2 with 2 micro batches all-reduces over its replicas (ranks 0 and 2 on rank 0) what one micro batch
    does, once per FSDP unit and step, where each micro batch reduced its own before; every other group the same."""
    counts = world4.value(all_reduces)
    assert counts[1]["[0, 2]"] > 0 and counts[1] == counts[2], counts


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


@pytest.mark.world
@pytest.mark.parametrize("layout", list(EVAL))
def test_evaluation_matches_single_process(world4, layout):
    history = train(evaluated(), write=False)
    want = {key: [m[key] for m in history if key in m] for key in ("loss", "eval_loss")}
    got = world4.value(run_eval)[layout]
    assert len(got["eval_loss"]) == len(want["eval_loss"]) == STEPS // 2
    for key in want:
        diff = max(abs(a - b) for a, b in zip(got[key], want[key], strict=True))
        assert diff <= 1e-5, f"{layout} {key}: {got[key]} vs {want[key]}"
