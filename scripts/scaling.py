"""Scaling sweeps: estimates over world sizes (no devices), or real runs on this machine; CSV, and PNG plots when
matplotlib is installed (`pip install -e '.[plot]'`).

    python scripts/scaling.py estimate recipes/llama3_8b.py --worlds 8 16 32 64 128 --device h100 --out runs/scaling
    python scripts/scaling.py real recipes/llama_debug.py --layouts 1x1 2x1 2x2 --out runs/scaling-cpu

`estimate` predicts, per world size, the worst rank's peak memory, tokens/s per device and MFU (weak scaling:
the recipe's sequences per data-parallel rank stay fixed). `real` runs the recipe for each DPxTP layout through
the CLI and reads metrics.jsonl: median tokens/s and step time after step 2, peak memory per rank. Each CSV
starts with the command that made it; each PNG's title carries it too.
"""

from __future__ import annotations

import argparse
import csv
import shlex
import statistics
import sys
from pathlib import Path

from _shardlab_run import run_shardlab


def estimate_rows(recipe: str, worlds: list[int], device_name: str) -> list[dict]:
    import msgspec

    from shardlab.estimate import estimate
    from shardlab.estimate.roofline import device
    from shardlab.loop import plan_model
    from shardlab.recipe import load_recipe

    r = load_recipe(recipe)
    base = r.config
    per_dp = base.train.global_batch // base.mesh.resolve(worlds[0]).size("dp")
    rows = []
    for world in worlds:
        batch = per_dp * base.mesh.resolve(world).size("dp")  # weak scaling: the batch grows with dp
        cfg = msgspec.structs.replace(base, train=msgspec.structs.replace(base.train, global_batch=batch)).resolve(
            world
        )
        _, plan = plan_model(cfg, r.rules(cfg))
        dev = device(device_name)
        e = estimate(cfg, plan, r.rules(cfg), dev)
        rows.append({
            "world": world, "mesh": e.mesh, "peak_gib": e.peak / 2**30, "activations_gib": e.activations / 2**30,
            "step_s": e.time.step_s, "tokens_per_s_per_device": e.time.tokens_per_s_per_device, "mfu": e.time.mfu,
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def real_rows(recipe: str, layouts: list[str], steps: int) -> list[dict]:
    rows = []
    for layout in layouts:
        dp, tp = (int(x) for x in layout.split("x"))
        _, metrics = run_shardlab(recipe, [
            "--world", str(dp * tp), "--mesh.dp-shard", str(dp), "--mesh.tp", str(tp), "--train.steps", str(steps),
            "--log.every", "1", "--checkpoint.resume", "none",
        ])  # fmt: skip
        timed = [m for m in metrics if m["step"] > 2]
        rows.append({
            "world": dp * tp, "mesh": f"dp_shard={dp} x tp={tp}",
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in timed),
            "step_s": statistics.median(m["step_s"] for m in timed),
            "peak_gib": max(m["peak_memory_bytes"] for m in metrics) / 2**30,
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def write(rows: list[dict], out: Path, command: str, y: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "scaling.csv").open("w", newline="") as f:
        f.write(f"# {command}\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'): wrote the CSV only", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(y), figsize=(5 * len(y), 4))
    for ax, key in zip(axes, y):
        ax.plot([r["world"] for r in rows], [r[key] for r in rows], marker="o", linestyle=":")
        for r in rows:  # two layouts can share a world size: name each point
            ax.annotate(r["mesh"], (r["world"], r[key]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    fig.suptitle(command, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["estimate", "real"])
    parser.add_argument("recipe")
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--device", default="h100")
    parser.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "2x2"], help="DPxTP per real run")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("runs/scaling"))
    args = parser.parse_args()
    command = "python " + shlex.join(sys.argv)
    if args.kind == "estimate":
        rows = estimate_rows(args.recipe, args.worlds, args.device)
        write(rows, args.out, command, ["tokens_per_s_per_device", "mfu", "peak_gib"])
    else:
        rows = real_rows(args.recipe, args.layouts, args.steps)
        write(rows, args.out, command, ["tokens_per_s", "step_s", "peak_gib"])


if __name__ == "__main__":
    main()
