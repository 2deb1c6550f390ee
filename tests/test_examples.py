"""examples/ run as a reader would run them (one process), and do what their docstrings say."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_own_loop_trains_on_one_process():
    out = subprocess.run(
        [sys.executable, "examples/own_loop.py"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)", out, flags=re.M)]
    assert len(losses) == 10, out[-2000:]
    assert losses[-1] < losses[0] - 0.5, losses
    assert "Plan for mesh" in out
