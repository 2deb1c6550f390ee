"""Your own training loop around shardlab's pieces: model -> plan -> apply -> step.

torchrun --nproc-per-node 4 examples/own_loop.py      # FSDP 2 x TP 2 on 4 CPU ranks
python examples/own_loop.py                           # one process (set MESH below to 1 rank)
"""

import os

import torch
import torch.distributed as dist

import shardlab
from shardlab.data.loader import make_loader

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
MESH = shardlab.MeshSpec(dp_shard=-1, tp=2 if WORLD % 2 == 0 and WORLD > 1 else 1).resolve(WORLD)


def main() -> None:
    if WORLD > 1:
        dist.init_process_group("gloo")
    cfg = shardlab.Config(
        mesh=MESH,
        model=shardlab.ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=512),
        train=shardlab.TrainConfig(steps=10, global_batch=8, seq_len=128),
    )
    with torch.device("meta"):
        model = shardlab.Llama(cfg.model)
    plan = shardlab.make_plan(model, cfg.mesh, shardlab.llama_rules(cfg.model, cfg.plan), cfg.plan)
    if RANK == 0:
        print(plan.table())
    model.to_empty(device="cpu")
    torch.manual_seed(cfg.train.seed)
    model.init_weights()
    mesh = None
    if WORLD > 1:
        mesh = shardlab.make_mesh(cfg.mesh)
        shardlab.parallel.apply(model, plan, mesh)
    step = shardlab.make_step(cfg, plan, mesh)
    state = shardlab.init_state(model, cfg.optim)
    loader = make_loader(
        cfg.data,
        seq_len=cfg.train.seq_len,
        global_batch=cfg.train.global_batch,
        vocab_size=cfg.model.vocab_size,
        dp_rank=cfg.mesh.group_index(RANK, ("dp",)),
        dp_size=cfg.mesh.size("dp"),
        micro_batches=cfg.micro_batches,
    )
    for batch in loader:
        state, metrics = step(state, batch)
        if RANK == 0:
            print(f"step {state.step}: loss {metrics['loss']:.4f} grad_norm {metrics['grad_norm']:.3f}")
        if state.step == cfg.train.steps:
            break
    if WORLD > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
