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
line per run, each round's ratio and their mean. Beside the wall clock, each run's CPU seconds per step (every rank's
user + system time over the same steps, `CpuClock`): the work done, which waiting for cores shared with other
processes does not inflate, so its ratio (torchtitan / shardlab; above 1, shardlab does less) says whether a
difference in tok/s is work or waiting.
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import os
import re
import resource
import subprocess
import threading
import time
from pathlib import Path

from _shardlab_run import run_shardlab

ROOT = Path(__file__).resolve().parents[1]
PEER = Path(harness) if (harness := os.environ.get("TORCHTITAN_HARNESS")) else None
TT_WORK = Path(work) if (work := os.environ.get("TT_WORK")) else None
"""The harness's work folder (TT_WORK, as its setup.sh uses it): shardlab reads the same JSONL from it; unset,
shardlab reads its default data (the stdlib)."""


class CpuClock:
    """CPU seconds (user + system) of every process descended from this one, sampled with the wall clock by a
    thread, so a run's steady state can be read off between two of its steps. Ranks sharing cores take turns: the
    wall clock of a step carries the other processes' turns, while its CPU seconds are the work the ranks did (the
    waiting in collectives blocks and costs none), which other load barely moves."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, every_s: float = 0.25) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def __enter__(self) -> CpuClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.samples.append((time.time(), self._descendants_cpu()))

    def _descendants_cpu(self) -> float:
        parent, ticks = {}, {}
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:  # the process ended
                    continue
                parent[int(pid)], ticks[int(pid)] = int(fields[1]), int(fields[11]) + int(fields[12])
        mine, total = os.getpid(), 0
        for pid, t in ticks.items():
            p = parent[pid]
            while p > 1 and p != mine:
                p = parent.get(p, 0)
            total += t if p == mine else 0
        return total / self.TICK

    def between(self, start: float, end: float) -> float:
        """CPU seconds from wall time `start` to `end` (linear between samples)."""
        times = [t for t, _ in self.samples]

        def at(t: float) -> float:
            i = min(max(bisect.bisect_left(times, t), 1), len(times) - 1)
            (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0)

        return at(end) - at(start)


def bench_shardlab(n: int, dp: int, tp: int, steps: int, dtype: str, ac: str, seq: int) -> dict:
    data = TT_WORK / "data" / "docstrings.jsonl" if TT_WORK is not None else None
    data_args = ["--data.source", "files", "--data.paths", str(data)] if data is not None and data.exists() else []
    env = {**os.environ}
    if n > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    with CpuClock() as clock:
        _, rows = run_shardlab("recipes/llama_debug.py", [
        "--world", str(n), "--mesh.dp-shard", str(dp), "--mesh.tp", str(tp), "--train.steps", str(steps),
        "--train.seq-len", str(seq), "--train.global-batch", str(8 * dp), "--optim.decay", "linear",
        "--plan.param-dtype", dtype, "--plan.activation-checkpoint", ac, *data_args,
        ], env=env)  # fmt: skip
    by_step = {r["step"]: r for r in rows}
    cpu = clock.between(by_step[2]["time"], by_step[steps]["time"])
    tokens = (steps - 2) * 8 * dp * seq
    elapsed = by_step[steps]["time"] - by_step[2]["time"]
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "tok_s_total": tokens / elapsed,
        "loss_first": by_step[1]["loss"],
        "loss_last": by_step[steps]["loss"],
        "step_s": elapsed / (steps - 2),
        "cpu_s": cpu / (steps - 2),
        "peak_rss_mib": rss,
    }


def run_torchtitan(n: int, dp: int, tp: int, steps: int, dtype: str, ac: str, seq: int) -> dict:
    if PEER is None:
        raise SystemExit(
            "set TORCHTITAN_HARNESS to the torchtitan harness folder (setup.sh, run.sh), or --skip-torchtitan"
        )
    flags = ["--training.mixed_precision_param", dtype, "--training.seq_len", str(seq), f"activation_checkpoint:{ac}"]
    with CpuClock() as clock:
        out = subprocess.run(
            [str(PEER / "run.sh"), str(n), str(dp), str(tp), str(steps), *flags], capture_output=True, text=True
        )
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode or not last.startswith("torchtitan n="):
        raise SystemExit(f"torchtitan failed (rc={out.returncode}): {last}\n{out.stderr[-2000:]}")
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    result = {k: float(fields[k]) for k in ("tok_s_total", "loss_first", "loss_last", "step_s", "peak_rss_mib")}
    run_dir = Path(re.search(r"run dir: (\S+)", out.stdout).group(1))
    when = _torchtitan_step_times(run_dir / "train.log")
    return result | {"cpu_s": clock.between(when[2], when[steps]) / (steps - 2)}


def _torchtitan_step_times(log: Path) -> dict[int, float]:
    """Wall time (time.time()) of each step's log line, as the harness times steps (its timestamps are local
    time, to the millisecond)."""
    when = {}
    for line in ANSI.sub("", log.read_text(errors="replace")).splitlines():
        if (step := re.search(r"step:\s*(\d+)\s+loss", line)) and (t := TS.search(line)):
            stamp = dt.datetime.strptime(t.group(1), "%Y-%m-%d %H:%M:%S,%f")
            when.setdefault(int(step.group(1)), stamp.timestamp())
    return when


ANSI = re.compile(r"\x1b\[[0-9;]*m")
TS = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def line(tool: str, n: int, dp: int, tp: int, steps: int, dtype: str, ac: str, r: dict) -> str:
    return (
        f"{tool} n={n} dp_shard={dp} tp={tp} steps={steps} tok_s_total={r['tok_s_total']:.0f} "
        f"loss_first={r['loss_first']:.4f} loss_last={r['loss_last']:.4f} peak_rss_mib={r['peak_rss_mib']:.0f} "
        f"step_s={r['step_s']:.2f} cpu_s={r['cpu_s']:.2f} param_dtype={dtype} ac={ac}"
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
    ratios, works = [], []
    for _ in range(a.rounds):
        runs: dict[str, list[dict]] = {"shardlab": [], "torchtitan": []}
        for tool in ("shardlab", "torchtitan", "torchtitan", "shardlab"):
            bench = bench_shardlab if tool == "shardlab" else run_torchtitan
            runs[tool].append(bench(*parts, a.seq_len))
            print(line(tool, *parts, runs[tool][-1]), flush=True)
        ours, theirs = ([r["tok_s_total"] for r in runs[t]] for t in ("shardlab", "torchtitan"))
        ratios.append(sum(ours) / sum(theirs))
        work = sum(r["cpu_s"] for r in runs["torchtitan"]) / sum(r["cpu_s"] for r in runs["shardlab"])
        works.append(work)
        print(
            f"round {len(ratios)}: ratio shardlab/torchtitan tok/s = {ratios[-1]:.3f}, "
            f"CPU seconds per step torchtitan/shardlab = {work:.3f}",
            flush=True,
        )
    print(
        f"ratio shardlab/torchtitan tok/s: mean {sum(ratios) / len(ratios):.3f}; CPU seconds per step "
        f"torchtitan/shardlab: mean {sum(works) / len(works):.3f}; over {len(ratios)} A B B A rounds"
    )


if __name__ == "__main__":
    main()
