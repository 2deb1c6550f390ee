"""Llama 3.1 8B as torchtitan lays it out on H100s: FSDP over every rank, bf16 compute with fp32 reductions,
seq 8192; activation checkpointing of every second block (torchtitan's default is op-level selective
checkpointing: `--plan.activation-checkpoint op`). For `python -m shardlab plan` and GPU clusters."""

from shardlab import Config, MeshSpec, OptimConfig, PlanConfig, TrainConfig, llama_config

config = Config(
    name="llama3_8b",
    mesh=MeshSpec(dp_shard=-1),
    model=llama_config("8B"),
    plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32", activation_checkpoint="selective"),
    optim=OptimConfig(lr=3e-4, warmup_steps=200),
    train=TrainConfig(steps=1000, global_batch=8, seq_len=8192, device="cuda"),
)
