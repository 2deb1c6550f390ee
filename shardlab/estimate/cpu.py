"""cpu_device(world) -> Device: this machine as `world` CPU ranks see it, measured once and cached.

CPU ranks share the machine's cores (each gets cores // world threads, as `shardlab.cli.launch` sets), so a rank's
FLOP/s and memory bandwidth are measured with `world` processes running at once, and the collective bandwidth is a
gloo all-reduce among them (its all-gather and reduce-scatter, slower per byte, relative to it; and the latency of a
tiny collective for every group size, which on shared cores is milliseconds). The peak is the
fastest matmul measured and the bandwidth a large copy's; the kernel table (shardlab.estimate.kernels: matmuls,
attention and adds of several sizes, and the cost of a tiny op) says how far below them each op runs, and
`busy_speed` how much faster a rank runs while others idle. Other jobs on the
machine slow every measurement alike (the estimate then runs slow too), and take the cores that idle ranks free; a
job that starts or stops between the calibration and a run biases the comparison: a calibration taken while another
job ran prices every layout too slow (one such measured 27 GFLOP/s on cores that reach 50 quiet), so the device's
name says when it was measured. The cache (SHARDLAB_CACHE, else ~/.cache/shardlab) is keyed by the world size and
checked against the cores, the processor and torch's version; delete it to measure again.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardlab.estimate._cache_dir import cache_dir, write_whole
from shardlab.estimate._forked import cores
from shardlab.estimate.device import Device
from shardlab.estimate.kernels import Rates, median_rates, table, timer
from shardlab.estimate.kernels import measure as measure_kernels

BUSY_MATMUL = 512
"""Square matmul side timed with some ranks idle: the debug models' projections are a few hundred wide."""
COPY_BYTES = 64 * 2**20
COLLECTIVE_BYTES = 16 * 2**20
COLLECTIVE_CALLS = 8
LATENCY_BYTES = 4096
LATENCY_CALLS = 20
"""A collective this small is all latency: its bytes take microseconds, gloo's hops among processes that share
cores milliseconds."""
GATHER_KINDS = ("all_gather", "reduce_scatter")
"""Collective kinds measured beside the all-reduce: FSDP's, TP's and CP's (a pipeline's sends: the link's speed)."""
SECONDS = 0.1
"""Each measurement runs at least this long on every rank (kernels and speeds: in each of three rounds)."""


class _Cached(msgspec.Struct):
    machine: str
    device: Device


CACHE_FORMAT = 5
"""Bumped whenever Device changes, so an older cache is measured again."""


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cores()} cores, {cpu}, torch {torch.__version__}, format {CACHE_FORMAT}"


def cache_path(world: int) -> Path:
    return cache_dir() / f"cpu-device-{world}-ranks.json"


def cpu_device(world: int) -> Device:
    """This machine for `world` ranks: read from the cache when it was measured here, else measured (a few seconds)."""
    path = cache_path(world)
    if path.is_file():
        try:
            cached = msgspec.json.decode(path.read_bytes(), type=_Cached)
            if cached.machine == _machine():
                return cached.device
        except msgspec.DecodeError:
            pass  # a damaged cache is measured again
    dev = measure(world)
    write_whole(path, msgspec.json.encode(_Cached(machine=_machine(), device=dev)))
    return dev


def measure(world: int) -> Device:
    """Run the measurements on `world` processes at once; each number is the ranks' median."""
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.get_context("spawn").Manager().list([None] * world) if world > 1 else [None]
        if world == 1:
            _rank(0, 1, f"{tmp}/store", results)
        else:
            mp.spawn(_rank, args=(world, f"{tmp}/store", results), nprocs=world, join=True)
        copy_bytes, link = (statistics.median(r[i] for r in results) for i in range(2))
        rates = median_rates([msgspec.convert(r[2], Rates) for r in results])
        speed = tuple(results[0][3])
        kinds = tuple(
            (kind, statistics.median(r[4][i][1] for r in results)) for i, (kind, _) in enumerate(results[0][4])
        )
        latency = tuple(
            (size, statistics.median(r[5][i][1] for r in results)) for i, (size, _) in enumerate(results[0][5])
        )
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world / 2**30
    peak = max(r for _, r in rates.matmul)
    command = f"shardlab.estimate.cpu.measure({world}) on {_machine()}"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return Device(
        name=f"CPU ({world} rank{'s' * (world > 1)} on {cores()} cores, measured {when})", bf16_tflops=peak / 1e12,
        hbm_tb_s=copy_bytes / 1e12, nvlink_gb_s=link / 1e9, network_gb_s=link / 1e9, memory_gib=memory,
        matmul_efficiency=1.0, hbm_efficiency=1.0, kernels=table(rates, peak, copy_bytes, command), busy_speed=speed,
        collective_speed=kinds, collective_latency=latency,
    )  # fmt: skip


def _timed(fn, barrier, calls: int | None = None) -> float:
    """Seconds per call of `fn`, every rank starting together (so all of them share the cores throughout): over
    about SECONDS, or exactly `calls` calls (a collective: every rank must make as many)."""
    fn()
    barrier()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < SECONDS if calls is None else done < calls:
        fn()
        done += 1
    return (time.perf_counter() - start) / done


def _collectives(world: int, barrier, latency: float) -> tuple[float, list[tuple[str, float]]]:
    """The all-reduce's bytes/s per rank, and the all-gather's and reduce-scatter's relative to it, each counted as
    roofline.collective_seconds counts it (all-reduce 2 (n - 1) / n of the buffer, the others (n - 1) / n; the
    world's `latency` per call is priced apart)."""
    buffer, shard = torch.ones(COLLECTIVE_BYTES // 4), torch.ones(COLLECTIVE_BYTES // 4 // world)
    runs = {
        "all_reduce": lambda: dist.all_reduce(buffer),
        "all_gather": lambda: dist.all_gather_single(buffer, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, buffer),
    }
    rate = {}
    for kind, fn in runs.items():
        moved = COLLECTIVE_BYTES * (world - 1) / world * (2 if kind == "all_reduce" else 1)
        seconds = _timed(fn, barrier, calls=COLLECTIVE_CALLS)
        rate[kind] = moved / max(seconds - latency, seconds / 2)  # a 16 MiB call is at least half bytes
    return rate["all_reduce"], [(kind, rate[kind] / rate["all_reduce"]) for kind in GATHER_KINDS]


def _latencies(rank: int, world: int, barrier) -> list[tuple[int, float]]:
    """(group size, seconds) of a tiny collective for every group size dividing the world, every rank in a group of
    consecutive ranks at once (as a layout's groups run side by side): the median of an all-reduce's, an
    all-gather's and a reduce-scatter's."""
    out = []
    for size in (s for s in range(2, world + 1) if world % s == 0):
        groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
        out.append((size, statistics.median(_timed(fn, barrier, LATENCY_CALLS) for fn in _tiny(groups[rank // size]))))
    return out


def _tiny(group) -> list:
    """An all-reduce, an all-gather and a reduce-scatter of LATENCY_BYTES over `group`."""
    size = dist.get_world_size(group)
    piece, whole = torch.ones(LATENCY_BYTES // 4 // size), torch.ones(LATENCY_BYTES // 4 // size * size)
    return [
        lambda: dist.all_reduce(whole, group=group),
        lambda: dist.all_gather_single(whole, piece, group=group),
        lambda: dist.reduce_scatter_single(piece, whole, group=group),
    ]


def _busy_speed(rank: int, world: int, barrier, rounds: int = 3) -> list[float]:
    """Rank 0's matmul speed while ranks 0 .. k - 1 run it and the others wait in a barrier (as a pipeline rank
    waits for its input), k = 1 .. world, relative to all of them running it: medians over `rounds` rounds of
    every k, and never more than the cores allow (k ranks of t threads each get min(t, cores / k) cores)."""
    a, b = torch.randn(BUSY_MATMUL, BUSY_MATMUL), torch.randn(BUSY_MATMUL, BUSY_MATMUL)
    timed = timer(torch.device("cpu"), SECONDS, barrier)
    seconds: list[list[float]] = [[] for _ in range(world)]
    for _ in range(rounds):
        for k in range(1, world + 1):
            if rank < k:
                seconds[k - 1].append(timed(lambda: torch.mm(a, b)))
            else:
                barrier()
    barrier()
    if rank:
        return []
    threads, n = torch.get_num_threads(), cores()
    t = [statistics.median(s) for s in seconds]
    return [min(t[-1] / t[k - 1], min(threads, n / k) / min(threads, n / world)) for k in range(1, world + 1)]


def _rank(rank: int, world: int, store: str, results) -> None:
    torch.set_num_threads(max(1, cores() // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    barrier = dist.barrier if world > 1 else (lambda: None)
    try:
        src, dst = torch.empty(COPY_BYTES // 4), torch.empty(COPY_BYTES // 4)
        copy_bytes = 2 * COPY_BYTES / _timed(lambda: dst.copy_(src), barrier)
        if world > 1:
            latency = _latencies(rank, world, barrier)
            link, speed = _collectives(world, barrier, latency[-1][1])
        else:
            link, speed, latency = copy_bytes, [], []  # one rank has no collectives; any finite number serves
        rates = measure_kernels(timer(torch.device("cpu"), SECONDS, barrier), torch.device("cpu"), torch.float32)
        results[rank] = (
            copy_bytes,
            link,
            msgspec.to_builtins(rates),
            _busy_speed(rank, world, barrier),
            speed,
            latency,
        )
    finally:
        if world > 1:
            dist.destroy_process_group()
