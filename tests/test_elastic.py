"""Runs that are stopped or lose a rank come back where they were: SIGTERM (preemption) makes every rank finish its
step, the run save it and stop with EXIT_STOPPED, and the next start continues bitwise as if nothing had happened;
with --max-restarts, a rank that dies mid-run brings the world back from the last checkpoint, with the same losses.

One process in this process (~3 s), then the CLI under shardlab's own launcher on 4 gloo ranks (marked world:
four launches, ~15-30 s each on 2 busy cores): a preempted run and its next start, and a run that loses a rank and
restarts; each matches one process, and the two match each other bit for bit.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlab._faults import FAULT_ENV
from shardlab.cli.torchrun import EXIT_STOPPED
from shardlab.config import CheckpointConfig, Config, DataConfig, LogConfig, MeshSpec, ModelConfig, TrainConfig
from shardlab.training import loop
from shardlab.training._preemption import Preempted
from shardlab.training.checkpoint import complete

ROOT = Path(__file__).resolve().parents[1]


def tiny(run_dir: Path, steps: int = 6, every: int | None = None) -> Config:
    return Config(
        mesh=MeshSpec(dp_shard=1),
        model=ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=300),
        train=TrainConfig(steps=steps, seq_len=32, global_batch=4, run_dir=str(run_dir)),
        log=LogConfig(wandb="disabled", progress=False),
        data=DataConfig(source="synthetic"),
        checkpoint=CheckpointConfig(every=every),
    )


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture
def sigterm_during(monkeypatch):
    """sigterm_during(k): this process sends itself SIGTERM in the middle of step k (after the forward and backward,
    before the step returns), as a cluster's preemption would arrive at any moment."""

    def arm(k: int) -> None:
        make_step = loop.make_step

        def signalling(*args, **kwargs):
            step = make_step(*args, **kwargs)

            def run(state, batch):
                out = step(state, batch)
                if out[0].step == k:
                    os.kill(os.getpid(), signal.SIGTERM)
                return out

            return run

        monkeypatch.setattr(loop, "make_step", signalling)

    return arm


def test_sigterm_saves_the_step_and_the_next_start_continues_bitwise(tmp_path, sigterm_during, monkeypatch):
    """Without checkpoint.every, SIGTERM during step 3 still saves step 3; the SIGTERM handler is the caller's
    again afterwards; the resumed run's steps 4 to 6 equal an uninterrupted run's, bitwise."""
    straight = loop.train(tiny(tmp_path / "straight"))
    before = signal.getsignal(signal.SIGTERM)
    sigterm_during(3)
    with pytest.raises(Preempted) as stop:
        loop.train(tiny(tmp_path / "run"))
    checkpoints = tmp_path / "run" / "checkpoints"
    assert str(stop.value) == f"stopped by SIGTERM after step 3; checkpoint saved: {checkpoints / 'step-00000003'}"
    assert [p.name for p in complete(checkpoints)] == ["step-00000003"]
    assert signal.getsignal(signal.SIGTERM) is before
    monkeypatch.undo()
    resumed = loop.train(tiny(tmp_path / "run"))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight[3:]]
    assert losses(tmp_path / "run") == losses(tmp_path / "straight")


def test_sigterm_during_the_last_step_ends_the_run_as_usual(tmp_path, sigterm_during):
    """Nothing is left to stop: the run finishes (and saves its last step, as every=2 asks) without Preempted."""
    sigterm_during(6)
    assert len(loop.train(tiny(tmp_path, every=2), write=False)) == 6
    assert [p.name for p in complete(tmp_path / "checkpoints")] == ["step-00000002", "step-00000004", "step-00000006"]


def test_request_stop_stops_a_run_off_the_main_thread_as_sigterm_does(tmp_path, monkeypatch):
    """Ray Train runs a rank in a thread, where no SIGTERM handler can be installed: `request_stop` (what the Ray
    launch calls when the driver gets SIGTERM) stops it after the step, with the step saved."""
    import threading

    from shardlab.training._preemption import request_stop

    make_step = loop.make_step

    def requesting(*args, **kwargs):
        step = make_step(*args, **kwargs)

        def run(state, batch):
            out = step(state, batch)
            if out[0].step == 2:
                request_stop()
            return out

        return run

    monkeypatch.setattr(loop, "make_step", requesting)
    outcome = {}

    def rank() -> None:
        try:
            loop.train(tiny(tmp_path))
        except Preempted as stopped:
            outcome["stopped"] = stopped

    thread = threading.Thread(target=rank)
    thread.start()
    thread.join(120)
    checkpoints = tmp_path / "checkpoints"
    assert (
        str(outcome["stopped"]) == f"stopped by SIGTERM after step 2; checkpoint saved: {checkpoints / 'step-00000002'}"
    )
    assert [p.name for p in complete(checkpoints)] == ["step-00000002"]
    request_stop()  # no run is open now: nothing to stop, nothing raised


def test_the_cli_says_where_it_stopped_and_exits_75(tmp_path, sigterm_during, capsys, monkeypatch):
    from shardlab.cli.main import main

    monkeypatch.chdir(ROOT)
    sigterm_during(2)
    assert main(["recipes/llama_debug.py", *TINY, "--train.run-dir", str(tmp_path)]) == EXIT_STOPPED == 75
    last = capsys.readouterr().out.splitlines()[-1]
    assert (
        last
        == f"shardlab: stopped by SIGTERM after step 2; checkpoint saved: {tmp_path / 'checkpoints' / 'step-00000002'}"
    )


TINY = ["--model.dim", "32", "--model.n-layers", "1", "--model.n-heads", "2", "--model.n-kv-heads", "1",
        "--model.ffn-dim", "64", "--model.vocab-size", "300", "--train.seq-len", "32", "--train.global-batch", "4",
        "--data.source", "synthetic", "--log.wandb", "disabled", "--log.no-progress", "--train.steps", "16"]  # fmt: skip
"""4 ranks (dp_shard 4), 16 steps of ~0.2 s: a signal sent after step 2 lands with most of the run still to go."""
STEPS = 16


def launch(run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "shardlab", "recipes/llama_debug.py", *TINY, "--mesh.dp-shard", "4",
            "--train.run-dir", str(run_dir), *extra]  # fmt: skip
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "SHARDLAB_TRACEBACK"}
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def preempted(tmp_path_factory) -> tuple[Path, int, str, str, dict[int, float]]:
    """SIGTERM to `python -m shardlab` (the process a cluster signals) after its second step, then the next start:
    (run dir, exit code and output of the stopped run, the losses of the whole run)."""
    run_dir = tmp_path_factory.mktemp("preempted")
    proc = launch(run_dir)
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)
    again = finish(launch(run_dir))
    assert again[0] == 0, again[1][-2000:] + again[2][-2000:]
    return run_dir, code, out, err, losses(run_dir)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory) -> tuple[str, dict[int, float]]:
    """Rank 1 dies after step 5 (saved every 2 steps) on the first attempt, under --max-restarts 2: (the first
    process's stderr, the losses of the whole run)."""
    run_dir = tmp_path_factory.mktemp("restarted")
    proc = launch(run_dir, "--checkpoint.every", "2", "--checkpoint.resume", "none", "--max-restarts", "2",
                  env={FAULT_ENV: "step:5@1"})  # fmt: skip
    code, out, err = finish(proc)
    assert code == 0, out[-2000:] + err[-2000:]
    return err, losses(run_dir)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[float]:
    """The same command on one process, in this process (the 4-rank runs match it within 1e-5)."""
    from shardlab.cli.main import main

    run_dir = tmp_path_factory.mktemp("one")
    assert main([str(ROOT / "recipes" / "llama_debug.py"), *TINY, "--train.run-dir", str(run_dir)]) == 0
    return [losses(run_dir)[k] for k in range(1, STEPS + 1)]


@pytest.mark.world
def test_sigterm_to_the_first_process_reaches_the_ranks_and_they_save(preempted, one_process):
    """torchrun passes SIGTERM on, the 4 ranks stop after the same step and save it, the first process prints one
    line and exits EXIT_STOPPED; the next start finishes the run."""
    run_dir, code, out, err, got = preempted
    assert code == EXIT_STOPPED, out[-2000:] + err[-2000:]
    assert err == ""
    saved = complete(run_dir / "checkpoints")
    assert len(saved) == 1
    step = int(saved[0].name.removeprefix("step-"))
    assert 2 <= step < STEPS
    assert out.splitlines()[-1] == f"shardlab: stopped by SIGTERM after step {step}; checkpoint saved: {saved[0]}"
    assert max(abs(got[k + 1] - want) for k, want in enumerate(one_process)) <= 1e-5


@pytest.mark.world
def test_a_rank_killed_mid_run_is_restarted_from_the_last_checkpoint(restarted, one_process):
    """--max-restarts brings all 4 ranks back after rank 1 dies; they resume from step 4 (a restart always resumes
    auto, here over checkpoint.resume=none), and the run ends with one line per step, after one warning line naming
    the rank."""
    err, got = restarted
    assert err.splitlines() == [
        "warning: rank 1: exited with code 17 and reported no error; restart 1 of 2, from the last checkpoint"
    ]
    assert max(abs(got[k + 1] - want) for k, want in enumerate(one_process)) <= 1e-5


@pytest.mark.world
def test_stopped_and_restarted_runs_are_the_uninterrupted_run_bitwise(preempted, restarted):
    """Stopped after step 2 or 3 by SIGTERM, or losing a rank after step 5 and resuming from step 4: both runs log
    the same losses, bit for bit, for every step (each equals the uninterrupted run's, which the two share)."""
    assert preempted[-1] == restarted[-1]
    assert sorted(restarted[-1]) == list(range(1, STEPS + 1))
