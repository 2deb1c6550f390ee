"""Launch: how `python -m shardlab RECIPE ...` becomes N processes.

The first process finds no launcher (`under_launcher()` is False), asks `nproc_for(world_size)` and `relaunch`es
itself through `torch.distributed.run`; every child then joins the world (shardlab.parallel.world). This module
imports no torch, so the relaunching parent stays light. A failure on the ranks comes back as one line (see
`shardlab.cli.torchrun`).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from shardlab._errors import ShardlabError
from shardlab.cli._parent_death import LAUNCHER_ENV, die_with_parent
from shardlab.cli.torchrun import ERROR_FILE_ENV, EXIT_STOPPED, STOPPED_FILE_ENV
from shardlab.parallel.world import env_number

if TYPE_CHECKING:
    pass

TORCHRUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun.py")
"""torch.distributed.run with one line per failure (`shardlab.cli.torchrun`), as the script the first process runs."""


def nproc_for(world_size: int, env: Mapping[str, str] | None = None) -> int:
    """Processes per node for `world_size` ranks spread over env NNODES nodes (default 1)."""
    nnodes = env_number(os.environ if env is None else env, "NNODES", 1)
    if world_size % nnodes:
        raise ShardlabError(
            f"world_size={world_size} is not divisible by NNODES={nnodes}; make the mesh a multiple of NNODES ranks"
        )
    return world_size // nnodes


def relaunch_command(
    nproc: int, argv: list[str], env: Mapping[str, str], module: str = "shardlab", max_restarts: int = 0
) -> list[str]:
    """The torchrun command line that re-runs `python -m <module> <argv>` as `nproc` processes on this node.

    One node (env NNODES unset or 1) uses `--standalone`; several use c10d rendezvous at MASTER_ADDR:MASTER_PORT
    (port default 29500), with NODE_RANK naming this node. torchrun runs as `shardlab/cli/torchrun.py` (by path: the
    agent needs torch's launcher, not all of shardlab), which takes torchrun's arguments and keeps its logs quiet.
    max_restarts: torchrun's own `--max-restarts` (see `shardlab.cli.torchrun` for what is not retried).
    """
    if nproc < 1:
        raise ShardlabError(f"nproc={nproc} must be at least 1")
    cmd = [sys.executable, TORCHRUN, f"--nproc-per-node={nproc}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    nnodes = env_number(env, "NNODES", 1)
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        missing = [name for name in ("NODE_RANK", "MASTER_ADDR") if name not in env]
        if missing:
            raise ShardlabError(
                f"NNODES={nnodes} needs {' and '.join(missing)} in the environment; "
                f"export NODE_RANK=<0..{nnodes - 1}> and MASTER_ADDR=<address of node 0> on every node"
            )
        node_rank = env_number(env, "NODE_RANK", 0)
        if node_rank >= nnodes:
            raise ShardlabError(f"NODE_RANK={node_rank} but NNODES={nnodes}; NODE_RANK counts nodes from 0")
        endpoint = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}"
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
    return [*cmd, "-m", module, *argv]


def relaunch_env(nproc: int, env: Mapping[str, str]) -> dict[str, str]:
    """`env` plus OMP_NUM_THREADS = this process's cores // nproc (at least 1), unless already set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cores // nproc)), **env}


def relaunch(nproc_per_node: int, argv: list[str], module: str = "shardlab", max_restarts: int = 0) -> int:
    """Run `python -m <module> <argv>` through torchrun as `nproc_per_node` processes; return its exit code.

    A subprocess, not `torch.distributed.run.main` in this process: the parent imports nothing twice, and torchrun's
    own exit code comes back (1 if any rank failed; 128 + N if torchrun was stopped by signal N). A failure prints
    one line to stderr, `error: rank R: ...`, from the first rank that failed. SIGINT and SIGTERM are forwarded to
    torchrun, which passes them on to the ranks (a second copy of Ctrl-C from the terminal is harmless): on SIGTERM
    the ranks save and stop, local rank 0 leaves its line in the stopped file, and this prints it and returns
    EXIT_STOPPED.
    """
    cmd = relaunch_command(nproc_per_node, argv, os.environ, module, max_restarts)
    with tempfile.TemporaryDirectory(prefix="shardlab-") as tmp:
        error_file, stopped_file = os.path.join(tmp, "error"), os.path.join(tmp, "stopped")
        env = {**relaunch_env(nproc_per_node, os.environ), ERROR_FILE_ENV: error_file, STOPPED_FILE_ENV: stopped_file}
        if max_restarts:
            # torch 2.13's agent shares its TCPStore with the ranks and keeps it, keys and all, across restarts: a
            # restarted rank can read the address of a rank that died (gloo: "connectFullMesh failed ... Connection
            # refused", in 5 of 8 restarts of 2 ranks here). Unshared, each attempt's rank 0 hosts a fresh store.
            env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        launcher = os.getpid()
        env[LAUNCHER_ENV] = str(launcher)  # each rank dies with torchrun's agent, and checks this at start
        proc = subprocess.Popen(cmd, env=env, preexec_fn=functools.partial(die_with_parent, launcher))
        forwarded = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
        previous = {sig: signal.signal(sig, lambda signum, _: proc.send_signal(signum)) for sig in forwarded}
        try:
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        # the ranks saved and stopped: torchrun's own code (143 after SIGTERM) adds nothing
        if os.path.isfile(stopped_file):
            with open(stopped_file) as f:
                print(f"shardlab: {f.read().strip()}", flush=True)
            return EXIT_STOPPED
        if code != 0 and os.path.isfile(error_file):
            with open(error_file) as f:
                print(f"error: {f.read().strip()}", file=sys.stderr, flush=True)
    return code if code >= 0 else 128 - code
