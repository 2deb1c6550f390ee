"""FSDP, the planner's part: the units `fully_shard` wraps, the mesh axes it shards over, its dtypes and resharding
(`fsdp_plan`). What runs it is shardlab.parallel.apply."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shardlab._base import Frozen
from shardlab._errors import ShardlabError
from shardlab.sharding.mesh import MeshSpec
from shardlab.sharding.plan_config import PlanConfig
from shardlab.sharding.rules import Rules, matching


class FsdpPlan(Frozen):
    """fully_shard per unit, then at the root."""

    axes: tuple[str, ...]
    """Mesh axes of the FSDP mesh: (dp_shard,) or (dp_replicate, dp_shard) for HSDP; dp_shard_cp in place of
    dp_shard under context parallelism."""
    units: tuple[tuple[str, ...], ...]
    """Module fqns sharded together, in application order (the root is applied last)."""
    reshard_after_forward: bool
    param_dtype: str
    reduce_dtype: str
    cpu_offload: bool
    resharding: str = "as set"
    """Why reshard_after_forward has its value: as set, the default, or the reason the default changed it."""
    last_kept: bool = False
    """The last unit stays gathered from its forward to its backward, which follows at once (the model's output
    layer; rules.fsdp_last_kept): one all-gather a step fewer, the same peak memory. Without resharding after
    forward every unit stays gathered anyway."""
    all_reduce_once: bool = False
    """HSDP accumulating micro batches without a pipeline: each micro batch's gradients are reduce-scattered over
    dp_shard and summed in reduce_dtype, and all-reduced over dp_replicate (the replicas, often across nodes) once,
    in the last micro batch's backward, not in each (`shardlab.parallel.accumulation`): 1 / m of that traffic.
    Only where reduce_dtype is float32, so the sum rounds no more than the fp32 gradients it replaces; a pipeline's
    schedule reduces once anyway."""


def fsdp_plan(
    modules: Mapping[str, nn.Module],
    params: Mapping[str, torch.Tensor],
    aliases: Mapping[str, tuple[str, ...]],
    mesh: MeshSpec,
    rules: Rules,
    options: PlanConfig,
) -> tuple[dict[str, str], FsdpPlan | None]:
    """Each parameter's FSDP unit (fqn -> the unit's modules joined by " + "; "": the root) and the FSDP plan; none
    where one rank holds everything in fp32 without offload."""
    dp = mesh.dp_replicate * mesh.dp_shard * mesh.cp  # cp ranks hold other tokens: their gradients are summed too
    if dp == 1 and options.param_dtype == "float32" and options.reduce_dtype == "float32" and not options.cpu_offload:
        return {}, None
    units: list[tuple[str, ...]] = []
    names = tuple(modules)
    for group in rules.fsdp_units:
        found = [matching(g, names) for g in group]
        if len(group) == 1:
            units.extend((f,) for f in found[0])
        else:
            units.append(tuple(f for hits in found for f in hits))
    last: dict[str, int] = {}  # module -> the last unit holding it (a later unit takes what it holds from earlier ones)
    for i, unit in enumerate(units):
        last |= dict.fromkeys(unit, i)
    unit_of: dict[str, str] = {}
    for fqn in params:
        names = (fqn, *aliases.get(fqn, ()))
        owners = {_owner(n, last, units) for n in names}
        if len(owners) > 1:
            raise ShardlabError(
                f"{fqn}: this tied parameter lies in FSDP units {sorted(owners)}; leave those modules to the root "
                "(drop them from rules.fsdp_units)"
            )
        unit_of[fqn] = owners.pop()
    shard = "dp_shard_cp" if mesh.cp > 1 else "dp_shard"
    axes = ("dp_replicate", shard) if mesh.dp_replicate > 1 else (shard,)
    reshard, why = options.resharding(mesh)
    return unit_of, FsdpPlan(
        axes=axes,
        units=tuple(units),
        reshard_after_forward=reshard,
        resharding=why,
        last_kept=rules.fsdp_last_kept and bool(units),
        param_dtype=options.param_dtype,
        reduce_dtype=options.reduce_dtype,
        cpu_offload=options.cpu_offload,
        all_reduce_once=mesh.dp_replicate > 1 and mesh.pp == 1 and options.reduce_dtype == "float32",
    )


def _owner(name: str, last: dict[str, int], units: list[tuple[str, ...]]) -> str:
    """The FSDP unit parameter `name` falls in: the last of `units` holding a module that contains it ("": none)."""
    parts = name.split(".")
    held = [last[m] for k in range(1, len(parts)) if (m := ".".join(parts[:k])) in last]
    return " + ".join(units[max(held)]) if held else ""
