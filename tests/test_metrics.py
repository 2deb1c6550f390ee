"""shardlab.training.metrics: what rank 0 prints and writes (metrics.jsonl, wandb offline), and the throughput helpers.

Run: pytest tests/test_metrics.py (~5 s, most of it the offline wandb run; it never touches the network).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardlab.config import LogConfig
from shardlab.models.flops import flops_per_token
from shardlab.training.metrics import MetricsWriter, format_line, mfu, peak_memory_bytes

QUIET = LogConfig(progress=False, wandb="disabled")


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_has_one_object_per_logged_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    with MetricsWriter(tmp_path, QUIET, total_steps=3, enabled=True) as writer:
        for step in (1, 2, 3):
            writer.record(step, {"loss": 4.0 - step, "lr": 1e-3, "tokens_per_s": 1234.0, "mfu": None})
            assert len(lines(tmp_path)) == step  # flushed as it goes
    assert lines(tmp_path)[1] == {"step": 2, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 1234.0}
    assert capsys.readouterr().out.splitlines()[0] == "step 1/3 | loss 3.0000 | 1,234 tok/s | lr 1.00e-03"


def test_log_every_is_respected_and_the_last_step_logged(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    log = LogConfig(every=3, progress=False, wandb="disabled")
    with MetricsWriter(tmp_path, log, total_steps=10, enabled=True) as writer:
        for step in range(1, 11):
            writer.record(step, {"loss": 1.0})
    assert [line["step"] for line in lines(tmp_path)] == [3, 6, 9, 10]
    assert len(capsys.readouterr().out.splitlines()) == 4


def test_progress_bar_does_not_get_in_the_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    log = LogConfig(progress=True, wandb="disabled")
    with MetricsWriter(tmp_path, log, total_steps=2, enabled=True) as writer:
        writer.record(1, {"loss": 2.0, "tokens_per_s": 10.0})
        writer.record(2, {"loss": 1.0, "tokens_per_s": 10.0})
    assert [line["loss"] for line in lines(tmp_path)] == [2.0, 1.0]
    assert "step 2/2 | loss 1.0000" in capsys.readouterr().out


def test_disabled_rank_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run_dir = tmp_path / "run"
    with MetricsWriter(run_dir, LogConfig(wandb="offline"), total_steps=2, enabled=False) as writer:
        writer.record(1, {"loss": 1.0})
    assert not run_dir.exists()
    assert capsys.readouterr().out == ""


def test_wandb_disabled_never_imports_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` would now raise
    with MetricsWriter(tmp_path, QUIET, total_steps=1, enabled=True) as writer:
        writer.record(1, {"loss": 1.0})
    assert not (tmp_path / "wandb").exists()


def test_wandb_offline_writes_under_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: the writer passes mode="offline" itself
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = LogConfig(progress=False, wandb="offline", wandb_project="shardlab-test")
    with MetricsWriter(tmp_path, log, total_steps=2, enabled=True, config_dict={"lr": 1e-3}, name="t") as writer:
        writer.record(1, {"loss": 2.0})
        writer.record(2, {"loss": 1.0})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_record_needs_a_loss(tmp_path: Path):
    with (
        MetricsWriter(tmp_path, QUIET, total_steps=1, enabled=True) as writer,
        pytest.raises(ValueError, match=r"MetricsWriter.record: values has no 'loss'"),
    ):
        writer.record(1, {"lr": 1.0})


def test_format_line_shows_known_keys_in_order_then_the_rest():
    values = {"aux": 0.5, "lr": 1e-4, "peak_memory_bytes": 1.5 * 2**30, "mfu": 0.412, "grad_norm": 0.8, "loss": 3.0}
    assert format_line(7, 9, values) == (
        "step 7/9 | loss 3.0000 | mfu 41.2% | mem 1.50 GiB | grad_norm 0.800 | lr 1.00e-04 | aux 0.5"
    )


def test_throughput_helpers():
    assert flops_per_token(n_params=1000, n_layers=2, dim=8, seq_len=16) == 6 * 1000 + 12 * 2 * 8 * 16
    assert mfu(100.0, 1e9, None) is None
    assert mfu(100.0, 1e9, 1e12) == pytest.approx(0.1)
    assert peak_memory_bytes(torch.device("cpu")) > 2**20


def test_a_resumed_run_drops_the_torn_tail_and_the_steps_after_its_checkpoint(tmp_path):
    """A kill in the middle of a write leaves half a JSON object at the end of metrics.jsonl; resuming from step 2
    keeps steps 1-2, drops step 3 (after the checkpoint) and the torn line, and appends from step 3 again."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    with MetricsWriter(tmp_path, QUIET, total_steps=4, enabled=True, start_step=2) as writer:
        writer.record(3, {"loss": 1.5})
    assert [(row["step"], row["loss"]) for row in lines(tmp_path)] == [(1, 4.0), (2, 3.0), (3, 1.5)]


def test_profile_step_traces_that_step_on_every_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """log.profile_step writes the step's Chrome trace (its matmuls and the optimizer in it) and prints the top ops;
    other steps are not traced."""
    from shardlab.config import Config, DataConfig, MeshSpec, ModelConfig, TrainConfig
    from shardlab.training.loop import train

    cfg = Config(
        mesh=MeshSpec(dp_shard=1),
        model=ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=300),
        train=TrainConfig(steps=2, seq_len=16, global_batch=2, run_dir=str(tmp_path)),
        log=LogConfig(wandb="disabled", progress=False, profile_step=2),
        data=DataConfig(source="synthetic"),
    )
    train(cfg)
    events = json.loads((tmp_path / "profile" / "rank0.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names, sorted(n for n in names if n)[:40]
    assert "Self CPU" in capsys.readouterr().out
    assert list((tmp_path / "profile").iterdir()) == [tmp_path / "profile" / "rank0.json"]
    trace = str(tmp_path / "profile" / "rank0.json")
    script = Path(__file__).resolve().parents[1] / "scripts" / "compare_profiles.py"
    out = subprocess.run(
        [sys.executable, script, trace, trace, "--top", "1000"], capture_output=True, text=True, check=True
    ).stdout
    mm = next(line.split() for line in out.splitlines() if line.startswith("aten::mm "))
    assert mm[2] == mm[4] != "0" and mm[5] == "0.0", out  # the same trace twice: same calls, no difference
