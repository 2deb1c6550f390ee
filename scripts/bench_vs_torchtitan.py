"""shardlab vs torchtitan on CPU ranks, same model, data, batch, layout and timing rule, run back to back.

    python scripts/bench_vs_torchtitan.py 4 2 2                 # FSDP 2 x TP 2, fp32, no activation checkpointing
    python scripts/bench_vs_torchtitan.py 4 2 2 --seq-len 512 --steps 6   # a short configuration while iterating
    python scripts/bench_vs_torchtitan.py 1 1 1 --dtype bfloat16
    python scripts/bench_vs_torchtitan.py 2 2 1 --skip-torchtitan

Mirrors the torchtitan harness's README (its location in TORCHTITAN_HARNESS: a folder with setup.sh and run.sh):
torchtitan's llama3 debug model (shardlab's default
ModelConfig), seq 2048, 8 sequences per data-parallel rank, AdamW 8e-4 with clipping at 1.0, the
stdlib-docstrings JSONL the peer's setup.sh writes (in the folder TT_WORK names), and tok/s = (STEPS - 2) x global tokens / (time
of step STEPS - time of step 2). The two run back to back in both orders, shardlab torchtitan torchtitan shardlab
(`--rounds` times), so a machine that slows down or speeds up during the runs favours neither; prints one summary
line per run, each round's ratio and their mean.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
from pathlib import Path

from _shardlab_run import run_shardlab

ROOT = Path(__file__).resolve().parents[1]
PEER = Path(harness) if (harness := os.environ.get("TORCHTITAN_HARNESS")) else None
TT_WORK = Path(work) if (work := os.environ.get("TT_WORK")) else None
"""The harness's work folder (TT_WORK, as its setup.sh uses it): shardlab reads the same JSONL from it; unset,
shardlab reads its default data (the stdlib)."""


def bench_shardlab(n: int, dp: int, tp: int, steps: int, dtype: str, ac: str, seq: int) -> dict:
    data = TT_WORK / "data" / "docstrings.jsonl" if TT_WORK is not None else None
    data_args = ["--data.source", "files", "--data.paths", str(data)] if data is not None and data.exists() else []
    env = {**os.environ}
    if n > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    _, rows = run_shardlab("recipes/llama_debug.py", [
        "--world", str(n), "--mesh.dp-shard", str(dp), "--mesh.tp", str(tp), "--train.steps", str(steps),
        "--train.seq-len", str(seq), "--train.global-batch", str(8 * dp), "--optim.decay", "linear",
        "--plan.param-dtype", dtype, "--plan.activation-checkpoint", ac, *data_args,
    ], env=env)  # fmt: skip
    by_step = {r["step"]: r for r in rows}
    tokens = (steps - 2) * 8 * dp * seq
    elapsed = by_step[steps]["time"] - by_step[2]["time"]
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "tok_s_total": tokens / elapsed,
        "loss_first": by_step[1]["loss"],
        "loss_last": by_step[steps]["loss"],
        "step_s": elapsed / (steps - 2),
        "peak_rss_mib": rss,
    }


def run_torchtitan(n: int, dp: int, tp: int, steps: int, dtype: str, ac: str, seq: int) -> dict:
    if PEER is None:
        raise SystemExit(
            "set TORCHTITAN_HARNESS to the torchtitan harness folder (setup.sh, run.sh), or --skip-torchtitan"
        )
    flags = ["--training.mixed_precision_param", dtype, "--training.seq_len", str(seq), f"activation_checkpoint:{ac}"]
    out = subprocess.run(
        [str(PEER / "run.sh"), str(n), str(dp), str(tp), str(steps), *flags], capture_output=True, text=True
    )
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode or not last.startswith("torchtitan n="):
        raise SystemExit(f"torchtitan failed (rc={out.returncode}): {last}\n{out.stderr[-2000:]}")
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    return {k: float(fields[k]) for k in ("tok_s_total", "loss_first", "loss_last", "step_s", "peak_rss_mib")}


def line(tool: str, n: int, dp: int, tp: int, steps: int, dtype: str, ac: str, r: dict) -> str:
    return (
        f"{tool} n={n} dp_shard={dp} tp={tp} steps={steps} tok_s_total={r['tok_s_total']:.0f} "
        f"loss_first={r['loss_first']:.4f} loss_last={r['loss_last']:.4f} peak_rss_mib={r['peak_rss_mib']:.0f} "
        f"step_s={r['step_s']:.2f} param_dtype={dtype} ac={ac}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n", type=int)
    parser.add_argument("dp_shard", type=int)
    parser.add_argument("tp", type=int)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--ac", choices=("none", "full"), default="none")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=1, help="A B B A rounds")
    parser.add_argument("--skip-torchtitan", action="store_true")
    a = parser.parse_args()
    if a.n != a.dp_shard * a.tp:
        raise SystemExit(f"n={a.n} must equal dp_shard x tp = {a.dp_shard * a.tp}")
    parts = (a.n, a.dp_shard, a.tp, a.steps, a.dtype, a.ac)
    if a.skip_torchtitan:
        print(line("shardlab", *parts, bench_shardlab(*parts, a.seq_len)), flush=True)
        return
    ratios = []
    for _ in range(a.rounds):
        runs: dict[str, list[dict]] = {"shardlab": [], "torchtitan": []}
        for tool in ("shardlab", "torchtitan", "torchtitan", "shardlab"):
            bench = bench_shardlab if tool == "shardlab" else run_torchtitan
            runs[tool].append(bench(*parts, a.seq_len))
            print(line(tool, *parts, runs[tool][-1]), flush=True)
        ours, theirs = ([r["tok_s_total"] for r in runs[t]] for t in ("shardlab", "torchtitan"))
        ratios.append(sum(ours) / sum(theirs))
        print(f"round {len(ratios)}: ratio shardlab/torchtitan tok/s = {ratios[-1]:.3f}", flush=True)
    print(f"ratio shardlab/torchtitan tok/s: mean {sum(ratios) / len(ratios):.3f} over {len(ratios)} A B B A rounds")


if __name__ == "__main__":
    main()
