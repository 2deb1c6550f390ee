"""A transformers LlamaForCausalLM trained by directory vs shardlab's own Llama: same shapes, weights' seed, data,
batch and layout, run back to back in both orders (A B B A).

    python scripts/bench_hf_vs_own.py                      # FSDP 2 x TP 2 (+SP, loss parallel), fp32, 4 ranks
    python scripts/bench_hf_vs_own.py --dp-shard 4 --tp 1  # FSDP 4
    python scripts/bench_hf_vs_own.py --seq-len 512 --steps 10

The transformers model is built from shardlab's default ModelConfig (torchtitan's llama3 debug model, written as
a transformers config.json, no weights: both start from the seed). tok/s = (steps - 2) x global tokens / (time of
the last step - time of step 2). Prints one line per run, then the mean ratio transformers / shardlab of tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from _shardlab_run import run_shardlab

from shardlab.config import ModelConfig
from shardlab.models.llama.model import to_hf_config


def run(kind: str, hf_dir: Path, a: argparse.Namespace) -> dict[str, float]:
    recipe = "recipes/hf_causal_lm.py" if kind == "transformers" else "recipes/llama_fsdp_tp.py"
    model = ["--model.hf-path", str(hf_dir)] if kind == "transformers" else []
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // (a.dp_shard * a.tp)))}
    _, rows = run_shardlab(recipe, [
        *model, "--mesh.dp-shard", str(a.dp_shard), "--mesh.tp", str(a.tp), "--train.steps", str(a.steps),
        "--train.seq-len", str(a.seq_len), "--train.global-batch", "8", "--optim.lr", "8e-4",
        "--optim.weight-decay", "0.1", "--checkpoint.resume", "none",
    ], env=env, quiet=True)  # fmt: skip
    by_step = {r["step"]: r for r in rows}
    elapsed = by_step[a.steps]["time"] - by_step[2]["time"]
    return {"tok_s": (a.steps - 2) * 8 * a.seq_len / elapsed, "loss_last": by_step[a.steps]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp-shard", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=256)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp)
        (hf_dir / "config.json").write_text(json.dumps(to_hf_config(ModelConfig())))
        results: dict[str, list[float]] = {"transformers": [], "shardlab": []}
        for kind in ("transformers", "shardlab", "shardlab", "transformers"):
            r = run(kind, hf_dir, a)
            results[kind].append(r["tok_s"])
            print(f"{kind:12} dp_shard={a.dp_shard} tp={a.tp} seq={a.seq_len} tok_s={r['tok_s']:.0f} "
                  f"loss_last={r['loss_last']:.4f}", flush=True)  # fmt: skip
    ratio = statistics.mean(results["transformers"]) / statistics.mean(results["shardlab"])
    print(f"ratio transformers-model / shardlab-Llama tok/s = {ratio:.2f} (mean of both orders)")


if __name__ == "__main__":
    main()
