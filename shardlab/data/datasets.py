"""Parquet, Arrow and JSONL datasets (a file, or a directory of them) through Hugging Face `datasets`: read,
tokenized once into an Arrow cache under `data.cache_dir`, and handed to the loader as one token array per row.
An error names a JSONL row by its file and line, as the loader's own JSONL reader does.

The cache is keyed by the files (paths, sizes, modification times), the text field and the tokenizer, so the first
process tokenizes before any rank starts and every rank then maps the same Arrow file. `datasets` is imported only
when such a path is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from shardlab._errors import ShardlabError
from shardlab._faults import fault_point
from shardlab._process import alive

BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json"}
"""File suffix -> the `datasets` builder that reads it."""
RecordEncoder = Callable[[list[Any], Callable[[int], str]], dict[str, list[np.ndarray]]]
"""Rows' field values and how an error names value j -> columns of arrays ("ids", and for chat "trainable")."""


def is_dataset(path: Path) -> bool:
    """Whether `path` is read through `datasets`: a directory, or a .parquet / .arrow file."""
    return path.is_dir() or path.suffix in (".parquet", ".arrow")


def dataset_rows(name: str, field: str, cache_dir: str, named_by: str = "data.paths") -> tuple[Any, list[Path]]:
    """The rows of dataset `name` (a `datasets.Dataset`) and the files they come from; one-line errors for a
    directory without data files, a mix of formats, unreadable files or a missing `field`, each led by the config
    field that named the dataset (`named_by`: data.paths, or eval.paths for an evaluation's files)."""
    datasets = _datasets(name, named_by)
    path = Path(name)
    files = sorted(f for f in path.rglob("*") if f.suffix in BUILDERS and f.is_file()) if path.is_dir() else [path]
    if not files:
        raise ShardlabError(f"{named_by}: {name} holds no {', '.join(BUILDERS)} files; point it at a dataset directory")
    kinds = {BUILDERS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise ShardlabError(
            f"{named_by}: {name} mixes {' and '.join(sorted(kinds))} files; give each format its own directory"
        )
    try:
        with _quiet(datasets):
            rows = datasets.load_dataset(
                kinds.pop(), data_files=[str(f) for f in files], split="train",
                cache_dir=str(Path(cache_dir) / "datasets"),
            )  # fmt: skip
    except Exception as e:  # whatever datasets or pyarrow raise on a user's file
        if BUILDERS[files[0].suffix] == "json" and not _check_json_lines(
            files, named_by
        ):  # datasets says StopIteration
            raise ShardlabError(
                f"{named_by}: {name} holds no documents: its .jsonl files are empty or blank; add one JSON record per line"
            ) from None
        while e.__cause__ is not None:  # datasets wraps the reader's own error ("Couldn't cast ...")
            e = e.__cause__
        lines = str(e).splitlines() or [type(e).__name__]
        why = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
        raise ShardlabError(f"{named_by}: {name} is not a readable dataset ({why})") from None
    if field not in rows.column_names:
        hint = "set data.jsonl_field to the field holding the text" if field != "messages" else "chat rows need it"
        raise ShardlabError(
            f"{named_by}: {name} has no field {field!r} (its fields: {', '.join(rows.column_names)}); {hint}"
        )
    return rows, files


def dataset_documents(
    name: str, field: str, records: RecordEncoder, encoder_key: str, cache_dir: str, named_by: str = "data.paths"
) -> tuple[dict[str, list[np.ndarray]], Callable[[int], str]]:
    """Per row of dataset `name`, the arrays `records` makes of its `field` (column -> one array per row), made
    once: the cache file's name is a hash of the files, the field and `encoder_key` (what identifies `records`);
    and how an error names row k (`row_names`). named_by: the config field that named it (`dataset_rows`)."""
    rows, files = dataset_rows(name, field, cache_dir, named_by)
    where = row_names(name, files, named_by)
    key = hashlib.blake2b(f"{field} {encoder_key}".encode(), digest_size=8)
    for f in files:
        stat = f.stat()
        key.update(f"{f.resolve()} {stat.st_size} {stat.st_mtime_ns}".encode())
    fingerprint = key.hexdigest()

    def tokenize(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[np.ndarray]]:
        if indices[0] > 0:  # a batch after the first, which datasets has written
            fault_point("tokenize")
        return records(batch[field], lambda j: where(indices[j]))

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    remove_leftovers(cache)
    final = cache / f"tokens-{fingerprint}.arrow"
    # datasets writes a temporary file beside its cache file and renames it when done: made in this process's own
    # folder, what a killed tokenization leaves is found and removed by the next start (`remove_leftovers`)
    partial = final if final.exists() else cache / f"{PARTIAL}{os.getpid()}" / final.name
    partial.parent.mkdir(exist_ok=True)
    try:
        with _quiet(_datasets(name, named_by)):
            ids = rows.map(
                tokenize, batched=True, with_indices=True, remove_columns=rows.column_names,
                cache_file_name=str(partial), new_fingerprint=fingerprint,
            )  # fmt: skip
    except UnicodeDecodeError as err:  # pyarrow's JSON reader passes bytes that are not UTF-8 on to the rows
        if BUILDERS[files[0].suffix] == "json":
            _check_json_lines(files, named_by)  # names the file and line
        raise ShardlabError(
            f"{named_by}: {name} holds text that is not UTF-8 ({err.reason} at byte {err.start}); fix or re-encode it"
        ) from None
    finally:
        if partial != final:
            if partial.exists():
                os.replace(partial, final)  # the memory map stays valid: it holds the file, not its name
            shutil.rmtree(partial.parent, ignore_errors=True)
    out = {}
    for key in ids.column_names:  # list arrays: flat values and row offsets, memory-mapped
        column = ids.data.column(key).combine_chunks()
        flat, offsets = column.values.to_numpy(zero_copy_only=False), column.offsets.to_numpy()
        out[key] = [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    return out, where


PARTIAL = "partial-"
"""The folder (PARTIAL + process id) a tokenization writes its cache file in until it is whole."""


def remove_leftovers(cache: Path) -> None:
    """Remove the folders that tokenizations killed before they finished left in `cache` (their process is gone)."""
    for folder in cache.glob(f"{PARTIAL}*"):
        pid = folder.name.removeprefix(PARTIAL)
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def row_names(name: str, files: list[Path], named_by: str = "data.paths") -> Callable[[int], str]:
    """How an error names row k: `data.paths: FILE:LINE` for JSONL (the rows are the files' non-blank lines, in
    order), else `data.paths: NAME row k` (`named_by` in place of data.paths: the field that named the files). The
    lines are counted on the first call, that is, only for an error."""
    if BUILDERS[files[0].suffix] != "json":
        return lambda k: f"{named_by}: {name} row {k}"
    lines: list[tuple[Path, np.ndarray]] = []

    def where(k: int) -> str:
        if not lines:
            for f in files:
                with f.open("rb") as text:
                    lines.append((f, np.array([n for n, line in enumerate(text, 1) if line.strip()], dtype=np.int64)))
        row = k
        for f, numbers in lines:
            if row < numbers.size:
                return f"{named_by}: {f}:{numbers[row]}"
            row -= numbers.size
        return f"{named_by}: {name} row {k}"

    return where


def _check_json_lines(files: list[Path], named_by: str) -> int:
    """Name the first line of `files` that is not a JSON object, for a JSONL dataset that `datasets` cannot read;
    else how many records they hold."""
    records = 0
    for f in files:
        with f.open("rb") as text:
            for n, line in enumerate(text, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
                    why = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
                    raise ShardlabError(
                        f"{named_by}: {f}:{n} is not valid JSON ({why}); fix or drop the line"
                    ) from None
                if not isinstance(record, dict):
                    raise ShardlabError(f"{named_by}: {f}:{n} is not a JSON object; each line holds one record")
                records += 1
    return records


@contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """No `datasets` progress bars or log lines while the CLI checks the data before launch: its output is one line
    per run (or one error line), the bars would come back on every rank, and the library logs a reader's failure
    (a bad JSON line) on a line of its own before shardlab's error names the file and line. Its logger (whose level
    its modules' loggers inherit) lets nothing below CRITICAL through, for this call only."""
    enabled = datasets.is_progress_bar_enabled()
    logger = datasets.logging.get_logger()  # the library's root logger
    level = logger.level
    datasets.disable_progress_bars()
    logger.setLevel(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
        if enabled:
            datasets.enable_progress_bars()


def _datasets(name: str, named_by: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ShardlabError(f"{named_by}: {name} needs the datasets package: pip install 'shardlab[hf]'") from None
    return datasets
