"""The one base for every config and plan struct: frozen, keyword-only, strict about unknown keys.

Change a struct with `msgspec.structs.replace`; validation lives in `__post_init__` and raises
`ValueError` (tyro turns that into a clean CLI error, and it also runs inside `msgspec.convert`).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T", bound="Frozen")


class Frozen(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Immutable, keyword-only struct that rejects unknown fields when decoded."""


def revalidate(value: T) -> T:
    """Round-trip through msgspec so `msgspec.Meta` constraints run (tyro builds structs by calling them).

    Errors come out as one line with the path, e.g. ``Expected `int` >= 1 - at `$.mesh.tp```.
    """
    try:
        return msgspec.convert(msgspec.to_builtins(value), type(value))
    except msgspec.ValidationError as err:
        raise ValueError(str(err)) from None


def to_json(value: Any) -> bytes:
    """Stable, indented JSON of a struct (for run directories and golden files)."""
    return msgspec.json.format(msgspec.json.encode(value), indent=2)
