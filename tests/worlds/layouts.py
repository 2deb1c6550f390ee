"""Shared tiny config and the check functions the parity worlds run (importable by spawned ranks)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import msgspec
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardlab.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LogConfig,
    MeshSpec,
    ModelConfig,
    OptimConfig,
    PlanConfig,
    TrainConfig,
)
from shardlab.models.provider import ModelProvider
from shardlab.sharding.mesh import FLAT_VIEWS
from shardlab.training.loop import build_model, train

STEPS = 4
"""Enough for a curve: two warmup steps, then the loss falls by about 2 nats; a wrong gradient shows from step 2."""
MID = STEPS // 2
"""Where the checkpoint tests stop, save and resume."""
TOL = 1e-5
GRAD_NORM_TOL = 1e-4
"""The gradient norm sums squares over every parameter, after AdamW has amplified fp32 rounding for several steps;
TP's different summation order moves it by about 1e-5. A wrong gradient scale is off by at least 1/dp."""


def tiny(mesh: MeshSpec = MeshSpec(dp_shard=1), **plan: object) -> Config:
    """dim 64, 2 layers, GQA 4/2 heads, STEPS steps of 8 x 64 stdlib tokens, fp32."""
    return Config(
        mesh=mesh,
        model=ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512),
        plan=PlanConfig(**plan),
        optim=OptimConfig(lr=1e-2, warmup_steps=2),
        train=TrainConfig(steps=STEPS, seq_len=64, global_batch=8, run_dir="/tmp/shardlab-tests/{name}"),
        log=LogConfig(wandb="disabled", progress=False, every=1000),
        data=DataConfig(source="stdlib"),
    )


def curves(cfg: Config, until: int | None = None, provider: ModelProvider | None = None) -> dict[str, list[float]]:
    """Per-step loss and gradient norm (before clipping): a wrong gradient scale shows in the norm even
    where AdamW and clipping would hide it from the loss."""
    history = train(cfg, write=False, until=until, provider=provider)
    return {"loss": [m["loss"] for m in history], "grad_norm": [m["grad_norm"] for m in history]}


def layout_curves(layouts: dict[str, Config]) -> dict[str, dict[str, list[float]]]:
    """Every rank runs every layout; rank 0's curves come back to the test."""
    return {name: curves(cfg) for name, cfg in layouts.items()}


def assert_matches(
    got: dict[str, list[float]], want: dict[str, list[float]], name: str, tol: float = TOL, steps: int = STEPS
) -> None:
    """Loss of every step within `tol`, and gradient norm within GRAD_NORM_TOL (relative to max(1, |norm|))."""
    assert len(got["loss"]) == len(want["loss"]) == steps, name
    loss = max(abs(a - b) for a, b in zip(got["loss"], want["loss"]))
    assert loss <= tol, f"{name}: max |loss diff| {loss:.2e} > {tol}; {got['loss']} vs {want['loss']}"
    norm = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got["grad_norm"], want["grad_norm"]))
    assert norm <= GRAD_NORM_TOL, (
        f"{name}: max grad-norm diff {norm:.2e} > {GRAD_NORM_TOL}; {got['grad_norm']} vs {want['grad_norm']}"
    )


def placements_match_plan(rank: int, world_size: int, cfg: Config) -> None:
    """Each parameter's actual DTensor placements are the ones the Plan predicted."""
    model, plan, _ = build_model(cfg)
    for fqn, param in model.named_parameters():
        want = plan.param(fqn).placements
        on = plan.mesh.experts if plan.param(fqn).expert else plan.mesh  # expert weights: over EXPERT_AXES
        if isinstance(param, DTensor):
            by_axis = {}
            for name, placement in zip(param.device_mesh.mesh_dim_names, param.placements):
                for axis in FLAT_VIEWS.get(name, (name,)):  # FSDP over dp_shard_cp shards over both axes
                    by_axis[axis] = placement
            got = tuple(str(by_axis[a]) if a in by_axis else "R" for a in on.axis_names)
        else:
            got = ("R",) * len(on.axis_names)
        # size-1 axes are Replicate in the plan; compare the axes that matter
        sizes = on.axis_sizes
        got = tuple(g if s > 1 else "R" for g, s in zip(got, sizes))
        want = tuple(w if s > 1 else "R" for w, s in zip(want, sizes))
        if got != want:
            raise AssertionError(f"rank {rank} {fqn}: placements {got} but the plan says {want}")
        local = param.to_local().shape if isinstance(param, DTensor) else param.shape
        if tuple(local) != plan.param(fqn).local_shape and not plan.param(fqn).padded:
            raise AssertionError(
                f"rank {rank} {fqn}: local shape {tuple(local)} but the plan says {plan.param(fqn).local_shape}"
            )
    dist.barrier()


def with_micro_batch(cfg: Config, micro_batch: int) -> Config:
    return msgspec.structs.replace(cfg, train=msgspec.structs.replace(cfg.train, micro_batch=micro_batch))


def tied(cfg: Config) -> Config:
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, tie_embeddings=True))


def with_plan(cfg: Config, **plan: object) -> Config:
    return msgspec.structs.replace(cfg, plan=msgspec.structs.replace(cfg.plan, **plan))


def ckpt(cfg: Config, run_dir: Path, *, every: int | None, resume: str = "auto", async_save: bool = False) -> Config:
    """`cfg` writing to `run_dir`, saving every `every` steps, resuming as `resume` says."""
    cfg = msgspec.structs.replace(cfg, train=msgspec.structs.replace(cfg.train, run_dir=str(run_dir)))
    return msgspec.structs.replace(cfg, checkpoint=CheckpointConfig(every=every, resume=resume, async_save=async_save))


def continue_from(cfg: Config, run_dir: Path, source: Path) -> list[float]:
    """Resume `cfg` from a checkpoint directory written by another layout; the losses of the steps after it."""
    return curves(ckpt(cfg, run_dir, every=None, resume=str(source)))["loss"]


def write_documents(path: Path) -> Path:
    """Short documents (the paragraphs of the stdlib's argparse.py, 1 to 3 sequences of 64 bytes each, most
    shorter) as JSONL, so packed rows of `tiny` hold several."""
    source = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    paragraphs = [p for p in source.read_text().split("\n\n") if p.strip()]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    return path


def packed(cfg: Config, documents: Path | str) -> Config:
    """`cfg` reading `documents` packed with document masks."""
    data = DataConfig(source="files", paths=(str(documents),), document_masks=True)
    return msgspec.structs.replace(cfg, data=data)
