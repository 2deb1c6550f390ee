"""One shardlab CLI run for the benchmark scripts: a fresh run directory, no wandb, no progress bar."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_shardlab(
    recipe: str, overrides: list[str], *, env: Mapping[str, str] | None = None, quiet: bool = False
) -> tuple[Path, list[dict]]:
    """Run `python -m shardlab RECIPE OVERRIDES` from the repository root; return its run directory and the rows
    of its metrics.jsonl. quiet: capture the run's output instead of showing it."""
    run_dir = Path(tempfile.mkdtemp(prefix="shardlab-run-"))
    cmd = [
        sys.executable, "-m", "shardlab", recipe, *overrides,
        "--log.wandb", "disabled", "--log.no-progress", "--train.run-dir", str(run_dir),
    ]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, env=env, capture_output=quiet)
    return run_dir, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
