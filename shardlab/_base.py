"""The one base for every config and plan struct: frozen, keyword-only, strict about unknown keys.

Change a struct with `msgspec.structs.replace`; validation lives in `check`, which runs whenever a struct is
built (also inside `msgspec.convert`) and raises a one-line `ValueError` naming the field and the fix. The CLI
builds under `deferred_checks` and then calls `revalidate`, so a bad override reads as one line too (tyro would
draw a box around it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Annotated, Any, TypeVar

import msgspec

from shardlab._errors import ShardlabError

T = TypeVar("T", bound="Frozen")

Positive = Annotated[int, msgspec.Meta(ge=1)]
"""An int field that must be at least 1."""


_DEFERRED: ContextVar[bool] = ContextVar("shardlab_deferred_checks", default=False)


class Frozen(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Immutable, keyword-only struct that rejects unknown fields when decoded."""

    def __post_init__(self) -> None:
        if not _DEFERRED.get():
            self.check()

    def check(self) -> None:
        """Raise ValueError for values that cannot work together (subclasses override)."""


@contextmanager
def deferred_checks() -> Iterator[None]:
    """Build structs without running `check` (call `revalidate` on the result to run them all)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def revalidate(value: T) -> T:
    """Round-trip through msgspec so `msgspec.Meta` constraints and every `check` run (tyro builds structs by
    calling them, which skips the former).

    Errors come out as one line led by the field: ``train.seq_len=0: Expected `int` >= 1``.
    """
    data = msgspec.to_builtins(value)
    try:
        return msgspec.convert(data, type(value))
    except msgspec.ValidationError as err:
        raise ShardlabError(_field_first(str(err), data)) from None


_AT = re.compile(r"^(?P<what>.*) - at `\$\.?(?P<path>[^`]*)`$", re.S)
"""msgspec's message and the path of the field it is about (`... - at `$.train.seq_len``)."""
_STEP = re.compile(r"[^.\[\]]+|\[(\d+)\]")


def _field_first(message: str, data: Any) -> str:
    """`message` led by its field and the value given, as every check's own message is; a check's message (it names
    its fields already) loses msgspec's path suffix."""
    found = _AT.match(message)
    if found is None:
        return message
    what, path = found["what"], found["path"]
    if not what.startswith(("Expected ", "Invalid ")):  # msgspec's own words; anything else is a check's
        return what
    for step in _STEP.finditer(path):
        try:
            data = data[int(step[1])] if step[1] is not None else data[step[0]]
        except (KeyError, IndexError, TypeError):
            return f"{path}: {what}"
    return f"{path}={data!r}: {what}"


def to_json(value: Any) -> bytes:
    """Stable, indented JSON of a struct (for run directories and golden files)."""
    return msgspec.json.format(msgspec.json.encode(value), indent=2)
