"""Two torch.profiler Chrome traces of one step side by side, op by op: self time and calls per op, largest
differences first, and the totals (every op, aten ops, time spent waiting on collectives).

    python -m shardlab RECIPE ... --log.profile-step 5           # writes RUN/profile/rank0.json
    python scripts/compare_profiles.py RUN/profile/rank0.json OTHER/rank0_trace.json.gz --top 30

Any trainer's torch.profiler trace works (torchtitan writes profiling/traces/iteration_N/rank0_trace.json.gz).
Self time is an op's duration less its child ops' on the same thread. Op counts do not depend on how busy the
machine was; times do, so compare times only between traces taken back to back.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from pathlib import Path


def op_times(path: Path) -> tuple[Counter, Counter, float]:
    """Self microseconds and calls per op name, and the span of the trace in microseconds."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    if not events:
        raise SystemExit(f"{path}: no CPU ops; is it a torch.profiler Chrome trace?")
    by_thread: dict[object, list[dict]] = {}
    for e in events:
        by_thread.setdefault(e["tid"], []).append(e)
    self_us, calls = Counter(), Counter()
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ops: list[dict] = []
        for e in thread:
            while open_ops and open_ops[-1]["ts"] + open_ops[-1]["dur"] <= e["ts"]:
                open_ops.pop()
            if open_ops:
                self_us[open_ops[-1]["name"]] -= e["dur"]
            self_us[e["name"]] += e["dur"]
            calls[e["name"]] += 1
            open_ops.append(e)
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    return self_us, calls, span


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    (ta, ca, sa), (tb, cb, sb) = op_times(args.a), op_times(args.b)

    def totals(t: Counter, c: Counter, span: float) -> str:
        waits = sum(v for k, v in t.items() if "wait" in k)
        aten = sum(n for k, n in c.items() if k.startswith("aten::"))
        return f"span {span / 1e3:.0f} ms, {sum(c.values())} ops ({aten} aten), collective waits {waits / 1e3:.0f} ms"

    print(f"A {args.a}: {totals(ta, ca, sa)}")
    print(f"B {args.b}: {totals(tb, cb, sb)}")
    print(f"{'op':64s} {'A ms':>8s} {'A calls':>8s} {'B ms':>8s} {'B calls':>8s} {'A - B ms':>9s}")
    for name in sorted(set(ta) | set(tb), key=lambda n: -abs(ta[n] - tb[n]))[: args.top]:
        print(
            f"{name[:64]:64s} {ta[name] / 1e3:8.1f} {ca[name]:8d} {tb[name] / 1e3:8.1f} {cb[name]:8d} "
            f"{(ta[name] - tb[name]) / 1e3:9.1f}"
        )


if __name__ == "__main__":
    main()
