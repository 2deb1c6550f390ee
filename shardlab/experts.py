"""Expert parallelism: each `ep` rank holds 1/ep of every MoE layer's experts, and tokens travel to them.

`expert_plan` is the planner's part (which modules hold ep-sharded weights, how FSDP shards them); the rest
runs at train time. `ep` borrows its ranks from dp_shard x cp (`MeshSpec.experts`): those ranks hold other
tokens, so an expert's gradient already sums over the tokens of its ep group, and FSDP shards the experts over
the remaining dp_shard_mod_ep ranks with a divide factor of every rank holding other tokens.

Tokens are routed where they live; `all_to_all_dispatch` sends each expert's rows to the rank holding it and
the results back with torch's autograd-aware uneven all-to-all, so the backward runs the same exchange in
reverse. Routing statistics (the balancing loss, the bias update) are unchanged: they count tokens at home.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from shardlab._base import Frozen
from shardlab.mesh import MeshSpec

Compute = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""The experts a rank holds: rows grouped by its local expert, counts per local expert -> their outputs."""
Dispatch = Callable[[Compute, torch.Tensor, torch.Tensor], torch.Tensor]
"""(compute, rows sorted by global expert, counts [E]) -> the rows' expert outputs, in the same order."""


class ExpertPlan(Frozen):
    """Expert parallelism (mesh.ep > 1)."""

    ep: int
    modules: tuple[str, ...]
    """The modules holding ep-sharded weights (e.g. each MoE layer's `experts`): their `dispatch` becomes an
    all-to-all over ep, and each is an FSDP unit of its own over `fsdp_axes`."""
    fsdp_axes: tuple[str, ...]
    """FSDP's axes for expert weights: (dp_shard_mod_ep,), with dp_replicate first under HSDP."""
    gradient_divide_factor: int
    """Ranks holding other tokens (dp_replicate x dp_shard x cp): FSDP averages expert gradients over them,
    not over its own smaller mesh."""


def strip_ep(spec: tuple) -> tuple:
    """A spec without the ep axis (mesh.ep == 1: the expert weights are planned on the main mesh)."""
    out = []
    for entry in spec:
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a != "ep")
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(out)


def expert_plan(modules: dict[str, nn.Module], expert_params: list[str], mesh: MeshSpec) -> ExpertPlan | None:
    """The plan's expert parallelism: None when mesh.ep is 1. expert_params: the parameters whose spec uses ep."""
    if mesh.ep == 1:
        return None
    if not expert_params:
        raise ValueError(
            f"mesh.ep={mesh.ep} but no rule shards a parameter over ep; map the expert dim to ep "
            "(logical ('experts', 'ep') or spec ('ep', None, None)), or set mesh.ep=1"
        )
    owners = tuple(dict.fromkeys(f.rpartition(".")[0] for f in expert_params))
    for owner in owners:
        module = modules[owner]
        others = [n for n, _ in module.named_parameters() if f"{owner}.{n}" not in expert_params]
        if others:
            raise ValueError(
                f"{owner}.{others[0]}: {owner} holds ep-sharded weights, so all of its parameters must be sharded "
                "over ep (its module is FSDP's unit on the expert mesh); shard it over ep or move it to another module"
            )
        if not hasattr(module, "dispatch"):
            raise ValueError(
                f"{owner}: holds ep-sharded weights but has no `dispatch` to send tokens to them "
                "(shardlab.models.moe.Experts has one); replicate its parameters over ep"
            )
    e = mesh.experts
    return ExpertPlan(
        ep=mesh.ep,
        modules=owners,
        fsdp_axes=("dp_replicate", "dp_shard_mod_ep") if e.dp_replicate > 1 else ("dp_shard_mod_ep",),
        gradient_divide_factor=mesh.size("batch"),
    )


def all_to_all_dispatch(group: dist.ProcessGroup) -> Dispatch:
    """Run each expert where its weights are: rank r of the ep `group` holds experts [r L, (r + 1) L), L = E / ep.

    The counts go first (one small all-to-all), then the rows, which each rank regroups by local expert,
    computes and sends back in the order they came."""

    def dispatch(compute: Compute, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = group.size()
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        by_source = received.view(ep, -1)  # [source rank, local expert]
        local = by_source.shape[1]
        sent = counts.view(ep, local).sum(1).tolist()
        came = by_source.sum(1).tolist()
        x = funcol.all_to_all_single_autograd(rows, came, sent, group)
        segment = torch.repeat_interleave(torch.arange(ep * local, device=rows.device), received.to(rows.device))
        order = torch.argsort((segment % local) * ep + segment // local, stable=True)  # -> by expert, then source
        y = compute(x[order], by_source.sum(0).tolist())
        return funcol.all_to_all_single_autograd(y[torch.argsort(order)], sent, came, group)

    return dispatch
