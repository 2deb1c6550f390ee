"""The benchmark scripts' gloo worlds on this machine: one world per size the chosen layouts need."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def join(rank: int, world: int, port: int) -> None:
    """Join the world `run_worlds` spawned, with this rank's share of the cores."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def free_port() -> int:
    """A port no one listens on now, for a world's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worlds(
    run: Callable[[int, int, int, argparse.Namespace, dict], None],
    layouts: dict[str, tuple[int, int]],
    args: argparse.Namespace,
) -> dict[str, dict]:
    """`run(rank, world, port, args, out)` on every rank of one world per size among `args.layouts` (name -> (dp_shard,
    tp) in `layouts`); rank 0 fills `out[name]` for its world's layouts. Returns every world's `out`."""
    results: dict[str, dict] = {}
    for world in sorted({dp * tp for dp, tp in (layouts[n] for n in args.layouts)}):
        port = free_port()
        out = mp.Manager().dict()
        mp.spawn(run, args=(world, port, args, out), nprocs=world)
        results |= dict(out)
    return results


def arguments(doc: str | None, layouts: dict[str, tuple[int, int]]) -> argparse.Namespace:
    """The benchmarks' common flags: which layouts, how many steps (two of them warm-up), the sequence length."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(layouts), choices=list(layouts))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    if args.steps < 4:
        raise SystemExit(f"--steps={args.steps}: give at least 4 (two warm-up steps, then the timed ones)")
    return args


def report(results: dict[str, dict], a: str, b: str, ratio: str, extra: Callable[[dict], str] = lambda r: "") -> None:
    """One line per layout: each side's step times (`r["times"][a]`, `[b]`), the ratio of their means a / b, and the
    largest loss difference, which must stay within 1e-5 (both sides compute the same model on the same batches)."""
    for name, r in results.items():
        t, losses = r["times"], r["losses"]
        diff = max(abs(x - y) for x, y in zip(losses[a], losses[b]))
        print(
            f"{name}: step s {a} {[round(x, 4) for x in t[a]]} {b} {[round(x, 4) for x in t[b]]}  "
            f"{ratio} {statistics.mean(t[a]) / statistics.mean(t[b]):.3f}{extra(r)}  max |loss diff| {diff:.1e}"
        )
        if diff > 1e-5:
            raise SystemExit(f"{name}: {a} and {b} do not compute the same losses ({diff:.1e})")
