"""shardlab's step against the same placements written by hand (`parallelize_module` + `fully_shard`, torch's
AdamW and `clip_grad_norm_`): what the planner, `apply` and `make_step` cost beyond torch itself.

    python scripts/bench_overhead.py                 # FSDP 2, TP 2 (+SP, loss parallel), FSDP 2 x TP 2; fp32
    python scripts/bench_overhead.py --layouts fsdp2 --steps 12 --seq-len 512

Every rank of one gloo world builds both models from the same seed (shardlab's Llama debug model) and runs them
interleaved A B B A, `--steps` steps each (the first two are warm-up, not timed), on the same batches. Both must
reach the same losses (1e-5), which checks that the hand-written layout is the plan's. Prints each run's step
time and the mean ratio shardlab / hand-written of step time per layout (goal: <= 1.02).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _worlds import arguments, join, report, run_worlds
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from shardlab.config import Config, DataConfig, LogConfig, MeshSpec, ModelConfig, OptimConfig, TrainConfig
from shardlab.data.loader import make_loader
from shardlab.models.llama.provider import LlamaProvider
from shardlab.training.loop import build_model
from shardlab.training.step import init_state, lr_schedule, make_step

LAYOUTS = {"fsdp2": (2, 1), "tp2": (1, 2), "fsdp2xtp2": (2, 2)}
"""name -> (dp_shard, tp)."""


def config(dp: int, tp: int, seq_len: int) -> Config:
    return Config(
        mesh=MeshSpec(dp_shard=dp, tp=tp),
        model=ModelConfig(),  # torchtitan's llama3 debug model
        optim=OptimConfig(lr=8e-4, weight_decay=0.1, max_norm=1.0),
        train=TrainConfig(steps=1000, global_batch=8, seq_len=seq_len),
        log=LogConfig(wandb="disabled", progress=False),
        data=DataConfig(source="stdlib"),
    )


def hand_written(cfg: Config, dp: int, tp: int):
    """torchtitan's layout for this model, written with torch's APIs: TP (+SP, loss parallel) inside, FSDP per
    block and at the root, fused AdamW (as shardlab), the mean cross-entropy over the global batch."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    provider = LlamaProvider(cfg.model)
    with torch.device("meta"):
        model = provider.build()
    provider.materialize(model, "cpu", cfg.train.seed)
    if tp > 1:
        block = {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
        plan = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
            **{f"model.layers.{i}.{k}": v for i in range(cfg.model.n_layers) for k, v in block.items()},
        }
        parallelize_module(model, mesh["tp"], plan)
    if dp > 1:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=0.1, fused=True)
    tokens = cfg.train.global_batch * cfg.train.seq_len

    def step(inputs: torch.Tensor, labels: torch.Tensor, lr: float) -> float:
        for g in opt.param_groups:
            g["lr"] = lr
        with loss_parallel() if tp > 1 else contextlib.nullcontext():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            (loss * dp / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
        if dp > 1:
            dist.all_reduce(total, group=mesh["dp_shard"].get_group())
        return (total / tokens).item()

    return step


def run(rank: int, world: int, port: int, a: argparse.Namespace, out: dict) -> None:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # torch's own clip, 2D mesh
    join(rank, world, port)
    for name in a.layouts:
        dp, tp = LAYOUTS[name]
        if dp * tp != world:
            continue
        cfg = config(dp, tp, a.seq_len)
        model, plan, mesh = build_model(cfg)
        ours, state = make_step(cfg, plan, mesh), init_state(model, cfg.optim)
        theirs = hand_written(cfg, dp, tp)
        loader = make_loader(
            cfg.data, seq_len=a.seq_len, global_batch=8, vocab_size=cfg.model.vocab_size,
            dp_rank=rank // tp, dp_size=dp,
        )  # fmt: skip
        batches = [loader.batch(i) for i in range(4 * a.steps)]
        lr_at = lr_schedule(cfg.optim, cfg.train.steps)
        times: dict[str, list[float]] = {"shardlab": [], "hand": []}
        losses: dict[str, list[float]] = {"shardlab": [], "hand": []}
        at = {"shardlab": 0, "hand": 0}
        for kind in ("shardlab", "hand", "hand", "shardlab"):
            dist.barrier()
            start = None
            for k in range(a.steps):
                if k == 2:
                    start = time.perf_counter()
                b = batches[at[kind]]
                if kind == "shardlab":
                    state, m = ours(state, b)
                    loss = m["loss"]
                else:
                    loss = theirs(b.inputs, b.labels, lr_at(at[kind]))
                losses[kind].append(loss)
                at[kind] += 1
            times[kind].append((time.perf_counter() - start) / (a.steps - 2))
        if rank == 0:
            out[name] = {"times": times, "losses": losses}
    dist.destroy_process_group()


def main() -> None:
    a = arguments(__doc__, LAYOUTS)
    report(run_worlds(run, LAYOUTS, a), "shardlab", "hand", "ratio")


if __name__ == "__main__":
    main()
