"""Dotted-name globs, the one pattern language of rules, FSDP units, blocks and optimizer groups."""

from __future__ import annotations

import functools
import re

from shardlab._errors import ShardlabError


@functools.lru_cache(maxsize=4096)
def glob_regex(pattern: str) -> re.Pattern[str]:
    """`layers.*.attn.q_proj.weight`: `*` never crosses a dot (as torch's parallelize_module), `**` does."""
    if not pattern or pattern.startswith(".") or pattern.endswith(".") or ".." in pattern:
        raise ShardlabError(
            f"rule pattern {pattern!r} is not a dotted name glob; write e.g. 'model.layers.*.mlp.up_proj.weight'"
        )
    out = []
    for part in re.split(r"(\*\*|\*|\?)", pattern):
        out.append({"**": ".*", "*": "[^.]*", "?": "[^.]"}.get(part, re.escape(part)))
    return re.compile("".join(out))


def matches(pattern: str, fqn: str) -> bool:
    return glob_regex(pattern).fullmatch(fqn) is not None
