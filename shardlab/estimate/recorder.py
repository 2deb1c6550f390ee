"""What a fake run records: a dispatch mode that keeps every collective (mesh axis, phase, bytes), every op's
FLOPs and bytes moved (in the order they ran), and the storages a forward leaves alive.

What FSDP runs to gather weights again in the backward (its pre-backward unshard and backward prefetch, named by
torch's record_function) is kept apart too: with reshard_after_forward=False those gathers find the weights
gathered and do nothing, so one probe that reshards gives both (`Measurement.at`).

`shardlab.estimate.probe` runs the model under it; scripts run real tensors under it to compare the two.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from shardlab._base import Frozen
from shardlab._errors import ShardlabError
from shardlab.estimate._fake import forget_dtensor_dispatch, inferring_dtensor_shapes
from shardlab.parallel._activation_checkpoint import in_backward, recomputing
from shardlab.parallel.device_mesh import flat_view
from shardlab.sharding.mesh import AXES, FLAT_VIEWS

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
    *(ns._wrap_tensor_autograd for ns in funcol if hasattr(ns, "_wrap_tensor_autograd")),
}  # fmt: skip
"""Ops that allocate or relabel memory without reading or writing it (with views and prim/profiler ops; a functional
collective's output wrapped for autograd, which real tensors dispatch and fake ones do not)."""
DEVICE = torch.ops.prim.device.default
"""A tensor's `.device` under a mode that fakes it: asked at every turn by models, FSDP and DTensor."""
WAITS = {ns.wait_tensor for ns in funcol if hasattr(ns, "wait_tensor")}
"""Ops that wait for a functional collective's result and return it: an op to dispatch, no bytes to move."""
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: (sdpa_flop_count, 3, 4),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (sdpa_backward_flop_count, 4, 7),
}
"""CPU's flash attention, which torch's flop counter lacks: (formula, tensors it reads shapes of, is_causal's position)."""
OpKind = Literal["matmul", "fp8_matmul", "attention", "memory"]
"""How the roofline prices an op (shardlab.estimate.kernels): attention kernels, float8 matmuls (torchao's
Float8Linear: `_scaled_mm`, at the device's FP8 peak), other ops with FLOPs, ops without (its float8 casts too)."""
ATTENTION = {*CPU_ATTENTION, *(p for p in flop_registry if "attention" in str(p))}
REGATHER = ("FSDP::pre_backward", "FSDP::backward_prefetch")
"""torch's record_function names of FSDP's backward unshard (its own, and a prefetch of the next unit's)."""
GATHER, REDUCE = "FSDP::all_gather", "FSDP::post_backward_reduce"
"""torch's record_function names around FSDP's gathers (copying the shards in and the gathered weights out) and its
reduction of gradients (copying them into the reduce-scatter's buffer)."""
Role = Literal["", "gather", "regather", "reduce", "recompute"]
"""Whose op it is: the step's own (""), FSDP's in the forward's gathers, in the backward's gathers again (what
reshard_after_forward=False skips), or in the gradients' reduction; or the step's recomputing checkpointed
activations (a forward inside the backward). A pipeline runs FSDP's backward gathers and reductions per step or per
gather, not per micro batch (shardlab.estimate's `per_step`)."""
FSDP_ROLES = ("gather", "regather", "reduce")
"""The roles of what FSDP runs."""


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


class Recorder(TorchDispatchMode):
    """A dispatch mode that counts collectives (kind, mesh axis, phase, bytes), every op's FLOPs and bytes, and the
    storages a forward leaves alive. It runs each op itself: as the base of this mode, torch's CommDebugMode, which
    counts collectives too, cost an eighth of a search in bookkeeping nothing here reads (tests/worlds/test_probe.py
    checks that the two count the same collectives)."""

    def __init__(
        self, axis_of_group: dict[str | tuple[str, str], str], grouped_rows: float = 1.0, fused_casts: bool = False
    ) -> None:
        super().__init__()
        self.axis_of_group = axis_of_group
        self.grouped_rows = grouped_rows
        """The share of a grouped matmul's rows it computes: transformers' stacked experts split over ep x tp
        see every row of their group, and compute only those routed to their experts (evenly, 1 / (ep x tp))."""
        self.fused_casts = fused_casts
        """Count torchao's float8 casts as compiled blocks run them (`_fused_cast`), not op by op."""
        self._cast_source: int | None = None
        """Bytes the float8 cast under way reads of its source (None: none under way)."""
        self.stage: int | None = None
        self.collectives: Counter[tuple[str, Kind, Phase, int, int | None]] = Counter()
        self.collective_bytes: Counter[tuple[str, Kind, Phase, int, int | None]] = Counter()
        self.ops: Counter[tuple[int, int, OpKind]] = Counter()
        self.sequence: list[tuple[int, int, OpKind, Role, int | None]] = []
        """Every op as it ran: (FLOPs, bytes, kind, whose it is, the pipeline stage that ran it)."""
        self.stage_activations: dict[int | None, int] = {}
        """What each pipeline stage's forward left alive (they add up to activation_bytes)."""
        self.regathers: Counter[tuple[str, Kind, Phase, int, int | None]] = Counter()
        self.regather_bytes: Counter[tuple[str, Kind, Phase, int, int | None]] = Counter()
        """The part of `collectives` and `collective_bytes` that FSDP ran to gather weights again in the backward."""
        self.scopes: list[str] = []
        """The record_function names entered and not yet left."""
        self.flops = 0
        self.storages: dict[int, StorageWeakRef] = {}
        self.activation_bytes = 0
        self._repeated: tuple[int, int] | None = None
        """Where the ops that `repeat` counts again begin: (their first in `sequence`, the collectives then)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if DTensor in types:  # DTensor desugars it into local ops and collectives, which come back here
            forget_dtensor_dispatch()
            return NotImplemented
        if func is DEVICE:  # half of what a probe dispatches; nothing to count
            return func(*args, **(kwargs or {}))
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            # torch's shape function for grouped matmuls (transformers' stacked experts) accepts bf16 only, though
            # the CPU kernel runs any float: the shapes are the same, so infer them in bf16
            out_dtype = (kwargs or {}).get("out_dtype") or args[0].dtype
            cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            return self.__torch_dispatch__(func, types, tuple(cast), kwargs).to(out_dtype)
        out = func(*args, **(kwargs or {}))
        if inferring_dtensor_shapes() or not hasattr(func, "_overloadpacket"):
            # DTensor runs the global op on fake tensors to learn its output shape: nothing runs on any rank, so
            # neither count nor keep it; a higher-order op's own ops come back here
            return out
        packet = func._overloadpacket
        if packet is torch.ops.profiler._record_function_enter_new:
            self.scopes.append(args[0])
        elif packet is torch.ops.profiler._record_function_exit and self.scopes:
            self.scopes.pop()
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
        inputs = [t if (data := _float8_data(t)) is None else data for t in _tensors((args, kwargs))]
        moved = sum(t.nbytes for t in inputs if t.numel()) + sum(t.nbytes for t in outputs)
        if packet in WAITS:
            moved = 0
        self.flops += flops
        float8 = packet is aten._scaled_mm or any(t.dtype in FLOAT8 for t in inputs)
        op_kind: OpKind = (
            "attention" if packet in ATTENTION else "fp8_matmul" if flops and float8 else
            "matmul" if flops else "memory"
        )  # fmt: skip
        if self.fused_casts and op_kind == "memory" and not float8 and _in_float8_cast():
            fused = self._fused_cast(packet, inputs, outputs)
            if fused is None:
                return out
            moved = fused
        self.ops[(flops, moved, op_kind)] += 1
        self.sequence.append((flops, moved, op_kind, self._role(), self.stage))
        return out

    def _fused_cast(self, packet: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int | None:
        """The bytes an op of one of torchao's float8 casts moves as torch.compile runs the cast: two passes over its
        source, one taking its amax (torchao's `abs`, whose reduction and the scale's arithmetic on it fuse in), one
        scaling, clamping and casting it (the intermediates in fp32 are never written); each writes only its result.
        The pass's other ops move nothing of their own (None). Eager, the same cast is six kernels, four of them
        reading or writing every element in fp32 (BENCHMARKS.md: tensorwise FP8 2.2x slower than bf16 eager on an
        H200, 5.6% faster compiled)."""
        source = sum(t.nbytes for t in inputs if t.numel() > 1)
        if any(t.dtype in FLOAT8 for t in outputs):  # the cast's result: the second pass
            read, self._cast_source = self._cast_source, None
            return (source if read is None else read) + sum(t.nbytes for t in outputs)
        if packet is aten.abs:  # a cast's amax pass: what each of its passes reads
            self._cast_source = source
            return source
        if self._cast_source is None and source:  # a cast by a scale given (no amax): its first op reads the source
            self._cast_source = source
        return None

    def begin(self) -> None:
        """The ops from here on are one of identical iterations (`training.loss.chunks_counted_by`)."""
        self._repeated = (len(self.sequence), self.collectives.total())

    def repeat(self, times: int) -> None:
        """The ops since `begin` ran `times` more times: counted, and in `sequence`, as if they had."""
        if self._repeated is None:
            raise ShardlabError("probe: a loop's iterations repeated before one began")
        (start, collectives), self._repeated = self._repeated, None
        if self.collectives.total() != collectives:
            raise ShardlabError("probe: a loop counted once for all its iterations ran collectives")
        once = self.sequence[start:]
        for flops, moved, kind, _, _ in once:
            self.ops[(flops, moved, kind)] += times
            self.flops += flops * times
        self.sequence.extend(once * times)

    def _role(self) -> Role:
        if self._regathering():
            return "regather"
        if any(scope.startswith(GATHER) for scope in self.scopes):
            return "gather"
        if any(scope.startswith(REDUCE) for scope in self.scopes):
            return "reduce"
        return "recompute" if recomputing() else ""

    def _regathering(self) -> bool:
        """Whether FSDP is gathering weights again in the backward (what reshard_after_forward=False skips)."""
        return any(scope.startswith(REGATHER) for scope in self.scopes)

    def _collective(self, packet: Any, kind: Kind, args: tuple) -> None:
        name, size = _group(args)
        # c10d ops take (output, input): an all-gather's full buffer is its output, a reduce-scatter's its input.
        # funcol ops take the input alone: an all-gather's shard, a reduce-scatter's full buffer.
        full = 1 if packet in (c10d._reduce_scatter_base_, c10d.reduce_scatter_) else 0
        nbytes = sum(
            t.nbytes if (data := _float8_data(t)) is None else data.nbytes for t in _tensors(args[full : full + 1])
        )
        if kind == "all_gather" and packet not in (c10d._allgather_base_, c10d.allgather_):
            nbytes *= size
        phase: Phase = "backward" if in_backward() else "forward"
        fsdp = self.axis_of_group.get(("fsdp", name)) if self._role() in FSDP_ROLES else None
        axis = fsdp or self.axis_of_group.get((kind, name)) or self.axis_of_group.get(name, f"group of {size}")
        key = (axis, kind, phase, size, self.stage)
        self.collectives[key] += 1
        self.collective_bytes[key] += nbytes
        if self._regathering():
            self.regathers[key] += 1
            self.regather_bytes[key] += nbytes

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


FLOAT8_CASTS = tuple(
    os.path.join("torchao", "float8", name) for name in ("float8_scaling_utils.py", "float8_utils.py",
                                                          "float8_training_tensor.py")
)  # fmt: skip
"""torchao's files holding its float8 casts (amax, scale, the scaled cast); not its linear's own ops (a bias add)."""


def _in_float8_cast() -> bool:
    """Whether one of torchao's float8 casts dispatched the op under way."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(FLOAT8_CASTS):
            return True
        frame = frame.f_back
    return False


FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


def _float8_data(t: torch.Tensor) -> torch.Tensor | None:
    """The float8 data of one of torchao's float8 tensors (Float8TrainingTensor: its float8 `_data` and scale under
    the dtype it stands for), else None. A matmul of them reaches this mode as the matmul of the training dtype: the
    tensor's own dispatch, which calls `_scaled_mm`, runs below the mode; its operands move a byte per element, and
    so do the collectives that carry it (TP's gathers of float8 inputs under tensorwise)."""
    data = getattr(t, "_data", None)
    return data if isinstance(data, torch.Tensor) and data.dtype in FLOAT8 else None


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
    raise ShardlabError(f"probe: no process group among the collective's arguments {args!r}")


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


def axis_names(mesh: DeviceMesh, experts: DeviceMesh | None = None) -> dict[str | tuple[str, str], str]:
    """Each group's axis name; (kind, group) keys name one kind of collective on a group that several axes share,
    ("fsdp", group) keys what FSDP runs on a group it shares with an axis (its gathers and reductions).
    experts: the expert mesh the model was parallelized with (`Parallelized.experts`), whose groups are its own."""
    names: dict[str | tuple[str, str], str] = {}
    for view in FLAT_VIEWS:
        if math.prod(mesh[a].size() for a in FLAT_VIEWS[view] if mesh[a].size() > 1) > 1:
            names.setdefault(flat_view(mesh, view).get_group().group_name, view)  # the narrowest view's name
    for axis in AXES:  # single axes win over views with the same group (a view of one axis of size > 1)
        if mesh[axis].size() > 1:
            names[mesh[axis].get_group().group_name] = axis
    if mesh["dp_shard"].size() == 1 and mesh["cp"].size() > 1:  # FSDP shards over cp alone: its collectives there
        names["fsdp", mesh["cp"].get_group().group_name] = "dp_shard_cp"  # are FSDP's (overlapped), not CP's own
    for axis in experts.mesh_dim_names if experts is not None else ():  # the expert mesh's own groups
        if experts[axis].size() > 1:
            names.setdefault(experts[axis].get_group().group_name, axis)
            if axis == "ep":  # the dispatch's all-to-alls are ep's, even where ep is all of dp_shard (same ranks)
                names["all_to_all", experts[axis].get_group().group_name] = "ep"
    return names


def param_storages(model: nn.Module) -> set[int]:
    """Storages of the parameters as registered now (FSDP's unsharded ones between forward and backward), and
    FSDP's sharded ones, which its lazy init re-allocates in the first forward and which stay alive while the
    unsharded ones are registered (reshard_after_forward=False): the plan counts them, not the activations."""
    local = [p._local_tensor if isinstance(p, DTensor) else p for p in model.parameters()]
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group  # torch keeps the shards there, unregistered
            local += [fp._sharded_param_data for fp in group.fsdp_params] if group is not None else []
    return {t.untyped_storage()._cdata for t in local}
