"""Expert parallelism: each `ep` rank holds 1/ep of every MoE layer's experts, and tokens travel to them.

`expert_plan` is the planner's part (which modules hold ep-sharded weights, how FSDP shards them); the rest
runs at train time. `ep` borrows its ranks from dp_shard x cp (`MeshSpec.experts`): those ranks hold other
tokens, so an expert's gradient already sums over the tokens of its ep group, and FSDP shards the experts over
the remaining dp_shard_mod_ep ranks with a divide factor of every rank holding other tokens.

Tokens are routed where they live; `expert_dispatch` sends each expert's rows to the rank holding it and
the results back with torch's autograd-aware uneven all-to-all, so the backward runs the same exchange in
reverse. Routing statistics (the balancing loss, the bias update) are unchanged: they count tokens at home.

transformers' stacked experts (`stacked_experts`) run their own forward instead: split by experts over ep x tp,
each rank gathers its ep group's tokens, runs the ones routed to its experts, and the partial outputs are summed
back to the tokens' ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from shardlab._base import Frozen
from shardlab.mesh import MeshSpec
from shardlab.spec import P, Spec

Compute = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""The experts a rank holds: rows grouped by its local expert, counts per local expert -> their outputs."""
Dispatch = Callable[[Compute, torch.Tensor, "torch.Tensor | list[int]"], torch.Tensor]
"""(compute, rows sorted by global expert, counts [E]) -> the rows' expert outputs, in the same order."""


class ExpertPlan(Frozen):
    """Expert parallelism (mesh.ep > 1), tensor parallelism inside the experts (tp over their hidden dim), or both."""

    ep: int
    tensor_parallel: bool
    """The experts' hidden dim is sharded over tp (gate/up by rows, down by columns)."""
    modules: tuple[str, ...]
    """The modules holding the expert weights (the dims the rules name `ep`; e.g. each MoE layer's `experts`):
    their `dispatch` sends rows by all-to-all over ep and sums partial outputs over tp. With ep > 1 each is an
    FSDP unit of its own over `fsdp_axes`; with ep = 1 FSDP shards it with its block."""
    fsdp_axes: tuple[str, ...]
    """FSDP's axes for expert weights: (dp_shard_mod_ep,), with dp_replicate first under HSDP; () when ep is 1."""
    gradient_divide_factor: int | None
    """With ep > 1, the ranks holding other tokens (dp_replicate x dp_shard x cp): FSDP averages expert gradients
    over them, not over its own smaller mesh. None when ep is 1 (FSDP's own mean is right)."""
    stacked: bool = False
    """transformers' stacked experts: split by experts (dim 0) over ep x tp, run by `stacked_experts`."""


def strip_ep(spec: Spec) -> Spec:
    """A spec without the ep axis (mesh.ep == 1: the expert weights are planned on the main mesh)."""
    out = []
    for entry in spec:
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a != "ep")
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(out)


def module_of(fqn: str) -> str:
    """The module holding parameter `fqn` (what expert parallelism and its FSDP unit act on)."""
    return fqn.rpartition(".")[0]


def expert_plan(modules: dict[str, nn.Module], expert_specs: dict[str, Spec], mesh: MeshSpec) -> ExpertPlan | None:
    """The plan's expert parallelism. expert_specs: the specs of the parameters whose rules name ep (fqn -> spec).
    None when neither ep nor tp splits the experts."""
    tp_dims = {f: P(*s).dim_of("tp") for f, s in expert_specs.items()}
    tensor_parallel = mesh.tp > 1 and any(d is not None for d in tp_dims.values())
    if mesh.ep == 1 and not tensor_parallel:
        return None
    if not expert_specs:
        raise ValueError(
            f"mesh.ep={mesh.ep} but no rule shards a parameter over ep; map the expert dim to ep "
            "(logical ('experts', 'ep') or spec ('ep', None, None)), or set mesh.ep=1"
        )
    owners = tuple(dict.fromkeys(module_of(f) for f in expert_specs))
    stacked = all(is_stacked_experts(modules[o]) for o in owners)
    for owner in owners:
        module = modules[owner]
        others = [n for n, _ in module.named_parameters() if f"{owner}.{n}" not in expert_specs]
        if others:
            raise ValueError(
                f"{owner}.{others[0]}: {owner} holds expert weights (rules name ep on them), so each of its parameters "
                "needs its expert dim over ep too; shard it over ep or move it to another module"
            )
        if not stacked and (not hasattr(module, "dispatch") or not hasattr(module, "hidden_dims")):
            raise ValueError(
                f"{owner}: holds ep-sharded weights but has no `dispatch` and `hidden_dims` to run them "
                "(shardlab.models.moe.Experts has both) and is not transformers' stacked experts (`num_experts`, "
                "weights stacked on dim 0); replicate its parameters over ep"
            )
    for fqn, spec in expert_specs.items():
        p = P(*spec)
        if stacked:  # split by experts alone: ep, then tp, on dim 0
            if p.axes(0) not in (("ep",), ("ep", "tp")) or any(p.axes(d) for d in range(1, len(p))):
                raise ValueError(
                    f"{fqn}: {p!r}; transformers' stacked experts split by experts only, over ep then tp on dim 0 "
                    "(spec (('ep', 'tp'), None, ...)): fix the rule"
                )
            continue
        hidden = modules[module_of(fqn)].hidden_dims.get(fqn.rpartition(".")[2])
        if (
            p.axes(0) != ("ep",)
            or any("ep" in p.axes(d) for d in range(1, len(p)))
            or tp_dims[fqn] not in (None, hidden)
        ):
            raise ValueError(
                f"{fqn}: {p!r} shards it where its dispatch cannot compute; an expert weight splits its expert dim "
                f"(0) over ep alone and only its hidden dim ({hidden}) over tp: fix the rule"
            )
    if tensor_parallel and None in tp_dims.values():
        fqn = next(f for f, d in tp_dims.items() if d is None)
        raise ValueError(f"{fqn}: some expert weights are sharded over tp and this one is not; shard all or none")
    e = mesh.experts
    fsdp_axes = ("dp_replicate", "dp_shard_mod_ep") if e.dp_replicate > 1 else ("dp_shard_mod_ep",)
    return ExpertPlan(
        ep=mesh.ep,
        tensor_parallel=tensor_parallel,
        modules=owners,
        fsdp_axes=fsdp_axes if mesh.ep > 1 else (),
        gradient_divide_factor=mesh.size("batch") if mesh.ep > 1 else None,
        stacked=stacked,
    )


def is_stacked_experts(module: nn.Module) -> bool:
    """transformers' experts convention: `num_experts`, every weight stacked along dim 0 by expert."""
    n = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    return isinstance(n, int) and bool(params) and all(p.ndim >= 2 and p.shape[0] == n for p in params)


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
        raise ValueError(
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
