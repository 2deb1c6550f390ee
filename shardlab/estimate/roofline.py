"""Step time from a Probe and a device: a roofline for compute, link bandwidths for collectives.

The model, stated so it can be argued with:
- Each op of the probe takes max(FLOPs / (peak x MATMUL_EFFICIENCY), bytes / (HBM x HBM_EFFICIENCY)): eager
  PyTorch, one kernel per op, no fusion; causal attention does half the square. A device with a measured kernel
  table (`Device.kernels`, shardlab.estimate.kernels: `--device cpu`, and any device in kernels.MEASURED) prices each
  op by its class and size instead, plus a fixed cost per op.
- A collective over n ranks moves (n - 1) / n of its buffer per rank (ring; all-reduce twice that; a pipeline
  send all of it) at the group's link bandwidth: NVLink when the group's ranks share a node, else the node's network per GPU.
  A measured device may run some kinds slower per byte (`Device.collective_speed`: gloo's gathers and reduce-scatters),
  and take a fixed time per collective (`Device.collective_latency`: gloo's milliseconds on ranks sharing cores).
  Mesh axes are laid out as `MeshSpec` orders them (tp innermost), GPUS_PER_NODE to a node.
- FSDP's collectives (dp axes) overlap with compute (prefetch): they cost only what exceeds it. TP's and CP's
  (K/V all-gathers) are on the critical path (eager TP, no async TP, no overlap of the gathers). Scalar all-reduces of the loss and norm are left out.
- Pipelines: the sends between stages are on the critical path; the rank idles the schedule's analytic
  bubble fraction of the step (shardlab.sharding.pipeline.bubble_fraction), the optimizer step comes after. Ranks that
  time-share one machine's cores (`--device cpu`) run faster while others idle, by their measured `busy_speed`: the
  step is priced as GPipe's lockstep timeline with the same bubble, slot by slot at the speed its busy ranks get
  (`shared_pipeline_factor`), and the compute that sets its pace is the pp ranks' mean rather than the slowest
  rank's: a stage that finishes early leaves its cores to the others (`shared_compute`).
- The AdamW step streams 7 fp32 words per local parameter (read p, g, m, v; write p, m, v) through HBM.
- No stragglers, and without a kernel table no kernel-launch or Python overheads: a floor, which real runs
  approach from above.
- FP8 (plan.fp8): torchao's float8 matmuls (`_scaled_mm`) run at the device's FP8 peak with the efficiency of its
  bf16 matmuls, rowwise scaling as tensorwise (on an H200 rowwise ran 14% slower: a floor there); its casts (amax,
  scale, cast to float8) are memory-bound ops like any other, and compiled (plan.compile) each cast is two passes over
  its source (`Recorder._fused_cast`); FSDP's float8 all-gathers move one byte per weight, as the probe records
  them. MFU stays relative to the bf16 peak.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shardlab._base import Frozen
from shardlab.estimate.device import Device
from shardlab.estimate.measurement import Probe
from shardlab.estimate.recorder import Collective
from shardlab.sharding.mesh import AXES, FLAT_VIEWS, MeshSpec

GPUS_PER_NODE = 8
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes per element of the dtypes a plan names (param_dtype, reduce_dtype)."""
DP_AXES = ("dp_replicate", "dp_shard", "dp", "dp_shard_cp", "batch", "dp_shard_mod_ep")
ADAM_BYTES_PER_PARAM = 7 * 4


class StepTime(Frozen):
    """Predicted seconds per optimizer step on every rank, and what follows from them."""

    compute_s: float
    """This rank's ops, recomputation included."""
    fsdp_comm_s: float
    tp_comm_s: float
    """Collectives on the critical path: every axis but the data-parallel ones and pp."""
    pp_comm_s: float
    """Sends between pipeline stages (0 without a pipeline)."""
    bubble_s: float
    """Pipeline idle time: the schedule's bubble fraction of the step."""
    optimizer_s: float
    step_s: float
    tokens_per_s_per_device: float
    mfu: float
    recompute_s: float = 0.0
    """The part of compute_s that recomputes checkpointed activations in the backward (the probe's
    `recompute_ops`)."""


def axis_bandwidth(mesh: MeshSpec, axis: str, dev: Device) -> float:
    """Bytes/s of the links a group of `axis` uses: NVLink if all its ranks share a node, else the network."""
    return (dev.nvlink_gb_s if _span(mesh, axis) <= GPUS_PER_NODE else dev.network_gb_s) * 1e9


def _span(mesh: MeshSpec, axis: str) -> int:
    """Ranks from a group's first to one past its last. ep is the fast part of dp_shard x cp (its ranks are tp
    apart), dp_shard_mod_ep the slow part (the expert mesh, `MeshSpec.experts`)."""
    if axis == "ep":
        return mesh.ep * mesh.tp
    if axis == "dp_shard_mod_ep":
        return mesh.size("dp_shard_cp") * mesh.tp
    axes = _FROM_INNERMOST.get(axis)
    if axes is None:
        raise ValueError(f"{axis!r} is neither a mesh axis nor a view of axes")
    span = 1
    for a in axes:
        span *= getattr(mesh, a)
    return span


_FROM_INNERMOST = {
    name: AXES[min(AXES.index(a) for a in FLAT_VIEWS.get(name, (name,))) :] for name in (*AXES, *FLAT_VIEWS)
}
"""Per axis or view: the axes from its innermost one on (a search asks `_span` of hundreds of thousands of layouts)."""


def collective_seconds(c: Collective, mesh: MeshSpec, dev: Device) -> float:
    n = c.group_size
    factor = {"all_reduce": 2 * (n - 1) / n, "send": 1.0}.get(c.kind, (n - 1) / n)
    moving = c.bytes * factor / (axis_bandwidth(mesh, c.axis, dev) * dict(dev.collective_speed).get(c.kind, 1.0))
    return moving + c.count * collective_latency(dev, n)


def collective_latency(dev: Device, group_size: int) -> float:
    """Seconds one collective over `group_size` ranks takes beyond its bytes (`Device.collective_latency`)."""
    listed = [(size, seconds) for size, seconds in dev.collective_latency if size <= group_size]
    return max(listed)[1] if listed else 0.0


def compute_seconds(p: Probe, dev: Device) -> float:
    """Seconds the ops of `p` take: float8 matmuls at the device's FP8 peak, with the efficiency (flat, or the
    kernel table's matmul curve) of the training dtype's matmuls; every other op at the training dtype's peak."""
    fp8 = dev.fp8_tflops if dev.fp8_tflops is not None else dev.bf16_tflops

    def peak(kind: str) -> float:
        return (fp8 if kind == "fp8_matmul" else dev.bf16_tflops) * 1e12

    if dev.kernels is not None:
        bandwidth = dev.hbm_tb_s * 1e12
        return sum(
            count * dev.kernels.seconds(kind, flops, moved, peak(kind), bandwidth)
            for flops, moved, count, kind in p.ops
        )
    bytes_s = dev.hbm_tb_s * 1e12 * dev.hbm_efficiency
    return sum(
        count * max(flops / (peak(kind) * dev.matmul_efficiency), moved / bytes_s)
        for flops, moved, count, kind in p.ops
    )


def step_time(
    compute: float,
    collectives: Sequence[Collective],
    mesh: MeshSpec,
    dev: Device,
    *,
    params_per_rank: int,
    global_tokens: int,
    model_flops_per_token: float,
    bubble: float = 0.0,
    recompute: float = 0.0,
) -> StepTime:
    """One optimizer step on `dev` of a rank computing `compute` seconds (`compute_seconds` of its ops per step) with
    `collectives` (per step), `global_tokens` in all, `recompute` seconds of it recomputing checkpointed activations.
    A pipeline idles `bubble` of the step; the rest is this rank's work.

    MFU counts `model_flops_per_token` (the trainer's own convention, shardlab.training.metrics.flops_per_token).
    """

    def seconds(axes: Callable[[str], bool]) -> float:
        return sum(collective_seconds(c, mesh, dev) for c in collectives if axes(c.axis))

    fsdp = seconds(lambda axis: axis in DP_AXES)
    tp = seconds(lambda axis: axis not in DP_AXES and axis != "pp")
    pp = seconds(lambda axis: axis == "pp")
    optimizer = params_per_rank * ADAM_BYTES_PER_PARAM / (dev.hbm_tb_s * 1e12 * dev.hbm_efficiency)
    busy = max(compute, fsdp) + tp + pp
    if dev.busy_speed:
        idle = busy * (shared_pipeline_factor(dev.busy_speed, mesh.pp, mesh.world_size // mesh.pp, bubble) - 1)
    else:
        idle = busy * bubble / (1 - bubble)
    step = busy + idle + optimizer
    per_device = global_tokens / mesh.world_size / step
    mfu = per_device * model_flops_per_token / (dev.bf16_tflops * 1e12)
    return StepTime(
        compute_s=compute, fsdp_comm_s=fsdp, tp_comm_s=tp, pp_comm_s=pp, bubble_s=idle, optimizer_s=optimizer,
        step_s=step, tokens_per_s_per_device=per_device, mfu=mfu, recompute_s=recompute,
    )  # fmt: skip


def shared_compute(busiest: float, head: float, pp: int, group: int, speed: Sequence[float]) -> float:
    """Compute seconds that set the pace of a pipeline whose `pp` ranks (of `group` processes each) time-share a
    machine's cores (`Device.busy_speed`: speed[k - 1] with k processes busy): a rank that finishes its share early
    leaves its cores to the others, so the pp ranks' mean, taken as pp - 1 ranks like the busiest (`busiest`
    seconds, at least any other's) and the one holding the last stage (`head`); and never less than the slower
    of the two alone, at the speed its group gets with every other rank idle."""
    mean = ((pp - 1) * busiest + head) / pp
    return max(mean, max(busiest, head) / speed[min(group, len(speed)) - 1])


def shared_pipeline_factor(speed: Sequence[float], pp: int, group: int, bubble: float) -> float:
    """Step time / busy time of a pipeline of `pp` ranks of `group` processes each, idle `bubble` of a step on
    dedicated devices, on processes whose speed with k busy is speed[k - 1] (speed[-1] = 1: all busy).

    The timeline is GPipe's with the micro batches m that give this bubble, (pp - 1) / (m + pp - 1): slot j of
    m + pp - 1 runs one micro batch on each of min(j + 1, pp, m, m + pp - 1 - j) busy pp ranks, at their speed.
    """
    if pp == 1 or bubble <= 0:
        return 1.0
    m = (pp - 1) * (1 - bubble) / bubble
    if m >= pp - 1:  # ramps up and down through 1 .. pp - 1 busy, all busy in between
        slots = [(k, 2.0) for k in range(1, pp)] + [(pp, m - pp + 1)]
    else:  # fewer micro batches than the ramp: at most m busy at once
        m = max(1, round(m))
        slots = [(k, 2.0) for k in range(1, m)] + [(m, float(pp - m + 1))]
    return sum(length / speed[min(k * group, len(speed)) - 1] for k, length in slots) / m
