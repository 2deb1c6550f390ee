"""A Hugging Face model directory's weights: one `model.safetensors`, or an index naming its shards."""

from __future__ import annotations

from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def has_weights(root: Path) -> bool:
    """Whether a Hugging Face directory holds safetensors weights (one file or an index)."""
    return (root / SINGLE).is_file() or (root / INDEX).is_file()
