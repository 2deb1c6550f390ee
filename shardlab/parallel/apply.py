"""apply(model, plan, mesh): the one door to torch's parallel APIs, in the order the layout needs.

this rank's pipeline stages (the other stages' modules pass their input on, `shardlab.parallel.stages`) -> FP8 linears
(`shardlab.parallel.fp8`) -> activation checkpointing -> TP/SP (`parallelize_module`) -> context-parallel attention (`shardlab.sharding.context`) -> expert
parallelism (`shardlab.sharding.experts`) -> compile -> FSDP/HSDP (`fully_shard` per unit, then the root: the model,
or the module each of this rank's pipeline stages runs). The pipeline schedule itself runs in the step
(shardlab.training.pipeline_schedule). Also the JAX-like helpers `shard` (device_put with a spec),
`constrain` (with_sharding_constraint for activations) and `shard_map` (code on local blocks, over local_map).

What parallel code hands a model's modules (context parallelism's `attend`, expert parallelism's `dispatch`) goes in
as a keyword of each call, one their forward declares, through a forward pre-hook as TP's input styles do: nothing is
set on the modules. What `apply` builds beside the model (the modules the pipeline stages run, the expert mesh) is
returned to the caller by `parallelize`, not kept anywhere.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement

from shardlab._errors import ShardlabError
from shardlab.parallel._activation_checkpoint import checkpoint as checkpoint_module
from shardlab.parallel._compile import compile_block
from shardlab.parallel.context import all_gather_attention
from shardlab.parallel.device_mesh import expert_mesh, flat_view, make_expert_mesh, mesh_spec_of
from shardlab.parallel.experts import expert_dispatch, stacked_experts
from shardlab.parallel.fp8 import convert as convert_to_fp8
from shardlab.parallel.fp8 import gathers_float8
from shardlab.parallel.fp8 import tp_style as fp8_tp_style
from shardlab.parallel.stages import build_stages, in_stages, keep_own_stages
from shardlab.sharding.fp8 import Fp8Plan
from shardlab.sharding.mesh import AXES, FLAT_VIEWS
from shardlab.sharding.pipeline import StagePlan
from shardlab.sharding.plan import Plan
from shardlab.sharding.spec import P, Spec, check_shape, expand, placements
from shardlab.sharding.tensor_parallel import ModulePlan


class Parallelized(NamedTuple):
    """What `parallelize` made of a model: the model, and what runs it that is not part of it."""

    model: nn.Module
    """The model, parallelized in place."""
    stages: tuple[nn.Module, ...]
    """The modules torch's PipelineStage runs for this rank's pipeline stages, in model order (each an FSDP root
    under FSDP): the model itself, or those `shardlab.parallel.stages.build_stages` made. (model,) without a
    pipeline. The step must run these very modules (`make_step(..., stages=)`)."""
    experts: DeviceMesh | None
    """The expert mesh (`make_expert_mesh`) the expert weights and their FSDP live on with ep > 1, else None."""


def apply(model: nn.Module, plan: Plan, mesh: DeviceMesh | None = None) -> nn.Module:
    """Parallelize `model` in place as `plan` says, on `mesh` (from `make_mesh`), and return it.

    A plan without TP or FSDP (one process in fp32) needs no mesh: only checkpointing and compile apply. A rank that
    runs several pipeline stages, or a transformers model's stage, runs modules built beside the model:
    `parallelize` returns them.
    """
    return parallelize(model, plan, mesh).model


def parallelize(model: nn.Module, plan: Plan, mesh: DeviceMesh | None = None) -> Parallelized:
    """`apply`, returning the model with what was built to run it (`Parallelized`): the caller holds them."""
    if mesh is None:
        if plan.mesh.world_size > 1 or plan.fsdp is not None:
            raise ShardlabError(
                "apply: this plan shards over tp, FSDP, pipeline stages or cp and needs the mesh from "
                "make_mesh(plan.mesh)"
            )
    else:
        _check_mesh(plan, mesh)
    kept = keep_own_stages(model, plan, mesh["pp"].get_local_rank()) if plan.pipeline is not None else None
    _check_model(model, plan, kept)
    if plan.fp8 is not None:  # first: TP's styles and FSDP's all-gather act on the Float8Linear
        convert_to_fp8(model, plan.fp8, None if kept is None else {f for f in plan.fp8.linears if in_stages(f, kept)})
    # Block indices count over the whole model, so selective checkpointing picks the same blocks in every layout.
    blocks = [(i, model.get_submodule(f)) for i, f in enumerate(plan.blocks) if kept is None or in_stages(f, kept)]
    # Checkpointing before TP: its hook keeps a block's inputs as they come, ahead of any TP hook of the block itself
    # (a transformers model's first block takes its sequence shard), so the recomputation runs that hook again on
    # the same inputs instead of on its output.
    for i, block in blocks:
        if plan.activation_checkpoint in ("full", "op") or (
            plan.activation_checkpoint == "selective" and i % plan.ac_every == 0
        ):
            checkpoint_module(block, ops=plan.activation_checkpoint == "op")
    if plan.mesh.tp > 1:
        kept_modules = plan.modules if kept is None else [m for m in plan.modules if in_stages(m.fqn, kept)]
        fp8 = plan.fp8 if plan.fp8 is not None and gathers_float8(mesh["tp"]) else None
        parallelize_module(model, mesh["tp"], {m.fqn: _tp_style(m, fp8) for m in kept_modules})
        _retie(model, plan)
    if plan.context is not None:
        attend = all_gather_attention(mesh["cp"].get_group())
        for fqn in plan.context.modules:
            if kept is None or in_stages(fqn, kept):
                _call_with(model.get_submodule(fqn), attend=attend)
    experts = ()
    expert_axes = make_expert_mesh(mesh, plan.mesh.ep) if plan.experts is not None and plan.experts.ep > 1 else None
    if plan.experts is not None:  # this rank's stages' experts
        experts = tuple(f for f in plan.experts.modules if kept is None or in_stages(f, kept))
        _expert_parallel(model, plan, mesh, expert_axes, experts)
    if plan.compile:
        for _, block in blocks:
            compile_block(block)
    roots = (model,) if kept is None else build_stages(model, plan, kept)
    # FSDP goes last: fully_shard must see the TP-sharded DTensors to shard them again over dp.
    if plan.fsdp is not None:
        f = plan.fsdp
        dp_mesh = _fsdp_mesh(mesh, f.axes)
        kwargs = dict(
            mesh=dp_mesh,
            reshard_after_forward=f.reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(param_dtype=_dtype(f.param_dtype), reduce_dtype=_dtype(f.reduce_dtype)),
            offload_policy=CPUOffloadPolicy() if f.cpu_offload else OffloadPolicy(),
            shard_placement_fn=_fsdp_dims(model, plan),
        )
        if plan.experts is not None and plan.experts.ep > 1:  # before their blocks, which leave them out
            e = plan.experts
            on = expert_mesh(expert_axes, mesh, e.fsdp_axes)
            for fqn in experts:
                unit = fully_shard(model.get_submodule(fqn), **(kwargs | {"mesh": on}))
                unit.set_gradient_divide_factor(float(e.gradient_divide_factor))
                # Sum, then divide: gloo has no PREMUL_SUM. Not over one shard: torch 2.13 would divide twice.
                unit.set_force_sum_reduction_for_comms(plan.mesh.experts.dp_shard_mod_ep > 1)
        for i, unit in enumerate(f.units):
            modules = [model.get_submodule(m) for m in unit]
            modules = [m for m in modules if next(m.parameters(), None) is not None]  # other stages' are Identity
            if modules:
                kept = {"reshard_after_forward": False} if f.last_kept and i == len(f.units) - 1 else {}
                fully_shard(modules if len(modules) > 1 else modules[0], **(kwargs | kept))
        # One FSDP root per module a pipeline stage runs: its forward must run the root's hooks. A root's backward
        # begins as its forward ends, so torch's default (None) keeps it gathered in between when the units reshard.
        for root in roots:
            fully_shard(root, **(kwargs | {"reshard_after_forward": None if f.reshard_after_forward else False}))
    return Parallelized(model, roots, expert_axes)


def _call_with(module: nn.Module, **keywords: Any) -> None:
    """Give every call of `module` `keywords`, which its forward declares (`shardlab.sharding.rules.takes_keyword`):
    a forward pre-hook, torch's way for code outside a module to shape its inputs (TP's input styles use it), so
    nothing is set on the module itself."""

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return args, {**kwargs, **keywords}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _expert_parallel(
    model: nn.Module, plan: Plan, mesh: DeviceMesh, experts: DeviceMesh | None, modules: tuple[str, ...]
) -> None:
    """Expert weights become DTensors sharded over ep and/or tp as the plan says, each rank keeping its block of
    the full weight it holds; their modules get the dispatch to them with each call, or, transformers' stacked
    experts, gather their group's tokens (shardlab.sharding.experts). experts: `make_expert_mesh`'s (ep > 1)."""
    e = plan.experts
    axes = (("ep",) if e.ep > 1 else ()) + (("tp",) if e.tensor_parallel else ())
    on = expert_mesh(experts, mesh, axes) if e.ep > 1 else mesh["tp"]
    ep = expert_mesh(experts, mesh, ("ep",)) if e.ep > 1 else None
    tp = mesh["tp"] if e.tensor_parallel else None
    dispatch = expert_dispatch(ep.get_group() if ep is not None else None, tp)
    for fqn in modules:
        module = model.get_submodule(fqn)
        for name, param in list(module.named_parameters(recurse=False)):
            mine = _placements_on(on, P(*plan.param(f"{fqn}.{name}").spec))  # FSDP's axes have size 1 on `on`
            shard_ = distribute_tensor(param.detach(), on, mine, src_data_rank=None)  # every rank has the full weight
            module.register_parameter(name, nn.Parameter(shard_, requires_grad=param.requires_grad))
        if e.stacked:
            stacked_experts(module, ep, tp)
        else:
            _call_with(module, dispatch=dispatch)


def _fsdp_dims(model: nn.Module, plan: Plan) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP's shard_placement_fn: the plan's dim for the parameters it does not shard on dim 0."""
    dims = {}
    for fqn, param in model.named_parameters():
        if (d := plan.param(fqn).fsdp_dim) != 0:
            dims[id(param)] = Shard(d)
    return lambda param: dims.get(id(param))


def _fsdp_mesh(mesh: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh:
    """FSDP's mesh: one axis or flattened view (dp_shard, dp_shard_cp), or HSDP's (dp_replicate, shard axis)."""
    if len(axes) == 1:
        return flat_view(mesh, axes[0]) if axes[0] in FLAT_VIEWS else mesh[axes[0]]
    with warnings.catch_warnings():  # torch 2.13 has no other way to pair an axis with a flattened view
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return mesh[axes]


def _check_mesh(plan: Plan, mesh: DeviceMesh) -> None:
    names = tuple(mesh.mesh_dim_names or ())
    if names != AXES:
        raise ShardlabError(f"apply: the DeviceMesh has axes {names}, not {AXES}; build it with make_mesh(plan.mesh)")
    plan.check_mesh(mesh_spec_of(mesh, plan.mesh.ep))


def _check_model(model: nn.Module, plan: Plan, stages: tuple[StagePlan, ...] | None = None) -> None:
    """The plan must describe this model (or this rank's pipeline stages of it): same parameter names and shapes."""
    have = {fqn: tuple(p.shape) for fqn, p in model.named_parameters()}
    held = None if stages is None else {s.index for s in stages}
    want = {p.fqn: p.shape for p in plan.params if held is None or p.stage in held}
    for fqn in sorted(have.keys() ^ want.keys()):
        where = "the model" if fqn in have else "the plan"
        raise ShardlabError(f"apply: parameter {fqn!r} is only in {where}; make the plan from this model (make_plan)")
    for fqn, shape in want.items():
        if have[fqn] != shape:
            raise ShardlabError(
                f"apply: {fqn} has shape {have[fqn]} but the plan says {shape}; make the plan from this model"
            )


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _tp(spec: Spec | None) -> Placement | None:
    """The tp placement of an activation spec: Shard(dim) where tp splits it, else Replicate."""
    if spec is None:
        return None
    dim = P(*spec).dim_of("tp")
    return Replicate() if dim is None else Shard(dim)


def _tp_style(m: ModulePlan, fp8: Fp8Plan | None) -> ParallelStyle:
    """The module's ParallelStyle; `fp8`: the FP8 linears whose styles gather float8 inputs (None: none do)."""
    inp = _tp(m.inputs[0]) if m.inputs else None
    out = _tp(m.output)
    if m.style in ("colwise", "embedding_colwise"):
        style = fp8_tp_style(ColwiseParallel, fp8, m.fqn)
        return style(input_layouts=inp, output_layouts=out, use_local_output=m.local_output)
    if m.style in ("rowwise", "embedding_rowwise"):
        default_in = Replicate() if m.style == "embedding_rowwise" else None
        style = fp8_tp_style(RowwiseParallel, fp8, m.fqn)
        return style(input_layouts=inp or default_in, output_layouts=out, use_local_output=m.local_output)
    if m.style == "sequence_parallel":
        return SequenceParallel(sequence_dim=inp.dim, use_local_output=m.local_output)
    if m.style == "prepare_input_output":
        return PrepareModuleInputOutput(
            input_layouts=tuple(_tp(x) for x in m.inputs),
            desired_input_layouts=tuple(_tp(x) for x in m.desired_inputs),
            use_local_input=True,
            output_layouts=_tp(m.output),
            desired_output_layouts=_tp(m.desired_output),
        )
    if m.style == "prepare_input":
        return PrepareModuleInput(
            input_layouts=None if m.inputs is None else tuple(_tp(x) for x in m.inputs),
            desired_input_layouts=None if m.desired_inputs is None else tuple(_tp(x) for x in m.desired_inputs),
            input_kwarg_layouts=None if m.kwarg_inputs is None else {k: _tp(x) for k, x in m.kwarg_inputs},
            desired_input_kwarg_layouts=(
                None if m.desired_kwarg_inputs is None else {k: _tp(x) for k, x in m.desired_kwarg_inputs}
            ),
            use_local_output=m.local_output,
        )
    raise ShardlabError(f"{m.fqn}: unknown style {m.style!r} in the plan; re-run make_plan")


def _retie(model: nn.Module, plan: Plan) -> None:
    """parallelize_module replaces each module's parameters separately: point tied names at one tensor again."""
    for p in plan.params:
        for alias in p.aliases:
            owner, _, name = alias.rpartition(".")
            setattr(model.get_submodule(owner), name, model.get_parameter(p.fqn))


def _placements_on(mesh: DeviceMesh, spec: P, shape: tuple[int, ...] | None = None) -> list[Placement]:
    """A spec's placements on `mesh` (from make_mesh, a slice of it, or an expert weight's mesh); with a shape, its
    dims must divide."""
    spec_mesh = mesh_spec_of(mesh)
    if shape is not None:
        check_shape(expand(spec, spec_mesh), spec_mesh, shape)
    full = placements(spec, spec_mesh)
    return [full[spec_mesh.axis_names.index(n)] for n in mesh.mesh_dim_names]


def shard(tensor: torch.Tensor, mesh: DeviceMesh, spec: P) -> DTensor:
    """`jax.device_put(x, NamedSharding(mesh, spec))`: distribute a full tensor with a PartitionSpec."""
    return distribute_tensor(tensor, mesh, _placements_on(mesh, P(*spec), tuple(tensor.shape)))


def constrain(x: torch.Tensor, spec: P) -> torch.Tensor:
    """`with_sharding_constraint`: redistribute a DTensor to `spec` on its own mesh; a plain tensor is returned as is."""
    if not isinstance(x, DTensor):
        return x
    return x.redistribute(x.device_mesh, _placements_on(x.device_mesh, P(*spec), tuple(x.shape)))


def shard_map(
    fn: Callable[..., Any],
    mesh: DeviceMesh,
    in_specs: tuple[P | None, ...],
    out_specs: P | tuple[P | None, ...] | None,
) -> Callable[..., Any]:
    """`jax.shard_map(fn, mesh, in_specs, out_specs)` over torch's `local_map`: `fn` runs on this rank's blocks.

    A DTensor argument is redistributed to its spec (None: kept as it is) and `fn` gets its local block; a plain
    tensor with a spec is taken to be this rank's block of a tensor with that spec; anything else (a spec of None)
    is passed as is. Arguments are positional, one spec each. Tensor outputs
    become DTensors on `mesh` with `out_specs` (one P, or a tuple with one per output; None: replicated, or a
    value that is not a tensor; with no DTensor among the arguments, local_map returns `fn`'s outputs as they are).
    Collectives inside `fn` take `mesh[axis].get_group()`; `mesh` is one from
    make_mesh or a slice of it. Gradients follow local_map: each block's gradient lands in its DTensor's shard, with
    the input's placements, so a replicated input whose ranks compute different things needs `fn` to sum its
    gradient itself (JAX inserts that psum; torch does not).
    """

    def lower(spec: P | None) -> list[Placement] | None:  # local_map: a list per value, a tuple of them per output
        return None if spec is None else _placements_on(mesh, P(*spec))

    single = out_specs is None or isinstance(out_specs, P)
    out_placements = lower(out_specs) if single else tuple(lower(s) for s in out_specs)

    def run(*args: Any) -> Any:
        if len(args) != len(in_specs):
            raise ShardlabError(
                f"shard_map: {len(args)} arguments but {len(in_specs)} in_specs; give one spec per argument"
            )
        args = tuple(  # a plain tensor with a spec is this rank's block of a global tensor with that spec
            DTensor.from_local(a, mesh, lower(s)) if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            and s is not None else a
            for a, s in zip(args, in_specs)
        )  # fmt: skip
        in_placements = tuple(
            (a.placements if s is None else lower(s)) if isinstance(a, DTensor) else None
            for a, s in zip(args, in_specs)
        )
        mapped = local_map(
            fn, out_placements=out_placements, in_placements=in_placements, device_mesh=mesh, redistribute_inputs=True
        )
        return mapped(*args)

    return run
