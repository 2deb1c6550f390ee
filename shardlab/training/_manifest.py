"""A checkpoint's manifest: every file's size and CRC-32, written at the commit, checked before a resume.

files -> `entries` (size + crc32 each; ranks compute their own files' and rank 0 merges them) -> manifest.json
inside the step directory before its rename, so it commits with the files it describes. `problems` compares the
files on disk with it: a missing or resized file costs a stat, a changed byte costs reading the file (CRC-32 runs
at about 1.5 GB/s per core from the page cache). A checkpoint without a manifest (written before manifests) is
trusted.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

from shardlab._errors import ShardlabError

MANIFEST_FILE = "manifest.json"
CHUNK_BYTES = 16 << 20
"""Read size for checksums: large enough to run at CRC-32's speed, small enough to stay out of the way."""


def checksum(file: Path) -> int:
    """CRC-32 of a file, streamed: corruption detection at disk speed, not a cryptographic hash."""
    crc = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def entries(directory: Path, names: Iterable[str]) -> dict[str, dict[str, int]]:
    """{name: {"size", "crc32"}} for the named files of `directory`."""
    return {name: {"size": (directory / name).stat().st_size, "crc32": checksum(directory / name)} for name in names}


def write(directory: Path, files: Mapping[str, Mapping[str, int]]) -> None:
    (directory / MANIFEST_FILE).write_text(json.dumps({"files": dict(sorted(files.items()))}, indent=1) + "\n")


def read(directory: Path) -> dict[str, dict[str, int]] | None:
    """The manifest's entries; None when the checkpoint has no manifest. An unreadable one is a ValueError."""
    file = directory / MANIFEST_FILE
    if not file.is_file():
        return None
    try:
        files = json.loads(file.read_text())["files"]
        return {name: {"size": int(e["size"]), "crc32": int(e["crc32"])} for name, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ShardlabError(f"{MANIFEST_FILE} is unreadable ({type(err).__name__}: {err})") from None


def _what(name: str) -> str:
    return f"data file {name}" if name.endswith(".distcp") else f"file {name}"


def problems(directory: Path, files: Mapping[str, Mapping[str, int]], checksummed: Iterable[str]) -> dict[str, str]:
    """{name: what is wrong} for the files of the manifest `files` that differ on disk: each one's presence and
    size, and the checksums of those in `checksummed` (a rank checks its share of the bytes)."""
    out = {}
    checksummed = set(checksummed)
    for name, entry in sorted(files.items()):
        file = directory / name
        if not file.is_file():
            out[name] = f"{_what(name)} is missing"
            continue
        size = file.stat().st_size
        if size < entry["size"]:
            out[name] = f"{_what(name)} is truncated ({size} of {entry['size']} bytes)"
        elif size != entry["size"]:
            out[name] = f"{_what(name)} has {size} bytes but the manifest says {entry['size']}"
        elif name in checksummed and (crc := checksum(file)) != entry["crc32"]:
            out[name] = f"{_what(name)} is corrupt (CRC-32 {crc:08x}, the manifest says {entry['crc32']:08x})"
    return out
