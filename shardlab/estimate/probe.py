"""probe(cfg) -> Probe: run one micro batch of the real layout on fake tensors and record what happens.

The estimator's measurements, so they cannot drift from what `apply` and `step` do: in a fake world of
the config's size (this process is rank 0, the worst rank; with pipelines, the first rank of the busiest pp
rank), the model is planned, built on the meta
device, parallelized by `apply`, given fake storage, and one micro batch goes through `forward_backward`
(with pipeline stages: through each stage this pp rank runs, as torch's PipelineStage would; the schedule's
order and its sends are left to shardlab.estimate). A dispatch mode (torch's CommDebugMode, which also
counts) records every collective with its mesh axis, phase and bytes, every op's FLOPs and bytes moved, and
what the forward leaves alive (activations).

A model of L identical blocks is probed with 2k and 3k blocks per stage (k = the activation-checkpointing
period); every quantity is linear in the number of blocks, so the two probes give it for L exactly (for
uneven pipeline stages, to the nearest byte), in seconds even for 405B on 4096 ranks.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any, Literal

import msgspec
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from shardlab._activation_checkpoint import in_backward
from shardlab._base import Frozen
from shardlab._device_mesh import _experts_of, flat_view, make_mesh
from shardlab.apply import apply
from shardlab.config import Config
from shardlab.context_parallel import cp_positions
from shardlab.estimate._fake import (
    cached_sharding_propagation,
    fake_tensors,
    fake_world,
    forget_dtensor_dispatch,
    inferring_dtensor_shapes,
)
from shardlab.loss import summed_loss
from shardlab.mesh import AXES, FLAT_VIEWS
from shardlab.metrics import module_flops
from shardlab.models.provider import ModelProvider, provider_for
from shardlab.plan import Plan, make_plan
from shardlab.routers import moe_layers
from shardlab.rules import Rules
from shardlab.stages import stage_modules
from shardlab.step import forward_backward

Kind = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send"]
Phase = Literal["forward", "backward"]

aten, c10d = torch.ops.aten, torch.ops.c10d
funcol = (torch.ops._c10d_functional, torch.ops.c10d_functional, torch.ops._c10d_functional_autograd)
KINDS: dict[Any, Kind] = {
    c10d._allgather_base_: "all_gather",
    c10d.allgather_: "all_gather",
    c10d.allgather_into_tensor_coalesced_: "all_gather",
    c10d._reduce_scatter_base_: "reduce_scatter",
    c10d.reduce_scatter_: "reduce_scatter",
    c10d.reduce_scatter_tensor_coalesced_: "reduce_scatter",
    c10d.allreduce_: "all_reduce",
    c10d.allreduce_coalesced_: "all_reduce",
    c10d.alltoall_base_: "all_to_all",
    c10d.broadcast_: "broadcast",
    **{getattr(ns, name): kind for ns in funcol for name, kind in (
        ("all_gather_into_tensor", "all_gather"), ("reduce_scatter_tensor", "reduce_scatter"),
        ("all_reduce", "all_reduce"), ("all_to_all_single", "all_to_all"), ("broadcast", "broadcast"),
    ) if hasattr(ns, name)},
}  # fmt: skip
"""Collective op -> kind. A kind's bytes are its full buffer: the gathered output, the scattered input."""

NO_TRAFFIC = {
    aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.empty_like, aten._unsafe_view,
    aten.resize_, aten.set_, aten.lift_fresh, aten._local_scalar_dense,
}  # fmt: skip
"""Ops that allocate or relabel memory without reading or writing it (with views and prim/profiler ops)."""
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: (sdpa_flop_count, 3, 4),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (sdpa_backward_flop_count, 4, 7),
}
"""CPU's flash attention, which torch's flop counter lacks: (formula, tensors it reads shapes of, is_causal's position)."""
OpKind = Literal["matmul", "attention", "memory"]
"""How the roofline prices an op (shardlab.estimate.kernels): attention kernels, other ops with FLOPs, ops without."""
ATTENTION = {*CPU_ATTENTION, *(p for p in flop_registry if "attention" in str(p))}


class Collective(Frozen):
    """All collectives of one kind on one mesh axis in one phase, per micro batch on the probed rank."""

    axis: str
    """Mesh axis or flattened view (`dp` for HSDP's 2-D FSDP mesh) whose group ran it."""
    kind: Kind
    phase: Phase
    count: int
    bytes: int
    """Summed full-buffer bytes."""
    group_size: int
    stage: int | None = None
    """The pipeline stage whose forward or backward ran it (None without a pipeline)."""


class Probe(Frozen):
    """One micro batch of forward + backward on the probed rank, for the whole model (with pipelines: for the
    probed pp rank's stages)."""

    collectives: tuple[Collective, ...]
    flops: int
    """Executed FLOPs: matmuls and attention (causal attention as run, half the square), recomputation included."""
    ops: tuple[tuple[int, int, int, OpKind], ...]
    """(FLOPs, bytes read + written, how many such ops, kind): the roofline's input, one entry per distinct op."""
    activation_bytes: int
    """Bytes the forward leaves alive for the backward (saved tensors, checkpoint inputs, logits, loss)."""
    block_activation_bytes: int
    """What one more block adds to activation_bytes (a model of at most 3 periods: the mean over its blocks)."""


class _Recorder(CommDebugMode):
    """CommDebugMode (torch's collective counter) that also keeps bytes, axes, FLOPs and live storages."""

    def __init__(self, axis_of_group: dict[str | tuple[str, str], str], grouped_rows: float = 1.0) -> None:
        super().__init__()
        self.axis_of_group = axis_of_group
        self.grouped_rows = grouped_rows
        """The share of a grouped matmul's rows it computes: transformers' stacked experts split over ep x tp
        see every row of their group, and compute only those routed to their experts (evenly, 1 / (ep x tp))."""
        self.stage: int | None = None
        self.collectives: Counter[tuple[str, Kind, Phase, int, int | None]] = Counter()
        self.collective_bytes: Counter[tuple[str, Kind, Phase, int, int | None]] = Counter()
        self.ops: Counter[tuple[int, int, OpKind]] = Counter()
        self.flops = 0
        self.storages: dict[int, StorageWeakRef] = {}
        self.activation_bytes = 0

    def __enter__(self) -> _Recorder:
        """CommDebugMode's, without its module tracker: its hooks assume each module's forward and backward nest,
        which a pipeline schedule's interleaved micro batches break, and nothing here reads per-module counts."""
        self.comm_counts.clear()
        self.comm_module_counts.clear()
        self.comm_module_counts["Global"] = {"forward": defaultdict(int), "backward": defaultdict(int)}
        self.comm_module_operation_counts.clear()
        tracker = self.advanced_module_tracker  # never entered: every count goes to the root, outside any module
        tracker.name, tracker.module_parents_dict["Global"] = "Global", set()
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args: Any) -> None:
        TorchDispatchMode.__exit__(self, *args)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            # torch's shape function for grouped matmuls (transformers' stacked experts) accepts bf16 only, though
            # the CPU kernel runs any float: the shapes are the same, so infer them in bf16
            out_dtype = (kwargs or {}).get("out_dtype") or args[0].dtype
            cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            return self.__torch_dispatch__(func, types, tuple(cast), kwargs).to(out_dtype)
        if inferring_dtensor_shapes():  # DTensor runs the global op on fake tensors to learn its output shape
            return func(*args, **(kwargs or {}))  # nothing runs on any rank: neither count nor keep it
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented:
            forget_dtensor_dispatch()  # so that its local ops come back here
            return out
        if not hasattr(func, "_overloadpacket"):
            return out
        packet = func._overloadpacket
        outputs = list(_tensors(out))
        for t in outputs:  # collectives' outputs too: an SP reduce-scatter's output is the next residual stream
            s = t.untyped_storage()
            known = self.storages.get(s._cdata)
            if known is None or known.expired():  # a freed storage's address can come back for a new one
                self.storages[s._cdata] = StorageWeakRef(s)
        kind = KINDS.get(packet)
        if kind is not None:
            self._collective(packet, kind, args)
            return out
        if func.is_view or packet in NO_TRAFFIC or func.namespace in ("prim", "profiler"):
            return out
        flops = _flops(packet, args, kwargs or {}, out)
        if packet is aten._grouped_mm:
            flops = round(flops * self.grouped_rows)
        moved = sum(t.nbytes for t in _tensors((args, kwargs)) if t.numel()) + sum(t.nbytes for t in outputs)
        self.flops += flops
        self.ops[(flops, moved, "attention" if packet in ATTENTION else "matmul" if flops else "memory")] += 1
        return out

    def _collective(self, packet: Any, kind: Kind, args: tuple) -> None:
        name, size = _group(args)
        # c10d ops take (output, input): an all-gather's full buffer is its output, a reduce-scatter's its input.
        # funcol ops take the input alone: an all-gather's shard, a reduce-scatter's full buffer.
        full = 1 if packet in (c10d._reduce_scatter_base_, c10d.reduce_scatter_) else 0
        nbytes = sum(t.nbytes for t in _tensors(args[full : full + 1]))
        if kind == "all_gather" and packet not in (c10d._allgather_base_, c10d.allgather_):
            nbytes *= size
        phase: Phase = "backward" if in_backward() else "forward"
        axis = self.axis_of_group.get((kind, name)) or self.axis_of_group.get(name, f"group of {size}")
        key = (axis, kind, phase, size, self.stage)
        self.collectives[key] += 1
        self.collective_bytes[key] += nbytes

    def live_bytes(self, exclude: set[int]) -> int:
        """Bytes of storages made under this mode that are still alive and not in `exclude`."""
        total = 0
        for key, ref in self.storages.items():
            if key not in exclude and not ref.expired():
                total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    for leaf in torch.utils._pytree.tree_leaves(tree):
        if isinstance(leaf, DTensor):
            yield leaf._local_tensor
        elif isinstance(leaf, torch.Tensor):
            yield leaf


def _group(args: tuple) -> tuple[str, int]:
    """(group name, group size) of a collective's arguments: a ProcessGroup object or a funcol group name."""
    for a in reversed(args):  # a funcol op's group name is its last string (a reduce op is a string too)
        if isinstance(a, str):
            pg = dist.distributed_c10d._resolve_process_group(a)
            return a, pg.size()
        if isinstance(a, dist.ProcessGroup):
            return a.group_name, a.size()
        if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith("ProcessGroup"):
            pg = dist.ProcessGroup.unbox(a)
            return pg.group_name, pg.size()
    raise ValueError(f"probe: no process group among the collective's arguments {args!r}")


def _flops(packet: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs one op executes: torch's flop_counter formulas, plus CPU's flash attention (causal: half)."""
    if packet in CPU_ATTENTION:
        formula, n_shapes, causal_at = CPU_ATTENTION[packet]
        full = formula(*(tuple(t.shape) for t in args[:n_shapes]))
        causal = kwargs.get("is_causal", args[causal_at] if len(args) > causal_at else False)
        return full // 2 if causal else full
    if packet is aten._grouped_mm:  # every row of mat_a meets one [K, N] matrix: 2 K N each
        return 2 * args[0].numel() * args[1].shape[-1]
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))  # the registry's formulas take tensors and read shapes


def _axis_names(mesh: DeviceMesh) -> dict[str | tuple[str, str], str]:
    """Each group's axis name; (kind, group) keys name one kind of collective on a group that several axes share."""
    names: dict[str | tuple[str, str], str] = {}
    for view in FLAT_VIEWS:
        if math.prod(mesh[a].size() for a in FLAT_VIEWS[view] if mesh[a].size() > 1) > 1:
            names.setdefault(flat_view(mesh, view).get_group().group_name, view)  # the narrowest view's name
    for axis in AXES:  # single axes win over views with the same group (a view of one axis of size > 1)
        if mesh[axis].size() > 1:
            names[mesh[axis].get_group().group_name] = axis
    experts = _experts_of(mesh)
    for axis in experts.mesh_dim_names if experts is not None else ():  # the expert mesh's own groups
        if experts[axis].size() > 1:
            names.setdefault(experts[axis].get_group().group_name, axis)
            if axis == "ep":  # the dispatch's all-to-alls are ep's, even where ep is all of dp_shard (same ranks)
                names["all_to_all", experts[axis].get_group().group_name] = "ep"
    return names


def _probe_layers(
    cfg: Config,
    rules: Rules | None,
    provider: ModelProvider,
    mesh: DeviceMesh,
    n_layers: int,
    forward_only: bool,
) -> _Recorder:
    if n_layers != provider.n_layers:  # a smaller model of the same shape; its stages split evenly
        provider = provider.with_layers(n_layers)
        cfg = msgspec.structs.replace(cfg, plan=msgspec.structs.replace(cfg.plan, pp_split=(), pp_balance="blocks"))
    with torch.device("meta"):
        model = provider.build()
    flops = None
    if cfg.mesh.pp > 1 and cfg.plan.pp_balance == "flops":  # the model as configured: its stages split by FLOPs
        sample = torch.zeros(1, cfg.train.seq_len, dtype=torch.long, device="meta")
        flops = module_flops(model, sample, provider.forward)
    plan = make_plan(model, cfg.mesh, rules or provider.rules(cfg.plan), cfg.plan, flops)
    apply(model, plan, mesh)
    for layer in moe_layers(model):  # fake tensors hold no data to route: every expert gets the same load
        layer.balanced = True
    dp = cfg.mesh.size("dp")
    micro = cfg.micro_batches
    rows = cfg.train.global_batch // dp // micro
    e = plan.experts
    recorder = _Recorder(
        _axis_names(mesh), 1 / (e.ep * (plan.mesh.tp if e.tensor_parallel else 1)) if e and e.stacked else 1
    )
    with fake_tensors():
        model.to_empty(device="cpu")
        positions = None
        if plan.context is not None:  # cp rank 0's chunks of every sequence
            positions = cp_positions(cfg.train.seq_len, cfg.mesh.cp, mesh["cp"].get_local_rank())
        tokens = torch.zeros((rows, cfg.train.seq_len // cfg.mesh.cp), dtype=torch.long)

        def after_forward() -> None:
            recorder.activation_bytes = recorder.live_bytes(_param_storages(model))
            if forward_only:
                raise _ForwardDone

        with recorder, contextlib.suppress(_ForwardDone), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            if plan.pipeline is None:
                forward_backward(
                    model, tokens, tokens, 1.0, plan.loss_parallel, after_forward, positions, forward=provider.forward
                )
            else:
                _stages_forward_backward(
                    model, plan, mesh, cfg, provider.dim, tokens, after_forward, recorder, positions
                )
    return recorder


def stage_boundary(cfg: Config, plan: Plan, rows: int, dim: int) -> tuple[tuple[int, int, int], torch.dtype]:
    """Shape and dtype of what one pipeline stage hands the next for a micro batch of `rows` sequences: the
    residual stream of the rank's tokens (its cp chunks, sequence-sharded over tp under SP), in the parameters'
    compute dtype."""
    sp = cfg.mesh.tp if cfg.plan.sequence_parallel else 1
    dtype = getattr(torch, plan.fsdp.param_dtype) if plan.fsdp is not None else torch.float32
    return (rows, cfg.train.seq_len // cfg.mesh.cp // sp, dim), dtype


def _stages_forward_backward(
    model: nn.Module,
    plan: Plan,
    mesh: DeviceMesh,
    cfg: Config,
    dim: int,
    tokens: torch.Tensor,
    after_forward: Callable[[], None],
    recorder: _Recorder,
    positions: torch.Tensor | None = None,
) -> None:
    """One micro batch through each of this rank's pipeline stages, as torch's PipelineStage runs them: the first
    stage takes the tokens, the others a residual-stream tensor from the previous stage (sequence-sharded under
    SP); the last stage's loss is backpropagated, the others' outputs get a gradient from the next stage."""
    stages = plan.pipeline.stages_of(mesh["pp"].get_local_rank())
    last = len(plan.pipeline.stages) - 1
    hidden, dtype = stage_boundary(cfg, plan, tokens.shape[0], dim)
    outputs = []
    with loss_parallel() if plan.loss_parallel else contextlib.nullcontext():
        for module, stage in zip(stage_modules(model), stages, strict=True):
            recorder.stage = stage.index
            x = tokens if stage.index == 0 else torch.zeros(hidden, dtype=dtype, requires_grad=True)
            y = module(x) if positions is None else module(x, positions=positions)
            if stage.index == last:
                y = summed_loss(y, tokens)
            outputs.append((stage.index, y))
        after_forward()
        for index, y in reversed(outputs):  # the schedule runs the backwards in reverse stage order
            recorder.stage = index
            y.backward() if y.ndim == 0 else y.backward(torch.ones_like(y))


class _ForwardDone(Exception):
    pass


def _param_storages(model: nn.Module) -> set[int]:
    """Storages of the parameters as registered now (FSDP's unsharded ones between forward and backward), and
    FSDP's sharded ones, which its lazy init re-allocates in the first forward and which stay alive while the
    unsharded ones are registered (reshard_after_forward=False): the plan counts them, not the activations."""
    local = [p._local_tensor if isinstance(p, DTensor) else p for p in model.parameters()]
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group  # torch keeps the shards there, unregistered
            local += [fp._sharded_param_data for fp in group.fsdp_params] if group is not None else []
    return {t.untyped_storage()._cdata for t in local}


def probe(
    cfg: Config,
    rules: Rules | None = None,
    *,
    forward_only: bool = False,
    pp_rank: int = 0,
    blocks: int | None = None,
    provider: ModelProvider | None = None,
) -> Probe:
    """What one micro batch of `cfg` (resolved: its mesh names the world) does on rank 0, for the whole model
    (with pipelines: on the first rank of pp rank `pp_rank`, for its stages).

    provider: the model (default: the one the config names); rules: its layout (default: the provider's); they
    must not depend on the number of blocks. forward_only stops
    after the forward: only activation_bytes and the forward's collectives and ops are then filled.
    With pipeline stages: one pipeline micro batch through the stages of pp rank `pp_rank` (this process is its
    first rank), which hold `blocks` blocks in cfg's plan (default: an even share).
    """
    return measure(cfg, rules, forward_only=forward_only, pp_rank=pp_rank, provider=provider).at(blocks)


class Measurement:
    """The probes of a model cut to two sizes (or of the whole model), from which `at` gives any number of blocks."""

    def __init__(self, records: list[_Recorder], n: int, k: int, v: int, stages: int) -> None:
        self.records = [
            (r.collectives.copy(), r.collective_bytes.copy(), r.ops.copy(), r.flops, r.activation_bytes)
            for r in records
        ]
        self.n, self.k, self.v, self.stages = n, k, v, stages

    def at(self, blocks: int | None = None) -> Probe:
        """The probe of the probed rank holding `blocks` blocks (default: an even share of the model's)."""
        n, k, v = self.n, self.k, self.v
        held = (n * v // self.stages if blocks is None else blocks) if self.stages > 1 else n
        if len(self.records) == 1:
            a = b = self.records[0]
            scale = 0.0
            per_block = a[4] / held
        else:
            a, b = self.records
            # quantity(held) = quantity(2k v) + (held - 2k v) / (k v) * (quantity(3k v) - quantity(2k v))
            scale = (held - 2 * k * v) / (k * v)
            per_block = (b[4] - a[4]) / (k * v)
        exact = abs(scale - round(scale)) < 1e-9  # uneven pipeline stages land between two probed sizes

        def extend(x: int, y: int) -> int:
            value = x + scale * (y - x)
            if value < 0 or (exact and abs(value - round(value)) > 1e-6 * max(1.0, abs(value))):
                raise AssertionError(f"probe: a quantity is not linear in blocks ({x}, then {y} with {k * v} more)")
            return round(value)

        keys = a[0].keys() | b[0].keys()
        collectives = tuple(
            Collective(
                axis=axis, kind=kind, phase=phase, group_size=size, stage=stage,
                count=extend(a[0][key], b[0][key]), bytes=extend(a[1][key], b[1][key]),
            )
            for key in sorted(keys, key=str)
            for axis, kind, phase, size, stage in [key]
        )  # fmt: skip
        ops = tuple(sorted((*key[:2], extend(a[2][key], b[2][key]), key[2]) for key in a[2].keys() | b[2].keys()))
        return Probe(
            collectives=tuple(c for c in collectives if c.count),
            flops=extend(a[3], b[3]),
            ops=tuple(op for op in ops if op[2]),
            activation_bytes=extend(a[4], b[4]),
            block_activation_bytes=round(per_block),
        )


def measure(
    cfg: Config,
    rules: Rules | None = None,
    *,
    forward_only: bool = False,
    pp_rank: int = 0,
    provider: ModelProvider | None = None,
) -> Measurement:
    """`probe`'s runs, before they are extended to a number of blocks: probes of one model serve every count."""
    provider = provider or provider_for(cfg)
    n = provider.n_layers
    k = cfg.plan.ac_every if cfg.plan.activation_checkpoint == "selective" else 1
    pp, v = cfg.mesh.pp, cfg.plan.pp_stages_per_rank if cfg.mesh.pp > 1 else 1
    stages = pp * v  # the model's blocks split into `stages` stages, v of them on this rank
    # Two and three periods per stage: the first and the last block differ from the middle ones (FSDP prefetches
    # and reshards them differently), so every probe holds both and the difference is one middle period.
    sizes = (n,) if n <= 3 * k * stages else (2 * k * stages, 3 * k * stages)
    rank = pp_rank * (cfg.mesh.world_size // pp)
    with fake_world(cfg.mesh.world_size, rank), cached_sharding_propagation():
        # One mesh for both probes: DTensor caches redistributions by mesh equality, so a second equal mesh
        # would run on the first one's groups.
        mesh = make_mesh(cfg.mesh, "cpu")
        records = [_probe_layers(cfg, rules, provider, mesh, size, forward_only) for size in sizes]
    return Measurement(records, n, k, v, stages)
