"""Where shardlab keeps what it measured on this machine (SHARDLAB_CACHE, else ~/.cache/shardlab), written whole."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("SHARDLAB_CACHE") or Path.home() / ".cache" / "shardlab")


def write_whole(path: Path, data: bytes) -> None:
    """`data` at `path`, never half written: a reader finds the old file, none, or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
