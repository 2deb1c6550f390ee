"""Llama 3.1 70B, torchtitan's layout: FSDP over dp_shard x TP 8 (within a node) with sequence and
loss parallel, bf16 compute, full activation checkpointing. For `plan` and GPU clusters (e.g. --world 256)."""

from shardlab import Config, MeshSpec, OptimConfig, PlanConfig, TrainConfig, llama_config

config = Config(
    name="llama3_70b",
    mesh=MeshSpec(dp_shard=-1, tp=8),
    model=llama_config("70B"),
    plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32", activation_checkpoint="full"),
    optim=OptimConfig(lr=1.5e-4, warmup_steps=200),
    train=TrainConfig(steps=1000, global_batch=256, seq_len=8192, device="cuda", init="sharded"),
)
