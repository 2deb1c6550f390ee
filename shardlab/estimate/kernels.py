"""Kernels: how far below a device's peak each class of kernel runs, measured by microbenchmarks, never fitted.

A roofline at peak is a floor that small models never approach: a 64-wide matmul runs far below the FLOP/s of an
8192-wide one, eager attention below both, and every op pays a fixed dispatch (or launch) cost. A `Kernels` table says
by how much, per class of op as the probe records it (shardlab.estimate.recorder: `matmul`, `attention`, and `memory`
for ops without FLOPs), each as a curve over the op's size, so the roofline prices op by op:

    seconds = overhead + max(FLOPs / (peak x efficiency(class, FLOPs)), bytes / (bandwidth x memory(bytes)))

Every number comes from `measure`: square matmuls, causal SDPA forward + backward, and an elementwise add at a few
sizes each, timed on the device (`--device cpu` runs it on every CPU rank at once, shardlab.estimate.cpu;
scripts/bench_kernels.py on any device, printing the table for MEASURED). Sizes between two measured ones are
interpolated in log size; sizes outside are held at the nearest end.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from shardlab._base import Frozen
from shardlab._errors import ShardlabError

Curve = tuple[tuple[float, float], ...]
"""(size, achieved / peak) points, sizes ascending."""

MATMULS = (64, 128, 256, 512, 1024)
"""Square matmul sides on a CPU: the debug models' projections are 64 to 2048 wide."""
ATTENTION = ((8, 64, 64), (8, 256, 64), (8, 1024, 64))
"""(heads, sequence, head dim) of one sequence's causal SDPA on a CPU."""
ELEMENTWISE = (2**12, 2**16, 2**20, 2**22)
"""Elements of each operand of an add on a CPU: from cache-resident to beyond the last-level cache."""
GPU_MATMULS = (256, 512, 1024, 2048, 4096, 8192)
GPU_ATTENTION = ((32, 1024, 128), (32, 4096, 128), (32, 8192, 128))
GPU_ELEMENTWISE = (2**16, 2**20, 2**24, 2**27)


class Kernels(Frozen):
    """Measured efficiencies of one device, per kernel class (see the module docstring for how they are used)."""

    matmul: Curve
    """Over FLOPs per call: achieved FLOP/s / the device's peak, measured on square matmuls."""
    attention: Curve
    """Over FLOPs per call (causal: half the square, as the probe counts them): causal SDPA, forward + backward."""
    memory: Curve
    """Over bytes read + written per call: achieved bandwidth / the device's (above 1 where the operands fit in a
    cache the device's bandwidth figure does not see)."""
    overhead_s: float
    """Seconds every op costs beyond its roofline: a one-element add's time (dispatch, launch)."""
    command: str
    """What measured it, so it can be measured again."""

    def check(self) -> None:
        for name in ("matmul", "attention", "memory"):
            curve = getattr(self, name)
            if not curve or any(e <= 0 for _, e in curve) or [s for s, _ in curve] != sorted(s for s, _ in curve):
                raise ShardlabError(f"Kernels.{name}: give (size, efficiency > 0) points, sizes ascending; got {curve}")

    def seconds(self, kind: str, flops: int, moved: int, peak_flops: float, bandwidth: float) -> float:
        """One op of `kind` doing `flops` and moving `moved` bytes on a device of `peak_flops` and `bandwidth`."""
        memory = moved / (bandwidth * efficiency(self.memory, moved)) if moved else 0.0
        compute = 0.0
        if flops:
            compute = flops / (peak_flops * efficiency(self.attention if kind == "attention" else self.matmul, flops))
        return self.overhead_s + max(compute, memory)


MEASURED: dict[str, Kernels] = {}
"""Tables measured on the named devices (`python scripts/bench_kernels.py --name NAME` prints the entry). A device
without one keeps the flat MATMUL_EFFICIENCY and HBM_EFFICIENCY of shardlab.estimate.roofline."""


def efficiency(curve: Curve, size: float) -> float:
    """The curve at `size`: log-linear between measured points, the nearest end outside them."""
    sizes = [s for s, _ in curve]
    i = bisect.bisect_left(sizes, size)
    if i == 0:
        return curve[0][1]
    if i == len(curve):
        return curve[-1][1]
    (s0, e0), (s1, e1) = curve[i - 1], curve[i]
    w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return e0 + w * (e1 - e0)


Timer = Callable[[Callable[[], object]], float]
"""Seconds per call of a function (the caller decides how: a barrier between ranks, a device synchronize)."""


def timer(device: torch.device, seconds: float, barrier: Callable[[], None] = lambda: None) -> Timer:
    """A Timer that runs each function for about `seconds` after one warm-up call, every rank starting together,
    synchronizing an accelerator before reading the clock."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn: Callable[[], object]) -> float:
        fn()
        sync()
        barrier()
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn()
            done += 1
            if done % 8 == 0:  # an accelerator queues work: read the clock only when it has run
                sync()
        sync()
        return (time.perf_counter() - start) / done

    return timed


class Rates(Frozen):
    """Raw measurements, before they are divided by a peak: (size, FLOP/s or bytes/s) per class, and seconds per
    tiny op. CPU ranks measure these each and the median over ranks is taken before `table`."""

    matmul: Curve
    attention: Curve
    memory: Curve
    overhead_s: float


def measure(
    timed: Timer, device: torch.device, dtype: torch.dtype, rounds: int = 3, gpu_sizes: bool | None = None
) -> Rates:
    """Time matmuls, causal SDPA (forward + backward) and adds of the sizes above on `device` in `dtype`: every
    kernel once per round, round after round, and each its median over rounds, so that a burst of other work on a
    shared machine moves one round of every kernel rather than all rounds of one."""
    big = device.type != "cpu" if gpu_sizes is None else gpu_sizes
    kernels: list[tuple[str, float, Callable[[], object]]] = []  # (class, size, run it once)
    tiny_a, tiny_b = torch.ones(1, device=device, dtype=dtype), torch.ones(1, device=device, dtype=dtype)
    kernels.append(("overhead", 1.0, lambda: torch.add(tiny_a, tiny_b)))
    for n in GPU_MATMULS if big else MATMULS:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        kernels.append(("matmul", 2.0 * n**3, lambda a=a, b=b: torch.mm(a, b)))
    for heads, seq, head_dim in GPU_ATTENTION if big else ATTENTION:
        shape = (1, heads, seq, head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(shape, device=device, dtype=dtype)
        flops = (sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)) // 2

        def step(q=q, k=k, v=v, grad=grad) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        kernels.append(("attention", float(flops), step))
    for n in GPU_ELEMENTWISE if big else ELEMENTWISE:
        a, b = torch.randn(n, device=device, dtype=dtype), torch.randn(n, device=device, dtype=dtype)
        kernels.append(("memory", 3.0 * n * a.element_size(), lambda a=a, b=b: torch.add(a, b)))  # as the probe counts
    times = [[timed(fn) for _, _, fn in kernels] for _ in range(rounds)]
    seconds = [statistics.median(column) for column in zip(*times, strict=True)]
    overhead = seconds[0]

    def rate(kind: str, size: float, t: float) -> float:
        """Size over the op's own time: less the per-op cost (attention: two ops, forward and backward), and never
        less than half what was measured."""
        return size / max(t - overhead * (2 if kind == "attention" else 1), t / 2)

    def curve(kind: str) -> Curve:
        return tuple((size, rate(k, size, t)) for (k, size, _), t in zip(kernels, seconds, strict=True) if k == kind)

    return Rates(matmul=curve("matmul"), attention=curve("attention"), memory=curve("memory"), overhead_s=overhead)


def median_rates(rates: Sequence[Rates]) -> Rates:
    """Each number's median over ranks (they ran at once, sharing the machine)."""

    def curve(name: str) -> Curve:
        curves = [getattr(r, name) for r in rates]
        return tuple((points[0][0], statistics.median([p[1] for p in points])) for points in zip(*curves, strict=True))

    return Rates(
        matmul=curve("matmul"), attention=curve("attention"), memory=curve("memory"),
        overhead_s=statistics.median([r.overhead_s for r in rates]),
    )  # fmt: skip


def table(rates: Rates, peak_flops: float, bandwidth: float, command: str) -> Kernels:
    """Rates divided by a device's peak FLOP/s and bandwidth (datasheet ones, or the best a measured device reached)."""
    return Kernels(
        matmul=tuple((s, r / peak_flops) for s, r in rates.matmul),
        attention=tuple((s, r / peak_flops) for s, r in rates.attention),
        memory=tuple((s, r / bandwidth) for s, r in rates.memory),
        overhead_s=rates.overhead_s,
        command=command,
    )
