"""make_plan(model on meta, MeshSpec, Rules) -> Plan: the whole layout as data, before any process starts.

Per parameter: global shape, PartitionSpec (rules + FSDP), DTensor placements, local shape, bytes
per rank and the rule that decided it. Per module: the derived TP style. Plus FSDP units and
options. A Plan holds no modules, meshes or tensors: it prints, diffs and round-trips through JSON.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Literal

import msgspec
import torch
from torch import nn

from shardlab._base import Frozen, to_json
from shardlab._errors import ShardlabError
from shardlab.sharding import plan_text
from shardlab.sharding.context import ContextPlan, context_plan
from shardlab.sharding.experts import ExpertPlan, expert_plan, module_of, strip_ep
from shardlab.sharding.fp8 import Fp8Plan, fp8_plan
from shardlab.sharding.fsdp import FsdpPlan, fsdp_plan
from shardlab.sharding.mesh import ExpertMeshSpec, MeshSpec
from shardlab.sharding.pipeline import ZERO_BUBBLE, PipelinePlan, pipeline_plan
from shardlab.sharding.plan_config import PlanConfig
from shardlab.sharding.rules import Rules, matches, matching, matching_any, resolve
from shardlab.sharding.spec import P, Spec, check_shape, dim_of, expand, local_shape, placements
from shardlab.sharding.tensor_parallel import ModulePlan, module_plans

PLAN_VERSION = 2
DATA_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "dp", "dp_shard_cp", "batch", "dp_shard_mod_ep")
"""Axes rules may not put in a parameter spec: FSDP (and later PP/CP) owns them."""
FSDP_AXES = ("dp_shard", "cp", "dp_shard_mod_ep")
"""The axes FSDP shards parameters over (HSDP replicates over dp_replicate)."""


class ParamPlan(Frozen):
    """Where one parameter lives."""

    fqn: str
    """Fully qualified name (the first one, for a tied tensor)."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    spec: Spec
    """Full PartitionSpec: the rule's model-parallel axes, plus FSDP's axes as the minor part of dim 0 (or 1)."""
    placements: tuple[str, ...]
    """DTensor placement per mesh axis (`Plan.mesh.axis_names` order)."""
    local_shape: tuple[int, ...]
    """Largest per-rank shard (FSDP pads the last shards when dim 0 is uneven)."""
    bytes_per_rank: int
    """Bytes of the largest shard in the parameter's dtype."""
    rule: int | None
    """Index of the rule that decided the spec; None when replicated by plan.allow_uncovered."""
    shadowed: tuple[int, ...] = ()
    """Later rules that also matched (the first match won)."""
    fallbacks: tuple[str, ...] = ()
    """Logical names that fell back because their preferred mesh axes were taken."""
    fsdp_unit: str | None = None
    """FSDP unit owning it ('' is the root); None without FSDP."""
    padded: bool = False
    """FSDP pads the dim it shards (not divisible by the FSDP shards; only dim 0 may be)."""
    aliases: tuple[str, ...] = ()
    """Other names of the same tensor (tied weights)."""
    stage: int | None = None
    """Pipeline stage holding it; None without pipeline parallelism."""
    expert: bool = False
    """Sharded over ep: spec and placements are over the expert mesh (`mesh.EXPERT_AXES`), and its module is an
    FSDP unit of its own there (`Plan.experts`)."""

    @property
    def tp_dim(self) -> int | None:
        return dim_of(self.spec, "tp")

    @property
    def fsdp_dim(self) -> int:
        """The dim FSDP shards: where its axes are in the spec (0, or 1 where dim 0 is smaller than the shards)."""
        spec = P(*self.spec)
        return next((d for d in range(len(spec)) if set(spec.axes(d)) & set(FSDP_AXES)), 0)


class Plan(Frozen):
    """The layout of one model on one mesh. Made by `make_plan`, consumed by `apply`."""

    version: int
    """Format version; a plan of another version is refused when loaded."""
    mesh: MeshSpec
    """The (resolved) mesh the plan was made for; using it with another mesh is an error."""
    rules: Rules
    """The rules it was made from (so `explain` can name them)."""
    params: tuple[ParamPlan, ...]
    """One record per unique parameter, in `named_parameters` order."""
    modules: tuple[ModulePlan, ...]
    """TP styles per module (empty when tp is 1)."""
    fsdp: FsdpPlan | None
    """FSDP units and options; None when no FSDP is applied (one process in fp32, or TP only)."""
    blocks: tuple[str, ...]
    """Repeated blocks that activation checkpointing and compile wrap."""
    activation_checkpoint: Literal["none", "full", "selective", "op"] = "none"
    """none, full (every block), selective (one block in ac_every), op (every block, keeping its expensive ops'
    outputs)."""
    ac_every: int = 2
    """With selective checkpointing, one block in this many is checkpointed."""
    compile: bool = False
    loss_parallel: bool = False
    """The logits stay vocab-sharded, so the loss runs under torch's `loss_parallel()`."""
    pipeline: PipelinePlan | None = None
    """Pipeline stages; None when mesh.pp is 1."""
    context: ContextPlan | None = None
    """Context parallelism; None when mesh.cp is 1."""
    experts: ExpertPlan | None = None
    """Expert parallelism and TP inside the experts; None when neither splits them."""
    fp8: Fp8Plan | None = None
    """The linears that run in float8 (plan.fp8); None without FP8."""

    def param(self, fqn: str) -> ParamPlan:
        for p in self.params:
            if p.fqn == fqn or fqn in p.aliases:
                return p
        raise KeyError(f"{fqn!r} is not a parameter of this plan")

    def module(self, fqn: str) -> ModulePlan | None:
        return next((m for m in self.modules if m.fqn == fqn), None)

    @property
    def bytes_per_rank(self) -> int:
        """Parameter bytes on the worst rank."""
        return sum(p.bytes_per_rank for p in self.worst_rank_params)

    @property
    def worst_rank_params(self) -> tuple[ParamPlan, ...]:
        """The parameters of the pp rank holding the most bytes (every parameter without a pipeline)."""
        if self.pipeline is None:
            return self.params
        rank_of = {s.index: s.pp_rank for s in self.pipeline.stages}
        held: dict[int, list[ParamPlan]] = {}
        for p in self.params:
            held.setdefault(rank_of[p.stage], []).append(p)
        return tuple(max(held.values(), key=lambda ps: sum(p.bytes_per_rank for p in ps)))

    def to_json(self) -> bytes:
        return to_json(self)

    @staticmethod
    def from_json(data: bytes | str) -> Plan:
        plan = msgspec.json.decode(data, type=Plan)
        if plan.version != PLAN_VERSION:
            raise ShardlabError(
                f"plan: version {plan.version} is not supported (this shardlab reads {PLAN_VERSION}); re-run make_plan"
            )
        return plan

    def check_mesh(self, mesh: MeshSpec) -> None:
        if mesh != self.mesh:
            raise ShardlabError(
                f"plan: made for mesh {self.mesh.describe()} but used with {mesh.describe()}; re-run make_plan for this mesh"
            )

    def explain(self, fqn: str) -> str:
        """Why a parameter is laid out as it is: the winning rule, the shadowed ones, the fallbacks."""
        return plan_text.explain(self, fqn)

    def table(self, collapse: bool = True, groups: Mapping[str, str] | None = None) -> str:
        """Readable table; with `collapse`, parameters of repeated blocks are shown once (`layers.*`); `groups`:
        each parameter's optimizer group (`shardlab.training.step.group_names`), shown as a column."""
        return plan_text.table(self, collapse, groups)

    def __str__(self) -> str:
        return self.table()


def make_plan(
    model: nn.Module,
    mesh: MeshSpec,
    rules: Rules,
    options: PlanConfig = PlanConfig(),
    flops: Mapping[str, float] | None = None,
) -> Plan:
    """Resolve `rules` against `model` (any nn.Module, normally on the meta device) for `mesh`. Pure: no process group.

    flops: training FLOPs per token of each module (`metrics.module_flops`), for plan.pp_balance="flops"."""
    if not mesh.is_resolved:
        raise ShardlabError("make_plan: the mesh has a -1 axis; call MeshSpec.resolve(world_size) first")
    modules = dict(model.named_modules())
    params, aliases, names = _unique_params(model)
    _check_module_globs(modules, rules)
    unit_of, fsdp = fsdp_plan(modules, params, aliases, mesh, rules, options)
    used: set[int] = set()
    uncovered: list[str] = []
    out: list[ParamPlan] = []
    ep_named: dict[str, Spec] = {}
    for fqn, t in params.items():
        match = resolve(fqn, t.ndim, rules)
        expert = False
        if match is None:
            uncovered.append(fqn)
            spec: Spec = (None,) * t.ndim
        else:
            used.add(match.rule)
            spec = match.spec
            if "ep" in P(*spec).used_axes:  # an expert weight: on the expert mesh, or the main one when ep is 1
                ep_named[fqn] = spec
                expert = mesh.ep > 1
                spec = spec if expert else strip_ep(spec)
            on = mesh.experts if expert else mesh
            _check_model_axes(fqn, match.rule, rules, spec, on)
            if not _shape_ok(spec, on, tuple(t.shape)):
                check_shape(P(*spec), on, t.shape, name=fqn)
        unit = module_of(fqn) if expert and fsdp is not None else unit_of.get(fqn)
        out.append(_param_plan(fqn, t, spec, match, mesh, unit, aliases.get(fqn, ()), expert))
    if uncovered and not options.allow_uncovered:
        more = f" (and {len(uncovered) - 1} more)" if len(uncovered) > 1 else ""
        raise ShardlabError(
            f"{uncovered[0]}{more}: no rule covers this parameter; add a rule for it "
            "(spec=(None,) * ndim replicates) or set plan.allow_uncovered=True"
        )
    unused = [
        i for i in range(len(rules.params)) if i not in used and not _matches_any(rules.params[i].pattern, params)
    ]
    if unused and not options.allow_unused_rules:
        i = unused[0]
        pattern = rules.params[i].pattern
        alias = next(((a, f) for f, names in aliases.items() for a in names if matches(pattern, a)), None)
        if alias is not None:
            raise ShardlabError(
                f"rules[{i}] {pattern!r} matches only {alias[0]!r}, a tied alias of {alias[1]!r} (tied parameters are "
                "planned under their first name); drop the rule or set plan.allow_unused_rules=True"
            )
        raise ShardlabError(
            f"rules[{i}] {pattern!r} matched no parameter; fix the glob or set plan.allow_unused_rules=True"
        )
    if mesh.tp > 1 and not options.allow_unused_axes and all(p.tp_dim is None for p in out):
        raise ShardlabError(
            f"mesh.tp={mesh.tp} but no rule shards a parameter over tp, so every tp rank would repeat the same work; "
            "use tp in the rules, set mesh.tp=1, or set plan.allow_unused_axes=True"
        )
    by_name = {name: p for p in out for name in (p.fqn, *p.aliases)}
    experts = expert_plan(modules, ep_named, mesh)
    tp_dims = {n: p.tp_dim for n, p in by_name.items()}
    if experts is not None:  # expert weights are sharded by apply's expert parallelism, not by a ParallelStyle
        tp_dims = {n: d for n, d in tp_dims.items() if module_of(n) not in experts.modules}
    styles = module_plans(modules, tp_dims, rules) if mesh.tp > 1 else ()
    blocks = matching_any(rules.blocks, tuple(modules))
    pipeline = None
    if mesh.pp > 1:
        pipeline, stage_of = pipeline_plan(
            [(p.fqn, p.aliases, math.prod(p.shape)) for p in out],
            names, blocks, mesh.pp, options.pp_schedule,
            options.pp_stages_per_rank, options.pp_microbatches, options.pp_balance, options.pp_split, flops,
            rules.stage_call,
        )  # fmt: skip
        out = [msgspec.structs.replace(p, stage=stage_of[p.fqn]) for p in out]
        if fsdp is not None and fsdp.reshard_after_forward and options.pp_schedule in ZERO_BUBBLE:
            raise ShardlabError(
                f"plan.pp_schedule={options.pp_schedule!r} computes weight gradients after FSDP has resharded the "
                "weights (wrong gradients); set plan.reshard_after_forward=False, or use a schedule without zero bubble"
            )
    context = context_plan(modules, mesh, rules)
    fp8 = fp8_plan(modules, blocks, {n: p.tp_dim for n, p in by_name.items()}, mesh, rules, options.fp8,
                   mesh.dp_shard * mesh.cp if fsdp is not None else 1)  # fmt: skip
    for option, on in (
        ("activation_checkpoint", options.activation_checkpoint != "none"),
        ("compile", options.compile),
    ):
        if on and not blocks:
            raise ShardlabError(
                f"plan.{option} is set but rules.blocks matched no module; add the block glob (e.g. 'model.layers.*')"
            )
    return Plan(
        version=PLAN_VERSION,
        mesh=mesh,
        rules=rules,
        params=tuple(out),
        modules=styles,
        fsdp=fsdp,
        blocks=blocks,
        activation_checkpoint=options.activation_checkpoint,
        ac_every=options.ac_every,
        compile=options.compile,
        loss_parallel=any(not m.local_output and m.style == "colwise" for m in styles),
        pipeline=pipeline,
        context=context,
        experts=experts,
        fp8=fp8,
    )


def _unique_params(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, ...]], list[str]]:
    """Each tensor under its first name, its other names (tied aliases), and every name in model order: one walk
    of the model (a 126-block model has over a thousand)."""
    first: dict[int, str] = {}
    params: dict[str, torch.Tensor] = {}
    aliases: dict[str, list[str]] = {}
    names: list[str] = []
    for fqn, t in model.named_parameters(remove_duplicate=False):
        names.append(fqn)
        if id(t) in first:
            aliases.setdefault(first[id(t)], []).append(fqn)
        else:
            first[id(t)] = fqn
            params[fqn] = t
    return params, {k: tuple(v) for k, v in aliases.items()}, names


def _matches_any(pattern: str, params: dict[str, torch.Tensor]) -> bool:
    return any(matches(pattern, f) for f in params)


def _check_model_axes(fqn: str, rule: int, rules: Rules, spec: Spec, mesh: MeshSpec) -> None:
    if _model_axes_ok(spec, mesh):
        return
    expand(P(*spec), mesh, name=fqn)  # unknown axes and an axis used twice are errors
    for axis in P(*spec).used_axes:
        if axis in DATA_AXES:
            raise ShardlabError(
                f"{fqn}: rules[{rule}] {rules.params[rule].pattern!r} puts {axis!r} in a parameter spec; FSDP shards "
                "parameters over the data-parallel axes itself: use model-parallel axes (tp) in rules"
            )


@functools.lru_cache(maxsize=4096)
def _shape_ok(spec: Spec, mesh: MeshSpec | ExpertMeshSpec, shape: tuple[int, ...]) -> bool:
    """Whether `spec`'s axes on `mesh` divide `shape` (`check_shape`; once per mesh for each distinct weight)."""
    try:
        check_shape(P(*spec), mesh, shape)
    except ShardlabError:
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _model_axes_ok(spec: Spec, mesh: MeshSpec | ExpertMeshSpec) -> bool:
    """Whether `spec` names only `mesh`'s model-parallel axes, each once (a model's blocks repeat a few specs: each
    mesh checks them once)."""
    try:
        expand(P(*spec), mesh)
    except ShardlabError:
        return False
    return not set(P(*spec).used_axes) & set(DATA_AXES)


def _param_plan(
    fqn: str,
    t: torch.Tensor,
    spec: Spec,
    match,
    mesh: MeshSpec,
    unit: str | None,
    aliases: tuple[str, ...],
    expert: bool = False,
) -> ParamPlan:
    full, placed, local, padded = _sharded(spec, tuple(t.shape), mesh.experts if expert else mesh, unit is not None,
                                           expert)  # fmt: skip
    return ParamPlan(
        fqn=fqn,
        shape=tuple(t.shape),
        dtype=str(t.dtype).removeprefix("torch."),
        spec=full,
        placements=placed,
        local_shape=local,
        bytes_per_rank=math.prod(local) * t.element_size(),
        rule=None if match is None else match.rule,
        shadowed=() if match is None else match.shadowed,
        fallbacks=() if match is None else match.fallbacks,
        fsdp_unit=unit,
        padded=padded,
        aliases=aliases,
        expert=expert,
    )


@functools.lru_cache(maxsize=4096)
def _sharded(
    spec: Spec, shape: tuple[int, ...], on: MeshSpec | ExpertMeshSpec, fsdp: bool, expert: bool
) -> tuple[Spec, tuple[str, ...], tuple[int, ...], bool]:
    """A parameter's whole spec (FSDP's axes added where it is in a unit), placements, local shape and whether FSDP
    pads it, on `on` (the expert mesh for expert weights): the same for every block's copy of a weight, so each mesh
    works them out once."""
    full = P(*spec) if spec else P()
    local = local_shape(full, on, shape)
    padded = False
    fsdp_axes = FSDP_AXES[2:] if expert else FSDP_AXES[:2]
    shards = math.prod(on.size(a) for a in fsdp_axes)
    if fsdp and shards > 1 and len(shape) > 0:
        # FSDP chunks the TP/EP-local tensor (torch.chunk: ceil rows, padded): ceil(ceil(n / tp) / shards) rows,
        # over dp_shard and, with context parallelism, cp too (expert weights: over dp_shard_mod_ep). Where dim 0
        # has fewer rows than shards (a few stacked experts over many ranks), most shards would be padding: dim 1
        # instead, if it splits evenly (FSDP needs that off dim 0), as torchtitan does for experts.
        d = 1 if local[0] < shards and len(shape) > 1 and local[1] % shards == 0 else 0
        padded = local[d] % shards != 0
        local = tuple(-(-n // shards) if i == d else n for i, n in enumerate(local))
        full = P(*full, *[None] * (len(shape) - len(full))).with_minor(d, tuple(a for a in fsdp_axes if on.size(a) > 1))
    return tuple(full), tuple(str(p) for p in placements(full, on)), local, padded


def _check_module_globs(modules: dict[str, nn.Module], rules: Rules) -> None:
    """Globs over modules must match at any mesh, not only at the one where they are used."""
    names = tuple(modules)
    for i, a in enumerate(rules.activations):
        if not matching(a.pattern, names):
            raise ShardlabError(f"rules.activations[{i}] {a.pattern!r} matched no module; fix the glob")
    for i, group in enumerate(rules.fsdp_units):
        for g in group:
            if not matching(g, names):
                raise ShardlabError(f"rules.fsdp_units[{i}] {g!r} matched no module; fix the glob")
