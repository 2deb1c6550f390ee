"""The benchmark scripts' gloo worlds on this machine: one world per size the chosen layouts need."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def join(rank: int, world: int, port: int) -> None:
    """Join the world `run_worlds` spawned, with this rank's share of the cores."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def run_worlds(
    run: Callable[[int, int, int, argparse.Namespace, dict], None],
    layouts: dict[str, tuple[int, int]],
    args: argparse.Namespace,
) -> dict[str, dict]:
    """`run(rank, world, port, args, out)` on every rank of one world per size among `args.layouts` (name -> (dp_shard,
    tp) in `layouts`); rank 0 fills `out[name]` for its world's layouts. Returns every world's `out`."""
    results: dict[str, dict] = {}
    for world in sorted({dp * tp for dp, tp in (layouts[n] for n in args.layouts)}):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = mp.Manager().dict()
        mp.spawn(run, args=(world, port, args, out), nprocs=world)
        results |= dict(out)
    return results
