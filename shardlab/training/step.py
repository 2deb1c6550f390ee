"""TrainState + make_step(cfg, plan, mesh) -> step(state, batch) -> (state, metrics): the functional train step.

Everything `step` reads is in its arguments; everything it changes is in, or owned by, the state it
returns. The learning rate is a pure function of `state.step`. The loss is averaged over every token
of the global batch, so a change of layout or of gradient accumulation never changes the maths (an MoE
model's balancing loss is taken per global micro batch: a change of train.micro_batch changes it).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardlab._base import Frozen
from shardlab._errors import ShardlabError
from shardlab._glob import matches
from shardlab.config import Config, OptimConfig
from shardlab.data.loader import Batch
from shardlab.models import provider_for
from shardlab.models.llama.moe import moe_layers, router_stats
from shardlab.models.provider import ModelProvider, logits_of
from shardlab.parallel.accumulation import all_reduced_if
from shardlab.parallel.device_mesh import flat_view
from shardlab.parallel.fp8 import refresh_scales
from shardlab.sharding.context import cp_positions
from shardlab.sharding.plan import Plan
from shardlab.training.loss import all_reduce_sum, counted, local_value, scaled, summed_loss
from shardlab.training.pipeline_schedule import PipelineRun
from shardlab.training.routers import Routers

Metrics = dict[str, float | list[int]]
FUSED_DEVICES = ("cpu", "cuda")
"""Devices with torch's fused AdamW kernel that shardlab runs on."""


class TrainState(Frozen):
    """Everything step() reads or changes (and what a checkpoint will hold)."""

    model: nn.Module
    optim: torch.optim.Optimizer
    step: int = 0
    skipped: int = 0
    """Steps whose update was dropped for a non-finite loss or gradient (train.on_nonfinite='skip')."""


class NonFiniteError(ShardlabError):
    """A step's loss or gradient norm is not finite and train.on_nonfinite is 'stop' (a ValueError: a value the
    run cannot go on with, reported in one line like a bad setting)."""


StepFn = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]


def init_state(model: nn.Module, optim: OptimConfig) -> TrainState:
    """AdamW over the (already parallelized) parameters; weight decay on every parameter but `optim.no_decay`'s
    (by default all, as torchtitan), learning rates scaled by `optim.lr_scales` (`param_group`).

    One param group per mesh and (decay, lr scale): fused and foreach kernels cannot mix plain tensors with
    DTensors (TP without sequence parallel leaves norms plain), nor DTensors of different meshes. A group's
    `lr_scale` is what the step multiplies the scheduled learning rate by. torch's fused kernel (one pass over
    each parameter, as torchtitan uses) where the parameters' device has one, else foreach.
    """
    groups: dict[tuple[object, ParamGroup], list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault((mesh, param_group(name, optim)), []).append(p)
    fused = all(p.device.type in FUSED_DEVICES for ps in groups.values() for p in ps)
    opt = torch.optim.AdamW(
        [
            {"params": ps, "weight_decay": optim.weight_decay if g.decay else 0.0, "lr_scale": g.lr_scale}
            for (_, g), ps in groups.items()
        ],
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        fused=fused,
        foreach=not fused,
    )
    return TrainState(model=model, optim=opt, step=0)


class ParamGroup(NamedTuple):
    decay: bool
    lr_scale: float


def group_names(names: list[str], optim: OptimConfig) -> dict[str, str] | None:
    """Each parameter's optimizer group as the plan table shows it (`wd 0.1 lr x1`); None when every parameter
    is in the default one."""
    if not optim.no_decay and not optim.lr_scales:
        return None
    out = {}
    for name in names:
        g = param_group(name, optim)
        out[name] = f"wd {optim.weight_decay if g.decay else 0.0:g} lr x{g.lr_scale:g}"
    return out


def param_group(name: str, optim: OptimConfig) -> ParamGroup:
    """A parameter's optimizer group: weight decay unless a `no_decay` glob matches it, and the factor of the first
    `lr_scales` glob it matches (1)."""
    decay = not any(matches(g, name) for g in optim.no_decay)
    return ParamGroup(decay, next((f for g, f in optim.lr_scales if matches(g, name)), 1.0))


def lr_schedule(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """step (0-based) -> lr: linear warmup over warmup_steps, then cosine or linear decay to lr * min_lr_ratio."""

    def lr_at(step: int) -> float:
        if step < optim.warmup_steps:
            return optim.lr * (step + 1) / (optim.warmup_steps + 1)
        progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.decay == "cosine" else 1 - progress
        return optim.lr * (optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape)

    return lr_at


def make_step(
    cfg: Config,
    plan: Plan,
    mesh: DeviceMesh | None = None,
    provider: ModelProvider | None = None,
    stages: tuple[nn.Module, ...] | None = None,
) -> StepFn:
    """The step for one layout; everything layout-specific is read off the plan and the mesh, everything
    model-specific (how tokens become logits, MoE routers) off the provider (default: the one the config names).
    stages: with pipeline stages, the modules this rank runs (`parallelize(model, plan, mesh).stages`; None: the
    model itself, which does for one stage per rank of a model whose forward is its parts in sequence).

    FSDP averages gradients over the ranks holding different tokens (`batch`: dp_replicate x dp_shard x cp),
    so each micro batch's summed loss is scaled by that count / (tokens in the global batch): the result is
    the global mean. The token count and the reported loss are reduced over `batch`, never over tp. Under
    context parallelism each cp rank keeps its chunks of every sequence (`shardlab.sharding.context.cp_positions`).
    """
    cfg = cfg.resolve(plan.mesh.world_size)
    plan.check_mesh(cfg.mesh)
    holders = plan.mesh.size("batch")  # ranks holding different tokens: FSDP averages over them
    layout = step_layout(cfg, plan, mesh, stages)
    micro_batches, positions, group, pipeline = layout
    stage_group = pipeline.group if pipeline is not None else None
    lr_at = lr_schedule(cfg.optim, cfg.train.steps)
    max_norm = cfg.optim.max_norm

    provider = provider or provider_for(cfg)
    moe, forward = provider.moe, provider.forward
    skip_nonfinite = cfg.train.on_nonfinite == "skip"
    once = micro_batches > 1 and plan.fsdp is not None and plan.fsdp.all_reduce_once  # HSDP: the replicas' reduction

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        model, opt = state.model, state.optim
        routers = None
        if moe is not None:
            routers = Routers(
                moe_layers(model),
                group,
                micro_batches,
                stage_group,
                n_experts=moe.n_experts,
                device=model_device(model),
            )
        lr = lr_at(state.step)
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        device = model_device(model)
        inputs, labels, at = local_tokens(batch, positions, device)
        if inputs.shape[0] % micro_batches:
            raise ShardlabError(
                f"step: {inputs.shape[0]} rows per rank do not split into {micro_batches} micro batches"
            )
        tokens = all_reduce_sum(counted(labels), group)
        scale = holders / tokens  # stays on the device: the step reads the host once, after the backward
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        with router_stats(routers.record) if routers is not None else contextlib.nullcontext():
            if pipeline is not None:  # the schedule splits the batch into the plan's micro batches
                try:
                    loss_sum += pipeline(model, inputs, labels, scale, positions=at)
                finally:  # a schedule that raised must not leave the routers' hooks on the model
                    if routers is not None:
                        routers.remove_hooks()
                if routers is not None:
                    routers.after_pipeline()
            else:
                pieces = zip(inputs.chunk(micro_batches), labels.chunk(micro_batches), chunks(at, micro_batches))
                for i, (x, y, p) in enumerate(pieces):
                    with all_reduced_if(model, i == micro_batches - 1) if once else contextlib.nullcontext():
                        loss = forward_backward(
                            model, x, y, scale, plan.loss_parallel, positions=p, extra_loss=routers and routers.loss,
                            forward=forward,
                        )  # fmt: skip
                    loss_sum += local_value(loss).to(torch.float64)
        match_param_layouts(model)
        grad_norm = clip_grad_norm(model, max_norm, stage_group)
        loss_total = all_reduce_sum(all_reduce_sum(loss_sum, stage_group), group)  # only the last stage has a loss
        # The step's one host read: the update is vetoed on a non-finite loss or norm (the same on every rank).
        read = torch.stack([loss_total / tokens, grad_norm.to(loss_total.device)])
        if routers is not None:
            read = torch.cat([read, routers.summary().to(read.device)])
        loss, grad_norm, *moe_metrics = read.tolist()
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite and skip_nonfinite is False:
            opt.zero_grad(set_to_none=True)
            raise NonFiniteError(
                f"step {state.step + 1}: loss {loss}, gradient norm {grad_norm}; stopped before the update (lower "
                "optim.lr, raise optim.warmup_steps, or set train.on_nonfinite='skip' to drop such steps)"
            )
        if finite:
            opt.step()
            refresh_scales(model, plan.fp8)  # the float8 weights FSDP gathers next are scaled by their new values
        opt.zero_grad(set_to_none=True)
        if routers is not None and finite:
            routers.update_bias()
        skipped = state.skipped + (not finite)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr}
        if skip_nonfinite:
            metrics["skipped_steps"] = skipped
        if routers is not None:
            metrics |= routers.metrics(moe_metrics)
        return msgspec.structs.replace(state, step=state.step + 1, skipped=skipped), metrics

    return step


class StepLayout(NamedTuple):
    """What a step (and an evaluation) reads off the plan and the mesh for one layout."""

    micro_batches: int
    cp_at: torch.Tensor | None
    """The sequence positions this context-parallel rank holds (`cp_positions`), or None without cp."""
    group: dist.ProcessGroup | None
    """The ranks holding different tokens (`batch`: dp_replicate x dp_shard x cp): losses and token counts are
    summed over them; None when this rank holds the whole batch."""
    pipeline: PipelineRun | None
    """This rank's pipeline stages under the plan's schedule, or None without pp."""


def step_layout(
    cfg: Config, plan: Plan, mesh: DeviceMesh | None, stages: tuple[nn.Module, ...] | None = None
) -> StepLayout:
    cp_at = None
    if plan.context is not None:
        cp_at = cp_positions(cfg.train.seq_len, plan.mesh.cp, mesh["cp"].get_local_rank())
    group = flat_view(mesh, "batch").get_group() if mesh is not None and plan.mesh.size("batch") > 1 else None
    pipeline = PipelineRun(plan, mesh, stages) if plan.pipeline is not None else None
    return StepLayout(cfg.micro_batches, cp_at, group, pipeline)


def local_tokens(
    batch: Batch, cp_at: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's inputs, labels and positions on `device`. cp_at: the sequence positions a context-parallel rank
    holds (`cp_positions`), or None. The positions are the packed rows' positions in their documents ([rows, s],
    cut to the cp rank's chunks), else the cp rank's sequence positions ([s]), else None (0..s-1)."""
    inputs, labels = batch.inputs.to(device, non_blocking=True), batch.labels.to(device, non_blocking=True)
    positions = None if batch.positions is None else batch.positions.to(device, non_blocking=True)
    if cp_at is not None:  # this cp rank's chunks of every sequence
        at = cp_at.to(device)
        inputs, labels = inputs[:, at], labels[:, at]
        positions = at if positions is None else positions[:, at]
    return inputs, labels, positions


def chunks(positions: torch.Tensor | None, n: int) -> list[torch.Tensor | None]:
    """The positions of each of n micro batches: per-row positions are split with the rows, others shared."""
    if positions is not None and positions.dim() == 2:
        return list(positions.chunk(n))
    return [positions] * n


def forward_backward(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor | float,
    vocab_parallel: bool,
    after_forward: Callable[[], None] | None = None,
    positions: torch.Tensor | None = None,
    extra_loss: Callable[[], torch.Tensor | None] | None = None,
    forward: Callable[[nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One micro batch: summed cross-entropy, backward of loss * scale (a 0-dim tensor); returns the (detached)
    summed loss.

    vocab_parallel: the logits are vocab-sharded DTensors (the plan's loss_parallel). after_forward runs between
    the loss and the backward (the estimator measures what the forward left alive there). positions: where the
    tokens sit in their sequences (a context-parallel rank's chunks; None: 0..s-1). extra_loss: a term added
    to what is backpropagated after the forward (an MoE model's load-balancing loss), or None. forward: how the
    model turns tokens into logits (`ModelProvider.forward`; default: `model(inputs)`, its output or `.logits`).
    The logits are dropped before the backward: the loss has their gradient already (`training.loss`).
    """
    with loss_parallel() if vocab_parallel else contextlib.nullcontext():
        if forward is not None:
            logits = forward(model, inputs, positions)
        else:
            logits = logits_of(model(inputs) if positions is None else model(inputs, positions=positions))
        loss = summed_loss(logits, labels, reuse_logits=True)
        del logits  # the loss's backward writes their gradient into them: nothing else holds them
        if after_forward is not None:
            after_forward()
        objective = scaled(loss, scale)
        extra = extra_loss() if extra_loss is not None else None
        # two roots: under loss parallel the objective is a DTensor, the routers' balancing loss a plain tensor
        torch.autograd.backward([objective] if extra is None else [objective, extra])
    return loss.detach()


def model_device(model: nn.Module) -> torch.device:
    """Where the model computes, so where batches go: where its (local shards of) parameters live, but for shards on
    the host of a GPU mesh (FSDP's CPU offload, plan.cpu_offload), the mesh's current device, where FSDP gathers
    them."""
    p = next(iter(model.parameters()))
    if not isinstance(p, DTensor):
        return p.device
    local, compute = p.to_local().device, p.device_mesh.device_type
    if local.type == "cpu" and compute != "cpu":
        return torch.device(compute, torch.get_device_module(compute).current_device())
    return local


def match_param_layouts(model: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements: a tensor used twice (a tied embedding
    under TP) can collect a Partial gradient, which the optimizer and the norm cannot use."""
    for p in model.parameters():
        if isinstance(p, DTensor) and p.grad is not None and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def clip_grad_norm(
    model: nn.Module, max_norm: float | None, stage_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Global L2 norm of all gradients (DTensors on any mix of meshes), clipped to max_norm in place.

    Gradients are grouped by (mesh, placements): a group's squared norm is summed locally, where the gradients are,
    then all-reduced over each mesh dim that shards it (Replicate dims hold copies) on the model's device (the GPU
    too where FSDP keeps the gradients on the host). With pipeline stages, the stages' squared norms are summed over
    `stage_group` (the pp group). Returns the norm before clipping as a float64 scalar on the model's device, the
    number one process computes; nothing is read back to the host (the factor is applied where the gradients are, 1
    where the norm is within max_norm, as torch's `clip_grad_norm_`).
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    device = model_device(model)
    total_sq = torch.zeros((), dtype=torch.float64, device=device)
    local: dict[object, list[torch.Tensor]] = {}
    for key, grads in groups.items():
        local[key] = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        sq = torch.stack([n.double() for n in torch._foreach_norm(local[key])]).pow(2).sum().to(device)
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                if placement.is_partial():
                    raise ShardlabError(
                        f"clip_grad_norm: a gradient is Partial over mesh dim {dim}; call match_param_layouts first"
                    )
                if not placement.is_replicate() and mesh.size(dim) > 1:
                    dist.all_reduce(sq, group=mesh.get_group(dim))
        total_sq += sq
    if stage_group is not None:
        dist.all_reduce(total_sq, group=stage_group)
    total = total_sq.sqrt()
    if max_norm is not None:
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in local.values():
            torch._foreach_mul_(grads, factor.to(grads[0].device, grads[0].dtype))
    return total
