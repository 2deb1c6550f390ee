"""Parquet, Arrow and JSONL datasets (a file, or a directory of them) through Hugging Face `datasets`: read,
tokenized once into an Arrow cache under `data.cache_dir`, and handed to the loader as one token array per row.

The cache is keyed by the files (paths, sizes, modification times), the text field and the tokenizer, so the first
process tokenizes before any rank starts and every rank then maps the same Arrow file. `datasets` is imported only
when such a path is used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json"}
"""File suffix -> the `datasets` builder that reads it."""
RecordEncoder = Callable[[list[Any], list[str]], dict[str, list[np.ndarray]]]
"""Rows' field values and how an error names each row -> columns of arrays ("ids", and for chat "trainable")."""


def is_dataset(path: Path) -> bool:
    """Whether `path` is read through `datasets`: a directory, or a .parquet / .arrow file."""
    return path.is_dir() or path.suffix in (".parquet", ".arrow")


def dataset_rows(name: str, field: str, cache_dir: str) -> tuple[Any, list[Path]]:
    """The rows of dataset `name` (a `datasets.Dataset`) and the files they come from; one-line errors for a
    directory without data files, a mix of formats, unreadable files or a missing `field`."""
    datasets = _datasets(name)
    path = Path(name)
    files = sorted(f for f in path.rglob("*") if f.suffix in BUILDERS and f.is_file()) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"data.paths: {name} holds no {', '.join(BUILDERS)} files; point it at a dataset directory")
    kinds = {BUILDERS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise ValueError(
            f"data.paths: {name} mixes {' and '.join(sorted(kinds))} files; give each format its own directory"
        )
    try:
        rows = datasets.load_dataset(
            kinds.pop(), data_files=[str(f) for f in files], split="train",
            cache_dir=str(Path(cache_dir) / "datasets"),
        )  # fmt: skip
    except Exception as e:  # whatever datasets or pyarrow raise on a user's file
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"data.paths: {name} is not a readable dataset ({first})") from None
    if field not in rows.column_names:
        hint = "set data.jsonl_field to the field holding the text" if field != "messages" else "chat rows need it"
        raise ValueError(
            f"data.paths: {name} has no field {field!r} (its fields: {', '.join(rows.column_names)}); {hint}"
        )
    return rows, files


def dataset_documents(
    name: str, field: str, records: RecordEncoder, encoder_key: str, cache_dir: str
) -> dict[str, list[np.ndarray]]:
    """Per row of dataset `name`, the arrays `records` makes of its `field` (column -> one array per row), made
    once: the cache file's name is a hash of the files, the field and `encoder_key` (what identifies `records`)."""
    rows, files = dataset_rows(name, field, cache_dir)
    key = hashlib.blake2b(f"{field} {encoder_key}".encode(), digest_size=8)
    for f in files:
        stat = f.stat()
        key.update(f"{f.resolve()} {stat.st_size} {stat.st_mtime_ns}".encode())
    fingerprint = key.hexdigest()

    def tokenize(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[np.ndarray]]:
        return records(batch[field], [f"data.paths: {name} row {i}" for i in indices])

    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    ids = rows.map(
        tokenize, batched=True, with_indices=True, remove_columns=rows.column_names,
        cache_file_name=str(Path(cache_dir) / f"tokens-{fingerprint}.arrow"),
        new_fingerprint=fingerprint, desc=f"tokenizing {name}",
    )  # fmt: skip
    out = {}
    for key in ids.column_names:  # list arrays: flat values and row offsets, memory-mapped
        column = ids.data.column(key).combine_chunks()
        flat, offsets = column.values.to_numpy(zero_copy_only=False), column.offsets.to_numpy()
        out[key] = [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    return out


def _datasets(name: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data.paths: {name} needs the datasets package: pip install 'shardlab[hf]'") from None
    return datasets
