"""TrainState <-> torch.distributed.checkpoint, committed atomically, reshardable across meshes.

A step directory `checkpoints/step-00000010/` holds the DCP files (model and optimizer as DTensor
shards, so any other mesh can load them), `train_state.json` (step, data position, RNG), the
resolved `config.json` and `manifest.json` (every file's size and CRC-32). Ranks write into
`step-00000010.tmp/`; only when every rank has written and the metadata and manifest are in place
does rank 0 rename it: a crash at any moment leaves the previous checkpoint loadable, and the
partial one is deleted on the next start. A resume checks the manifest first: `auto` falls back
past a damaged checkpoint to the newest intact one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardlab._base import to_json
from shardlab._errors import ShardlabError
from shardlab._faults import fault_point
from shardlab.config import Config
from shardlab.data.loader import TokenLoader
from shardlab.data.tokenizer import run_tokenizer
from shardlab.models import provider_for
from shardlab.models.llama.provider import LlamaProvider
from shardlab.models.provider import ModelProvider, first_difference
from shardlab.parallel.fp8 import plain_shards
from shardlab.training import _manifest, _one_process_save
from shardlab.training.step import TrainState

STEP_PREFIX = "step-"
TMP_SUFFIX = ".tmp"
STATE_FILE = "train_state.json"
MODEL_FILE = "model.json"
"""What identifies the model (`ModelProvider.identity`): compared on resume, read by export."""


_ONE_PROCESS_WARNING = (
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load) in a single "
    r"process"
)
"""What DCP warns on every save or load without a process group."""


@contextmanager
def one_process(no_dist: bool) -> Iterator[None]:
    """Around a DCP save or load that shardlab makes in one process on purpose (`no_dist`): without torch's warning
    that it assumes one process, which is the intent. That warning alone, for the call alone (the filters are the
    process's again after it); with a process group, nothing changes."""
    if not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS_WARNING, category=UserWarning)
        yield


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"{STEP_PREFIX}{step:08d}"


def committed(checkpoints: Path) -> list[Path]:
    """Checkpoints that committed, oldest first (a directory is committed once it has its final name), intact or
    not."""
    if not checkpoints.is_dir():
        return []
    return sorted(
        p
        for p in checkpoints.iterdir()
        if p.is_dir() and p.name.startswith(STEP_PREFIX) and not p.name.endswith(TMP_SUFFIX)
    )


def complete(checkpoints: Path) -> list[Path]:
    """Committed checkpoints that hold DCP's index and the train state, oldest first."""
    return [p for p in committed(checkpoints) if _missing(p) is None]


def _missing(path: Path) -> str | None:
    """Which of the files every committed checkpoint has is not there."""
    for name in (".metadata", STATE_FILE):
        if not (path / name).is_file():
            return f"{name} is missing"
    return None


def resolve_resume(resume: str, checkpoints: Path, *, checksums: bool = True) -> Path | None:
    """`auto`: the newest committed checkpoint that matches its manifest, skipping damaged ones with a warning
    (None when there is none; an error when every one is damaged); `none`; or a path, which must be intact.

    checksums: False checks only each file's presence and size (a stat; the CLI does this before launch). In a
    process group this is collective: each rank reads its share of the files (see `damage`).
    """
    if resume == "none":
        return None
    if resume == "auto":
        path, skipped = newest_intact(checkpoints, checksums)
        if path is not None:
            for line in skipped:
                warn(f"checkpoint.resume=auto skips {line}; resuming from {path.name}")
            return path
        if skipped:
            raise ShardlabError(
                f"checkpoint.resume=auto: no intact checkpoint in {str(checkpoints)!r} (newest {skipped[0]}); "
                "set checkpoint.resume=none to start fresh"
            )
        return None
    path = Path(resume)
    if not (path / ".metadata").is_file() or not (path / STATE_FILE).is_file():
        raise ShardlabError(
            f"checkpoint.resume={resume!r}: not a complete shardlab checkpoint (no .metadata or {STATE_FILE}); give a step directory"
        )
    problem = damage(path, checksums)
    if problem is not None:
        raise ShardlabError(f"checkpoint.resume={resume!r}: {problem}; resume from another step")
    return path


def newest_intact(checkpoints: Path, checksums: bool = True) -> tuple[Path | None, list[str]]:
    """The newest committed checkpoint that matches its manifest (None when none does), and what is wrong with each
    newer one ("step-...: why", newest first). Collective in a process group (see `damage`)."""
    skipped: list[str] = []
    for path in reversed(committed(checkpoints)):
        problem = damage(path, checksums)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.name}: {problem}")
    return None, skipped


def damage(path: Path, checksums: bool = True) -> str | None:
    """What is wrong with a committed checkpoint, per its manifest: None when its files match it, or when it has
    none (written before manifests: trusted, as before). Collective in a process group: each rank checksums
    every world_size-th file, so a resume reads the checkpoint once more, split over the ranks."""
    missing = _missing(path)
    if missing is not None:
        return missing
    try:
        files = _manifest.read(path)
    except ValueError as err:
        return str(err)
    if files is None:  # no manifest: its train_state.json, which the resume reads first, must at least be readable
        return _state_problem(path)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found = _manifest.problems(path, files, sorted(files)[rank::world] if checksums else ())
    if dist.is_initialized():
        every: list[dict[str, str]] = [{} for _ in range(world)]
        dist.all_gather_object(every, found)
        found = {name: why for part in every for name, why in part.items()}
    return found[min(found)] if found else _state_problem(path)


def _read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's train_state.json; a ValueError saying what is wrong with it (the caller names the checkpoint)."""
    try:
        meta = json.loads((path / STATE_FILE).read_bytes())
    except (OSError, ValueError) as err:  # JSONDecodeError, UnicodeDecodeError
        raise ShardlabError(f"{STATE_FILE} is unreadable ({type(err).__name__}: {err})") from None
    kinds = {"step": int, "data": dict, "rng": list}
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), t) for k, t in kinds.items()):
        raise ShardlabError(f"{STATE_FILE} is unreadable (not the object shardlab writes: step, data, rng)")
    return meta


def _state_problem(path: Path) -> str | None:
    try:
        _read_state(path)
    except ValueError as err:
        return str(err)
    return None


def warn(message: str) -> None:
    if _rank() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def remove_partial(checkpoints: Path) -> list[Path]:
    """Delete checkpoints that never committed (rank 0, before a run starts)."""
    partial = [p for p in checkpoints.glob(f"{STEP_PREFIX}*{TMP_SUFFIX}")] if checkpoints.is_dir() else []
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return partial


OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state and hyperparameters keyed by parameter name, not by param-group index: pipeline stages hold
different parameters in their group 0, and DCP would keep only one rank's group."""


def _tensors(state: TrainState) -> dict:
    """What a checkpoint saves and loads: plain tensors, also where FP8 wraps the weights' shards."""
    return plain_shards({
        "model": get_model_state_dict(state.model),
        "optim": get_optimizer_state_dict(state.model, state.optim, options=OPTIM_OPTIONS),
    })  # fmt: skip


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class PendingSave:
    """An async save whose files are still being written; `commit()` waits for them, then commits.

    own: this rank's manifest entries (its own data files), computed in the background after an async write."""

    def __init__(self, own: Future, tmp: Path, final: Path, files: dict[str, bytes], keep: int | None) -> None:
        self.own, self.tmp, self.final, self.files, self.keep = own, tmp, final, files, keep
        self.committed = False

    def commit(self) -> Path:
        """Wait for the files, then commit (a collective: every rank calls it); a second call does nothing."""
        if not self.committed:
            _commit(self.tmp, self.final, self.files, self.keep, self.own.result())
            self.committed = True
        return self.final


def _own_entries(tmp: Path, rank: int) -> dict[str, dict[str, int]]:
    """Manifest entries of the data files this rank wrote (DCP names them `__<rank in its group>_<n>.distcp`),
    checksummed by their writer while they are likely still in its page cache."""
    return _manifest.entries(tmp, sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp")))


def _after(future, tmp: Path, rank: int) -> Future:
    """`_own_entries` once an async write is done, on a thread of its own: checksums do not block training."""

    def written_then_summed() -> dict[str, dict[str, int]]:
        future.result()
        return _own_entries(tmp, rank)

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardlab-manifest")
    out = pool.submit(written_then_summed)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return out


def save(
    state: TrainState,
    loader: TokenLoader,
    cfg: Config,
    checkpoints: Path,
    *,
    async_save: bool = False,
    group: dist.ProcessGroup | None = None,
    provider: ModelProvider | None = None,
    metrics: Mapping[str, Any] | None = None,
) -> PendingSave:
    """Write the whole TrainState; sync saves are committed on return, async ones by `PendingSave.commit()`.

    An async save runs its collectives in a background thread: give it its own process group (`group`,
    from `checkpoint_group()`), or they interleave with training's on the default group and hang. `metrics`: the
    step's values (JSON-able), kept in train_state.json so a resume can restore a log line a kill cut short.
    """
    if async_save and dist.is_initialized() and group is None:
        raise ShardlabError("checkpoint.save: an async save needs its own process group; pass group=checkpoint_group()")
    final = step_dir(checkpoints, state.step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    files = {  # written by rank 0 at the commit, beside the DCP files
        STATE_FILE: json.dumps(
            {
                "step": state.step,
                "skipped": state.skipped,
                "data": loader.state_dict(),
                "metrics": metrics,
                **_rng_state(),
            }
        ).encode(),
        "config.json": to_json(cfg),
        MODEL_FILE: json.dumps((provider or provider_for(cfg)).identity(), indent=2).encode(),
    }
    if (tokenizer := run_tokenizer(cfg)) is not None:  # what the ids mean travels with the weights
        files |= tokenizer.files()
    tensors = _tensors(state)
    no_dist = not dist.is_initialized()  # one process: DCP needs no process group
    if async_save and no_dist:  # DCP's own would warn from its thread, where no filter scoped to this call reaches
        future = _one_process_save.async_save(tensors, tmp)
    else:
        write = dcp.async_save if async_save else dcp.save
        with one_process(no_dist):
            future = write(tensors, checkpoint_id=str(tmp), no_dist=no_dist, process_group=group)
    rank = dist.get_rank(group) if dist.is_initialized() else 0  # the rank DCP names this rank's files by
    if async_save:
        own = _after(future, tmp, rank)
    else:
        own = Future()
        own.set_result(_own_entries(tmp, rank))
    pending = PendingSave(own, tmp, final, files, cfg.checkpoint.keep)
    if not async_save:
        pending.commit()
    return pending


def _rng_state() -> dict[str, list[int]]:
    """Torch's RNG states (CPU, and this rank's CUDA device when there is one), as JSON-able byte lists."""
    out = {"rng": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_rng"] = torch.cuda.get_rng_state().tolist()
    return out


def _set_rng_state(meta: dict) -> None:
    torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
    if "cuda_rng" in meta and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(meta["cuda_rng"], dtype=torch.uint8))


def checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group of all ranks for background checkpoint I/O (collective: every rank calls it once)."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def _commit(tmp: Path, final: Path, files: dict[str, bytes], keep: int | None, own: dict) -> None:
    # gathering doubles as the barrier: every rank has written its shards, and rank 0 .metadata inside dcp.save
    every: list[dict] | None = [own]
    if dist.is_initialized():
        every = [{} for _ in range(dist.get_world_size())] if _rank() == 0 else None
        dist.gather_object(own, every, dst=0)
    if _rank() == 0:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        entries = {name: entry for part in every for name, entry in part.items()}
        unlisted = sorted(p.name for p in tmp.iterdir() if p.name not in entries and p.name != _manifest.MANIFEST_FILE)
        _manifest.write(tmp, {**entries, **_manifest.entries(tmp, unlisted)})  # commits with the files it lists
        fault_point(f"save:{json.loads(files[STATE_FILE])['step']}")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # the commit: atomic on one filesystem
        kept = committed(final.parent)
        for later in kept[kept.index(final) + 1 :]:  # an earlier run's, past the step this run started over from
            shutil.rmtree(later, ignore_errors=True)
        if keep is not None:
            for old in complete(final.parent)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()


def load(
    state: TrainState, loader: TokenLoader, path: Path, cfg: Config, provider: ModelProvider | None = None
) -> TrainState:
    """Load a checkpoint into an already parallelized state (any mesh: DCP reshards); provider: the model it goes
    into (default: the one the config names), whose identity must be the saved one's."""
    saved = saved_identity(path)
    now = (provider or provider_for(cfg)).identity()
    diff = None if saved is None else first_difference(saved, now)
    if diff is not None:
        raise ShardlabError(
            f"checkpoint {str(path)!r}: saved for another model ({diff}={saved.get(diff)!r}, "
            f"now {now.get(diff)!r}); resume with the saved model config or set checkpoint.resume=none"
        )
    try:
        meta = _read_state(path)
    except ValueError as err:
        raise ShardlabError(f"checkpoint {str(path)!r}: {err}; resume from another step") from None
    loader.load_state_dict(meta["data"])
    tensors = _tensors(state)
    verify(path, tensors["model"])  # before anything is loaded: a damaged checkpoint changes nothing
    with one_process(no_dist := not dist.is_initialized()):
        dcp.load(tensors, checkpoint_id=str(path), no_dist=no_dist)
    set_model_state_dict(state.model, tensors["model"])
    set_optimizer_state_dict(state.model, state.optim, tensors["optim"], options=OPTIM_OPTIONS)
    _set_rng_state(meta)
    return state.__class__(model=state.model, optim=state.optim, step=meta["step"], skipped=meta.get("skipped", 0))


def saved_metrics(path: Path) -> dict[str, Any] | None:
    """The values of the step a checkpoint holds, as `save` got them (None when it got none, or is older)."""
    try:
        return _read_state(path).get("metrics")
    except ValueError as err:
        raise ShardlabError(f"checkpoint {str(path)!r}: {err}; resume from another step") from None


def saved_identity(path: Path) -> dict | None:
    """The identity of the model a checkpoint holds (`ModelProvider.identity`): its model.json, or for checkpoints
    written before model.json, the Llama its config.json describes; None when neither is there."""
    if (path / MODEL_FILE).is_file():
        return json.loads((path / MODEL_FILE).read_text())
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    return LlamaProvider(msgspec.json.decode(config_file.read_bytes(), type=Config).model).identity()


def verify(path: Path, model_state: dict, fix: str = "resume from another step") -> None:
    """Check that a checkpoint is whole and fits the model: every parameter present with its shape, and
    every data file present and long enough for the bytes the metadata says it holds. fix: what an error about a
    damaged checkpoint tells the user to do (an export's: export another step)."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # torch raises several kinds for an unreadable .metadata
        raise ShardlabError(
            f"checkpoint {str(path)!r}: unreadable .metadata ({type(err).__name__}: {err}); {fix}"
        ) from None
    saved = metadata.state_dict_metadata
    for fqn, tensor in model_state.items():
        entry = saved.get(f"model.{fqn}")
        if entry is None:
            raise ShardlabError(
                f"checkpoint {str(path)!r}: no tensor for parameter {fqn!r}; it was saved from another model"
            )
        if tuple(entry.size) != tuple(tensor.shape):
            raise ShardlabError(
                f"checkpoint {str(path)!r}: {fqn} has shape {tuple(entry.size)} there but {tuple(tensor.shape)} here"
            )
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise ShardlabError(f"checkpoint {str(path)!r}: data file {name} is missing; {fix}")
        if file.stat().st_size < size:
            raise ShardlabError(
                f"checkpoint {str(path)!r}: data file {name} is truncated ({file.stat().st_size} of {size} bytes); "
                f"{fix}"
            )
