"""Measured vs analytic pipeline bubble on this machine's CPU ranks.

    python scripts/bench_pipeline.py       # recipes/llama_pp.py: pp 2, every schedule (looped and V: 2 stages per rank)

Each schedule runs through the CLI on pp ranks and, as the reference, on one rank (same model and global batch),
every rank on one thread (OMP_NUM_THREADS=1), so p ranks have p times the reference's cores.
With a perfect split each of the p ranks would be busy for t1 / p, so the measured idle fraction is
1 - (t1 / p) / t_pp, where t1 and t_pp are median step times after step 2. It includes the sends between
stages, so it is an upper bound on the schedule's own bubble; the analytic one is the plan's.
"""

from __future__ import annotations

import argparse
import os
import statistics

from _shardlab_run import run_shardlab

from shardlab.sharding.pipeline import LOOPED, V_SHAPED, bubble_fraction


def step_s(recipe: str, overrides: list[str], steps: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one core per rank, the one-rank reference too
    _, rows = run_shardlab(recipe, [*overrides, "--train.steps", str(steps), "--log.every", "1",
                                    "--checkpoint.resume", "none"], env=env, quiet=True)  # fmt: skip
    return statistics.median(r["step_s"] for r in rows if r["step"] > 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/llama_pp.py")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", *LOOPED, *V_SHAPED])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    one = step_s(args.recipe, ["--mesh.pp", "1", "--world", "1"], args.steps)
    print(f"one rank: {one:.3f} s/step")
    print(f"{'schedule':<24} {'v':>2} {'micro':>5} {'s/step':>7} {'measured idle':>14} {'analytic bubble':>16}")
    for schedule in args.schedules:
        v = 2 if schedule in (*LOOPED, *V_SHAPED) else 1  # stages per rank
        for m in args.microbatches:
            t = step_s(args.recipe, ["--mesh.pp", str(args.pp), "--world", str(args.pp), "--plan.pp-schedule", schedule,
                                     "--plan.pp-stages-per-rank", str(v), "--plan.pp-microbatches", str(m)],
                       args.steps)  # fmt: skip
            idle = 1 - (one / args.pp) / t
            bubble = bubble_fraction(schedule, args.pp, v, m)
            print(f"{schedule:<24} {v:>2} {m:>5} {t:7.3f} {100 * idle:13.1f}% {100 * bubble:15.1f}%", flush=True)


if __name__ == "__main__":
    main()
