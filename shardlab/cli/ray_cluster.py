"""The Ray cluster a `--launcher ray` run goes to: ray imported (or one line saying how to install it), the cluster
reached (a local instance without an address), and its resources checked against the world's before anything
trains, each problem one line naming the flag and the fix."""

from __future__ import annotations

import json
import os
import socket
from types import ModuleType

from shardlab._errors import ShardlabError, first_line
from shardlab.cli.flags import RayFlags

LOCAL_RAY_ENV = {
    "RAY_DEDUP_LOGS": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600",
}
"""What a local Ray instance is started with (unless set): no deduplication of the ranks' lines, no usage-stats
notice, and time for the workers to start where the ranks share a few cores (4 workers took 25 s of Ray Train's
default 60 on 2 busy cores; past it Ray Train starts them again, and again)."""


def import_ray() -> ModuleType:
    """ray with Ray Train, or one line saying how to install it."""
    try:
        import ray
        import ray.train.torch  # Ray Train: the [train] extra of ray
    except ImportError as err:
        raise ShardlabError(
            f"--launcher ray needs ray with Ray Train ({err}); install it: pip install 'shardlab[ray]', or use "
            "--launcher torchrun"
        ) from None
    return ray


def cluster_address(flags: RayFlags, env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """--ray.address, else env RAY_ADDRESS, else None (a local instance); and where it came from, for errors."""
    env = dict(os.environ) if env is None else env
    if flags.address:
        return flags.address, "--ray.address"
    return env.get("RAY_ADDRESS") or None, "env RAY_ADDRESS"


def check_reachable(address: str, source: str = "--ray.address", timeout_s: float = 5.0) -> None:
    """One line unless something listens at `address` (host:port, ray://host:port): ray.init itself would retry for
    a minute before saying so. "auto" and "local" are ray's own words and left to it."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ShardlabError(
            f"{source} {address!r} is not HOST:PORT (e.g. 10.0.0.5:6379, or ray://10.0.0.5:10001); "
            "`ray status` on the head node prints it"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ShardlabError(
            f"{source} {address!r}: no Ray cluster answers there ({err.strerror or err}); start one with "
            "`ray start --head`, fix the address, or leave --ray.address out (and RAY_ADDRESS unset) for a local Ray "
            "instance"
        ) from None


def connect(ray: ModuleType, address: str | None, cpus: float, source: str = "--ray.address") -> bool:
    """Join the cluster at `address`, or start a local Ray instance offering at least `cpus` CPUs (its ranks share
    this machine's cores, as torchrun's do); return whether this process started Ray (and so shuts it down). A
    Ray already initialised in this process (a notebook, a test) is used as it is."""
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": "ERROR", "include_dashboard": False}
    if address is not None:
        check_reachable(address, source)
        try:
            ray.init(address=address, **quiet)
        except Exception as err:
            raise ShardlabError(
                f"{source} {address!r}: could not join the Ray cluster there ({first_line(err)}); check that "
                "its Ray version is this one's, or leave --ray.address out for a local Ray instance"
            ) from None
        return True
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ray.init(num_cpus=max(cores, int(cpus + 0.999)), **quiet)
    return True


def worker_resources(flags: RayFlags, device: str, cluster: dict[str, float]) -> dict[str, float]:
    """What each rank reserves: --ray.resources-per-worker, else one GPU where the run uses CUDA (train.device
    cuda, or auto on a cluster with GPUs), else one CPU."""
    if flags.resources_per_worker is not None:
        return dict(flags.resources_per_worker)
    gpu = device == "cuda" or (device == "auto" and cluster.get("GPU", 0) > 0)
    return {"GPU": 1.0} if gpu else {"CPU": 1.0}


def check_resources(world: int, per_worker: dict[str, float], nodes: list[dict[str, float]], strategy: str) -> None:
    """One line unless the cluster's nodes (their resources) can hold `world` workers of `per_worker` each: in
    total, each on some node, and one per node for STRICT_SPREAD; Ray would otherwise wait for them for ever."""
    flag = f"--ray.resources-per-worker '{json.dumps({k: _number(v) for k, v in per_worker.items()})}'"
    for name, amount in per_worker.items():
        total = sum(node.get(name, 0.0) for node in nodes)
        if world * amount > total:
            raise ShardlabError(
                f"{flag}: {world} workers need {_number(world * amount)} {name} but the Ray cluster has "
                f"{_number(total)}; ask for less per worker, fewer ranks (--world, the mesh), or a bigger cluster"
            )
    if not any(all(node.get(k, 0.0) >= v for k, v in per_worker.items()) for node in nodes):
        raise ShardlabError(f"{flag}: no node of the Ray cluster has that much for one worker; ask for less per worker")
    if strategy == "STRICT_SPREAD" and len(nodes) < world:
        raise ShardlabError(
            f"--ray.placement-strategy STRICT_SPREAD puts each of {world} workers on its own node but the Ray cluster "
            f"has {len(nodes)}; use SPREAD or PACK"
        )


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value
