"""Activation checkpointing none / selective (per block) / op (per op) / full: memory and time, measured beside the
estimator's figures, on CPU ranks (no CUDA needed: memory is counted in storages and resident pages).

    python scripts/bench_checkpointing.py                          # one process, then FSDP 2 x TP 2 on 4 gloo ranks
    python scripts/bench_checkpointing.py --layouts one --steps 4 --seq-len 1024

torchtitan's Llama debug model (shardlab's default ModelConfig: dim 256, 6 blocks, 16 heads, vocab 2048), fp32,
stdlib text, seq 2048, global batch 8 (one micro batch per step). Every run is a world of fresh gloo ranks
(`cores // ranks` threads each, as shardlab.cli.launch gives CPU ranks). Measured, on rank 0 unless said:
- step s: the fastest of the timed steps (steps 2.., the first warms up; every rank times the same steps) of --runs
  timing runs per mode, in the order A B C D D C B A, with glibc's default malloc, and their median in brackets
  (other jobs on the machine only ever add time); CPU s / step: the median CPU time (user + system, every thread)
  rank 0's process spends on a timed step, which depends far less on the machine's other jobs than wall time;
- then one memory run per mode, started with MALLOC_MMAP_THRESHOLD_=64 KiB so that freed tensors leave the process
  at once and its resident memory follows the live tensors: after one training step (lazy initialisation), one
  micro batch (this rank's rows of the next batch) runs under the estimator's own recorder
  (shardlab.estimate.recorder.Recorder) on the real tensors:
  - act MiB: bytes of the storages its forward leaves alive for the backward (saved tensors, checkpoint inputs,
    selective checkpointing's kept outputs, logits, loss);
  - +RSS MiB: what its forward adds to the process's resident memory;
  - peak RSS MiB: the largest resident memory of any rank over that run;
  - TFLOP: the FLOPs its forward and backward execute, recomputation included.
Estimated for the same config: `estimate(cfg, plan, dev)`, with dev = `--device cpu` (this machine measured with that
many ranks, afresh: a new SHARDLAB_CACHE) and H100. Its activations and executed FLOPs come from the probe (fake
tensors, fake world), its step time from the roofline over the probe's ops; est. peak adds parameters, gradients,
AdamW state and FSDP's buffers. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's shardlab (ranks inherit sys.path)

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _worlds import free_port, join

from shardlab.config import Config, DataConfig, LogConfig, MeshSpec, ModelConfig, PlanConfig, TrainConfig
from shardlab.data.loader import make_loader
from shardlab.estimate import estimate
from shardlab.estimate.devices import device
from shardlab.estimate.recorder import Recorder, axis_names, param_storages
from shardlab.training.loop import build_model, plan_model
from shardlab.training.step import forward_backward, init_state, make_step

MODES = ("none", "selective", "op", "full")
LAYOUTS = {"one": MeshSpec(dp_shard=1), "fsdp2xtp2": MeshSpec(dp_shard=2, tp=2)}
MMAP_THRESHOLD = 65536


def config(mesh: MeshSpec, ac: str, seq_len: int, global_batch: int, steps: int) -> Config:
    return Config(
        mesh=mesh,
        model=ModelConfig(),
        plan=PlanConfig(activation_checkpoint=ac),  # SP and loss parallel under TP (the defaults)
        train=TrainConfig(steps=steps, global_batch=global_batch, seq_len=seq_len),
        log=LogConfig(wandb="disabled", progress=False),
        data=DataConfig(source="stdlib"),
    )


def cpu_seconds() -> float:
    """CPU time this process has used (all its threads, user and system): what a step costs it, whatever else
    runs on the machine (wall time on a shared machine is mostly the other jobs')."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_main(rank: int, world: int, port: int, cfg_json: bytes, memory: bool, out: str) -> None:
    join(rank, world, port)
    cfg = msgspec.json.decode(cfg_json, type=Config)
    model, plan, mesh = build_model(cfg)
    step, state = make_step(cfg, plan, mesh), init_state(model, cfg.optim)
    tp = cfg.mesh.tp
    loader = make_loader(
        cfg.data, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch, vocab_size=cfg.model.vocab_size,
        dp_rank=rank // tp, dp_size=world // tp,
    )  # fmt: skip
    times, cpu, losses = [], [], []
    for i in range(1 if memory else cfg.train.steps):
        batch = loader.batch(i)
        dist.barrier()
        start, start_cpu = time.perf_counter(), cpu_seconds()
        state, metrics = step(state, batch)
        times.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
        losses.append(metrics["loss"])
    result = {"times": times, "cpu": cpu, "losses": losses}
    if memory:
        batch = loader.batch(1)
        recorder = Recorder(axis_names(mesh) if mesh is not None else {})
        seen = {"before": rss()}

        def after_forward() -> None:
            seen["after"] = rss()
            seen["live"] = recorder.live_bytes(param_storages(model))

        with recorder:
            forward_backward(model, batch.inputs, batch.labels, 1.0, plan.loss_parallel, after_forward)
        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result |= {
            "live": seen["live"],
            "rss_forward": seen["after"] - seen["before"],
            "peak_rss": int(peak.item()),
            "flops": recorder.flops,
        }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(cfg: Config, memory: bool) -> dict:
    """One world of cfg.mesh.world_size fresh gloo ranks: cfg.train.steps timed steps, or (memory) one step and one
    recorded micro batch, with malloc's mmap threshold at 64 KiB."""
    port = free_port()
    if memory:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # read by each spawned rank's malloc at start
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "result.json")
            args = (cfg.mesh.world_size, port, msgspec.json.encode(cfg), memory, out)
            mp.spawn(rank_main, args=args, nprocs=cfg.mesh.world_size)
            return json.loads(Path(out).read_text())
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)


def estimated(cfg: Config) -> dict:
    cfg = cfg.resolve(cfg.mesh.world_size)
    _, plan = plan_model(cfg)
    cpu = estimate(cfg, plan, dev=device("cpu", cfg.mesh.world_size), compare_checkpointing=False)
    h100 = estimate(cfg, plan, dev=device("h100"), compare_checkpointing=False)
    micro = cpu.micro_batches
    return {
        "live": cpu.activations,
        "peak": cpu.peak,
        "step_s": cpu.time.step_s,
        "flops": cpu.executed_flops // micro,
        "h100_ms": h100.time.step_s * 1e3,
    }


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (the first is not timed)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2, help="runs per mode, in the order A B C D D C B A ...")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    a = parser.parse_args()
    os.environ["SHARDLAB_CACHE"] = tempfile.mkdtemp(prefix="shardlab-cache-")  # measure the CPU device afresh
    rows, everything = [], {}
    order = [*a.modes, *reversed(a.modes)] * (a.runs // 2) + list(a.modes) * (a.runs % 2)  # A B B A ...
    for name in a.layouts:
        print(f"{name}: {device('cpu', LAYOUTS[name].world_size)}", flush=True)
        timed: dict[str, list[dict]] = {ac: [] for ac in a.modes}
        for ac in order:
            got = measure(config(LAYOUTS[name], ac, a.seq_len, a.global_batch, a.steps), memory=False)
            got["step_s"] = statistics.median(got["times"][1:])
            timed[ac].append(got)
            print(f"{name} {ac}: step s {[round(t, 2) for t in got['times']]}", flush=True)
        reference = timed[a.modes[0]][0]["losses"]
        for ac in a.modes:
            cfg = config(LAYOUTS[name], ac, a.seq_len, a.global_batch, a.steps)
            got, want = measure(cfg, memory=True), estimated(cfg)
            steps = [t for r in timed[ac] for t in r["times"][1:]]
            cpu = [t for r in timed[ac] for t in r["cpu"][1:]]
            everything[f"{name}/{ac}"] = {"timed": timed[ac], "memory": got, "estimated": want}
            diff = max(abs(x - y) for r in timed[ac] for x, y in zip(r["losses"], reference))
            rows.append(
                f"| {name} | {ac} | {min(steps):.2f} ({statistics.median(steps):.2f}) | {statistics.median(cpu):.2f} | "
                f"{want['step_s']:.2f} | {mib(got['live'])} | {mib(want['live'])} | {mib(got['rss_forward'])} | "
                f"{mib(got['peak_rss'])} | {mib(want['peak'])} | {got['flops'] / 1e12:.3f} | "
                f"{want['flops'] / 1e12:.3f} | {want['h100_ms']:.1f} | {diff:.0e} |"
            )
            print(rows[-1], flush=True)
    print()
    print(
        "| layout | AC | step s: fastest (median) | CPU s / step | est. step s (cpu) | act MiB | est. act MiB | +RSS MiB (fwd) | peak RSS MiB | "
        "est. peak MiB | TFLOP / micro batch | est. TFLOP | est. H100 step ms | max loss diff vs first mode |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    if a.json is not None:
        a.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
