"""Expert parallelism at run time: tokens travel to the ep rank holding their expert, and back.

Tokens are routed where they live; `expert_dispatch` sends each expert's rows to the rank holding it and the results
back with torch's autograd-aware uneven all-to-all, so the backward runs the same exchange in reverse. Routing
statistics (the balancing loss, the bias update) are unchanged: they count tokens at home. Which modules hold which
experts is the plan's (shardlab.sharding.experts).

transformers' stacked experts (`stacked_experts`) run their own forward instead: split by experts over ep x tp,
each rank gathers its ep group's tokens, runs the ones routed to its experts, and the partial outputs are summed
back to the tokens' ranks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from shardlab._errors import ShardlabError
from shardlab.models.llama.moe import Compute, Dispatch


def expert_dispatch(ep_group: dist.ProcessGroup | None, tp_mesh: DeviceMesh | None) -> Dispatch:
    """How rows reach the experts: by all-to-all over `ep_group` (None: this rank holds every expert), into
    experts whose hidden dim is sharded over `tp_mesh` (None: not sharded)."""

    def dispatch(compute: Compute, rows: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        run = compute if tp_mesh is None else _tensor_parallel(compute, tp_mesh)
        if ep_group is None:
            return run(rows, counts if isinstance(counts, list) else counts.tolist())
        return _all_to_all(run, rows, counts, ep_group)

    return dispatch


def _all_to_all(
    compute: Compute, rows: torch.Tensor, counts: torch.Tensor | list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Run each expert where its weights are: rank r of the ep `group` holds experts [r L, (r + 1) L), L = E / ep.

    The counts go first (one small all-to-all), then the rows, which each rank regroups by local expert,
    computes and sends back in the order they came. Counts as a host list are the same on every rank (balanced
    routing): what arrives is known without reading the exchange, which still runs, as it would."""
    ep = group.size()
    known = counts if isinstance(counts, list) else None
    counts = torch.tensor(known, device=rows.device) if known is not None else counts
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert], flattened
    local = counts.numel() // ep
    if known is None:
        by_source = received.view(ep, local)
        sent, came, per_expert = (
            counts.view(ep, local).sum(1).tolist(), by_source.sum(1).tolist(), by_source.sum(0).tolist()
        )  # fmt: skip
    else:  # every source sends this rank's experts `mine` of each
        mine = known[dist.get_rank(group) * local :][:local]
        received = torch.tensor(mine * ep, device=rows.device)
        sent = [sum(known[s * local : (s + 1) * local]) for s in range(ep)]
        came, per_expert = [sum(mine)] * ep, [c * ep for c in mine]
    x = funcol.all_to_all_single_autograd(rows, came, sent, group)
    segment = torch.repeat_interleave(
        torch.arange(ep * local, device=rows.device), received.to(rows.device), output_size=sum(came)
    )
    order = torch.argsort((segment % local) * ep + segment // local, stable=True)  # -> by expert, then source
    y = compute(x[order], per_expert)
    return funcol.all_to_all_single_autograd(y[torch.argsort(order)], sent, came, group)


def _tensor_parallel(compute: Compute, tp_mesh: DeviceMesh) -> Compute:
    """Experts whose gate and up projections are split by rows and down by columns over tp: every tp rank holds
    the same rows and computes a partial sum of their outputs. Megatron's two operators, as DTensor layouts: the
    rows' gradients are summed over tp (the partial sums of each rank's slice), the outputs are summed forward."""

    def run(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return summed(compute(with_summed_grad(rows, tp_mesh), counts), tp_mesh)

    return run


def with_summed_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`x`, the same on every rank of `mesh`, whose gradient is summed over it (each rank computes a part)."""
    return DTensor.from_local(x, mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def summed(partial: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The sum over `mesh` of each rank's `partial` (an all-reduce; its gradient reaches every rank whole)."""
    return DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()


def stacked_experts(module: nn.Module, ep: DeviceMesh | None, tp: DeviceMesh | None) -> None:
    """Run a transformers experts module (stacked weights [E, ...], `num_experts`, called with the tokens, each
    token's top-k expert ids and weights) whose weights are split by experts over ep x tp (already local blocks of
    DTensors): rank (e, t) holds experts block e * tp + t.

    Each rank gathers its ep group's tokens (ep ranks hold other tokens; tp ranks the same ones), runs the module's
    own forward on the tokens routed to its experts, and the partial outputs are summed over tp and reduce-scattered
    back over ep. transformers' experts skip an id equal to `num_experts` (the sentinel of its own expert
    parallelism), so ids of other ranks' experts become that sentinel, with zero weight. Autograd runs the same
    collectives in reverse (a gather's gradient is a reduce-scatter), so the tokens' and routing weights' gradients
    are summed over every rank that used them. Communication per layer: an all-gather and a reduce-scatter of the
    tokens over ep, an all-reduce over tp; the fused gate/up weight is never split."""
    experts = module.num_experts
    ranks = (ep.size() if ep is not None else 1) * (tp.size() if tp is not None else 1)
    if experts % ranks:
        raise ShardlabError(
            f"{type(module).__name__}: {experts} experts do not split over ep x tp = {ranks} ranks; pick ep and tp "
            "whose product divides them"
        )
    module.register_forward_pre_hook(functools.partial(_enter, ep, tp, experts), with_kwargs=True)
    module.register_forward_hook(functools.partial(_leave, ep, tp, experts))


_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def _enter(
    ep: DeviceMesh | None, tp: DeviceMesh | None, experts: int, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict[str, Any]]:
    """Before the forward: the group's tokens, this rank's experts (local weights, renumbered ids, others' ids the
    sentinel)."""
    bound = dict(zip(_ARGS, args)) | {k: v for k, v in kwargs.items() if k in _ARGS}
    hidden, index, weights = (bound[k] for k in _ARGS)
    if ep is not None:  # the ep group's tokens, in rank order
        group = ep.get_group()
        hidden = funcol.all_gather_single_autograd(hidden, 0, group)
        weights = funcol.all_gather_single_autograd(weights, 0, group)
        index = funcol.all_gather_single(index, 0, group)
    if tp is not None:  # each tp rank computes a part for the same tokens
        hidden, weights = with_summed_grad(hidden, tp), with_summed_grad(weights, tp)
    tp_size, tp_rank = (tp.size(), tp.get_local_rank()) if tp is not None else (1, 0)
    ep_size, ep_rank = (ep.size(), ep.get_local_rank()) if ep is not None else (1, 0)
    local = experts // (ep_size * tp_size)
    first = (ep_rank * tp_size + tp_rank) * local
    mine = (index >= first) & (index < first + local)
    weights = weights * mine
    index = torch.where(mine, index - first, torch.full_like(index, local))
    for name, param in module.named_parameters(recurse=False):
        module.__dict__[name] = param.to_local()  # the forward reads plain tensors; gradients reach the DTensors
    module.num_experts = local
    if hasattr(module, "_is_expert_parallel"):  # transformers' kernels (grouped_mm) then mask the sentinel rows
        module._is_expert_parallel = True
    rest = {k: v for k, v in kwargs.items() if k not in _ARGS}
    return (hidden, index, weights), rest


def _leave(
    ep: DeviceMesh | None, tp: DeviceMesh | None, experts: int, module: nn.Module, args: tuple, output: torch.Tensor
) -> torch.Tensor:
    """After the forward: the module as it was; the outputs summed over tp, and over ep back to the tokens' ranks."""
    for name, _ in module.named_parameters(recurse=False):
        module.__dict__.pop(name, None)
    module.num_experts = experts
    if hasattr(module, "_is_expert_parallel"):
        module._is_expert_parallel = False
    if tp is not None:
        output = summed(output, tp)
    if ep is not None:
        output = funcol.reduce_scatter_single_autograd(output, "sum", 0, ep.get_group())
    return output
