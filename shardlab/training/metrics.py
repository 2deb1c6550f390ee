"""Metrics: each step's values from the loop -> progress bar, log lines, run_dir/metrics.jsonl and wandb.

Only the rank built with `enabled=True` (rank 0) writes or prints anything. Also the throughput helpers
the loop needs: FLOPs per token (per module for the pipeline's balance), MFU and peak memory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import torch

from shardlab._errors import ShardlabError
from shardlab._faults import fault_point
from shardlab.config import LogConfig

_LINE_FORMATS = {
    "loss": "loss {:.4f}",
    "tokens_per_s": "{:,.0f} tok/s",
    "mfu": "mfu {:.1%}",
    "peak_memory_bytes": "mem {:.2f} GiB",
    "grad_norm": "grad_norm {:.3f}",
    "lr": "lr {:.2e}",
    "eval_loss": "eval_loss {:.4f}",
    "eval_ppl": "eval_ppl {:.2f}",
}
"""Keys the log line knows, in print order; other values follow as `key value`."""


class MetricsWriter:
    """Reports each step on rank 0: a rich progress bar every step; every `log.every` steps (and the last)
    a log line, one JSON object appended to run_dir/metrics.jsonl (flushed) and a wandb row.

    `record(step, values)` takes `step` = optimizer steps completed (1 after the first step). wandb is
    offline unless log.wandb="online", writes under run_dir, and is imported only when used (slow import).
    A run resumed at `start_step` keeps the rows up to it, and adds `start_row` (the values its checkpoint saved)
    when a kill between the checkpoint's commit and its line left that row torn or unwritten.
    """

    def __init__(
        self,
        run_dir: str | Path,
        log: LogConfig,
        total_steps: int,
        *,
        enabled: bool,
        config_dict: dict[str, Any] | None = None,
        name: str | None = None,
        start_step: int = 0,
        start_row: dict[str, Any] | None = None,
    ) -> None:
        self.log = log
        self.total_steps = total_steps
        self.enabled = enabled
        self._file: TextIO | None = None
        self._progress: Any = None  # rich.progress.Progress, imported only when shown
        self._wandb_run: Any = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if log.wandb != "disabled":  # first: if it fails, no bar is left running
            import wandb

            self._wandb_run = wandb.init(
                project=log.wandb_project,
                name=name,
                config=config_dict,
                dir=str(run_dir),
                mode=log.wandb,
                reinit="create_new",
                settings=wandb.Settings(silent=True, console="off", disable_git=True, save_code=False),
            )
        path = run_dir / "metrics.jsonl"
        kept = []
        if start_step and path.exists():  # a resumed run keeps the lines up to its checkpoint, drops the rest
            kept = [row for row in read_metrics(path) if row["step"] <= start_step]
            if start_row is not None and self._logs(start_step) and (not kept or kept[-1]["step"] < start_step):
                kept.append(row_of(start_step, start_row))  # the kill came after the checkpoint, before its line
        self._file = path.open("w")
        self._file.write("".join(f"{json.dumps(row)}\n" for row in kept))
        if log.progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
            self._progress.start()

    def record(self, step: int, values: dict[str, float | list[int] | None]) -> None:
        """Report the values after `step` steps; None values (e.g. an unknown MFU) are left out, and lists (an MoE
        model's tokens per expert) go to metrics.jsonl only."""
        if not self.enabled:
            return
        if values.get("loss") is None:
            raise ShardlabError(
                f"MetricsWriter.record: values has no 'loss' (keys: {sorted(values)}); pass the step's loss"
            )
        floats = {key: float(value) for key, value in values.items() if isinstance(value, int | float)}
        if self._progress is not None:
            status = f"loss {floats['loss']:.4f}"
            if "tokens_per_s" in floats:
                status += f"  {floats['tokens_per_s']:,.0f} tok/s"
            self._progress.update(self._task, completed=step, status=status)
        if not self._logs(step):
            return
        print(format_line(step, self.total_steps, floats), flush=True)
        line = json.dumps(row_of(step, values)) + "\n"
        fault_point(f"log:{step}", lambda: (self._file.write(line[: len(line) // 2]), self._file.flush()))
        self._file.write(line)
        self._file.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(floats, step=step)

    def _logs(self, step: int) -> bool:
        """Whether `step` gets a log line and a row of metrics.jsonl."""
        return step % self.log.every == 0 or step == self.total_steps

    def close(self) -> None:
        """Finish the bar, the file and the wandb run; safe to call twice."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def row_of(step: int, values: dict[str, Any]) -> dict[str, Any]:
    """The row of metrics.jsonl for `step`: numbers as floats, lists as lists, anything else (None) left out."""
    floats = {key: float(value) for key, value in values.items() if isinstance(value, int | float)}
    lists = {key: list(value) for key, value in values.items() if isinstance(value, list | tuple)}
    return {"step": step, **floats, **lists}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, without the torn line a kill in the middle of a write leaves at its end."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break  # the torn tail: nothing was written after it
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def format_line(step: int, total_steps: int, values: dict[str, float]) -> str:
    """`step 10/100 | loss 3.4521 | 12,345 tok/s | mfu 41.2% | mem 1.23 GiB | grad_norm 0.812 | lr 8.00e-04`.

    The wall-clock `time` is kept for metrics.jsonl and left out of the line."""
    shown = {**values}
    if "peak_memory_bytes" in shown:
        shown["peak_memory_bytes"] /= 2**30
    parts = [f"step {step}/{total_steps}"]
    parts += [fmt.format(shown[key]) for key, fmt in _LINE_FORMATS.items() if key in shown]
    parts += [f"{key} {value:.4g}" for key, value in shown.items() if key not in _LINE_FORMATS and key != "time"]
    return " | ".join(parts)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]; None when the peak is unknown. Both rates must cover the same devices."""
    if peak_flops is None:
        return None
    return tokens_per_s * flops_per_token / peak_flops


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes: CUDA's max_memory_allocated on a GPU, else this process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource  # POSIX only

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}
"""Dense bf16 peaks (vendor datasheets, SXM parts), for MFU when log.peak_tflops is not given."""


def device_peak_flops(device: torch.device, peak_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: the configured value, a known GPU's bf16 peak, or None (CPU, unknown GPU)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS.items() if key in name), None)
