"""Throughput of one CUDA device: Llama 3.2 1B in bf16 (fp32 master weights), eager and torch.compile.

    python scripts/bench_gpu.py                       # recipes/llama3_1b.py, 30 steps, eager then compiled
    python scripts/bench_gpu.py --steps 50 --variants compile --seq-len 4096 --global-batch 2
    python scripts/bench_gpu.py --fp8 tensorwise      # the same in FP8 (torchao; compute capability >= 8.9)
    python scripts/bench_gpu.py --recipe recipes/hf_causal_lm.py --variants compile -- --model.hf-path DIR \
        --model.from-scratch --mesh.dp-shard 1 --mesh.tp 1 --plan.no-sequence-parallel --plan.no-loss-parallel
                                                      # a transformers model's shape; after --: the recipe's flags

Each variant is one `python -m shardlab` run of the recipe (the real CLI: plan, apply, step, metrics).
Reported per variant: median tokens/s and step time over the steps after `--warmup` (compile happens in the
first steps), MFU against the device's dense bf16 peak (shardlab.training.metrics.PEAK_BF16_TFLOPS), peak
torch.cuda.max_memory_allocated, and the first and last loss. `--out FILE` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _shardlab_run import run_shardlab

VARIANTS = {"eager": ["--plan.no-compile"], "compile": ["--plan.compile"]}


def run(variant: str, args: argparse.Namespace) -> dict:
    _, rows = run_shardlab(args.recipe, [
        *VARIANTS[variant], "--train.steps", str(args.steps), "--train.seq-len", str(args.seq_len),
        "--train.global-batch", str(args.global_batch), "--plan.activation-checkpoint", args.ac, "--log.every", "1",
        "--checkpoint.resume", "none", "--plan.fp8", args.fp8, *args.flags,
    ])  # fmt: skip
    timed = [r for r in rows if r["step"] > args.warmup]
    if not timed:
        raise SystemExit(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "variant": variant,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_s": statistics.median(r["step_s"] for r in timed),
        "mfu": statistics.median(mfu) if mfu else None,
        "peak_memory_gib": max(r["peak_memory_bytes"] for r in rows) / 2**30,
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "timed_steps": len(timed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/llama3_1b.py")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the medians")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--ac", default="none", choices=["none", "full", "selective", "op"])
    parser.add_argument("--fp8", default="none", choices=["none", "tensorwise", "rowwise", "rowwise_with_gw_hp"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON")
    parser.add_argument("flags", nargs="*", help="after --: more flags for every run (the recipe's own, e.g. a model)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device; none is visible")
    device = torch.cuda.get_device_name(0)
    results = [run(v, args) for v in args.variants]
    print(f"\n{device}, torch {torch.__version__}, {args.recipe}, seq {args.seq_len} x batch {args.global_batch}, "
          f"ac {args.ac}, medians of steps {args.warmup + 1}..{args.steps}")  # fmt: skip
    print(f"{'variant':<8} {'tok/s':>9} {'step s':>8} {'MFU':>6} {'peak GiB':>9} {'loss first->last':>18}")
    for r in results:
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "   n/a"
        print(f"{r['variant']:<8} {r['tokens_per_s']:9.0f} {r['step_s']:8.3f} {mfu} {r['peak_memory_gib']:9.2f} "
              f"{r['loss_first']:8.3f} -> {r['loss_last']:6.3f}")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"device": device, "torch": torch.__version__, "args": vars(args) | {
            "out": str(args.out)}, "results": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
