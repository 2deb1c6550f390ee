"""TrainState + make_step(...) -> step(state, batch) -> (state, metrics): the functional train step.

Everything `step` reads is in its arguments; everything it changes is in, or owned by, the state it
returns. The learning rate is a pure function of `state.step`. The loss is averaged over every token
of the global batch, so a change of layout or of gradient accumulation never changes the maths.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import msgspec
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardlab._base import Frozen
from shardlab.config import OptimConfig
from shardlab.data import Batch

Metrics = dict[str, float]


class TrainState(Frozen):
    """Everything step() reads or changes (and what a checkpoint will hold)."""

    model: nn.Module
    optim: torch.optim.Optimizer
    step: int = 0


StepFn = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]


def init_state(model: nn.Module, optim: OptimConfig) -> TrainState:
    """AdamW over the (already parallelized) parameters; weight decay on every parameter, as torchtitan.

    One param group per mesh: foreach kernels cannot mix plain tensors with DTensors (TP without
    sequence parallel leaves norms plain), nor DTensors of different meshes.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in model.parameters():
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    opt = torch.optim.AdamW(
        [{"params": ps} for ps in groups.values()],
        lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay, foreach=True,
    )  # fmt: skip
    return TrainState(model=model, optim=opt, step=0)


def lr_schedule(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """step (0-based) -> lr: linear warmup over warmup_steps, then cosine or linear decay to lr * min_lr_ratio."""

    def lr_at(step: int) -> float:
        if step < optim.warmup_steps:
            return optim.lr * (step + 1) / (optim.warmup_steps + 1)
        progress = (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
        progress = min(progress, 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.decay == "cosine" else 1 - progress
        return optim.lr * (optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape)

    return lr_at


def make_step(
    optim: OptimConfig,
    total_steps: int,
    *,
    grad_accum: int = 1,
    dp_size: int = 1,
    loss_group: dist.ProcessGroup | None = None,
    use_loss_parallel: bool = False,
) -> StepFn:
    """Build the step for one layout.

    dp_size: the data-parallel size FSDP averages gradients over (the loss is scaled by it so the
    result is a sum over the global batch divided by its token count). loss_group: the ranks that
    hold different tokens (dp x cp), for the token count and the reported loss.
    """
    lr_at = lr_schedule(optim, total_steps)
    parallel_loss = loss_parallel if use_loss_parallel else contextlib.nullcontext

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        model, opt = state.model, state.optim
        lr = lr_at(state.step)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, labels = batch
        if inputs.shape[0] % grad_accum:
            raise ValueError(
                f"step: the batch has {inputs.shape[0]} rows per rank, not divisible by grad_accum={grad_accum}"
            )
        device = next(model.parameters()).device
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        tokens = _all_reduce((labels != -100).sum().to(torch.float64), loss_group)
        scale = dp_size / tokens.item()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for x, y in zip(inputs.chunk(grad_accum), labels.chunk(grad_accum)):
            with parallel_loss():
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum", ignore_index=-100)
                (loss * scale).backward()
            loss_sum += _local(loss.detach()).to(torch.float64)
        grad_norm = clip_grad_norm(model, optim.max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_total = _all_reduce(loss_sum, loss_group)
        metrics = {"loss": (loss_total / tokens).item(), "grad_norm": grad_norm, "lr": lr}
        return msgspec.structs.replace(state, step=state.step + 1), metrics

    return step


def _local(t: torch.Tensor) -> torch.Tensor:
    """The value of a (replicated) DTensor loss as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Global L2 norm of all gradients (DTensors on any mix of meshes), clipped to max_norm in place.

    Gradients are grouped by (mesh, placements): a group's squared norm is summed locally, then
    all-reduced over each mesh dim that shards it (Replicate dims hold copies). Returns the norm
    before clipping, the same number one process computes.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            if isinstance(p, DTensor) and p.grad.placements != p.placements:
                # a tensor used twice (tied embedding under TP) can collect a Partial grad: give it the param's layout
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            g = p.grad
            key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(g)
    total_sq = 0.0
    for key, grads in groups.items():
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        sq = torch.stack([n.double() for n in torch._foreach_norm(local)]).pow(2).sum()
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                if placement.is_partial():
                    raise ValueError(
                        f"clip_grad_norm: a gradient is Partial over mesh dim {dim}; reduce it before clipping"
                    )
                if not placement.is_replicate():
                    dist.all_reduce(sq, group=mesh.get_group(dim))
        total_sq += sq.item()
    total = math.sqrt(total_sq)
    if max_norm is not None:
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for grads in groups.values():
                torch._foreach_mul_(grads, coef)
    return total
