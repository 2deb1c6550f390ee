"""shardlab vs transformers' native FSDP x TP (`DistributedConfig`) on the same transformers model and layout, on
CPU ranks with gloo, back to back in both orders (A B B A).

    python scripts/bench_vs_transformers.py                  # FSDP 2 x TP 2 on 4 ranks
    python scripts/bench_vs_transformers.py --layouts 1x2    # FSDPxTP layouts to try
    python scripts/bench_vs_transformers.py --no-sp          # shardlab without SP and loss parallel, as transformers

Builds a LlamaForCausalLM (vocab 2048, hidden 256, ffn 768, 6 layers, 16 heads = 16 kv heads, fp32), saves its
random weights once with save_pretrained; both tools start from that directory and train --steps steps (AdamW lr
1e-3, no weight decay, no clipping, constant lr, global batch 8 x 256 random tokens). transformers: once in a
single process, then per layout with `LlamaForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(
fsdp_size=F, tp_size=T))` under torch.distributed.run (its distributed loading needs the `accelerate` package);
shardlab: `python -m shardlab recipes/hf_causal_lm.py --model.hf-path DIR` (+SP, loss parallel), also once on one
process. Every process runs one thread. Prints tokens/s over the steps after the first two, rank 0's peak RSS, the
largest |loss - the same tool's one-process loss| over all steps, and the mean ratio of tokens/s. A layout that
fails is reported with its error and the transformers source line that raised it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from _shardlab_run import run_shardlab
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.distributed import DistributedConfig

GLOBAL_BATCH, SEQ_LEN, LR, WARMUP = 8, 256, 1e-3, 2
MODEL = LlamaConfig(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=16,
)


def train(weights: Path, fsdp: int, tp: int, steps: int) -> dict:
    """Train on this rank; returns its losses (averaged over the ranks), tokens/s and peak RSS."""
    distributed = fsdp * tp > 1
    config = {"distributed_config": DistributedConfig(fsdp_size=fsdp, tp_size=tp)} if distributed else {}
    model = LlamaForCausalLM.from_pretrained(weights, dtype=torch.float32, **config)
    # The dense mesh is (pp, dp_replicate, fsdp, tp) in row-major rank order (transformers/distributed/utils.py).
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    per_rank = GLOBAL_BATCH // fsdp
    rows = slice(rank // tp * per_rank, (rank // tp + 1) * per_rank)
    data = torch.randint(
        0, MODEL.vocab_size, (steps, GLOBAL_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, ends = [], []
    for step in range(steps):
        ids = data[step, rows]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if distributed:
            dist.all_reduce(mean)  # every rank holds the same number of tokens: the global mean is the rank mean
        losses.append(mean.item() / world)
        ends.append(time.perf_counter())
    tokens = (steps - WARMUP) * GLOBAL_BATCH * SEQ_LEN
    return {
        "losses": losses,
        "tok_s": tokens / (ends[-1] - ends[WARMUP - 1]),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def worker(weights: Path, fsdp: int, tp: int, steps: int, out: Path) -> None:
    """One rank: write its result, or the error and the innermost transformers frame that raised it, as JSON."""
    torch.set_num_threads(1)
    try:
        if fsdp * tp > 1:
            dist.init_process_group("gloo")
        result = train(weights, fsdp, tp, steps)
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/transformers/" in f.filename]
        where = f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else "?"
        result = {"error": f"{type(e).__name__}: {e}", "where": where}
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1 if "error" in result else 0)


def launch(weights: Path, fsdp: int, tp: int, steps: int, out: Path) -> list[dict]:
    """Run one layout in fresh processes (torch.distributed.run for more than one rank); one dict per rank."""
    out.mkdir()
    n = fsdp * tp
    launcher = (
        [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n)]
    )
    args = ["--worker", "--weights", str(weights), "--fsdp", str(fsdp), "--tp", str(tp), "--steps", str(steps)]
    with open(out / "log.txt", "w") as log:
        subprocess.run([*launcher, __file__, *args, "--out", str(out)], stdout=log, stderr=subprocess.STDOUT)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]
    if not results:
        last = (out / "log.txt").read_text().strip().splitlines() or ["(no output)"]
        results = [{"error": f"no rank wrote a result; last log line: {last[-1]}", "where": "?"}]
    return results


def shardlab_run(weights: Path, fsdp: int, tp: int, steps: int, no_sp: bool = False) -> dict:
    """The same model, data size and optimizer through shardlab's CLI; rank 0's numbers. no_sp: without sequence
    and loss parallelism (transformers' own TP layout)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    plain = ["--plan.no-sequence-parallel", "--plan.no-loss-parallel"] if no_sp else []
    _, rows = run_shardlab("recipes/hf_causal_lm.py", [*plain,
        "--model.hf-path", str(weights), "--mesh.dp-shard", str(fsdp), "--mesh.tp", str(tp),
        "--train.steps", str(steps), "--train.seq-len", str(SEQ_LEN), "--train.global-batch", str(GLOBAL_BATCH),
        "--data.source", "synthetic", "--optim.lr", str(LR), "--optim.weight-decay", "0", "--optim.max-norm", "None",
        "--optim.warmup-steps", "0", "--optim.min-lr-ratio", "1", "--checkpoint.resume", "none",
    ], env=env, quiet=True)  # fmt: skip
    by_step = {r["step"]: r for r in rows}
    return {
        "losses": [by_step[i + 1]["loss"] for i in range(steps)],
        "tok_s": (steps - WARMUP) * GLOBAL_BATCH * SEQ_LEN / (by_step[steps]["time"] - by_step[WARMUP]["time"]),
        "peak_rss_mib": by_step[steps]["peak_memory_bytes"] / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=["2x2"], help="FSDPxTP, e.g. 2x2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-sp", action="store_true", help="shardlab without sequence and loss parallelism")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--fsdp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        worker(a.weights, a.fsdp, a.tp, a.steps, a.out)
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "init"
        torch.manual_seed(0)
        LlamaForCausalLM(MODEL).save_pretrained(weights)
        [ref] = launch(weights, 1, 1, a.steps, Path(tmp) / "1x1")
        if "error" in ref:
            raise SystemExit(f"one-process reference failed at {ref['where']}: {ref['error']}")
        refs = {"transformers": ref, "shardlab": shardlab_run(weights, 1, 1, a.steps)}
        print(f"{'tool':<14}{'layout':<16}{'tok/s':>9}  {'rank-0 peak RSS MiB':>20}{'max |dloss|':>13}")
        for tool, r in refs.items():
            print(f"{tool:<14}{'1 process':<16}{r['tok_s']:>9.0f}  {r['peak_rss_mib']:>20.0f}{0:>13.1e}")
        for layout in a.layouts:
            fsdp, tp = map(int, layout.split("x"))
            name, tok_s = f"FSDP {fsdp} x TP {tp}", {"transformers": [], "shardlab": []}
            for i, tool in enumerate(("transformers", "shardlab", "shardlab", "transformers")):
                if tool == "shardlab":
                    r = shardlab_run(weights, fsdp, tp, a.steps, a.no_sp)
                else:
                    ranks = launch(weights, fsdp, tp, a.steps, Path(tmp) / f"{layout}-{i}")
                    if errors := [x for x in ranks if "error" in x]:
                        print(f"{tool:<14}{name:<16}  FAILED at {errors[0]['where']}: {errors[0]['error']}")
                        continue
                    r = ranks[0]
                diff = max(abs(x - y) for x, y in zip(r["losses"], refs[tool]["losses"]))
                tok_s[tool].append(r["tok_s"])
                print(f"{tool:<14}{name:<16}{r['tok_s']:>9.0f}  {r['peak_rss_mib']:>20.0f}{diff:>13.1e}", flush=True)
            if tok_s["transformers"] and tok_s["shardlab"]:
                ratio = statistics.mean(tok_s["shardlab"]) / statistics.mean(tok_s["transformers"])
                print(f"ratio shardlab / transformers tok/s, {name}: {ratio:.2f} (mean of both orders)")


if __name__ == "__main__":
    main()
