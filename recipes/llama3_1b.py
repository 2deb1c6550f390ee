"""Llama 3.2 1B on one GPU (or FSDP over several): bf16 compute with fp32 master weights and reductions,
seq 2048, 4 sequences per rank, no activation checkpointing. The model `scripts/bench_gpu.py` times."""

from shardlab import Config, MeshSpec, OptimConfig, PlanConfig, TrainConfig, llama_config

config = Config(
    name="llama3_1b",
    mesh=MeshSpec(dp_shard=-1),
    model=llama_config("1B"),
    plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32"),
    optim=OptimConfig(lr=3e-4, warmup_steps=20),
    train=TrainConfig(steps=50, global_batch=4, seq_len=2048, device="cuda"),
)
