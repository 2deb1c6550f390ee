"""Device: what the estimator knows of one accelerator (datasheet numbers, or ones measured on this machine)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shardlab._base import Frozen
from shardlab.estimate.kernels import Kernels

MATMUL_EFFICIENCY = 0.8
"""Achievable / datasheet bf16 FLOP/s: an 8192^3 bf16 matmul ran at 798 of 989 TFLOP/s on one H100 (BENCHMARKS.md)."""
HBM_EFFICIENCY = 0.9
"""Achievable / datasheet HBM bandwidth: a device-to-device copy moved 3.0 of 3.35 TB/s on the same H100."""


Rate = Annotated[float, msgspec.Meta(gt=0)]
"""A peak or a bandwidth: a number > 0 (checked where a Device is decoded: the table, a `--device FILE`)."""
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]


class Device(Frozen):
    """Datasheet numbers of one accelerator (dense bf16), or measured ones (`cpu`). The named ones are data
    (shardlab/estimate/devices.toml); `--device FILE` reads one more in the same fields."""

    name: str
    bf16_tflops: Rate
    """Dense matmul peak in the training dtype (bf16 on GPUs; a measured device: what it reached, fp32 on CPUs)."""
    hbm_tb_s: Rate
    nvlink_gb_s: Rate
    """Per GPU, one direction."""
    network_gb_s: Rate
    """Per GPU, one direction, between nodes (one NIC per GPU)."""
    memory_gib: Rate
    """Memory per device, as the driver reports it (what `search` fits layouts into by default)."""
    fp8_tflops: Rate | None = None
    """Dense float8 matmul peak (torch's `_scaled_mm`, which torchao's Float8Linear runs); None: the device has no
    float8 matmuls (A100), and `estimate` refuses plan.fp8 on it."""
    matmul_efficiency: Fraction = MATMUL_EFFICIENCY
    """Achieved / peak FLOP/s (1 for a measured device: its numbers are achieved ones)."""
    hbm_efficiency: Fraction = HBM_EFFICIENCY
    power_w: Rate | None = None
    """The power cap the numbers above are for, in W: informational. No derating is applied for it; a capped part
    whose peak under load is not published carries its silicon's datasheet peak (docs/estimate.md, "Devices")."""
    kernels: Kernels | None = None
    """Measured efficiency per kernel class and size, and a cost per op; None: the flat efficiencies above."""
    busy_speed: tuple[float, ...] = ()
    """Ranks that time-share one machine's cores (CPU ranks): a rank's speed while k of them are busy (entry k - 1),
    relative to all of them busy, as the numbers above were measured. A rank idling in a pipeline's bubble leaves
    part of its cores to the busy ones; how much depends on their threads and on the machine's other load, so it is
    measured. Empty: dedicated devices."""
    collective_speed: tuple[tuple[str, float], ...] = ()
    """(kind, bandwidth relative to the all-reduce's) for kinds that run at another speed per byte as
    `collective_seconds` counts them: gloo on CPU ranks gathers and reduce-scatters through slower paths than its
    all-reduce, so it is measured (shardlab.estimate.cpu). Kinds not listed, and every kind when empty, run at the
    link bandwidth."""
    collective_latency: tuple[tuple[int, float], ...] = ()
    """(group size, seconds) every collective over a group of that size takes beyond its bytes, measured with all
    ranks in such groups at once: gloo on ranks that share cores takes milliseconds, each hop waiting for its peer's
    process to get a core (shardlab.estimate.cpu). A size not listed takes the latency of the largest listed size
    below it. Empty: none (the named GPUs: NCCL's microseconds per collective are not modelled)."""
