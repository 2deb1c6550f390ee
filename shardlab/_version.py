"""shardlab's version, for `python -m shardlab --version` and `shardlab.__version__`."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from pathlib import Path


def version() -> str:
    """The installed distribution's version; in a source tree that is not installed, pyproject.toml's."""
    try:
        return installed_version("shardlab")
    except PackageNotFoundError:
        pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
        return re.search(r'^version = "([^"]+)"$', pyproject, re.MULTILINE).group(1)
