"""What a layout's collectives on the critical path take per step at least (`Floors.busy` adds them to the larger
of compute and FSDP's), each from the layout's shape alone and at most what the estimate prices:
- TP, for a model whose own rules split its blocks as Megatron does (`ModelProvider.tp_reduced_dim`: shardlab's
  Llama, and transformers' dense decoders by their TP plans): each block's attention and MLP end in a projection
  sharded over its input dim, whose partial outputs tp reduces in the forward, and begin with ones sharded over their
  output dim, whose input gradients it reduces in the backward: at least 4 collectives of the rank's tokens x dim
  (all-reduces, or under sequence parallelism all-gathers and reduce-scatters, twice as many of half the traffic),
  1 more for each recomputed block (the attention's: torch's checkpoint stops recomputing after the last tensor the
  backward needs, before the MLP's reduction), on the critical path as the roofline puts them.
- CP, for a model laid out by its own rules whose attention is shardlab's (`ModelProvider.kv_dim`: shardlab's Llama
  and transformers models): each block's attention all-gathers K and V over cp (the whole sequence of the rank's
  rows and kv heads, 1 / tp of them, in param_dtype) and reduce-scatters their gradients in the backward; a
  recomputed block gathers them again. On the critical path, as the roofline puts every collective but the
  data-parallel ones.
- EP, for shardlab's MoE laid out by its own rules: each block's experts get their tokens' rows (top_k of each, fewer
  under a capacity) by an all-to-all over ep and send them back by another, in the forward, again in a recomputed
  block, and in the backward; every tp rank routes all of its group's tokens. On the critical path, as CP's.
- Pipelines, for any model: each micro batch's residual stream crosses every stage boundary between two ranks, the
  outputs in the forward and their gradients in the backward, as `estimate` prices the busiest pp rank's sends; the
  floor takes the pp rank that sends fewest (a V-shaped schedule's first rank sends half of a middle one's), in
  param_dtype (the estimate's without FSDP: fp32).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from shardlab.config import Config
from shardlab.estimate.device import Device
from shardlab.estimate.layouts import Layout
from shardlab.estimate.roofline import DTYPE_BYTES, axis_bandwidth
from shardlab.sharding.pipeline import stage_sends

if TYPE_CHECKING:  # the floors call these with themselves
    from shardlab.estimate.floors import Floors


def exposed_seconds(f: Floors, cfg: Config, layout: Layout, dev: Device) -> float:
    """Seconds per step TP's, CP's and EP's collectives take at least, where the layout splits over them and the
    model's own rules lay them out (`Floors.tp_dim`, `kv_dim`, `expert_rows`)."""
    m, seconds = layout.mesh, 0.0
    if m.tp > 1 and f.tp_dim:
        seconds += tp_seconds(f, cfg, layout, dev)
    if m.cp > 1 and f.kv_dim:
        seconds += cp_seconds(f, cfg, layout, dev)
    if m.ep > 1 and f.expert_rows:
        seconds += ep_seconds(f, cfg, layout, dev)
    return seconds


def tp_seconds(f: Floors, cfg: Config, layout: Layout, dev: Device) -> float:
    """Seconds per step the blocks' TP reductions take at least (as all-reduces: an all-gather and a reduce-scatter
    under sequence parallelism move as much)."""
    m = layout.mesh
    blocks, recomputed = f.held_blocks(m.pp), f.recomputed(cfg, layout)
    tokens = cfg.train.global_batch // m.size("dp") * cfg.train.seq_len // m.cp
    all_reduced = tokens * f.tp_dim * gathered_bytes(cfg) * (4 * blocks + recomputed)  # fp8: inputs gathered
    return all_reduced * 2 * (m.tp - 1) / m.tp / axis_bandwidth(m, "tp", dev)


def cp_seconds(f: Floors, cfg: Config, layout: Layout, dev: Device) -> float:
    """Seconds per step CP's K and V gathers (and their gradients' reduce-scatters) take at least."""
    m = layout.mesh
    blocks, recomputed = f.held_blocks(m.pp), f.recomputed(cfg, layout)
    rows = cfg.train.global_batch // m.size("dp")  # over every micro batch
    kv = rows * cfg.train.seq_len * f.kv_dim // m.tp * DTYPE_BYTES[cfg.plan.param_dtype]  # K or V, gathered
    speed = dict(dev.collective_speed)
    per_byte = (m.cp - 1) / m.cp / axis_bandwidth(m, "cp", dev)  # a ring moves (n - 1) / n of the buffer
    gathers = 2 * (blocks + recomputed) * kv * per_byte / speed.get("all_gather", 1.0)
    return gathers + 2 * blocks * kv * per_byte / speed.get("reduce_scatter", 1.0)


def ep_seconds(f: Floors, cfg: Config, layout: Layout, dev: Device) -> float:
    """Seconds per step expert parallelism's all-to-alls take at least: each MoE block sends its tokens' rows to
    their experts and back, in the forward (again where recomputed) and the backward; every tp rank routes all of
    its group's tokens (the MoE layer takes whole tensors)."""
    m = layout.mesh
    blocks, recomputed = f.held_blocks(m.pp), f.recomputed(cfg, layout)
    tokens = cfg.train.global_batch // m.size("dp") * cfg.train.seq_len // m.cp
    rows = tokens * f.expert_rows * f.tp_dim * DTYPE_BYTES[cfg.plan.param_dtype]
    per_byte = (m.ep - 1) / m.ep / axis_bandwidth(m, "ep", dev) / dict(dev.collective_speed).get("all_to_all", 1.0)
    return (4 * blocks + 2 * recomputed) * rows * per_byte


def pp_seconds(f: Floors, cfg: Config, layout: Layout, dev: Device) -> float:
    """Seconds per step the pipeline's sends take at least: a micro batch's residual stream (its cp chunks,
    sequence-sharded under SP) for each stage boundary crossing from the pp rank that sends fewest."""
    m = layout.mesh
    if m.pp == 1 or not f.stage_dim:
        return 0.0
    rows = cfg.train.global_batch // m.size("dp") // layout.micro_batches
    tokens = rows * (cfg.train.seq_len // m.cp // (m.tp if cfg.plan.sequence_parallel else 1))
    sent = layout.micro_batches * _fewest_sends(m.pp, layout.pp_stages_per_rank, layout.pp_schedule) * tokens
    per_byte = 1 / axis_bandwidth(m, "pp", dev) / dict(dev.collective_speed).get("send", 1.0)
    return sent * f.stage_dim * DTYPE_BYTES[cfg.plan.param_dtype] * per_byte


@cache
def _fewest_sends(pp: int, stages_per_rank: int, schedule: str) -> int:
    """The sends a micro batch makes from the pp rank that sends fewest (`stage_sends`), per pipeline shape: a
    search floors tens of thousands of layouts over a few hundred."""
    return min(map(sum, stage_sends(pp, stages_per_rank, schedule)))


def gathered_bytes(cfg: Config) -> int:
    """Bytes per element FSDP gathers of a weight, and TP of an activation, at least: under tensorwise FP8 a byte
    (FSDP gathers the FP8 linears' weights in float8, TP their inputs; at most all of them), else param_dtype's."""
    return 1 if cfg.plan.fp8 == "tensorwise" else DTYPE_BYTES[cfg.plan.param_dtype]
