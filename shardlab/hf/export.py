"""Any model a provider describes -> a Hugging Face directory (config.json + safetensors) transformers loads.

`to_hf` gathers one parameter at a time (every rank calls it) and rank 0 writes; the directory appears whole or
not at all.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from shardlab._errors import ShardlabError
from shardlab.config import ModelConfig
from shardlab.hf.io import _reshard
from shardlab.models.hf_dir import INDEX, SINGLE
from shardlab.models.llama.provider import LlamaProvider
from shardlab.models.provider import ModelProvider


def to_hf(
    model: nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    config: ModelConfig | None = None,
    provider: ModelProvider | None = None,
    max_shard_bytes: int = 5 * 2**30,
    extra_files: Mapping[str, bytes] | None = None,
) -> None:
    """Write a Hugging Face directory (config.json + safetensors) that transformers' `from_pretrained` loads.

    `model` (plain or with DTensor parameters) or a state_dict with its names is written as `provider` says
    (default: shardlab's Llama of `config`, which defaults to `model.cfg`). Collective: with a process group every rank calls it (each DTensor is gathered
    with `full_tensor()`, one at a time) and rank 0 writes. Files above `max_shard_bytes` are split into
    `model-0000i-of-0000n.safetensors` plus an index. The directory appears whole or not at all (written
    next to `path`, then renamed); `path` may exist only as an empty directory. `extra_files`: name -> bytes written
    beside the weights (a tokenizer's files).
    """
    if provider is None:
        config = config or getattr(model, "cfg", None)
        if not isinstance(config, ModelConfig):
            raise ShardlabError("to_hf: `model` has no ModelConfig in .cfg; pass config=ModelConfig(...) or a provider")
        provider = LlamaProvider(config)
    if max_shard_bytes < 1:
        raise ShardlabError(f"to_hf: max_shard_bytes={max_shard_bytes}; must be >= 1")
    hf_config = provider.hf_config()  # a model without a Hugging Face mapping fails here, before any collective
    tensors = _export_tensors(model, provider)
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    files = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    target = Path(path)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    writer = not dist.is_initialized() or dist.get_rank() == 0
    error = None
    if writer:
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            error = f"{target}: already exists and is not an empty directory; choose a new path or remove it"
        else:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = f"{target}: cannot create {tmp} ({e}); check the parent directory"
    _raise_on_every_rank(error)
    # Every rank gathers every tensor in the same order (collectives); a write error on rank 0 is held
    # until the end so the other ranks are not left waiting in a collective.
    weight_map: dict[str, str] = {}  # checkpoint tensor -> its file
    total = 0
    for file, shard in zip(files, shards):
        buffer = {}
        for name, t in shard:
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if writer and error is None:
                full = full.detach().to("cpu", copy=not isinstance(t, DTensor))
                for stored, w in provider.hf_tensors(name, full):
                    buffer[stored] = w.clone(memory_format=torch.contiguous_format)  # no shared storage
                    weight_map[stored] = file
                    total += w.numel() * w.element_size()
            del full
        if writer and error is None:
            try:
                save_file(buffer, tmp / file, metadata={"format": "pt"})
            except (OSError, SafetensorError, ValueError, RuntimeError) as e:
                error = f"{target}: writing {file} failed ({e})"
        del buffer
    if writer and error is None:
        try:
            _write_metadata(tmp, hf_config, tensors[0][1].dtype, weight_map, total)
            for name, data in (extra_files or {}).items():
                (tmp / name).write_bytes(data)
            _as_new_files(tmp)
            os.replace(tmp, target)
        except OSError as e:
            error = f"{target}: cannot finish the export ({e}); check the disk and permissions"
    if writer and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_on_every_rank(error)


def _export_tensors(
    model: nn.Module | Mapping[str, torch.Tensor], provider: ModelProvider
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in the model's order, each distinct tensor once (tied: no lm_head.weight); checked by name and
    shape against the provider's model."""
    with torch.device("meta"):
        reference = provider.build()
    want = {name: tuple(p.shape) for name, p in reference.named_parameters()}  # tied: lm_head.weight drops out
    if isinstance(model, nn.Module):
        _reshard(model)
    source = model.state_dict(keep_vars=True) if isinstance(model, nn.Module) else model
    if not isinstance(source, Mapping):
        raise TypeError(f"to_hf: `model` is a {type(model).__name__}; pass an nn.Module or a state_dict mapping")
    missing = [n for n in want if n not in source]
    extra = [n for n in source if n not in want and not (provider.hf_tied() and n == "lm_head.weight")]
    for names, what in ((missing, "is missing"), (extra, "is not a parameter of this config")):
        if names:
            raise ShardlabError(
                f"to_hf: tensor {names[0]!r} (and {len(names) - 1} more) {what}; pass the state of a {provider.name} "
                f"model built from this config ({provider.describe()})"
            )
    for name, shape in want.items():
        if tuple(source[name].shape) != shape:
            raise ShardlabError(
                f"to_hf: tensor {name!r} has shape {tuple(source[name].shape)} but the config gives {shape}; "
                "pass the config the model was built from"
            )
    return [(name, source[name]) for name in want]


def _write_metadata(tmp: Path, hf_config: dict, dtype: torch.dtype, weight_map: dict[str, str], total: int) -> None:
    hf_config = hf_config | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _as_new_files(directory: Path) -> None:
    """Give every file in `directory` the mode a file created there gets (0666 less the umask): safetensors writes
    each file through a temporary one of mode 0600, which kept the weights from everyone but their writer. The mode
    is read from a file made for it, as the umask cannot be read without setting it for every thread."""
    probe = directory / ".mode"
    probe.touch()
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for file in directory.iterdir():
        if file.is_file():
            file.chmod(mode)


def _raise_on_every_rank(error: str | None) -> None:
    """Rank 0's verdict, raised as a ValueError on every rank (a no-op barrier when there is none)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ShardlabError(error)
