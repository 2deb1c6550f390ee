"""Where documents come from, as token arrays: byte-level tokens (or a tokenizer's), the Python standard library's
text, data files (.txt, .jsonl, .bin, and Parquet/Arrow/JSONL through Hugging Face datasets), and the held-out
split an evaluation reads. `shardlab.data.loader` turns the documents into each rank's rows of a global batch.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from shardlab._errors import ShardlabError
from shardlab.config import DataConfig
from shardlab.data.chat import FIELD
from shardlab.data.datasets import dataset_documents, is_dataset

Split = Literal["all", "train", "held_out"]
Encoder = Callable[[list[str]], list[np.ndarray]]
"""Texts -> one token array per document (bytes, or a tokenizer's ids)."""
RecordEncoder = Callable[[list[Any], Callable[[int], str]], dict[str, list[np.ndarray]]]
"""Records' field values and how an error names value j -> {"ids": token arrays} (and, for chat, "trainable":
bool arrays, True on the tokens the loss learns)."""

BOS = 256
EOS = 257
BYTE_VOCAB = 258
"""Byte-level tokens: 256 bytes, then BOS and EOS."""
STDLIB_MAX_BYTES = 4 * 2**20
"""Stop reading the stdlib after this many bytes of source, so startup stays well under a second."""
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}
)
"""Not read: installed packages, tests, and `encodings` (generated codec tables rather than prose or code)."""


def encode(text: str) -> np.ndarray:
    """Byte-level tokens of one document: BOS, its UTF-8 bytes, EOS (uint16)."""
    body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return np.concatenate([[BOS], body, [EOS]]).astype(np.uint16)


def decode(tokens: Any) -> str:
    """Text of byte-level tokens (BOS/EOS dropped, invalid UTF-8 replaced), for looking at data."""
    return bytes(int(t) for t in tokens if int(t) < 256).decode("utf-8", errors="replace")


HELD_OUT = 0.01
"""The share of the documents (or of a single document's tokens) an evaluation holds out of training."""


def hold_out(docs: list[np.ndarray], split: Split) -> list[np.ndarray]:
    """The documents of `split`: the last HELD_OUT of them (at least one) are held out; a single document is cut
    at its last HELD_OUT of tokens. Cut in file order, before any shuffling, so the split never depends on seeds."""
    if split == "all":
        return docs
    if len(docs) >= 2:
        k = max(1, int(len(docs) * HELD_OUT))
        return docs[:-k] if split == "train" else docs[-k:]
    (doc,) = docs
    cut = int(doc.size * (1 - HELD_OUT))
    if cut < 1 or doc.size - cut < 2:
        raise ShardlabError(
            f"data: one document of {doc.size} tokens is too short to hold out an evaluation slice; pass "
            "--eval.paths with held-out files"
        )
    return [doc[:cut]] if split == "train" else [doc[cut:]]


def byte_encode(texts: list[str]) -> list[np.ndarray]:
    return [encode(t) for t in texts]


def stdlib_texts() -> tuple[list[str], list[str]]:
    """This Python's stdlib `*.py` sources in sorted path order, one document each, up to STDLIB_MAX_BYTES of
    UTF-8 text; and their paths."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _STDLIB_SKIP_DIRS]
        paths += [os.path.join(directory, f) for f in files if f.endswith(".py")]
    texts, names, total = [], [], 0
    for path in sorted(paths):
        if total >= STDLIB_MAX_BYTES:
            break
        texts.append(Path(path).read_text(encoding="utf-8", errors="replace"))
        names.append(path)
        total += len(texts[-1].encode("utf-8")) + 2
    if not texts:
        raise ShardlabError(f"data.source='stdlib': no *.py files under {root}; use data.source='synthetic' or 'files'")
    return texts, names


def file_documents(
    data: DataConfig, vocab_size: int, records: RecordEncoder, key: str, seq_len: int, named_by: str = "data.paths"
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Token arrays (and for chat, trainable masks). .txt: one document per file; .jsonl: one per line; .bin: the
    file's tokens as one document (a memmap); .parquet, .arrow and directories: one per row, tokenized once into
    data.cache_dir (`shardlab.data.datasets`), and so are chat .jsonl files, whose rendering costs far more than
    tokenizing text. `key` identifies what `records` makes of a record (for that cache). named_by: the config field
    that named data.paths, which errors lead with (eval.paths for an evaluation's files)."""
    chat = data.format == "chat"
    field = FIELD if chat else data.jsonl_field
    docs: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for name in data.paths:
        path = Path(name)
        if not path.exists():
            raise ShardlabError(f"{named_by}: {name} does not exist; check the path")
        if chat and not (is_dataset(path) or path.suffix == ".jsonl"):
            raise ShardlabError(
                f"{named_by}: {name} is not chat data; data.format='chat' reads .jsonl files or datasets"
            )
        if is_dataset(path) or (chat and path.is_file()):
            if data.cache_dir is None:
                raise ShardlabError(f"{named_by}: {name} is tokenized once into data.cache_dir, which is unset; set it")
            columns, where = dataset_documents(name, field, records, key, data.cache_dir, named_by)
        elif not path.is_file():
            raise ShardlabError(f"{named_by}: {name} is not a file; check the path")
        elif path.suffix == ".bin":
            docs.append(_bin_tokens(path, data.bin_dtype, vocab_size, named_by))
            continue
        elif path.suffix in (".txt", ".jsonl"):
            try:  # a .jsonl's byte-order mark is no part of its first record (datasets, reading a directory, skips it)
                text = path.read_text(encoding="utf-8-sig" if path.suffix == ".jsonl" else "utf-8")
            except (OSError, UnicodeDecodeError) as err:
                why = f"{err.reason} at byte {err.start}" if isinstance(err, UnicodeDecodeError) else err.strerror
                raise ShardlabError(
                    f"{named_by}: {name} cannot be read as UTF-8 text ({why}); fix or re-encode it"
                ) from None
            values, wheres = (
                ([text], [f"{named_by}: {name}"])
                if path.suffix == ".txt"
                else _jsonl_values(name, text, field, named_by)
            )
            kept = [k for k, v in enumerate(values) if v != ""]  # an empty text would train on its markers alone
            values, wheres = [values[k] for k in kept], [wheres[k] for k in kept]
            columns, where = records(values, wheres.__getitem__), wheres.__getitem__
        else:
            raise ShardlabError(
                f"{named_by}: {name} has suffix {path.suffix!r}; use .txt, .jsonl, .bin, .parquet, .arrow or a directory"
            )
        if chat:
            for k, ids in enumerate(columns["ids"]):
                if ids.size > seq_len and not data.truncate:
                    raise ShardlabError(
                        f"{where(k)}: the conversation is {ids.size} tokens, longer than train.seq_len={seq_len}; raise "
                        "train.seq_len, drop the record, or set data.truncate to cut it"
                    )
            masks += [m[:seq_len] for m in columns["trainable"]]
            docs += [d[:seq_len] for d in columns["ids"]]
        else:
            docs += columns["ids"]
    if not docs:
        raise ShardlabError(f"{named_by}: {', '.join(data.paths)} hold no documents; add a non-empty file")
    return docs, masks if chat else None


def _jsonl_values(name: str, text: str, field: str, named_by: str) -> tuple[list[Any], list[str]]:
    """Each line's `field` and how an error names it (`data.paths: FILE:LINE`); blank lines are skipped."""
    values, wheres = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ShardlabError(
                f"{named_by}: {name}:{lineno} is not valid JSON ({err.msg}); fix or drop the line"
            ) from None
        values.append(record.get(field) if isinstance(record, dict) else None)
        wheres.append(f"{named_by}: {name}:{lineno}")
    return values, wheres


def text_records(encoder: Encoder, field: str) -> RecordEncoder:
    """Text records: each value must be a string, which `encoder` tokenizes."""

    def records(values: list[Any], where: Callable[[int], str]) -> dict[str, list[np.ndarray]]:
        for j, value in enumerate(values):
            if not isinstance(value, str):
                raise ShardlabError(
                    f"{where(j)} has no string field {field!r}; set data.jsonl_field to the field holding the text"
                )
        return {"ids": encoder(values)}

    return records


def _bin_tokens(path: Path, dtype: str, vocab_size: int, named_by: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0 or size % itemsize:
        raise ShardlabError(
            f"{named_by}: {path} is {size} bytes, not a positive multiple of {itemsize} (data.bin_dtype={dtype}); "
            "check data.bin_dtype"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if vocab_size <= np.iinfo(tokens.dtype).max and (top := int(tokens.max())) >= vocab_size:
        raise ShardlabError(
            f"{named_by}: {path} holds token id {top} but model.vocab_size={vocab_size}; "
            f"set model.vocab_size > {top} or re-tokenize with a smaller vocabulary"
        )
    return tokens


def ends(tokens: np.ndarray) -> np.ndarray:
    """The first and last 2**19 tokens: enough to fingerprint a large file without reading all of it."""
    return tokens if tokens.size <= 2**20 else np.concatenate([tokens[: 2**19], tokens[-(2**19) :]])
