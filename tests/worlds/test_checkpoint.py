"""Checkpoints across layouts (gloo): bitwise resume on the same layout; a checkpoint saved by one layout
continues on another (dp_shard 2 x tp 2 -> dp_shard 4, -> FSDP 2 on 2 ranks, -> one process, and one
process -> dp_shard 2 x tp 2) with the loss curve of an uninterrupted run within 1e-5; async saves commit."""

from pathlib import Path

import msgspec
import pytest

from shardlab.checkpoint import complete, step_dir
from shardlab.config import CheckpointConfig, Config, MeshSpec

from ._harness import run_world
from .layouts import TOL, curves, tiny

HALF = 5


def ckpt(
    cfg: Config, run_dir: Path, *, every: int | None = HALF, resume: str = "auto", async_save: bool = False
) -> Config:
    cfg = msgspec.structs.replace(cfg, train=msgspec.structs.replace(cfg.train, run_dir=str(run_dir)))
    return msgspec.structs.replace(cfg, checkpoint=CheckpointConfig(every=every, resume=resume, async_save=async_save))


def continue_from(cfg: Config, run_dir: Path, source: Path) -> list[float]:
    """Resume `cfg` from a checkpoint directory written by another layout; the losses of the steps after it."""
    return curves(ckpt(cfg, run_dir, every=None, resume=str(source)))["loss"]


def one_process_half(tmp: Path) -> Path:
    curves(ckpt(tiny(), tmp / "one"), until=HALF)
    return step_dir(tmp / "one" / "checkpoints", HALF)


def layouts(rank, world_size, tmp):
    tmp = Path(tmp)
    fsdp_tp = tiny(MeshSpec(dp_shard=2, tp=2))
    straight = curves(ckpt(fsdp_tp, tmp / "straight", every=None))["loss"]
    first = curves(ckpt(fsdp_tp, tmp / "split"), until=HALF)["loss"]
    second = curves(ckpt(fsdp_tp, tmp / "split"))["loss"]
    saved = step_dir(tmp / "split" / "checkpoints", HALF)
    return {
        "straight": straight,
        "split": first + second,
        "to_dp4": continue_from(tiny(MeshSpec(dp_shard=4)), tmp / "dp4", saved),
        "from_one_process": continue_from(fsdp_tp, tmp / "from_one", Path(tmp) / "one" / "checkpoints" / saved.name),
    }


def async_save(rank, world_size, tmp):
    tmp = Path(tmp)
    cfg = tiny(MeshSpec(dp_shard=2, tp=2))
    first = curves(ckpt(cfg, tmp / "async", every=2, async_save=True), until=6)["loss"]
    second = curves(ckpt(cfg, tmp / "async", every=2, async_save=True))["loss"]
    return {"losses": first + second, "committed": [p.name for p in complete(tmp / "async" / "checkpoints")]}


def to_fsdp2(rank, world_size, tmp):
    saved = step_dir(Path(tmp) / "split" / "checkpoints", HALF)
    return continue_from(tiny(MeshSpec(dp_shard=2)), Path(tmp) / "fsdp2", saved)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoints")
    one_process_half(path)
    return path


@pytest.fixture(scope="module")
def world4(tmp):
    return run_world(4, [layouts, async_save], timeout_s=600, tmp=str(tmp))


@pytest.fixture(scope="module")
def world2(tmp, world4):
    world4.raise_for(layouts)
    return run_world(2, [to_fsdp2], timeout_s=300, tmp=str(tmp))


def close(got: list[float], want: list[float], name: str) -> None:
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert len(got) == len(want) and diff <= TOL, f"{name}: max |loss diff| {diff:.2e}; {got} vs {want}"


@pytest.mark.world
def test_resume_is_bitwise_identical(world4):
    out = world4.value(layouts)
    assert out["split"] == out["straight"], (out["split"], out["straight"])


@pytest.mark.world
def test_dp2_tp2_checkpoint_continues_on_dp4(world4):
    out = world4.value(layouts)
    close(out["to_dp4"], out["straight"][HALF:], "dp2xtp2 -> dp4")


@pytest.mark.world
def test_one_process_checkpoint_continues_on_dp2_tp2(world4):
    out = world4.value(layouts)
    close(out["from_one_process"], out["straight"][HALF:], "1 -> dp2xtp2")


@pytest.mark.world
def test_dp2_tp2_checkpoint_continues_on_fsdp2(world2, world4):
    close(world2.value(to_fsdp2), world4.value(layouts)["straight"][HALF:], "dp2xtp2 -> fsdp2")


@pytest.mark.world
def test_dp2_tp2_checkpoint_continues_on_one_process(world4, tmp):
    saved = step_dir(tmp / "split" / "checkpoints", HALF)
    close(continue_from(tiny(), tmp / "to_one", saved), world4.value(layouts)["straight"][HALF:], "dp2xtp2 -> 1")


@pytest.mark.world
def test_async_saves_commit_and_resume_bitwise(world4):
    out, straight = world4.value(async_save), world4.value(layouts)["straight"]
    assert out["losses"] == straight
    assert out["committed"] == ["step-00000006", "step-00000008", "step-00000010"]  # keep=3
