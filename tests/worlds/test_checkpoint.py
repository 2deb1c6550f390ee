"""Checkpoints across layouts (gloo): bitwise resume on the same layout; a checkpoint saved by one layout
continues on another (dp_shard 2 x tp 2 -> dp_shard 4, -> FSDP 2 on 2 ranks, -> one process, and one
process -> dp_shard 2 x tp 2) with the loss curve of an uninterrupted run within 1e-5; async saves commit with a
manifest of every rank's files; resume=auto falls back past a checkpoint whose bytes no longer match it; SIGTERM on
one rank stops every rank after the same step, saved, and the run resumes from it bitwise."""

import functools
import json
import os
import signal
from pathlib import Path

import msgspec
import pytest
import torch.distributed as dist

from shardlab.config import Config, MeshSpec
from shardlab.training import loop
from shardlab.training._manifest import MANIFEST_FILE
from shardlab.training._preemption import Preempted
from shardlab.training.checkpoint import complete, damage, step_dir

from ._harness import run_world
from .layouts import TOL, continue_from, curves
from .layouts import ckpt as ckpt_every
from .layouts import tiny as tiny10

HALF = 4
ckpt = functools.partial(ckpt_every, every=HALF)
"""Checkpoints every HALF steps unless told otherwise."""


def tiny(mesh: MeshSpec = MeshSpec(dp_shard=1)) -> Config:
    """The parity model, run for 2 x HALF steps: straight, or HALF, stop, resume, HALF more."""
    cfg = tiny10(mesh)
    return msgspec.structs.replace(cfg, train=msgspec.structs.replace(cfg.train, steps=2 * HALF))


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
    first = curves(ckpt(cfg, tmp / "async", every=2, async_save=True), until=HALF)["loss"]
    second = curves(ckpt(cfg, tmp / "async", every=2, async_save=True))["loss"]
    last = complete(tmp / "async" / "checkpoints")[-1]
    return {
        "losses": first + second,
        "committed": [p.name for p in complete(tmp / "async" / "checkpoints")],
        "manifest": sorted(json.loads((last / MANIFEST_FILE).read_text())["files"]),
        "on_disk": sorted(p.name for p in last.iterdir() if p.name != MANIFEST_FILE),
        "damage": damage(last),  # collective: every rank checksums its share
    }


def fallback(rank, world_size, tmp):
    """Steps 3 and 6 saved by dp_shard 2 x tp 2, then one byte of rank 1's file of step 6 changed (rank 2
    checksums that file when 4 ranks resume): auto resumes from step 3 (steps 4 to 8 run), and every rank agrees."""
    tmp = Path(tmp)
    cfg = tiny(MeshSpec(dp_shard=2, tp=2))
    curves(ckpt(cfg, tmp / "fallback", every=3), until=6)
    if rank == 0:
        file = step_dir(tmp / "fallback" / "checkpoints", 6) / "__1_0.distcp"
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0x01
        file.write_bytes(bytes(data))
    dist.barrier()
    return curves(ckpt(cfg, tmp / "fallback", every=None), until=8)["loss"]


def sigterm_on_one_rank(rank, world_size, tmp):
    """Only rank 2 receives SIGTERM, during step 5: every rank stops after step 5 (the ranks agree by all-reduce), the
    run commits the async save of step 4 and saves step 5, and resuming runs steps 6 to 8 as the uninterrupted run
    did."""
    tmp = Path(tmp)
    cfg = ckpt(tiny(MeshSpec(dp_shard=2, tp=2)), tmp / "sigterm", every=4, async_save=True)
    make_step = loop.make_step

    def signalling(*args, **kwargs):
        step = make_step(*args, **kwargs)

        def run(state, batch):
            out = step(state, batch)
            if rank == 2 and out[0].step == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        return run

    loop.make_step = signalling
    try:
        loop.train(cfg, write=False)
        stopped_at = None
    except Preempted as stop:
        stopped_at = stop.step
    finally:
        loop.make_step = make_step
    every: list[int | None] = [None] * world_size
    dist.all_gather_object(every, stopped_at)
    return {"stopped_at": every, "committed": [p.name for p in complete(tmp / "sigterm" / "checkpoints")],
            "resumed": curves(cfg, until=8)["loss"]}  # fmt: skip


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
    return run_world(4, [layouts, async_save, fallback, sigterm_on_one_rank], timeout_s=600, tmp=str(tmp))


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
    assert out["committed"] == ["step-00000004", "step-00000006", "step-00000008"]  # keep=3
    assert out["manifest"] == out["on_disk"] and "__3_0.distcp" in out["manifest"]
    assert out["damage"] is None


@pytest.mark.world
def test_resume_auto_falls_back_past_a_corrupt_checkpoint_on_4_ranks(world4):
    assert world4.value(fallback) == world4.value(layouts)["straight"][3:8]


@pytest.mark.world
def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(world4):
    out = world4.value(sigterm_on_one_rank)
    assert out["stopped_at"] == [5, 5, 5, 5]
    assert out["committed"] == ["step-00000004", "step-00000005"]
    assert out["resumed"] == world4.value(layouts)["straight"][5:8]


@pytest.mark.world
def test_export_of_a_dp2_tp2_checkpoint_loads_in_transformers(world4, tmp):
    """`python -m shardlab export` turns a sharded DCP checkpoint into HF safetensors with the same logits."""
    transformers = pytest.importorskip("transformers")
    import torch

    from shardlab.cli.main import main
    from shardlab.data.loader import make_loader
    from shardlab.training.checkpoint import load
    from shardlab.training.loop import build_model
    from shardlab.training.step import init_state

    world4.raise_for(layouts)
    saved = step_dir(tmp / "split" / "checkpoints", HALF)
    assert main(["export", str(saved), "--to-hf", str(tmp / "hf")]) == 0
    cfg = tiny10()
    model, _, _ = build_model(cfg)
    loader = make_loader(cfg.data, seq_len=64, global_batch=8, vocab_size=512, dp_rank=0, dp_size=1)
    load(init_state(model, cfg.optim), loader, saved, cfg)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-5, rtol=0)
