"""Eager against `plan.compile` (torch.compile of each block, inductor) on CPU ranks: step time and compile time.

    python scripts/bench_compile.py                  # one process, FSDP 2, FSDP 2 x TP 2 (+SP, loss parallel); fp32
    python scripts/bench_compile.py --layouts fsdp2 --steps 12 --seq-len 512

Every rank of one gloo world builds both models from the same seed (shardlab's Llama debug model) and runs them
interleaved A B B A (eager, compiled, compiled, eager), `--steps` steps each on the same batches; the first two
steps of each run are warm-up, not timed. Both must reach the same losses (1e-5). Prints each run's step time, the
mean ratio eager / compiled of step time (the speed-up) and the compile time: the compiled model's first two steps
less two of its timed steps, which includes inductor's compilation of the forward and of the backward (on a cold
cache; set TORCHINDUCTOR_CACHE_DIR to a fresh directory to measure it so).
"""

from __future__ import annotations

import argparse
import time

import torch.distributed as dist
from _worlds import arguments, join, report, run_worlds

from shardlab.config import Config, DataConfig, LogConfig, MeshSpec, ModelConfig, OptimConfig, PlanConfig, TrainConfig
from shardlab.data.loader import make_loader
from shardlab.training.loop import build_model
from shardlab.training.step import init_state, make_step

LAYOUTS = {"one": (1, 1), "fsdp2": (2, 1), "fsdp2xtp2": (2, 2)}
"""name -> (dp_shard, tp)."""
KINDS = ("eager", "compiled", "compiled", "eager")


def config(dp: int, tp: int, seq_len: int, compile: bool) -> Config:
    return Config(
        mesh=MeshSpec(dp_shard=dp, tp=tp),
        model=ModelConfig(),  # torchtitan's llama3 debug model
        plan=PlanConfig(compile=compile),
        optim=OptimConfig(lr=8e-4, weight_decay=0.1, max_norm=1.0),
        train=TrainConfig(steps=1000, global_batch=8, seq_len=seq_len),
        log=LogConfig(wandb="disabled", progress=False),
        data=DataConfig(source="stdlib"),
    )


def run(rank: int, world: int, port: int, a: argparse.Namespace, out: dict) -> None:
    join(rank, world, port)
    for name in a.layouts:
        dp, tp = LAYOUTS[name]
        if dp * tp != world:
            continue
        steps, states = {}, {}
        for kind in ("eager", "compiled"):
            cfg = config(dp, tp, a.seq_len, compile=kind == "compiled")
            model, plan, mesh = build_model(cfg)
            steps[kind], states[kind] = make_step(cfg, plan, mesh), init_state(model, cfg.optim)
        loader = make_loader(
            cfg.data, seq_len=a.seq_len, global_batch=8, vocab_size=cfg.model.vocab_size,
            dp_rank=rank // tp, dp_size=dp,
        )  # fmt: skip
        batches = [loader.batch(i) for i in range(2 * a.steps)]
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        losses: dict[str, list[float]] = {"eager": [], "compiled": []}
        first: dict[str, float] = {}
        at = {"eager": 0, "compiled": 0}
        for kind in KINDS:
            dist.barrier()
            begin = time.perf_counter()
            start = begin
            for k in range(a.steps):
                if k == 2:
                    start = time.perf_counter()
                    first.setdefault(kind, start - begin)
                states[kind], m = steps[kind](states[kind], batches[at[kind]])
                losses[kind].append(m["loss"])
                at[kind] += 1
            times[kind].append((time.perf_counter() - start) / (a.steps - 2))
        if rank == 0:
            out[name] = {"times": times, "losses": losses, "compile_s": first["compiled"] - 2 * times["compiled"][0]}
    dist.destroy_process_group()


def main() -> None:
    a = arguments(__doc__, LAYOUTS)
    report(run_worlds(run, LAYOUTS, a), "eager", "compiled", "speed-up", lambda r: f"  compile {r['compile_s']:.1f} s")


if __name__ == "__main__":
    main()
