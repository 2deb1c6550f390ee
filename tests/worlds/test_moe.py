"""The MoE model on data- and expert-parallel layouts against one process: fp32, same seed and global batch,
layouts.STEPS steps; loss and gradient norm within tolerance. The balancing loss and the bias update use the router
statistics of the global batch, so they are the same in every layout: FSDP 2 (auxiliary loss; bias balancing;
sigmoid scores with a shared expert) on 2 ranks; on 4, HSDP 2 x 2, expert parallelism (ep 4 of FSDP 4; ep 2 of FSDP 4
for the first half of a run that ep 4 finishes from its checkpoint; ep 2 of HSDP 2 x 2, ep 4 across CP 2 x FSDP 2; 2
experts over FSDP 4 and ep 2 of FSDP 4, where FSDP shards the experts' dim 1) and TP inside the experts (ep 2 x tp 2
with SP and loss parallel, with op-level activation checkpointing; FSDP 2 x TP 2 with a shared expert) and pipelines
(pp 2 x FSDP 2 with bias balancing; the balancing loss on pp 2 x ep 2 with full activation checkpointing and on
DualPipeV with CP 2 in its stages, where FSDP shards the experts over cp, against one process accumulating the same
4 micro batches). Checkpoints move across a change of ep degree. A capacity limit applies to each rank's micro
batch (which tokens overflow depends on the layout), so it is tested on one process (tests/test_moe.py)."""

import math
from pathlib import Path

import msgspec
import pytest
import torch

from shardlab import P, shard, visualize
from shardlab.config import Config, MeshSpec, MoEConfig
from shardlab.data.loader import make_loader
from shardlab.models.llama.moe import moe_layers
from shardlab.parallel.device_mesh import mesh_spec_of
from shardlab.training.checkpoint import step_dir
from shardlab.training.loop import build_model, train
from shardlab.training.step import forward_backward, init_state, make_step

from .layouts import (
    MID,
    TOL,
    assert_matches,
    ckpt,
    continue_from,
    curves,
    placements_match_plan,
    tiny,
    with_micro_batch,
)

MOE = {
    "aux": MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64),
    "bias": MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64, balance="bias", bias_rate=0.01),
    "sigmoid_shared": MoEConfig(n_experts=4, top_k=1, expert_ffn_dim=64, score="sigmoid", shared_expert=True),
    "e2": MoEConfig(n_experts=2, top_k=1, expert_ffn_dim=64),  # fewer experts than FSDP shards: FSDP splits dim 1
}  # fmt: skip


def moe(name: str, mesh: MeshSpec = MeshSpec(dp_shard=1), sequence_parallel: bool = True, **options) -> Config:
    cfg = tiny()
    plan = msgspec.structs.replace(
        cfg.plan, sequence_parallel=sequence_parallel, loss_parallel=sequence_parallel, **options
    )
    return msgspec.structs.replace(cfg, mesh=mesh, plan=plan, model=msgspec.structs.replace(cfg.model, moe=MOE[name]))


def reference(name: str) -> Config:
    """One process: MOE[name]; "deep_": 4 layers; "_mb4": in 4 micro batches (the balancing loss is per global
    micro batch, so a pipeline of 4 micro batches matches one process accumulating 4)."""
    cfg = moe(name.removeprefix("deep_").removesuffix("_mb4"))
    if name.startswith("deep_"):
        cfg = deep(cfg)
    return with_micro_batch(cfg, cfg.train.global_batch // 4) if name.endswith("_mb4") else cfg


def deep(cfg: Config) -> Config:
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, n_layers=4))


LAYOUTS_2 = {f"fsdp2-{name}": moe(name, MeshSpec(dp_shard=2)) for name in MOE if name != "e2"}
LAYOUTS_4 = {
    "hsdp2x2-bias": moe("bias", MeshSpec(dp_replicate=2, dp_shard=2)),
    "hsdp2x2_ep2-bias": moe("bias", MeshSpec(dp_replicate=2, dp_shard=2, ep=2)),
    "cp2_fsdp2_ep4-aux": moe("aux", MeshSpec(dp_shard=2, cp=2, ep=4)),
    "fsdp4_ep4-bias": moe("bias", MeshSpec(dp_shard=4, ep=4)),
    "fsdp4-e2": moe("e2", MeshSpec(dp_shard=4)),  # 2 experts in the blocks' FSDP units of 4 shards
    "fsdp4_ep2-e2": moe("e2", MeshSpec(dp_shard=4, ep=2)),  # 1 expert per ep rank over 2 FSDP shards
    # + SP and loss parallel; op-level checkpointing: the experts' FSDP unit inside each block gathers its weights
    # again in the recomputation (shardlab.parallel._activation_checkpoint._Replay)
    "fsdp2_tp2_ep2_ac_op-aux": moe("aux", MeshSpec(dp_shard=2, tp=2, ep=2), activation_checkpoint="op"),
    "fsdp2_tp2-sigmoid_shared": moe("sigmoid_shared", MeshSpec(dp_shard=2, tp=2), sequence_parallel=False),
    "pp2_fsdp2-bias": moe("bias", MeshSpec(pp=2, dp_shard=2), pp_microbatches=4),
    "pp2x2_cp2_dualpipev-deep_aux_mb4": deep(  # zero bubble: FSDP keeps the weights for the weight gradients
        moe(
            "aux",
            MeshSpec(pp=2, dp_shard=1, cp=2),
            pp_microbatches=4,
            pp_schedule="dualpipev",
            pp_stages_per_rank=2,
            reshard_after_forward=False,
        )
    ),
    "pp2_ep2_ac_full-aux_mb4": moe(
        "aux", MeshSpec(pp=2, dp_shard=2, ep=2), pp_microbatches=4, activation_checkpoint="full"
    ),
}
LAYOUTS = {2: LAYOUTS_2, 4: LAYOUTS_4}


def run(rank, world_size, tmp=None):
    """Every layout's loss and gradient norm per step, and its routers' tokens per expert and busiest load."""
    out = {}
    for name, cfg in LAYOUTS[world_size].items():
        history = train(cfg, write=False)
        out[name] = {key: [m[metric] for m in history] for key, metric in ROUTED.items()}
    return out


ROUTED = {"loss": "loss", "grad_norm": "grad_norm", "tokens": "moe_tokens_per_expert", "max_load": "moe_max_load"}


PLACED = (
    "hsdp2x2_ep2-bias", "cp2_fsdp2_ep4-aux", "fsdp4-e2", "fsdp4_ep2-e2", "fsdp2_tp2_ep2_ac_op-aux",
    "fsdp2_tp2-sigmoid_shared", "pp2_ep2_ac_full-aux_mb4",
)  # fmt: skip
"""One layout of each kind of expert placement (ep over HSDP, over dp_shard x cp, FSDP on dim 1, ep x FSDP, ep x tp,
tp without ep, ep in pipeline stages): each costs a model build, and the others repeat these."""


def placements(rank, world_size, tmp=None):
    """Every layout's DTensors are placed as planned; with ep, the helpers still work on slices of the mesh, and
    visualize draws an expert weight on the expert mesh."""
    for name in PLACED:
        placements_match_plan(rank, world_size, LAYOUTS_4[name])
    model, _, mesh = build_model(LAYOUTS_4["fsdp2_tp2_ep2_ac_op-aux"])
    assert mesh_spec_of(mesh, ep=2).ep == 2 and mesh_spec_of(mesh["tp"]) == MeshSpec(dp_shard=1, tp=2)
    assert shard(torch.zeros(4, 2), mesh["tp"], P("tp", None)).to_local().shape == (2, 2)
    expert = moe_layers(model)[0].experts.gate_proj
    assert mesh_spec_of(expert.device_mesh).ep == 2
    rows = [r for r in visualize(expert).splitlines() if r.startswith("│")]
    assert rows == ["│ rank 0 │ rank 1 │", "│ rank 2 │ rank 3 │"]  # experts by ep (rows), hidden dim by tp


EP2 = moe("bias", MeshSpec(dp_shard=4, ep=2))
"""ep 2 of FSDP 4, 2 experts per ep rank over 2 FSDP shards (dim 0): its parity is the first half of ep_change."""


def ep_change(rank, world_size, tmp):
    """ep 2 (bias balancing) runs to step MID and saves it; ep 4 continues from it: the losses and gradient norms
    of every step, ep 2's then ep 4's."""
    first = curves(ckpt(EP2, Path(tmp) / "ep2", every=MID), until=MID)
    saved = step_dir(Path(tmp) / "ep2" / "checkpoints", MID)
    second = curves(ckpt(LAYOUTS_4["fsdp4_ep4-bias"], Path(tmp) / "ep4", every=None, resume=str(saved)))
    return {key: first[key] + second[key] for key in first}


def idle_experts(rank, world_size, tmp=None):
    """ep 2 of FSDP 4 with every token routed to expert 0 (a large bias on it, zero router weights): the ep rank
    holding experts 2 and 3 gets no rows, and expert 1 none either. Every rank still runs its experts' backward:
    their gradients are zeros, not none (FSDP reduce-scatters them over dp_shard_mod_ep, the norm all-reduces
    over ep), and the step finishes."""
    cfg = msgspec.structs.replace(
        EP2,
        model=msgspec.structs.replace(EP2.model, moe=msgspec.structs.replace(MOE["bias"], top_k=1)),
    )
    model, plan, mesh = build_model(cfg)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.to_local().zero_()
            layer.expert_bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    loader = make_loader(cfg.data, seq_len=64, global_batch=8, vocab_size=512, dp_rank=rank, dp_size=4)
    batch = next(iter(loader))
    forward_backward(model, batch.inputs, batch.labels, 1.0, plan.loss_parallel)
    for layer in moe_layers(model):  # this rank's FSDP shard: expert 0 on rank 0, 2 on 1, 1 on 2, 3 on 3
        grad = layer.experts.gate_proj.grad
        assert grad is not None, rank
        assert (grad.to_local().abs().sum() > 0) == (rank == 0), (rank, grad.to_local().abs().sum())
    model.zero_grad(set_to_none=True)
    _, metrics = make_step(cfg, plan, mesh)(init_state(model, cfg.optim), batch)
    assert metrics["moe_tokens_per_expert"][1:] == [0, 0, 0], metrics["moe_tokens_per_expert"]
    return metrics["grad_norm"]


def bias_resume(rank, world_size, tmp):
    """FSDP 2 with bias balancing stopped after step MID (saving it), then resumed: the losses of all steps.
    The expert biases are state (buffers) and come back from the checkpoint."""
    cfg = ckpt(LAYOUTS_2["fsdp2-bias"], Path(tmp) / "bias", every=MID)
    return curves(cfg, until=MID)["loss"] + curves(cfg)["loss"]


@pytest.fixture(scope="module")
def references():
    return {name: curves(reference(name)) for name in (*MOE, "aux_mb4", "deep_aux_mb4")}


@pytest.fixture(scope="module")
def tmp(shared_tmp) -> Path:
    return shared_tmp / "moe"  # what the shared worlds gave this module's checks


CHECKS_2 = [run, bias_resume]
CHECKS_4 = [run, placements, ep_change, idle_experts]


@pytest.fixture(scope="module")
def world2(shared_world2):
    return shared_world2


@pytest.fixture(scope="module")
def world4(shared_world4):
    return shared_world4


@pytest.mark.world
@pytest.mark.parametrize(("ranks", "layout"), [(n, name) for n, layouts in LAYOUTS.items() for name in layouts])
def test_moe_matches_single_process(request, references, ranks, layout):
    want = references[layout.split("-", 1)[1]]
    assert want["loss"][-1] < want["loss"][0] - 0.5, "the reference loss should fall"
    assert_matches(request.getfixturevalue(f"world{ranks}").value(run)[layout], want, layout)


@pytest.mark.world
def test_bias_balanced_resume_is_bitwise(world2):
    assert world2.value(bias_resume) == world2.value(run)["fsdp2-bias"]["loss"]


@pytest.mark.world
def test_expert_weights_are_placed_as_planned(world4):
    world4.raise_for(placements)


@pytest.mark.world
def test_checkpoint_moves_across_ep_degrees(world4, tmp, references):
    """ep 2 for MID steps, then ep 4 from its checkpoint, on 4 ranks: the reference curve, every step; ep 2's
    checkpoint -> one process continues it too."""
    want = references["bias"]
    assert_matches(world4.value(ep_change), want, "fsdp4_ep2-bias -> fsdp4_ep4-bias")
    one = continue_from(moe("bias"), tmp / "one", step_dir(tmp / "ep2" / "checkpoints", MID))
    assert max(abs(a - b) for a, b in zip(one, want["loss"][MID:], strict=True)) <= TOL, (one, want)


@pytest.mark.world
def test_experts_without_rows_still_step(world4):
    assert math.isfinite(world4.value(idle_experts))


@pytest.mark.world
def test_pipelined_routers_count_every_stage(world4):
    """pp 2 x ep 2: each stage counts its own layers and the metrics sum over stages, so tokens per expert and the
    busiest expert's load equal one process's every step (the balancing loss itself is compared with the layout's
    curve, in test_moe_matches_single_process)."""
    want = train(reference("aux_mb4"), write=False)
    got = world4.value(run)["pp2_ep2_ac_full-aux_mb4"]
    assert got["tokens"] == [m["moe_tokens_per_expert"] for m in want]
    assert max(abs(a - m["moe_max_load"]) for a, m in zip(got["max_load"], want)) < 1e-9
