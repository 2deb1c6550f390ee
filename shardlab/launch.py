"""Launch: how `python -m shardlab RECIPE ...` becomes N processes, and how each one joins the world.

environment -> (relaunch through torchrun | Dist). The first process finds no launcher (`under_launcher()` is
False), asks `nproc_for(world_size)` and `relaunch`es itself through `torch.distributed.run`; every child then
calls `init_distributed`. torch is imported inside `init_distributed` only, so the relaunching parent stays light.
A failure on the ranks comes back as one line (see `shardlab._torchrun`).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from shardlab._torchrun import ERROR_FILE_ENV, EXIT_STOPPED, STOPPED_FILE_ENV

if TYPE_CHECKING:
    import torch

TORCHRUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torchrun.py")
"""torch.distributed.run with one line per failure (`shardlab._torchrun`), as the script the first process runs."""


@dataclass(frozen=True)
class Dist:
    """This process's place in the world."""

    rank: int
    world_size: int
    local_rank: int
    """Index of this process on its node; it picks the CUDA device."""
    device: torch.device
    backend: str | None
    """"nccl" or "gloo"; None when there is no process group (one process started without a launcher)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_number(env: Mapping[str, str], name: str, default: int | float, kind: type = int) -> int | float:
    text = env.get(name)
    if text is None:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(
            f"{name}={text!r} in the environment is not {'an integer' if kind is int else 'a number'}"
        ) from None
    low = 0 if name in ("RANK", "LOCAL_RANK", "NODE_RANK") else 1
    if value < low:
        raise ValueError(f"{name}={text!r} in the environment must be >= {low}")
    return value


def under_launcher(env: MutableMapping[str, str] | None = None) -> bool:
    """True under torchrun (LOCAL_RANK and WORLD_SIZE set) or srun (SLURM_PROCID and SLURM_NTASKS set).

    Under srun it also maps SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID to RANK / WORLD_SIZE / LOCAL_RANK, sets
    MASTER_PORT from the job id and, on one node, MASTER_ADDR=127.0.0.1; values already set are kept. A batch script
    that runs python without srun also carries SLURM_PROCID=0 and SLURM_NTASKS: start training through srun there.
    """
    env = os.environ if env is None else env
    if "LOCAL_RANK" in env and "WORLD_SIZE" in env:
        return True
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return False
    env.setdefault("RANK", env["SLURM_PROCID"])
    env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))  # two jobs on one node differ
    if env.get("SLURM_NNODES", "1") == "1":
        env.setdefault("MASTER_ADDR", "127.0.0.1")
    return True


def nproc_for(world_size: int, env: Mapping[str, str] | None = None) -> int:
    """Processes per node for `world_size` ranks spread over env NNODES nodes (default 1)."""
    nnodes = _env_number(os.environ if env is None else env, "NNODES", 1)
    if world_size % nnodes:
        raise ValueError(
            f"world_size={world_size} is not divisible by NNODES={nnodes}; make the mesh a multiple of NNODES ranks"
        )
    return world_size // nnodes


def relaunch_command(
    nproc: int, argv: list[str], env: Mapping[str, str], module: str = "shardlab", max_restarts: int = 0
) -> list[str]:
    """The torchrun command line that re-runs `python -m <module> <argv>` as `nproc` processes on this node.

    One node (env NNODES unset or 1) uses `--standalone`; several use c10d rendezvous at MASTER_ADDR:MASTER_PORT
    (port default 29500), with NODE_RANK naming this node. torchrun runs as `shardlab/_torchrun.py` (by path: the
    agent needs torch's launcher, not all of shardlab), which takes torchrun's arguments and keeps its logs quiet.
    max_restarts: torchrun's own `--max-restarts` (see `shardlab._torchrun` for what is not retried).
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be at least 1")
    cmd = [sys.executable, TORCHRUN, f"--nproc-per-node={nproc}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    nnodes = _env_number(env, "NNODES", 1)
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        missing = [name for name in ("NODE_RANK", "MASTER_ADDR") if name not in env]
        if missing:
            raise ValueError(
                f"NNODES={nnodes} needs {' and '.join(missing)} in the environment; "
                f"export NODE_RANK=<0..{nnodes - 1}> and MASTER_ADDR=<address of node 0> on every node"
            )
        node_rank = _env_number(env, "NODE_RANK", 0)
        if node_rank >= nnodes:
            raise ValueError(f"NODE_RANK={node_rank} but NNODES={nnodes}; NODE_RANK counts nodes from 0")
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
        proc = subprocess.Popen(cmd, env=env)
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


def resolve_device(device: str = "auto", local_rank: int | None = None) -> torch.device:
    """ "auto" -> cuda:LOCAL_RANK when CUDA is available, else cpu; "cuda" -> cuda:LOCAL_RANK; "cpu" -> cpu."""
    import torch

    if local_rank is None:
        local_rank = _env_number(os.environ, "LOCAL_RANK", 0)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"train.device={device!r} is not one of 'auto', 'cuda', 'cpu'")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"train.device='cuda' needs cuda:{local_rank} (LOCAL_RANK) but {count} CUDA devices are visible; "
            "use device='cpu' or fewer processes per node"
        )
    return torch.device("cuda", local_rank)


def init_distributed(device: str = "auto") -> Dist:
    """Join the world described by the launcher's environment (or a world of one if there is no launcher).

    device: "auto" (cuda if available, else cpu), "cuda" (cuda:LOCAL_RANK, backend nccl) or "cpu" (backend gloo).
    A process group is made when WORLD_SIZE > 1 or a launcher started this process; its timeout is env
    SHARDLAB_PG_TIMEOUT_S (default 600 s). An existing default process group is reused.
    """
    import torch
    import torch.distributed as dist

    env = os.environ
    timeout_s = _env_number(env, "SHARDLAB_PG_TIMEOUT_S", 600.0, float)
    launched = under_launcher(env)
    rank, world_size, local_rank = (
        _env_number(env, k, d) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))
    )
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size(), local_rank, dev, dist.get_backend())
    if world_size == 1 and not launched:
        return Dist(0, 1, 0, dev, None)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise ValueError(
            f"init_distributed: WORLD_SIZE={world_size} needs {' and '.join(missing)} in the environment; "
            "start through torchrun, or export the address and port of rank 0"
        )
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if dev.type == "cuda" else None,
    )
    atexit.register(_leave_world)
    return Dist(rank, world_size, local_rank, dev, backend)


def _leave_world() -> None:
    """At exit, the process group this process made, if its program did not destroy it: left to the interpreter's
    teardown, the group's threads may be destroyed while still running, and the process then dies of SIGABRT
    ("terminate called without an active exception") instead of exiting with its own code."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
