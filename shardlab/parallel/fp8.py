"""The runtime half of FP8 training (plan half: `shardlab.sharding.fp8`): torchao's Float8Linear swapped in for the
plan's linears before TP and FSDP see them, torchao's float8 TP styles for them under tensorwise scaling, and the
weight scales that FSDP's float8 all-gather reads, computed once per step for all weights (one all-reduce).

torchao is an optional extra (`shardlab[fp8]`), imported here only.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Collection
from types import ModuleType
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardlab._errors import ShardlabError
from shardlab._quiet import quiet_imports
from shardlab.sharding.fp8 import Fp8Plan


def torchao_float8() -> ModuleType:
    """torchao's float8 package (imported quietly), or one line saying how to install it."""
    try:
        with quiet_imports():
            import torchao.float8 as float8
    except ImportError:
        raise ShardlabError("plan.fp8 needs torchao: pip install 'shardlab[fp8]' (or set plan.fp8='none')") from None
    return float8


def convert(model: nn.Module, fp8: Fp8Plan, present: Collection[str] | None = None) -> None:
    """Swap the plan's linears (those of them in `present`: this rank's pipeline stages; None: all) for Float8Linear,
    in place; their parameters keep their names, so checkpoints stay plain."""
    float8 = torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(fp8.recipe)
    if fp8.all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    wanted = {f for f in fp8.linears if present is None or f in present}
    float8.convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn in wanted, config=config)
    from torchao.float8.float8_linear import Float8Linear

    missed = sorted(f for f in wanted if not isinstance(model.get_submodule(f), Float8Linear))
    if missed:
        raise ShardlabError(f"apply: {missed[0]} did not become a Float8Linear; make the plan from this model")


def tp_style(style: type[ColwiseParallel | RowwiseParallel], fp8: Fp8Plan | None, fqn: str) -> type[Any]:
    """The ParallelStyle class for linear `fqn`: torchao's float8 one (the input cast to float8 before TP gathers
    it) for a tensorwise FP8 linear; otherwise `style` (rowwise scales run under torch's own styles)."""
    if fp8 is None or fp8.recipe != "tensorwise" or fqn not in fp8.linears:
        return style
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return Float8ColwiseParallel if style is ColwiseParallel else Float8RowwiseParallel


def gathers_float8(mesh: DeviceMesh) -> bool:
    """Whether the collectives of `mesh` (one axis) carry float8 tensors: NCCL's do, gloo's (CPU ranks) have no
    float8 types, so TP there gathers the compute dtype and Float8Linear casts after the gather (the same scales:
    tensorwise amaxes are taken over the whole DTensor)."""
    return dist.get_backend(mesh.get_group()) != "gloo"


def plain_shards(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (a nested state dict) with each DTensor whose shard is torchao's float8-gather wrapper as a DTensor
    over the plain tensor it wraps, the same storage: checkpoints then hold ordinary tensors (read without torchao,
    exported as plain weights) and a load still writes into the weights. Without FP8 (torchao not imported) `state`
    is returned as it is."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if fsdp_utils is None:
        return state
    wrapper = fsdp_utils.WeightWithDynamicFloat8CastTensor

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, DTensor) and isinstance(local := value.to_local(), wrapper):
            return DTensor.from_local(local._tensor, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())  # fmt: skip
        return value

    return plain(state)


def refresh_scales(model: nn.Module, fp8: Fp8Plan | None) -> None:
    """After an optimizer step: compute the float8 scales of every FSDP-sharded FP8 weight from its new values (one
    all-reduce of their amaxes) for the next all-gathers, which would otherwise each compute their own. Before the
    first step there are none, and the gathers compute them (the same numbers)."""
    if fp8 is not None and fp8.all_gather:
        torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)
