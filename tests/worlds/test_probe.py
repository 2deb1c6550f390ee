"""The estimator's probe (fake tensors, fake world, this process) against real runs on 4 gloo ranks.

Each rank runs one real micro batch under the same recorder the probe uses: every collective of rank 0 (count and
bytes per axis, kind and phase) must equal the probe's, and torch's CommDebugMode, counting the warm-up step before
it, must agree. Activations: the resident memory the real forward adds (malloc returns every block of 64 KiB or more
to the OS at once, so RSS follows live tensors; plus the output layer's weights, which FSDP keeps gathered for its
backward) and the bytes of the storages the real forward left alive must each be within 10% of the probe's activation
bytes.
Pipelined layouts (pp 2 x FSDP 2 with 1F1B and interleaved 1F1B, pp 2 x TP 2 + SP with GPipe, pp 2 x CP 2 with
1F1B): the estimate's
collectives per step and sends between stages equal what rank 0 runs in a real step of torch's schedule, and
its parameter, gradient and AdamW bytes are what the worst rank holds; FSDP's unsharded parameters and
gradients, which the schedule keeps until the step's end, are within 10% of what a 1F1B stage still holds then.
"""

import math
import os
from collections import Counter

import msgspec
import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from shardlab.config import Config, MeshSpec, MoEConfig
from shardlab.estimate import DTYPE_BYTES, cached_probe, estimate, per_step, probed_rank
from shardlab.estimate._fake import cached_sharding_propagation
from shardlab.estimate.probe import Probe, probe
from shardlab.estimate.recorder import Recorder, axis_names, param_storages
from shardlab.estimate.roofline import DP_AXES
from shardlab.models import provider_for
from shardlab.models.llama.moe import balanced_routing
from shardlab.sharding.context import cp_positions
from shardlab.training.loop import build, plan_model
from shardlab.training.pipeline_schedule import PipelineRun
from shardlab.training.step import forward_backward, init_state, match_param_layouts

from ._harness import run_world
from .layouts import tiny

MMAP_THRESHOLD = 65536
LAYOUTS = {
    "fsdp_tp_sp": (MeshSpec(dp_shard=2, tp=2), dict(sequence_parallel=True, loss_parallel=True)),
    "hsdp": (MeshSpec(dp_replicate=2, dp_shard=2), dict()),
    "fsdp_tp_full_ac": (MeshSpec(dp_shard=2, tp=2), dict(activation_checkpoint="full")),
    "fsdp_tp_sp_op_ac": (MeshSpec(dp_shard=2, tp=2), dict(activation_checkpoint="op")),  # + SP, loss parallel
    "fsdp_cp": (MeshSpec(dp_shard=2, cp=2), dict()),
    "moe_fsdp_ep2": (MeshSpec(dp_shard=4, ep=2), dict()),  # balanced routing in both runs
}


def config(name: str) -> Config:
    mesh, plan = LAYOUTS[name]
    cfg = tiny(**plan)
    moe = MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=256) if name.startswith("moe") else None
    model = msgspec.structs.replace(
        cfg.model, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=4, vocab_size=8192, n_layers=4, moe=moe
    )
    return msgspec.structs.replace(
        cfg, mesh=mesh, model=model, train=msgspec.structs.replace(cfg.train, seq_len=256)
    ).validated()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def real(rank, world_size, name: str) -> dict:
    cfg = config(name)
    built, plan, mesh = build(cfg)
    model = built.model
    rows = cfg.train.global_batch // cfg.resolve(world_size).mesh.size("dp")
    tokens = torch.randint(
        0, cfg.model.vocab_size, (rows, cfg.train.seq_len), generator=torch.Generator().manual_seed(0)
    )
    positions = None
    if plan.context is not None:  # this cp rank's chunks of every sequence, as the step takes them
        positions = cp_positions(cfg.train.seq_len, cfg.mesh.cp, mesh["cp"].get_local_rank())
        tokens = tokens[:, positions]
    recorder = Recorder(axis_names(mesh, built.experts))
    seen: dict[str, int] = {}

    def after_forward() -> None:
        seen["after"] = rss()
        seen["live"] = recorder.live_bytes(param_storages(model))

    with balanced_routing(), cached_sharding_propagation():  # the probe's routing, and its DTensor decisions kept
        with CommDebugMode() as torchs:  # torch's own count of the collectives, of a step that runs the same
            forward_backward(model, tokens, tokens, 1.0, plan.loss_parallel, positions=positions)  # lazy init, grads
        seen["before"] = rss()
        with recorder:
            forward_backward(model, tokens, tokens, 1.0, plan.loss_parallel, after_forward, positions)
    return {
        "collectives": {k[:4]: (n, recorder.collective_bytes[k]) for k, n in recorder.collectives.items()},
        "comm_debug_mode_count": torchs.get_total_counts(),
        "rss_added": seen["after"] - seen["before"],
        "live": seen["live"],
    }


def kept_bytes(cfg: Config) -> int:
    """The unsharded weights of the FSDP unit kept gathered after the forward (the output layer,
    plan.fsdp.last_kept): the process holds them at the end of the forward, where the estimate counts them in
    fsdp_buffers, not in activations."""
    _, plan = plan_model(cfg)
    f = plan.fsdp
    if f is None or not f.last_kept:
        return 0
    unit, shards = " + ".join(f.units[-1]), plan.mesh.size("dp_shard_cp")
    return sum(
        math.prod(p.local_shape) * shards * DTYPE_BYTES[f.param_dtype] for p in plan.params if p.fsdp_unit == unit
    )


def fsdp_tp_sp(rank, world_size):
    return real(rank, world_size, "fsdp_tp_sp")


def hsdp(rank, world_size):
    return real(rank, world_size, "hsdp")


def fsdp_tp_full_ac(rank, world_size):
    return real(rank, world_size, "fsdp_tp_full_ac")


def fsdp_tp_sp_op_ac(rank, world_size):
    return real(rank, world_size, "fsdp_tp_sp_op_ac")


def fsdp_cp(rank, world_size):
    return real(rank, world_size, "fsdp_cp")


def moe_fsdp_ep2(rank, world_size):
    return real(rank, world_size, "moe_fsdp_ep2")


PIPELINES = {  # (mesh, plan options, blocks): 8 blocks where FSDP's buffers must outweigh the step's other ones
    "pp_fsdp_1f1b": (MeshSpec(pp=2, dp_shard=2), dict(), 8),
    "pp_fsdp_interleaved": (MeshSpec(pp=2, dp_shard=2), dict(pp_schedule="interleaved_1f1b", pp_stages_per_rank=2), 4),
    "pp_tp_sp_gpipe": (MeshSpec(pp=2, dp_shard=1, tp=2), dict(pp_schedule="gpipe", pp_microbatches=4), 4),
    "pp_cp_1f1b": (MeshSpec(pp=2, dp_shard=1, cp=2), dict(), 4),
}


def pipeline_config(name: str) -> Config:
    mesh, plan, blocks = PIPELINES[name]
    cfg = tiny(mesh, **plan)
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, n_layers=blocks))


def nbytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def real_pipeline(name: str) -> dict:
    """One step of torch's schedule on this rank: collectives (after a first step that infers shapes and
    initialises FSDP), the bytes its stages send, and what it holds."""
    cfg = pipeline_config(name)
    built, plan, mesh = build(cfg)
    model = built.model
    rows = cfg.train.global_batch // cfg.resolve(4).mesh.size("dp")
    tokens = torch.randint(
        0, cfg.model.vocab_size, (rows, cfg.train.seq_len), generator=torch.Generator().manual_seed(0)
    )
    positions = None
    if plan.context is not None:  # this cp rank's chunks of every sequence, as the step takes them
        positions = cp_positions(cfg.train.seq_len, cfg.mesh.cp, mesh["cp"].get_local_rank())
        tokens = tokens[:, positions]
    run = PipelineRun(plan, mesh, built.stages)
    run(model, tokens, tokens, 1.0, positions)
    sends = []
    real_batch_p2p = schedules._batch_p2p

    def batch_p2p(ops, desc=None):
        sends.extend(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return real_batch_p2p(ops, desc)

    recorder = Recorder(axis_names(mesh, built.experts))
    unsharded = [0]  # what the step made and still holds when a stage's gradients are reduced at its end
    real_reduce = PipelineStage.perform_reduce_grad

    def reduce(stage, *args):
        unsharded.append(recorder.live_bytes(set()))
        return real_reduce(stage, *args)

    schedules._batch_p2p, PipelineStage.perform_reduce_grad = batch_p2p, reduce
    model.zero_grad(set_to_none=True)  # as after an optimizer step: the first micro batch's gradients add to none
    try:
        with cached_sharding_propagation(), recorder:  # as the probe: each op schema's decision made once
            run(model, tokens, tokens, 1.0, positions)
    finally:
        schedules._batch_p2p, PipelineStage.perform_reduce_grad = real_batch_p2p, real_reduce
    match_param_layouts(model)  # as the step does before the optimizer
    state = init_state(model, cfg.optim)
    state.optim.step()
    moved = Counter((f, b, kind, role) for f, b, kind, role, _ in recorder.sequence)
    counts, volume = Counter(), Counter()
    for key, n in recorder.collectives.items():
        axis, kind, phase, size, _ = key
        # torch's schedule has FSDP reduce the gradients after the last backward has returned from autograd
        merged = (axis, kind, "backward" if kind == "reduce_scatter" and axis in DP_AXES else phase, size)
        counts[merged] += n
        volume[merged] += recorder.collective_bytes[key]
    return {
        "collectives": {k: (n, volume[k]) for k, n in counts.items() if k[0] != "pp"},
        "sends": (len(sends), sum(sends)),
        "unsharded": max(unsharded),
        "moved": {
            role: sum(b * n for (_, b, kind, r), n in moved.items() if kind == "memory" and r == role)
            for role in ("", "gather", "regather", "reduce")
        },
        "memory": {
            "params": nbytes(model.parameters()),
            "grads": nbytes(p.grad for p in model.parameters()),
            "optim": nbytes(t for s in state.optim.state.values() for t in s.values()),
        },
    }


def pp_fsdp_1f1b(rank, world_size):
    return real_pipeline("pp_fsdp_1f1b")


def pp_fsdp_interleaved(rank, world_size):
    return real_pipeline("pp_fsdp_interleaved")


def pp_tp_sp_gpipe(rank, world_size):
    return real_pipeline("pp_tp_sp_gpipe")


def pp_cp_1f1b(rank, world_size):
    return real_pipeline("pp_cp_1f1b")


PROBED = [fsdp_tp_sp, hsdp, fsdp_tp_full_ac, fsdp_tp_sp_op_ac, fsdp_cp, moe_fsdp_ep2]
CHECKS = [*PROBED, pp_fsdp_1f1b, pp_fsdp_interleaved, pp_tp_sp_gpipe, pp_cp_1f1b]


@pytest.fixture(scope="module")
def world4():
    return run_world(4, CHECKS, timeout_s=400, environ={"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})  # malloc
    # reads it once, at the rank's start


@pytest.mark.world
@pytest.mark.parametrize("check", PROBED, ids=lambda c: c.__name__)
def test_probe_predicts_collectives_and_activations(world4, check):
    got = world4.value(check, rank=0)
    p = probe(config(check.__name__).resolve(4))
    want = {(c.axis, c.kind, c.phase, c.group_size): (c.count, c.bytes) for c in p.collectives}
    assert got["collectives"] == want
    assert got["comm_debug_mode_count"] == sum(count for count, _ in want.values())
    # Under TP/SP the real ranks keep a few activation-sized buffers more than the fake run: torch's
    # AsyncCollectiveTensor holds a collective's output where the fake kernels (wait_tensor,
    # _wrap_tensor_autograd) allocate new tensors. A constant per micro batch; vocab 8192 keeps it under 10%.
    assert abs(got["live"] - p.activation_bytes) <= 0.10 * p.activation_bytes, (got["live"], p.activation_bytes)
    # The process's own memory never grows past the estimate. It can grow less: pages freed since the warm-up step
    # (the ep dispatch's buffers) are reused, so only `live` is held to the estimate from both sides.
    assert got["rss_added"] <= 1.10 * p.activation_bytes + kept_bytes(config(check.__name__).resolve(4)), got


@pytest.mark.world
@pytest.mark.parametrize("check", CHECKS[len(PROBED) :], ids=lambda c: c.__name__)
def test_estimate_of_a_pipeline_is_the_busiest_ranks_step(world4, check):
    """Rank 0 runs pp rank 0, the busiest (equal blocks: the lowest); memory is the worst rank's."""
    got = world4.value(check, rank=0)
    cfg = pipeline_config(check.__name__).resolve(4)
    _, plan = plan_model(cfg)
    probes: dict[bytes, Probe] = {}
    e = estimate(cfg, plan, probes=probes)
    want = {(c.axis, c.kind, c.phase, c.group_size): (c.count, c.bytes) for c in e.collectives if c.axis != "pp"}
    assert got["collectives"] == want
    sends = [c for c in e.collectives if c.axis == "pp"]
    assert got["sends"] == (sum(c.count for c in sends), sum(c.bytes for c in sends))
    held = [world4.value(check, rank=r)["memory"] for r in range(4)]
    worst = {key: max(h[key] for h in held) for key in held[0]}
    assert worst == {"params": e.memory.params, "grads": e.memory.grads, "optim": e.memory.optim}
    # Its memory-bound traffic per step as the estimate prices it: each micro batch's ops, FSDP's gathers and its
    # reduction as torch's schedule runs them, the adds accumulating the micro batches' gradients. FSDP's reduction
    # is compared apart: gloo, which has no reduce-scatter of its own, copies the reduced shard out once more.
    rank, blocks = probed_rank(plan)
    assert rank == 0
    p = cached_probe(probes, cfg, None, pp_rank=0, blocks=blocks, provider=provider_for(cfg))
    reduce = sum(b * n for _, b, n, kind in p.reduce_ops if kind == "memory")
    moved = sum(b * n for _, b, n, kind in per_step(p, e.micro_batches, plan, 0).ops if kind == "memory") - reduce
    real = sum(got["moved"][role] for role in ("", "gather", "regather"))
    assert abs(moved - real) <= 0.03 * real and reduce <= got["moved"]["reduce"], (moved, reduce, got["moved"])
    if check is pp_fsdp_1f1b:  # one stage per rank: when it reduces, the step holds FSDP's buffers and nothing else
        assert abs(got["unsharded"] - e.fsdp_buffers) <= 0.10 * e.fsdp_buffers, (got["unsharded"], e.fsdp_buffers)
