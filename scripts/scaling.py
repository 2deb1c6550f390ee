"""Scaling sweeps: estimates over world sizes (no devices), or real runs on this machine beside their estimates;
a CSV and an SVG plot of each.

    python scripts/scaling.py estimate recipes/llama3_8b.py --worlds 8 16 32 64 128 --device h100 --out runs/scaling \
        --published docs/scaling/estimate-8b-h100/published.csv
    python scripts/scaling.py real recipes/llama_debug.py --layouts 1x1 2x1 2x2 --out runs/scaling-cpu

`estimate` predicts, per world size, the worst rank's peak memory, tokens/s per device and MFU (weak scaling:
the recipe's sequences per data-parallel rank stay fixed), with published figures (--published) on the same axes.
`real` runs the recipe for each DPxTP layout through the CLI and reads metrics.jsonl: median tokens/s and step
time after step 2, peak memory per rank; and estimates each layout with `--device cpu` (this machine, measured
once per world size). Each CSV starts with the command that made it; each SVG's caption carries it too.
"""

from __future__ import annotations

import argparse
import csv
import shlex
import statistics
import sys
from pathlib import Path

from _shardlab_run import run_shardlab
from _svg import Panel, Series, chart


def estimate_rows(recipe: str, worlds: list[int], device_name: str) -> list[dict]:
    import msgspec

    from shardlab.cli.recipe import load_recipe
    from shardlab.estimate import estimate
    from shardlab.estimate.devices import device
    from shardlab.training.loop import plan_model

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
        dev = device(device_name, world)
        e = estimate(cfg, plan, r.rules(cfg), dev)
        rows.append({
            "world": world, "mesh": e.mesh, "peak_gib": e.peak / 2**30, "activations_gib": e.activations / 2**30,
            "step_s": e.time.step_s, "tokens_per_s_per_device": e.time.tokens_per_s_per_device, "mfu": e.time.mfu,
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def real_estimate(recipe: str, dp: int, tp: int):
    """The estimate of the recipe on dp_shard x tp CPU ranks of this machine, as `real` runs it."""
    import msgspec

    from shardlab.cli.recipe import load_recipe
    from shardlab.estimate import estimate
    from shardlab.estimate.devices import device
    from shardlab.training.loop import plan_model

    r = load_recipe(recipe)
    mesh = msgspec.structs.replace(r.config.mesh, dp_shard=dp, tp=tp)
    cfg = msgspec.structs.replace(r.config, mesh=mesh).resolve(dp * tp)
    _, plan = plan_model(cfg, r.rules(cfg))
    return estimate(cfg, plan, r.rules(cfg), device("cpu", dp * tp)), cfg.train.global_batch * cfg.train.seq_len


def real_rows(recipe: str, layouts: list[str], steps: int) -> list[dict]:
    rows = []
    for layout in layouts:
        dp, tp = (int(x) for x in layout.split("x"))
        e, tokens = real_estimate(recipe, dp, tp)
        _, metrics = run_shardlab(recipe, [
            "--world", str(dp * tp), "--mesh.dp-shard", str(dp), "--mesh.tp", str(tp), "--train.steps", str(steps),
            "--log.every", "1", "--checkpoint.resume", "none",
        ])  # fmt: skip
        timed = [m for m in metrics if m["step"] > 2]
        rows.append({
            "world": dp * tp, "mesh": f"FSDP {dp}" + (f" x TP {tp}" if tp > 1 else "") if dp * tp > 1 else "one rank",
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in timed),
            "step_s": statistics.median(m["step_s"] for m in timed),
            "peak_gib": max(m["peak_memory_bytes"] for m in metrics) / 2**30,
            "est_tokens_per_s": tokens / e.time.step_s, "est_step_s": e.time.step_s, "est_peak_gib": e.peak / 2**30,
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def _layout(row: dict) -> str:
    """A point's label: its mesh, unless it is one axis over every rank (the x axis says that already)."""
    mesh = row["mesh"].split(" (")[0]
    return "" if "x" not in mesh and mesh.endswith(f"={row['world']}") else mesh


def write(rows: list[dict], out: Path, command: str, panels: list[Panel]) -> None:
    """`scaling.csv` (the rows, after the command that made them) and `scaling.svg` (the panels)."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "scaling.csv").open("w", newline="") as f:
        f.write(f"# {command}\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "scaling.svg").write_text(chart(panels, command))


def published_rows(path: Path | None) -> list[dict]:
    """Published figures to draw beside an estimate: a CSV with `world`, any of the estimate's columns, `source`."""
    if path is None:
        return []
    with path.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def estimate_panels(rows: list[dict], published: list[dict], device_name: str) -> list[Panel]:
    from shardlab.estimate.devices import device

    unit = "GPUs" if device_name != "cpu" else "CPU ranks"
    where = device(device_name).name if device_name != "cpu" else "this machine"  # a name or a device file

    def panel(title: str, key: str, y_title: str, scale: float = 1.0) -> Panel:
        labels = [_layout(r) for r in rows]
        series = [Series("estimate", [(r["world"], r[key] * scale) for r in rows], labels)]
        points = [(int(p["world"]), float(p[key]) * scale) for p in published if p.get(key)]
        if points:
            series.append(Series(f"published ({published[0]['source']})", points, line=False))
        return Panel(title, f"{unit} ({where})", y_title, series)

    return [
        panel("Throughput", "tokens_per_s_per_device", f"tokens/s per {unit[:-1]}"),
        panel("Model FLOPs utilization", "mfu", "MFU (%)", 100.0),
        panel("Memory", "peak_gib", f"peak memory per {unit[:-1]} (GiB)"),
    ]


def real_panels(rows: list[dict]) -> list[Panel]:
    def panel(title: str, measured: str, estimated: str, y_title: str, what: tuple[str, str]) -> Panel:
        labels = [r["mesh"] for r in rows]
        return Panel(title, "CPU ranks (gloo, this machine)", y_title, [
            Series(f"measured ({what[0]})", [(r["world"], r[measured]) for r in rows], labels, line=False),
            Series(f"estimated ({what[1]})", [(r["world"], r[estimated]) for r in rows], line=False),
        ])  # fmt: skip

    steps, estimate = "median of steps 3+", "--device cpu"
    return [
        panel("Throughput", "tokens_per_s", "est_tokens_per_s", "tokens/s (all ranks)", (steps, estimate)),
        panel("Step time", "step_s", "est_step_s", "seconds per step", (steps, estimate)),
        panel("Memory", "peak_gib", "est_peak_gib", "peak memory per rank (GiB)",
              ("peak RSS, runtime included", "tensors only")),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["estimate", "real"])
    parser.add_argument("recipe")
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--device", default="h100")
    parser.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "2x2"], help="DPxTP per real run")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("runs/scaling"))
    parser.add_argument("--published", type=Path, help="published figures (CSV) to draw beside an estimate")
    args = parser.parse_args()
    command = "python " + shlex.join(sys.argv)
    if args.kind == "estimate":
        rows = estimate_rows(args.recipe, args.worlds, args.device)
        write(rows, args.out, command, estimate_panels(rows, published_rows(args.published), args.device))
    else:
        rows = real_rows(args.recipe, args.layouts, args.steps)
        write(rows, args.out, command, real_panels(rows))


if __name__ == "__main__":
    main()
