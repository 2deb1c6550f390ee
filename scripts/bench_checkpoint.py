"""How long a checkpoint save blocks training: synchronous vs async (`--checkpoint.async-save`).

    python scripts/bench_checkpoint.py            # FSDP 2 on 2 CPU ranks, a 43M-parameter Llama
    python scripts/bench_checkpoint.py --n 1 --dp-shard 1

Runs the same training twice through the CLI (saving every 2 steps) and reads `checkpoint_block_s`
(time from the start of a save to the return to training) and `step_s` from metrics.jsonl.
"""

from __future__ import annotations

import argparse
import statistics

from _shardlab_run import run_shardlab

MODEL = ["--model.dim", "512", "--model.n-layers", "8", "--model.n-heads", "8", "--model.n-kv-heads", "8",
         "--model.ffn-dim", "1536", "--model.vocab-size", "8192"]  # fmt: skip


def run(n: int, dp_shard: int, steps: int, async_save: bool) -> dict[str, float]:
    run_dir, rows = run_shardlab("recipes/llama_debug.py", [
        "--world", str(n), "--mesh.dp-shard", str(dp_shard), *MODEL, "--train.steps", str(steps),
        "--train.seq-len", "256", "--train.global-batch", str(4 * dp_shard), "--checkpoint.every", "2",
        "--checkpoint.keep", "2", *(["--checkpoint.async-save"] if async_save else []),
    ], quiet=True)  # fmt: skip
    blocks = [r["checkpoint_block_s"] for r in rows if "checkpoint_block_s" in r and r["step"] < steps]
    plain = [r["step_s"] for r in rows[1:] if "checkpoint_block_s" not in r]
    size = sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file()) / 2 / 2**20
    return {"block_s": statistics.median(blocks), "step_s": statistics.median(plain), "ckpt_mib": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--dp-shard", type=int, default=2)
    parser.add_argument("--steps", type=int, default=9)
    a = parser.parse_args()
    sync, asyn = run(a.n, a.dp_shard, a.steps, False), run(a.n, a.dp_shard, a.steps, True)
    for name, r in (("sync", sync), ("async", asyn)):
        print(
            f"{name:5s} n={a.n} checkpoint {r['ckpt_mib']:.0f} MiB: save blocks {r['block_s']:.2f} s (median), step {r['step_s']:.2f} s"
        )
    print(f"async blocks {asyn['block_s'] / sync['block_s']:.2f}x as long as sync")


if __name__ == "__main__":
    main()
