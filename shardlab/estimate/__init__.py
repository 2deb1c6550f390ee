"""estimate(cfg) -> Estimate: per-rank memory, communication, FLOPs and step time of a layout, without devices.

Parameters, gradients and AdamW state are read off the Plan (every sharded axis gives its first coordinates the
largest torch.chunk piece, so rank 0 holds the largest shard of every parameter). The rest is measured by `probe`:
one micro batch of the real layout on fake tensors in a fake world of the config's size. Step time, tokens/s and MFU
come from `roofline` for a named device.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import msgspec
import torch.distributed as dist

from shardlab._base import Frozen
from shardlab._errors import ShardlabError
from shardlab.config import Config
from shardlab.estimate._fake import fake_world
from shardlab.estimate.device import Device
from shardlab.estimate.measurement import Probe
from shardlab.estimate.peak import first_grad_bytes, forward_without_grads
from shardlab.estimate.probe import probe, stage_boundary
from shardlab.estimate.recorder import Collective, OpKind
from shardlab.estimate.roofline import (
    DP_AXES,
    DTYPE_BYTES,
    StepTime,
    compute_seconds,
    shared_compute,
    step_time,
)
from shardlab.models import provider_for
from shardlab.models.provider import ModelProvider
from shardlab.sharding.pipeline import in_flight, stage_sends, stage_shape
from shardlab.sharding.plan import ParamPlan, Plan
from shardlab.sharding.rules import Rules
from shardlab.training.pipeline_schedule import stage_actions

ADAM_STATES = 2
"""AdamW keeps exp_avg and exp_avg_sq per parameter, in the parameter's dtype, plus a 0-dim fp32 step."""


class MemoryEstimate(Frozen):
    """Bytes on the worst rank (the one holding the first chunk of every sharded axis)."""

    params: int
    """Sharded parameters (FSDP's padded shard size)."""
    grads: int
    """Sharded gradients: the parameters' dtype and layout (reduce_dtype only changes the reduction)."""
    optim: int
    """AdamW state: two moments per parameter plus one fp32 step counter per tensor."""
    on_host: bool = False
    """The three are in host memory, not the device's (FSDP's CPU offload, plan.cpu_offload)."""

    @property
    def total(self) -> int:
        """What the device holds of the three: all of them, or none where they are on the host."""
        return 0 if self.on_host else self.params + self.grads + self.optim

    @property
    def host(self) -> int:
        """What the host holds of the three for this rank: all of them where they are offloaded, else none."""
        return self.params + self.grads + self.optim if self.on_host else 0


def estimate_memory(plan: Plan) -> MemoryEstimate:
    params = plan.bytes_per_rank
    optim = ADAM_STATES * params + 4 * len(plan.worst_rank_params)
    on_host = plan.fsdp is not None and plan.fsdp.cpu_offload
    return MemoryEstimate(params=params, grads=params, optim=optim, on_host=on_host)


def fsdp_buffer_bytes(plan: Plan) -> int:
    """FSDP's transient buffers at their largest: two units' unsharded parameters (the one computing and the
    one prefetched) in param_dtype, plus one unit's unsharded gradients in reduce_dtype before reduce-scatter.
    With reshard_after_forward=False every unit keeps its unsharded parameters from its forward to its backward,
    so at the end of the forward all of them are held.

    Under a pipeline torch's schedule keeps every unit of the busiest rank's stages unsharded from its first
    backward to the end of the step (set_reshard_after_backward(False)), and accumulates their unsharded
    gradients in reduce_dtype until the last backward reduces them (set_requires_gradient_sync(False)).
    """
    f = plan.fsdp
    if f is None:
        return 0
    if plan.pipeline is not None:
        held = _rank_params(plan, busiest_pp_rank(plan))
        return sum(_unsharded(plan, p) for p in held) * (DTYPE_BYTES[f.param_dtype] + DTYPE_BYTES[f.reduce_dtype])
    numel: Counter[str | None] = Counter()
    for p in plan.params:
        numel[p.fsdp_unit] += _unsharded(plan, p)
    largest = sorted(numel.values(), reverse=True)
    held = largest[:2] if f.reshard_after_forward else largest  # ZeRO-2: each unit stays gathered until its backward
    gathered = sum(held) * DTYPE_BYTES[f.param_dtype]
    return gathered + largest[0] * DTYPE_BYTES[f.reduce_dtype]


def _unsharded(plan: Plan, p: ParamPlan) -> int:
    """Elements of `p` FSDP gathers: its local shard times dp_shard x cp (expert weights: dp_shard_mod_ep)."""
    return math.prod(p.local_shape) * (plan.mesh.experts.dp_shard_mod_ep if p.expert else plan.mesh.size("dp_shard_cp"))


def _rank_params(plan: Plan, rank: int) -> list[ParamPlan]:
    """The parameters of pp rank `rank`'s stages."""
    held = {s.index for s in plan.pipeline.stages_of(rank)}
    return [p for p in plan.params if p.stage in held]


class Estimate(Frozen):
    """What one rank (the worst) holds, sends and computes per optimizer step."""

    mesh: str
    n_params: int
    memory: MemoryEstimate
    activations: int
    """Bytes the forwards leave alive at the peak (the config's checkpointing): a micro batch's, and under a pipeline
    what each block keeps of each other micro batch in flight."""
    activations_other: int
    """The same with the other choice: `full` when the config checkpoints nothing, else `none`."""
    other_checkpointing: str
    fsdp_buffers: int
    collectives: tuple[Collective, ...]
    """Per optimizer step (every micro batch)."""
    micro_batches: int
    flops_per_token: float
    """Model FLOPs per token as MFU counts them (6N + 12 L d S)."""
    executed_flops: int
    """FLOPs this rank runs per step, recomputation included."""
    time: StepTime | None
    block: Probe | None = None
    """One more block of a micro batch on the probed rank (`Measurement.middle_block`; the search's estimates)."""
    first_grads: int | None = None
    """Where the forward runs without gradients (`forward_without_grads`): the bytes of those the backward makes
    before it frees any block's activations (the parameters' outside the blocks); None: every gradient is held
    beside the activations."""
    block_activations: int = 0
    """What one block keeps for its backward: at most what it holds beside every gradient at the backward's end."""

    @property
    def peak(self) -> int:
        """Bytes at the worst rank's peak. Where the forward runs without gradients, the peak is at the backward's
        start (every activation, the first gradients) or at its end (every gradient, the last block's activations),
        whichever is larger: between them each block's backward frees its activations and makes its gradients."""
        m = self.memory
        if self.first_grads is None or m.on_host:
            return m.total + self.activations + self.fsdp_buffers
        held = max(self.activations + self.first_grads, m.grads + self.block_activations)
        return m.params + m.optim + self.fsdp_buffers + held


def estimate(
    cfg: Config,
    plan: Plan,
    rules: Rules | None = None,
    dev: Device | None = None,
    provider: ModelProvider | None = None,
    probes: dict[bytes, Probe] | None = None,
    compare_checkpointing: bool = True,
) -> Estimate:
    """The estimate for `cfg` (resolved) laid out by `plan`, with step time on `dev` when given; provider: the
    model (default: the one the config names); probes: a cache that estimates of the same model and rules share
    (`cached_probe`), so layouts that differ only in what the probe does not see (the pipeline schedule within its
    shape, the number of micro batches at the same rows) probe once; compare_checkpointing=False skips the forward
    with the other checkpointing choice (activations_other is then the layout's own activations).

    Without a pipeline, every collective and op the probe's micro batch ran runs in each of the m micro batches,
    but HSDP's all-reduce of the gradients over the replicas, which the step runs once (`FsdpPlan.all_reduce_once`).
    A pipelined layout is probed as its busiest pp rank (the most blocks): one pipeline micro batch through each
    of that rank's stages. Per step: m micro batches; FSDP's collectives, and its ops copying weights in and out of
    their buffers, as often as torch's schedule order makes them happen (`_runs`, `per_step`); the activations of
    the micro batches the schedule keeps in flight (`pipeline.in_flight`); the sends between stages; the analytic
    bubble. Every stage waits for the slowest, so the compute is the busiest rank's or that of the rank holding the
    last stage (`head_rank`: the output layer and the loss), whichever takes longer.
    """
    check_fp8(cfg, dev)
    ac = cfg.plan.activation_checkpoint
    other = ac if not compare_checkpointing else "full" if ac == "none" else "none"
    other_cfg = msgspec.structs.replace(cfg, plan=msgspec.structs.replace(cfg.plan, activation_checkpoint=other))
    rank, blocks = probed_rank(plan)
    provider = provider or provider_for(cfg)
    p = cached_probe(probes, cfg, rules, pp_rank=rank, blocks=blocks, provider=provider)
    forward = (
        cached_probe(probes, other_cfg, rules, forward_only=True, pp_rank=rank, blocks=blocks, provider=provider)
        if compare_checkpointing
        else p
    )
    last = None
    if plan.pipeline is not None and rank != head_rank(plan):  # the last stage also runs the norm, output and loss
        held = sum(len(s.blocks) for s in plan.pipeline.stages_of(head_rank(plan)))
        last = cached_probe(probes, cfg, rules, pp_rank=head_rank(plan), blocks=held, provider=provider)
    return estimate_from(cfg, plan, p, forward, other, dev, provider, last=last)


def check_fp8(cfg: Config, dev: Device | None) -> None:
    """Refuse plan.fp8 on a device without float8 matmuls, as training refuses a GPU below compute capability 8.9."""
    if cfg.plan.fp8 != "none" and dev is not None and dev.fp8_tflops is None:
        raise ShardlabError(
            f"plan.fp8={cfg.plan.fp8!r}: the {dev.name} has no float8 matmuls; set plan.fp8='none' or pick a --device "
            "that has them (h100, h200, b200, cpu)"
        )


def head_rank(plan: Plan) -> int:
    """The pp rank holding the pipeline's last stage, which also runs the final norm, the output layer and the loss:
    the last rank, or the first under a V-shaped schedule."""
    return plan.pipeline.stages[-1].pp_rank


def probed_rank(plan: Plan) -> tuple[int, int | None]:
    """The pp rank a layout is probed as (its busiest) and the blocks its stages hold (None without a pipeline)."""
    if plan.pipeline is None:
        return 0, None
    rank = busiest_pp_rank(plan)
    return rank, sum(len(s.blocks) for s in plan.pipeline.stages_of(rank))


def estimate_from(
    cfg: Config,
    plan: Plan,
    p: Probe,
    forward: Probe,
    other: str,
    dev: Device | None,
    provider: ModelProvider,
    actions: dict[tuple, dict[int, str]] | None = None,
    *,
    last: Probe | None = None,
) -> Estimate:
    """The estimate of `cfg` laid out by `plan` from its probe `p` (and `forward`, the forward with the `other`
    checkpointing choice): everything the probe does not see (micro batches, the schedule's order, sends, bubble,
    memory) comes from the config and the plan. actions: a cache of the pipeline schedule's per-stage order. last:
    the probe of the rank holding the last stage (`head_rank`) where `p` is another rank's; the compute is the
    slower one's."""
    pipe = plan.pipeline
    rank, blocks = probed_rank(plan)
    if pipe is None:
        micro, held, bubble = cfg.micro_batches, 1.0, 0.0
    else:
        micro, bubble = pipe.microbatches, pipe.bubble
        held = in_flight(pipe.schedule, cfg.mesh.pp, pipe.stages_per_rank, micro)
    extra_blocks = (held - 1) * (blocks or 0)  # activations of the other micro batches in flight: blocks only
    if pipe is None:
        collectives = [_times(c, 1 if _once_per_step(c, plan) else micro) for c in p.collectives]
    else:
        key = (pipe.schedule, cfg.mesh.pp, pipe.stages_per_rank, micro, len(pipe.stages), rank)
        if actions is None or key not in actions:
            found = _stage_actions(cfg, plan, rank)
            if actions is None:
                actions = {}
            actions[key] = found
        collectives = _merge_stages(_times(c, _runs(c, actions[key][c.stage], plan)) for c in p.collectives)
        collectives += _pipeline_sends(cfg, plan, micro, provider.dim)
    memory = estimate_memory(plan)
    fpt = provider.flops_per_token(cfg.train.seq_len)
    time = None
    if dev is not None:
        ranks = [per_step(p, micro, plan, rank)]
        if last is not None:  # the rank holding the last stage: whichever computes longer sets the pace
            ranks.append(per_step(last, micro, plan, head_rank(plan)))
        seconds = [(compute_seconds(x, dev), compute_seconds(msgspec.structs.replace(x, ops=x.recompute_ops), dev))
                   for x in ranks]  # fmt: skip
        compute, recompute = max(seconds)  # the slower rank's, its recomputation the step's
        if dev.busy_speed and len(seconds) == 2:  # ranks time-share cores: the pp ranks' mean sets the pace
            pp, group = cfg.mesh.pp, cfg.mesh.world_size // cfg.mesh.pp
            compute = shared_compute(seconds[0][0], seconds[1][0], pp, group, dev.busy_speed)
            recompute = (
                compute * ((pp - 1) * seconds[0][1] + seconds[1][1]) / ((pp - 1) * seconds[0][0] + seconds[1][0])
            )
        time = step_time(
            compute, collectives, plan.mesh, dev,
            recompute=recompute,
            params_per_rank=sum(math.prod(q.local_shape) for q in plan.worst_rank_params),
            global_tokens=cfg.train.global_batch * cfg.train.seq_len, model_flops_per_token=fpt, bubble=bubble,
        )  # fmt: skip
    return Estimate(
        mesh=plan.mesh.describe(),
        n_params=sum(math.prod(q.shape) for q in plan.params),
        memory=memory,
        activations=p.activation_bytes + round(extra_blocks * p.block_activation_bytes),
        activations_other=forward.activation_bytes + round(extra_blocks * forward.block_activation_bytes),
        other_checkpointing=other,
        fsdp_buffers=fsdp_buffer_bytes(plan),
        collectives=tuple(collectives),
        micro_batches=micro,
        flops_per_token=fpt,
        executed_flops=micro * p.flops,
        time=time,
        first_grads=first_grad_bytes(plan)
        if forward_without_grads(plan.activation_checkpoint, micro, cfg.mesh.pp)
        else None,
        block_activations=p.block_activation_bytes,
    )


def per_step(p: Probe, micro: int, plan: Plan, rank: int) -> Probe:
    """`p` (one micro batch of pp rank `rank`) over a step of `micro` micro batches: each op (and each of the
    recomputation's, `recompute_ops`) once per micro batch, except FSDP's under a pipeline, where torch's schedule
    gathers the weights in the forward once per step (the backward's gathers after a resharding forward stay once per
    micro batch: m + 1 in all) and reduces gradients once, at the last backward; and the adds that accumulate the
    gradients of the micro batches (`_accumulation`), which a probe of one micro batch does not run."""
    counts: Counter[tuple[int, int, OpKind]] = Counter()
    for f, b, n, kind in p.ops:
        counts[f, b, kind] += n * micro
    if plan.pipeline is not None:
        for f, b, n, kind in (*p.gather_ops, *p.reduce_ops):
            counts[f, b, kind] -= n * (micro - 1)
    for f, b, n, kind in _accumulation(plan, rank, micro):
        counts[f, b, kind] += n
    ops = tuple(sorted((f, b, n, kind) for (f, b, kind), n in counts.items() if n))
    recompute = tuple((f, b, n * micro, kind) for f, b, n, kind in p.recompute_ops)
    return msgspec.structs.replace(p, ops=ops, gather_ops=(), reduce_ops=(), recompute_ops=recompute)


def _accumulation(plan: Plan, rank: int, micro: int) -> tuple[tuple[int, int, int, OpKind], ...]:
    """The ops that accumulate `micro` micro batches' gradients on pp rank `rank`, each an add of two gradients into
    one. Under a pipeline FSDP keeps a stage's gradients unsharded until the last backward reduces them: in
    reduce_dtype where that is not param_dtype (the first micro batch's cast to it, then each later one's added, cast
    on the way), else in the gradient itself (autograd adds each later micro batch's). Elsewhere each micro batch's
    gradients (FSDP's reduced shards, or the parameters' own) are added to the last ones: once per later micro batch."""
    if micro == 1:
        return ()
    f, pipe = plan.fsdp, plan.pipeline
    if pipe is not None and f is not None:
        numel = sum(_unsharded(plan, q) for q in _rank_params(plan, rank))
        param, reduce = DTYPE_BYTES[f.param_dtype], DTYPE_BYTES[f.reduce_dtype]
        if param != reduce:
            return ((0, numel * (param + reduce), 1, "memory"), (0, numel * (2 * reduce + param), micro - 1, "memory"))
        return ((0, 3 * numel * param, micro - 1, "memory"),)
    grads = plan.bytes_per_rank if pipe is None else sum(q.bytes_per_rank for q in _rank_params(plan, rank))
    return ((0, 3 * grads, micro - 1, "memory"),)


def cached_probe(
    cache: dict[bytes, Probe] | None,
    cfg: Config,
    rules: Rules | None,
    *,
    forward_only: bool = False,
    pp_rank: int,
    blocks: int | None,
    provider: ModelProvider,
) -> Probe:
    """`probe`, remembered in `cache` (None: not remembered) under what it depends on: the config with its pipeline
    schedule replaced by the first of its shape (the probe runs the stages, not the schedule; the shape places the
    stages), the pp rank and its blocks. A whole probe answers a forward-only one (same forward, same activations)."""
    if cache is None:
        return probe(cfg, rules, forward_only=forward_only, pp_rank=pp_rank, blocks=blocks, provider=provider)
    canonical = msgspec.structs.replace(cfg.plan, pp_schedule=stage_shape(cfg.plan.pp_schedule)[0])
    key = msgspec.json.encode((msgspec.structs.replace(cfg, plan=canonical), pp_rank, blocks))
    if key in cache:
        return cache[key]
    if forward_only and b"forward" + key in cache:
        return cache[b"forward" + key]
    p = probe(cfg, rules, forward_only=forward_only, pp_rank=pp_rank, blocks=blocks, provider=provider)
    cache[b"forward" + key if forward_only else key] = p
    return p


def _stage_actions(cfg: Config, plan: Plan, pp_rank: int) -> dict[int, str]:
    """`schedule.stage_actions` for pp rank `pp_rank`, asked in a fake world of the config's size."""
    world, pp = cfg.mesh.world_size, cfg.mesh.pp
    with fake_world(world, pp_rank * (world // pp)):
        group = dist.new_group([r * (world // pp) for r in range(pp)])
        return stage_actions(plan.pipeline, pp_rank, group)


def _runs(c: Collective, actions: str, plan: Plan) -> int:
    """How often one step of the pipeline runs what a stage's probed micro batch ran once: FSDP reduces gradients
    once (the schedule syncs on the last backward) and all-gathers in the forwards and backwards that find the
    weights sharded (they are resharded after each forward unless reshard_after_forward=False, and stay
    gathered after a backward); everything else runs once per micro batch."""
    if c.axis not in DP_AXES:
        return plan.pipeline.microbatches
    if c.kind != "all_gather":
        return 1
    sharded, forwards, backwards = True, 0, 0
    for action in actions:
        if action == "F":
            forwards += sharded
            sharded = plan.fsdp.reshard_after_forward
        elif action in "BI":
            backwards += sharded
            sharded = False
    return forwards if c.phase == "forward" else backwards


def _merge_stages(collectives: Iterable[Collective]) -> list[Collective]:
    """Per-stage counts summed into one row per (axis, kind, phase, group size)."""
    merged: dict[tuple, Collective] = {}
    for c in collectives:
        key = (c.axis, c.kind, c.phase, c.group_size)
        if key in merged:
            m = merged[key]
            c = msgspec.structs.replace(m, count=m.count + c.count, bytes=m.bytes + c.bytes)
        merged[key] = msgspec.structs.replace(c, stage=None)
    return [c for c in merged.values() if c.count]


def busiest_pp_rank(plan: Plan) -> int:
    """The pp rank whose stages hold the most blocks (the lowest such rank)."""
    pipe = plan.pipeline
    return max(range(plan.mesh.pp), key=lambda r: (sum(len(s.blocks) for s in pipe.stages_of(r)), -r))


def _pipeline_sends(cfg: Config, plan: Plan, micro: int, dim: int) -> list[Collective]:
    """The busiest pp rank's sends per step: each micro batch's output to the next stage (forward) and its input
    gradient to the previous one (backward), where that stage is on another rank (`probe.stage_boundary`)."""
    pipe = plan.pipeline
    shape, dtype = stage_boundary(cfg, plan, cfg.train.global_batch // cfg.mesh.size("dp") // micro, dim)
    nbytes = math.prod(shape) * dtype.itemsize
    forward, backward = stage_sends(cfg.mesh.pp, pipe.stages_per_rank, pipe.schedule)[busiest_pp_rank(plan)]
    return [
        Collective(axis="pp", kind="send", phase=phase, count=n * micro, bytes=n * micro * nbytes, group_size=2)
        for phase, n in (("forward", forward), ("backward", backward))
        if n
    ]


def _once_per_step(c: Collective, plan: Plan) -> bool:
    """Whether `c`, run by each micro batch the probe saw, runs once per step without a pipeline: HSDP's all-reduce
    of the gradients over the replicas, where the step sums the micro batches' shards first (`all_reduce_once`)."""
    once = plan.fsdp is not None and plan.fsdp.all_reduce_once
    return once and c.axis == "dp_replicate" and c.kind == "all_reduce"


def _times(c: Collective, runs: int) -> Collective:
    return msgspec.structs.replace(c, count=c.count * runs, bytes=c.bytes * runs)
