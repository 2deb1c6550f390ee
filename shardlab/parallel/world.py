"""How each rank joins the world: the launcher's environment (torchrun's or Slurm's) -> a process group and a
device (`init_distributed` -> `Dist`). torch is imported inside the functions only: the launching process, which
reads `under_launcher`, stays light.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from shardlab._errors import ShardlabError

if TYPE_CHECKING:
    import torch


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


def env_number(env: Mapping[str, str], name: str, default: int | float, kind: type = int) -> int | float:
    """Environment variable `name` as a `kind`, or `default` when unset; one line naming it when it is not one."""
    text = env.get(name)
    if text is None:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise ShardlabError(
            f"{name}={text!r} in the environment is not {'an integer' if kind is int else 'a number'}"
        ) from None
    low = 0 if name in ("RANK", "LOCAL_RANK", "NODE_RANK") else 1
    if value < low:
        raise ShardlabError(f"{name}={text!r} in the environment must be >= {low}")
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


CUDA_INDEX_ENV = "SHARDLAB_CUDA_INDEX"
"""The CUDA device a launcher gave this process, where it is not cuda:LOCAL_RANK: Ray Train shows each worker the
GPUs of every worker on its node and names the worker's own (several per worker, or in any order)."""


def resolve_device(device: str = "auto", local_rank: int | None = None) -> torch.device:
    """ "auto" -> cuda:LOCAL_RANK when CUDA is available, else cpu; "cuda" -> cuda:LOCAL_RANK; "cpu" -> cpu.
    env SHARDLAB_CUDA_INDEX, where a launcher sets it, names the CUDA device instead of LOCAL_RANK."""
    import torch

    if local_rank is None:
        local_rank = env_number(os.environ, "LOCAL_RANK", 0)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ShardlabError(f"train.device={device!r} is not one of 'auto', 'cuda', 'cpu'")
    count = torch.cuda.device_count()
    index, source = (
        (env_number(os.environ, CUDA_INDEX_ENV, 0), CUDA_INDEX_ENV)
        if CUDA_INDEX_ENV in os.environ
        else (local_rank, "LOCAL_RANK")
    )
    if index >= count:
        raise ShardlabError(
            f"train.device='cuda' needs cuda:{index} ({source}) but {count} CUDA devices are visible; "
            "use device='cpu' or fewer processes per node"
        )
    return torch.device("cuda", index)


def init_distributed(device: str = "auto", host_collectives: bool = False) -> Dist:
    """Join the world described by the launcher's environment (or a world of one if there is no launcher).

    device: "auto" (cuda if available, else cpu), "cuda" (cuda:LOCAL_RANK, backend nccl) or "cpu" (backend gloo).
    host_collectives: on CUDA, gloo too for tensors on the host (FSDP's CPU offload keeps the shards and their
    gradients there, and DTensor's collectives on them run where they are).
    A process group is made when WORLD_SIZE > 1 or a launcher started this process; its timeout is env
    SHARDLAB_PG_TIMEOUT_S (default 600 s). An existing default process group is reused.
    """
    import torch
    import torch.distributed as dist

    env = os.environ
    timeout_s = env_number(env, "SHARDLAB_PG_TIMEOUT_S", 600.0, float)
    launched = under_launcher(env)
    rank, world_size, local_rank = (
        env_number(env, k, d) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))
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
        raise ShardlabError(
            f"init_distributed: WORLD_SIZE={world_size} needs {' and '.join(missing)} in the environment; "
            "start through torchrun, or export the address and port of rank 0"
        )
    backend = ("cpu:gloo,cuda:nccl" if host_collectives else "nccl") if dev.type == "cuda" else "gloo"
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
