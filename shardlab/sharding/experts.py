"""Expert parallelism: each `ep` rank holds 1/ep of every MoE layer's experts, and tokens travel to them.

This is the planner's part, pure data: which modules hold ep-sharded weights and how FSDP shards them
(`expert_plan`); the all-to-alls that run are shardlab.parallel.experts. `ep` borrows its ranks from dp_shard x cp (`MeshSpec.experts`): those ranks hold other
tokens, so an expert's gradient already sums over the tokens of its ep group, and FSDP shards the experts over
the remaining dp_shard_mod_ep ranks with a divide factor of every rank holding other tokens.
"""

from __future__ import annotations

from torch import nn

from shardlab._base import Frozen
from shardlab._errors import ShardlabError
from shardlab.sharding.mesh import MeshSpec
from shardlab.sharding.rules import takes_keyword
from shardlab.sharding.spec import P, Spec


class ExpertPlan(Frozen):
    """Expert parallelism (mesh.ep > 1), tensor parallelism inside the experts (tp over their hidden dim), or both."""

    ep: int
    tensor_parallel: bool
    """The experts' hidden dim is sharded over tp (gate/up by rows, down by columns)."""
    modules: tuple[str, ...]
    """The modules holding the expert weights (the dims the rules name `ep`; e.g. each MoE layer's `experts`):
    each call gets the keyword `dispatch`, which sends rows by all-to-all over ep and sums partial outputs over tp. With ep > 1 each is an
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
        raise ShardlabError(
            f"mesh.ep={mesh.ep} but no rule shards a parameter over ep; map the expert dim to ep "
            "(logical ('experts', 'ep') or spec ('ep', None, None)), or set mesh.ep=1"
        )
    owners = tuple(dict.fromkeys(module_of(f) for f in expert_specs))
    stacked = all(is_stacked_experts(modules[o]) for o in owners)
    for owner in owners:
        module = modules[owner]
        others = [n for n, _ in module.named_parameters() if f"{owner}.{n}" not in expert_specs]
        if others:
            raise ShardlabError(
                f"{owner}.{others[0]}: {owner} holds expert weights (rules name ep on them), so each of its parameters "
                "needs its expert dim over ep too; shard it over ep or move it to another module"
            )
        if not stacked and (not takes_keyword(module, "dispatch") or not hasattr(module, "hidden_dims")):
            raise ShardlabError(
                f"{owner}: holds ep-sharded weights but has no `dispatch` keyword and `hidden_dims` to run them "
                "(shardlab.models.llama.moe.Experts has both) and is not transformers' stacked experts (`num_experts`, "
                "weights stacked on dim 0); replicate its parameters over ep"
            )
    for fqn, spec in expert_specs.items():
        p = P(*spec)
        if stacked:  # split by experts alone: ep, then tp, on dim 0
            if p.axes(0) not in (("ep",), ("ep", "tp")) or any(p.axes(d) for d in range(1, len(p))):
                raise ShardlabError(
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
            raise ShardlabError(
                f"{fqn}: {p!r} shards it where its dispatch cannot compute; an expert weight splits its expert dim "
                f"(0) over ep alone and only its hidden dim ({hidden}) over tp: fix the rule"
            )
    if tensor_parallel and None in tp_dims.values():
        fqn = next(f for f, d in tp_dims.items() if d is None)
        raise ShardlabError(f"{fqn}: some expert weights are sharded over tp and this one is not; shard all or none")
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
