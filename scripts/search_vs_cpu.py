"""The search against reality on CPU ranks: estimated and measured step times of layouts that differ.

    python scripts/search_vs_cpu.py [--steps 8] [--repeats 2] [--out runs/search-vs-cpu.md]

A wider debug model (dim 512, 4 blocks, 8 heads, seq 256, 8 sequences per step) on 4 gloo ranks of this machine:
FSDP 4, HSDP 2x2, FSDP 2 x TP 2, TP 4, PP 2 x FSDP 2 and CP 2 x FSDP 2, each without and with full activation
checkpointing, and the layout `python -m shardlab search --device cpu` picks from all of them. Each layout is
estimated with `--device cpu` (this machine measured afresh with 4 ranks sharing its cores, the cache replaced:
one measured under another job's load prices every layout too slow) and run for --steps steps (median step time
after step 2), --repeats times, every layout once per pass and the passes in alternating order
(A B ... B A), so that a slow stretch of a shared machine falls on different layouts; --measured adds the passes of
an earlier --out, and only what they lack is measured (--no-runs: nothing; the estimates are scored against those
passes, and a search's pick they lack is reported unmeasured). Prints a markdown table (the median over passes and
each pass), the Spearman rank correlation of estimated and measured times, and how much slower than the measured
best the estimator's pick is.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import msgspec
from _shardlab_run import run_shardlab

RECIPE = "recipes/llama_debug.py"
MODEL = ["--model.dim", "512", "--model.n-layers", "4", "--model.n-heads", "8", "--model.n-kv-heads", "8",
         "--model.ffn-dim", "1536", "--model.vocab-size", "2048", "--train.seq-len", "256", "--train.global-batch", "8",
         "--data.source", "synthetic"]  # fmt: skip
MESHES = {
    "FSDP 4": dict(dp_shard=4),
    "HSDP 2x2": dict(dp_replicate=2, dp_shard=2),
    "FSDP 2 x TP 2": dict(dp_shard=2, tp=2),
    "TP 4": dict(dp_shard=1, tp=4),
    "PP 2 x FSDP 2": dict(pp=2, dp_shard=2),
    "CP 2 x FSDP 2": dict(dp_shard=2, cp=2),
}
WORLD = 4


def config(name: str, ac: str):
    """The recipe with the model above, laid out as MESHES[name] with checkpointing `ac`."""
    import tyro

    from shardlab._base import deferred_checks
    from shardlab.cli.recipe import load_recipe
    from shardlab.config import Config
    from shardlab.sharding.mesh import MeshSpec

    with deferred_checks():
        cfg = tyro.cli(Config, default=load_recipe(RECIPE).config, args=MODEL)
    mesh = MeshSpec(**MESHES[name])
    plan = msgspec.structs.replace(cfg.plan, activation_checkpoint=ac)
    return msgspec.structs.replace(cfg.validated(), mesh=mesh, plan=plan).resolve(WORLD)


def overrides(cfg) -> list[str]:
    axes = [
        f"--mesh.{a.replace('_', '-')}={getattr(cfg.mesh, a)}" for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    ]
    ac = f"--plan.activation-checkpoint={cfg.plan.activation_checkpoint}"
    micro = [f"--plan.pp-microbatches={cfg.plan.pp_microbatches}"] if cfg.plan.pp_microbatches else []
    if cfg.train.micro_batch:
        micro.append(f"--train.micro-batch={cfg.train.micro_batch}")
    return [*MODEL, *axes, ac, *micro, f"--plan.pp-schedule={cfg.plan.pp_schedule}",
            f"--plan.pp-stages-per-rank={cfg.plan.pp_stages_per_rank}",
            f"--plan.{'' if cfg.plan.resharding(cfg.mesh)[0] else 'no-'}reshard-after-forward"]  # fmt: skip


def estimated(cfg, dev) -> float:
    from shardlab.estimate import estimate
    from shardlab.training.loop import plan_model

    _, plan = plan_model(cfg)
    return estimate(cfg, plan, dev=dev).time.step_s


def measured(cfg, steps: int) -> float:
    _, metrics = run_shardlab(RECIPE, [*overrides(cfg), "--world", str(WORLD), "--train.steps", str(steps),
                                       "--checkpoint.resume", "none"], quiet=True)  # fmt: skip
    return statistics.median(m["step_s"] for m in metrics if m["step"] > 2)


def _as_list(value: float | list[float]) -> list[float]:
    """An earlier --out's measurement: one pass (a number) or several."""
    return list(value) if isinstance(value, list) else [value]


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, i in enumerate(order):
        out[i] = float(rank)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    return statistics.correlation(ranks(a), ranks(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, help="write the table here, and the measured times beside it as JSON")
    parser.add_argument("--measured", type=Path, help="add the measured passes of an earlier --out (its JSON)")
    parser.add_argument("--repeats", type=int, default=1, help="measurements of every layout, in alternating passes")
    parser.add_argument("--no-runs", action="store_true", help="measure nothing: score against --measured only")
    parser.add_argument("--reverse", action="store_true", help="start with the last layout (the search's pick)")
    args = parser.parse_args()
    known = json.loads(args.measured.read_text()) if args.measured else {}
    from shardlab.cli.recipe import load_recipe
    from shardlab.estimate.cpu import cache_path
    from shardlab.estimate.devices import device
    from shardlab.estimate.search import search
    from shardlab.models import provider_for

    # measured afresh, the cache replaced: a calibration taken under another job's load skews every estimate
    cache_path(WORLD).unlink(missing_ok=True)
    dev = device("cpu", WORLD)
    print(f"device: {dev}", flush=True)
    rows = []
    for name in MESHES:
        for ac in ("none", "full"):
            cfg = config(name, ac)
            rows.append((f"{name}, AC {ac}", cfg, estimated(cfg, dev)))
    base = config("FSDP 4", "none")
    found = search(
        base, WORLD, provider_for(base), load_recipe(RECIPE).rules, dev, round(dev.memory_gib * 2**30), top=1
    )
    pick = found.best[0]
    rows.append((f"search's pick: {pick.layout.describe()}", pick.layout.config(base).resolve(WORLD), pick.step_s))
    print(f"search: {found.layouts} layouts, {found.estimated} estimated in {found.seconds:.1f} s", flush=True)
    key = {label: " ".join(overrides(cfg)) for label, cfg, _ in rows}
    passes = {key[label]: _as_list(known.get(key[label], [])) for label, _, _ in rows}
    for r in range(args.repeats):  # until every layout has --repeats measurements, earlier ones included
        for label, cfg, _ in rows if (r % 2 == 0) != args.reverse else rows[::-1]:
            if len(passes[key[label]]) > r or args.no_runs:
                continue
            passes[key[label]].append(measured(cfg, args.steps))
            print(f"pass {r + 1}, {label}: measured {passes[key[label]][-1]:.3f} s", flush=True)
            if args.out:  # as it goes: a pass cut short keeps what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.with_suffix(".json").write_text(json.dumps({**known, **passes}, indent=1))
    known.update(passes)
    if args.no_runs and not all(passes[key[label]] for label, _, _ in rows[:-1]):
        parser.error("--no-runs needs --measured with every fixed layout measured; drop --no-runs to run them")
    results = [(label, est, statistics.median(passes[key[label]] or [math.nan])) for label, _, est in rows]
    spread = {label: passes[key[label]] for label, _, _ in rows}
    fixed = results[:-1]
    rho = spearman([e for _, e, _ in fixed], [m for _, _, m in fixed])
    best_measured = min(m for _, _, m in results if not math.isnan(m))
    pick_vs_best = (
        f"{results[-1][2] / best_measured - 1:+.1%} against the measured best of every layout run"
        if not math.isnan(results[-1][2])
        else "not measured (--no-runs)"
    )
    among = min(fixed, key=lambda r: r[1])
    lines = [
        "| layout | estimated s/step | measured s/step (median) | passes | estimated rank | measured rank |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    er, mr = ranks([e for _, e, _ in fixed]), ranks([m for _, _, m in fixed])
    for i, (label, est, meas) in enumerate(results):
        rank = (f"{int(er[i]) + 1}", f"{int(mr[i]) + 1}") if i < len(fixed) else ("-", "-")
        each = ", ".join(f"{t:.2f}" for t in spread[label])
        lines.append(f"| {label} | {est:.3f} | {meas:.3f} | {each} | {rank[0]} | {rank[1]} |")
    fastest = [min(spread[label]) for label, _, _ in fixed]  # other jobs only ever slow a run down
    lines += [
        "",
        f"Spearman rank correlation (the 12 fixed layouts): {rho:.2f} against the median over passes, "
        f"{spearman([e for _, e, _ in fixed], fastest):.2f} against the fastest pass of each",
        f"estimator's pick among them, {among[0]}: {among[2] / min(m for _, _, m in fixed) - 1:+.1%} against the "
        "measured best of them",
        f"search's pick over all {found.layouts} layouts: {pick_vs_best}",
        f"device: {dev.name}: {dev.bf16_tflops * 1e3:.1f} GFLOP/s, {dev.hbm_tb_s * 1e3:.1f} GB/s, "
        f"all-reduce {dev.nvlink_gb_s:.2f} GB/s per rank, speed with 1..{WORLD} ranks busy "
        + ", ".join(f"{x:.2f}" for x in dev.busy_speed)
        + "".join(f", {kind} {speed:.2f} of the all-reduce's speed" for kind, speed in dev.collective_speed)
        + "".join(f", {s * 1e3:.1f} ms per collective of {n}" for n, s in dev.collective_latency),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"python {' '.join(sys.argv)}\n\n{text}\n")
        args.out.with_suffix(".json").write_text(json.dumps(known, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
