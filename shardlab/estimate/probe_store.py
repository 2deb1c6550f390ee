"""Probes kept on disk between searches: a search of the same model on another world, device, memory or top K, or
the same search again, reads what an earlier one measured instead of probing again; and the counts of the model's
block its floors are made of (`count_block`, keyed by the sequence length, plan options, own rules and the axes
whose traffic they count).

A measurement (`probe.Measurement`) depends on the probed config and pp rank, the rules, the model, and the code
that ran it, so the key hashes them all: the config, the rank and the rules as data; the model's identity; the
source of shardlab, of every module the model's classes and its provider come from (a user's model files), and
the versions of Python, torch and transformers. Entries are written whole (`write_whole`), and one that cannot be
read is measured again; where the directory cannot be written, nothing is kept. They live in SHARDLAB_CACHE/probes
(else ~/.cache/shardlab/probes); delete it at will.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import pickle
import platform
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from shardlab.config import Config, PlanConfig
from shardlab.estimate._cache_dir import cache_dir, write_whole
from shardlab.estimate.block_counts import Block
from shardlab.estimate.measurement import Measurement
from shardlab.models.provider import ModelProvider
from shardlab.sharding.rules import Rules

FORMAT = 2
"""Bumped when what an entry holds changes shape or meaning (2: compiled FP8 casts counted fused)."""
UNREADABLE = (OSError, EOFError, zlib.error, pickle.UnpicklingError, ValueError, TypeError, AttributeError)
"""What reading a missing, damaged or foreign entry raises: it is measured again."""


class ProbeStore:
    """The measurements of one model's probes on disk (`measured`), and how many were read and written."""

    def __init__(self, provider: ModelProvider, root: Path | None = None) -> None:
        self.root = root if root is not None else cache_dir() / "probes"
        self.model = _fingerprint(provider)
        self.read = self.written = 0

    def measured(self, cfg: Config, rank: int, rules: Rules | None, measure: Callable[[], Measurement]) -> Measurement:
        """The measurement of `cfg` (resolved) as pp rank `rank` under `rules`: read, else `measure()` and kept."""
        key = hashlib.sha256(self.model + msgspec.json.encode((cfg, rank, rules))).hexdigest()
        path = self.root / key[:2] / f"{key}.probe"
        try:
            runs, n, k, v, stages = pickle.loads(zlib.decompress(path.read_bytes()))
            found = Measurement(runs, n, k, v, stages)
        except UNREADABLE:
            found = measure()
            try:
                write_whole(path, zlib.compress(pickle.dumps((found.runs, found.n, found.k, found.v, found.stages))))
                self.written += 1
            except OSError:  # a store that cannot be written (read-only, full) keeps nothing; the search goes on
                pass
        else:
            self.read += 1
        return found

    def block(
        self,
        seq_len: int,
        options: PlanConfig,
        own_rules: bool,
        splits: tuple[str, ...],
        count: Callable[[], Block | None],
    ) -> Block | None:
        """The model's block counts for the floors (`count_block`) at `seq_len` under `options`, with the traffic
        the `splits` axes add: read, else `count()` and kept (None too: a model that cannot be counted). Not in
        `read` and `written`, which count probes."""
        keyed = msgspec.json.encode((seq_len, options, own_rules, splits))
        key = hashlib.sha256(self.model + b"block" + keyed).hexdigest()
        path = self.root / key[:2] / f"{key}.block"
        try:
            (found,) = pickle.loads(zlib.decompress(path.read_bytes()))
        except UNREADABLE:
            found = count()
            with contextlib.suppress(OSError):  # a store that cannot be written keeps nothing
                write_whole(path, zlib.compress(pickle.dumps((found,))))
        return found


def _fingerprint(provider: ModelProvider) -> bytes:
    """What every probe of `provider`'s model depends on beside its config, rank and rules."""
    model = provider.meta_model()
    modules = {type(m).__module__ for m in model.modules()} | {type(provider).__module__}
    modules |= {getattr(value, "__module__", None) for value in vars(provider).values() if callable(value)}
    root = Path(__file__).resolve().parents[1]  # the shardlab package
    files = sorted(root.rglob("*.py"))
    for name in sorted(m for m in modules if m and m in sys.modules and m.split(".")[0] not in ("torch", "shardlab")):
        file = getattr(sys.modules[name], "__file__", None)
        if file and file.endswith(".py"):
            files.append(Path(file))
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.name).encode() + file.read_bytes())
    versions = [FORMAT, platform.python_version(), torch.__version__, _version("transformers"), _version("torchao")]
    identity = json.dumps([type(provider).__qualname__, provider.identity(), versions], sort_keys=True, default=str)
    return digest.digest() + identity.encode()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
