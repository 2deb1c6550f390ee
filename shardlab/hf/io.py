"""Hugging Face Llama and Mixtral checkpoints (config.json + safetensors) <-> shardlab models, plain or sharded.

`load_hf_weights(model, dir)` reads into an existing model, each rank only the block of each tensor its
DTensor placements give it (writing is `shardlab.hf.export`).
Weights are read only as safetensors, never through pickle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardlab._errors import ShardlabError
from shardlab.config import Config, ModelConfig
from shardlab.models.hf_dir import INDEX, SINGLE, has_weights
from shardlab.models.llama.hf_names import llama_names
from shardlab.models.llama.model import Llama, from_hf_config, materialize
from shardlab.models.llama.provider import LlamaProvider
from shardlab.models.provider import HFNames, ModelProvider, first_difference
from shardlab.parallel.device_mesh import placed_spec
from shardlab.sharding.spec import P, block

NameMap = Callable[[str, Sequence[int]], HFNames]
"""Parameter name and shape -> its checkpoint tensor(s) (`ModelProvider.hf_names`)."""

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers that old transformers versions saved with the weights; the model rebuilds them."""
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a Hugging Face Llama directory (its config.json)."""
    file = _dir(path) / "config.json"
    if not file.is_file():
        raise ShardlabError(f"{file}: no such file; a Hugging Face model directory holds config.json")
    try:
        d = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardlabError(f"{file}: not readable JSON ({e}); re-download or re-export the checkpoint") from None
    if d.get("model_type", "llama") not in ("llama", "mixtral"):
        raise ShardlabError(
            f"{file}: model_type={d['model_type']!r}; only Llama and Mixtral checkpoints (model_type 'llama', "
            "'mixtral') load"
        )
    try:
        return from_hf_config(d)
    except ValueError as e:
        raise ShardlabError(f"{file}: {str(e).removeprefix('from_hf_config: ')}") from None
    except (KeyError, TypeError) as e:
        raise ShardlabError(f"{file}: field {e} is missing or of the wrong type; is it a Llama config.json?") from None


def from_hf(path: str | os.PathLike, device: torch.device | str = "cpu") -> Llama:
    """A single-process Llama with the config and weights of a Hugging Face directory."""
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = Llama(cfg)
    materialize(model, device)  # re-ties and builds the RoPE buffers; every weight is overwritten below
    load_hf_weights(model, path)
    return model


@dataclass(frozen=True)
class _Stored:
    file: Path
    shape: tuple[int, ...]
    dtype: str


def initial_weights(cfg: Config, provider: ModelProvider) -> Path | None:
    """The Hugging Face directory a run starts from when it has nothing to resume: checkpoint.init_from_hf (whose
    config.json must describe the configured model), a transformers model's own directory when it holds
    safetensors (unless model.from_scratch), or None: the seed's weights."""
    if cfg.checkpoint.init_from_hf is not None:
        saved = LlamaProvider(read_hf_config(cfg.checkpoint.init_from_hf)).identity()
        now = provider.identity()
        diff = first_difference(saved, now)
        if diff is not None:
            raise ShardlabError(
                f"checkpoint.init_from_hf: the checkpoint has {diff}={saved.get(diff)!r} but the config says "
                f"{now.get(diff)!r}; set the model fields to the checkpoint's"
            )
        return Path(cfg.checkpoint.init_from_hf)
    path = cfg.model.hf_path
    if path is None or cfg.model.from_scratch or not has_weights(Path(path)):
        return None
    return Path(path)


def load_hf_weights(
    model: nn.Module,
    path: str | os.PathLike,
    names: NameMap | None = None,
    elsewhere: Iterable[tuple[str, tuple[int, ...]]] = (),
) -> None:
    """Copy a Hugging Face checkpoint into `model` in place, by parameter name.

    Parameters may be plain tensors or DTensors (TP, FSDP, HSDP, FSDP x TP); each rank reads only its own
    block of each tensor. Everything is checked before anything is copied (names, shapes, dtypes, files),
    so a bad checkpoint leaves the model as it was. A tied parameter is read once, from whichever of its
    names the checkpoint has (HF omits `lm_head.weight` when tied). `names` maps a parameter to its checkpoint
    tensor(s) (default: shardlab's Llama, `shardlab.models.llama.hf_names.llama_names`); a stacked expert weight reads the experts of its
    block, each from its own tensor. `elsewhere`: (name, shape) of the parameters other pipeline stages hold, whose
    tensors the checkpoint has and this rank does not read.
    """
    root = _dir(path)
    stored = _stored_tensors(root)
    _reshard(model)
    matched = _match(root, stored, _param_names(model), names or llama_names, elsewhere)
    jobs = [(names, stacked, *_local_block(param)) for names, stacked, param in matched]
    _check_tied_copies(stored, [(names, local, slices) for names, stacked, local, slices in jobs if not stacked])
    by_file: dict[Path, list[tuple[str, torch.Tensor, tuple[slice, ...]]]] = {}
    for names, stacked, local, slices in jobs:
        if local is None:
            continue
        if stacked:  # the experts of this rank's block (none: an FSDP shard that is all padding)
            experts = range(slices[0].start, slices[0].stop)
            rows = stored[_pieces(names[0])[0]].shape[0] * len(_pieces(names[0]))
            reads = [r for e in experts for r in _slice_reads(names[e], local[e - slices[0].start], slices[1:], rows)]
        else:
            reads = [(names[0], local, slices)]
        for name, into, block_ in reads:
            by_file.setdefault(stored[name].file, []).append((name, into, block_))
    with torch.no_grad():
        for file, items in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name, local, slices in items:
                    local.copy_(f.get_slice(name)[slices])  # a copy: nothing keeps the mmap alive


def _reshard(model: nn.Module) -> None:
    """FSDP swaps unsharded copies in around forward (kept with reshard_after_forward=False): use the sharded ones."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _dir(path: str | os.PathLike) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise ShardlabError(
            f"{root}: no such directory; pass a Hugging Face model directory (config.json + safetensors)"
        )
    return root


def _stored_tensors(root: Path) -> dict[str, _Stored]:
    """Every tensor of the checkpoint: name -> file, shape, dtype (headers only, no data is read)."""
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ShardlabError(f"{index}: not a safetensors index ({e!r}); re-export the checkpoint") from None
        files = sorted({root / f for f in weight_map.values()})
    elif (root / SINGLE).is_file():
        weight_map, files = None, [root / SINGLE]
    else:
        pickled = sorted(p.name for pattern in PICKLED for p in root.glob(pattern))
        if pickled:
            raise ShardlabError(
                f"{root}: has {', '.join(pickled)} but no {SINGLE} or {INDEX}; only safetensors are read "
                "(pickle can run code): convert it, e.g. save_pretrained(dir, safe_serialization=True)"
            )
        raise ShardlabError(f"{root}: no {SINGLE} or {INDEX}; pass a Hugging Face directory saved as safetensors")
    stored: dict[str, _Stored] = {}
    for file in files:
        if not file.is_file():
            raise ShardlabError(f"{file}: listed in {INDEX} but missing; re-download or re-export the checkpoint")
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    s = f.get_slice(name)
                    stored[name] = _Stored(file, tuple(s.get_shape()), s.get_dtype())
        except (SafetensorError, OSError) as e:
            raise ShardlabError(
                f"{file}: not a readable safetensors file ({e}); it may be truncated, re-download it"
            ) from None
    for name, file in (weight_map or {}).items():
        if name not in stored or stored[name].file != root / file:
            raise ShardlabError(
                f"{root / file}: has no tensor {name!r} although {INDEX} says so; re-export the checkpoint"
            )
    return stored


def _param_names(model: nn.Module) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """Each distinct parameter with all its names (a tied one has several), in model order."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), ([], p))[0].append(name)
    return [(tuple(names), p) for names, p in groups.values()]


def _match(
    root: Path,
    stored: dict[str, _Stored],
    params: list[tuple[tuple[str, ...], torch.Tensor]],
    name_map: NameMap,
    elsewhere: Iterable[tuple[str, tuple[int, ...]]] = (),
) -> list[tuple[tuple[str, ...], bool, torch.Tensor]]:
    """(names in the checkpoint, stacked, parameter) for every parameter, or an error for the first thing that
    does not fit. stacked: the names are the experts of a stacked expert weight, in order."""
    jobs, known = [], set()
    for name, shape in elsewhere:
        other = name_map(name, shape)
        known.update(n for e in (other if isinstance(other, tuple) else (other,)) for n in _pieces(e))
    for model_names, param in params:
        experts = name_map(model_names[0], param.shape)
        if isinstance(experts, tuple):
            known.update(n for e in experts for n in _pieces(e))
            jobs.append((_match_experts(root, stored, experts, model_names[0], param), True, param))
            continue
        names = tuple(name_map(n, param.shape) for n in model_names)
        known.update(names)
        found = [n for n in names if n in stored]
        if not found:
            hint = (
                "the checkpoint ties lm_head to embed_tokens: load it into a model with tie_embeddings=True"
                if names == ("lm_head.weight",) and "model.embed_tokens.weight" in stored
                else "load a checkpoint of this architecture"
            )
            raise ShardlabError(f"{root}: no tensor {names[0]!r} in the checkpoint ({len(stored)} tensors); {hint}")
        name, s = found[0], stored[found[0]]
        if s.shape != tuple(param.shape):
            raise ShardlabError(
                f"{s.file}: tensor {name!r} has shape {s.shape} but the model's is {tuple(param.shape)}; "
                "the checkpoint is of another model size, build the model from its config.json (read_hf_config)"
            )
        if param.is_floating_point() and not s.dtype.startswith(("F", "BF")):
            raise ShardlabError(
                f"{s.file}: tensor {name!r} is {s.dtype} but the model's is {param.dtype}; expected floating-point weights"
            )
        jobs.append((tuple(found), False, param))
    extra = sorted(n for n in stored if n not in known and not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ShardlabError(
            f"{stored[extra[0]].file}: tensor {extra[0]!r} (and {len(extra) - 1} more) matches no model parameter; "
            "load a checkpoint of this architecture (for a tied checkpoint, set tie_embeddings=True)"
        )
    return jobs


def _match_experts(
    root: Path, stored: dict[str, _Stored], experts: tuple[str | tuple[str, ...], ...], name: str, param: torch.Tensor
) -> tuple[str | tuple[str, ...], ...]:
    """The checkpoint's tensors of a stacked expert weight: per expert one tensor of the shape of one slice, or
    several whose rows, concatenated, make it (transformers' gate_up_proj: each expert's gate and up)."""
    missing = [n for e in experts for n in _pieces(e) if n not in stored]
    if missing:
        raise ShardlabError(
            f"{root}: no tensor {missing[0]!r} for {name} ({len(experts)} experts); load a checkpoint of this "
            "architecture (as many experts as the checkpoint's config.json says)"
        )
    for e in experts:
        parts = _pieces(e)
        want = (param.shape[1] // len(parts), *param.shape[2:])
        bad = next((n for n in parts if stored[n].shape != tuple(want)), None)
        if bad is not None:
            raise ShardlabError(
                f"{stored[bad].file}: tensor {bad!r} has shape {stored[bad].shape} but each expert of {name} needs "
                f"{tuple(want)} from it; build the model from the checkpoint's config.json (read_hf_config)"
            )
    return experts


def _pieces(entry: str | tuple[str, ...]) -> tuple[str, ...]:
    """The names of one expert's slice: one tensor, or the row blocks concatenated into it."""
    return (entry,) if isinstance(entry, str) else entry


def _slice_reads(
    entry: str | tuple[str, ...], into: torch.Tensor, block_: tuple[slice, ...], rows: int
) -> list[tuple[str, torch.Tensor, tuple[slice, ...]]]:
    """(name, destination, block of that tensor) for this rank's `block_` of one expert slice of `rows` rows."""
    parts = _pieces(entry)
    size = rows // len(parts)
    out = []
    for j, name in enumerate(parts):
        lo, hi = max(block_[0].start, j * size), min(block_[0].stop, (j + 1) * size)
        if lo < hi:
            into_rows = into[lo - block_[0].start : hi - block_[0].start]
            out.append((name, into_rows, (slice(lo - j * size, hi - j * size), *block_[1:])))
    return out


def _check_tied_copies(stored: dict[str, _Stored], jobs: list) -> None:
    """A checkpoint that stores several names of one tied parameter must store equal tensors (this rank's block)."""
    for names, local, slices in jobs:
        if len(names) < 2 or local is None:
            continue
        first, *others = names
        with safe_open(stored[first].file, framework="pt") as f:
            want = f.get_slice(first)[slices]
        for other in others:
            with safe_open(stored[other].file, framework="pt") as f:
                if not torch.equal(f.get_slice(other)[slices].to(want.dtype), want):
                    raise ShardlabError(
                        f"{stored[other].file}: {other!r} differs from {first!r} but the model ties them; "
                        "load it into an untied model (tie_embeddings=False)"
                    )


def _local_block(param: torch.Tensor) -> tuple[torch.Tensor | None, tuple[slice, ...]]:
    """The tensor this rank writes into and the block of the global tensor it holds (None: holds nothing)."""
    if not isinstance(param, DTensor):
        return param, tuple(slice(0, n) for n in param.shape)
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None, ()
    spec, spec_mesh, names = placed_spec(param)
    coord = {a: 0 for a in spec_mesh.axis_names} | dict(zip(names, coordinate))
    slices = _nested_block(spec, spec_mesh, tuple(param.shape), coord)
    local = param.to_local()
    if tuple(s.stop - s.start for s in slices) != tuple(local.shape):
        raise ShardlabError(
            f"load_hf_weights: local shard {tuple(local.shape)} is not the block {slices} that placements "
            f"{param.placements} give; this layout is not supported, please report it"
        )
    return local, slices


def _nested_block(spec: P, mesh, shape: tuple[int, ...], coordinate: dict[str, int]) -> tuple[slice, ...]:
    """The block at `coordinate` when each axis of a dim chunks what the axes before it left (major first).

    This is how torch lays out shards (FSDP chunks the TP-local tensor), and equals `spec.block` whenever
    every split is even. It differs when FSDP pads: vocab 130 over (tp=2, dp_shard=2) leaves rows
    0:33, 33:65, 65:98, 98:130, where one JAX-style split of 130 in 4 would give 0:33, 33:66, 66:99, 99:130.
    """
    out = []
    for d, n in enumerate(shape):
        start, stop = 0, n
        for axis in spec.axes(d) if d < len(spec) else ():
            part = block(P(axis), mesh, (stop - start,), coordinate)[0]
            start, stop = start + part.start, start + part.stop
        out.append(slice(start, stop))
    return tuple(out)
