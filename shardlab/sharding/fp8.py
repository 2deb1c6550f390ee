"""The plan half of FP8 training: which linear layers compute their matmuls in float8 (torchao's Float8Linear), and
why the other linears of the blocks do not. Pure data, read off the model on the meta device; the conversion
itself is `shardlab.parallel.fp8`.

By default every `nn.Linear` inside the blocks whose (tensor-parallel local) dims are multiples of 16, torchao's
requirement for its float8 matmul; the embedding and the output head stay in the compute dtype unless the rules
name them (`Rules.fp8_modules`), and the rules can keep block linears out (`Rules.fp8_exclude`: an MoE router,
whose scores need the precision).
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from shardlab._base import Frozen
from shardlab._errors import ShardlabError
from shardlab._glob import matches
from shardlab.sharding.mesh import MeshSpec
from shardlab.sharding.rules import Rules

Fp8Recipe = Literal["none", "tensorwise", "rowwise", "rowwise_with_gw_hp"]
"""torchao's recipes: one scale per tensor (with FSDP: float8 weights all-gathered), one per row, or one per row
with the weight gradient's matmul kept in high precision."""
ALIGNMENT = 16
"""torchao's float8 matmul needs both dims of a weight to be multiples of this."""


class Fp8Plan(Frozen):
    """The FP8 linears of a plan."""

    recipe: Fp8Recipe
    linears: tuple[str, ...]
    """The modules converted to Float8Linear, in model order."""
    kept: tuple[tuple[str, str], ...] = ()
    """(module, why) for each linear of the blocks that stays in the compute dtype."""
    all_gather: bool = False
    """FSDP gathers the float8 weights (tensorwise scaling with FSDP sharding over more than one rank), their scales
    precomputed once after each optimizer step."""


def fp8_plan(
    modules: dict[str, nn.Module],
    blocks: tuple[str, ...],
    tp_dims: dict[str, int | None],
    mesh: MeshSpec,
    rules: Rules,
    recipe: Fp8Recipe,
    fsdp_shards: int,
) -> Fp8Plan | None:
    """The FP8 plan of a model's `modules` (name -> module) with these `blocks`; tp_dims: each weight's tensor-
    parallel dim (None: not split over tp); fsdp_shards: the ranks FSDP shards a weight over (1 without FSDP)."""
    if recipe == "none":
        return None
    for i, g in enumerate(rules.fp8_modules):
        if not any(matches(g, f) and isinstance(modules[f], nn.Linear) for f in modules):
            raise ShardlabError(f"rules.fp8_modules[{i}] {g!r} matched no nn.Linear; fix the glob")
    linears, kept = [], []
    for fqn, module in modules.items():
        if not isinstance(module, nn.Linear):
            continue
        in_block = any(fqn.startswith(b + ".") for b in blocks)
        named = any(matches(g, fqn) for g in rules.fp8_modules)
        if not (in_block or named):
            continue
        if any(matches(g, fqn) for g in rules.fp8_exclude):
            kept.append((fqn, "rules.fp8_exclude"))
            continue
        why = _unaligned(module, tp_dims.get(f"{fqn}.weight"), mesh.tp)
        if why is None:
            linears.append(fqn)
        else:
            kept.append((fqn, why))
    if not linears:
        first = f" ({kept[0][0]}: {kept[0][1]})" if kept else ""
        raise ShardlabError(
            f"plan.fp8={recipe!r}: no linear qualifies for float8{first}; torchao needs nn.Linear layers inside "
            f"rules.blocks (or named by rules.fp8_modules) whose dims are multiples of {ALIGNMENT}: set plan.fp8='none'"
        )
    return Fp8Plan(
        recipe=recipe, linears=tuple(linears), kept=tuple(kept), all_gather=recipe == "tensorwise" and fsdp_shards > 1
    )


def _unaligned(linear: nn.Linear, tp_dim: int | None, tp: int) -> str | None:
    """Why `linear` cannot run in float8 (a local dim not a multiple of ALIGNMENT), or None."""
    out_f, in_f = linear.out_features, linear.in_features
    for name, n, dim in (("out_features", out_f, 0), ("in_features", in_f, 1)):
        local = n // tp if tp_dim == dim else n
        if local % ALIGNMENT:
            per_rank = f" per tp rank ({n} / {tp})" if tp_dim == dim and tp > 1 else ""
            return f"{name} {local}{per_rank} is not a multiple of {ALIGNMENT}"
    return None
