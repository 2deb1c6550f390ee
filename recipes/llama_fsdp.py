"""FSDP over 2 CPU ranks: parameters, gradients and optimizer state sharded over dp_shard."""

from shardlab import Config, MeshSpec, TrainConfig

config = Config(
    name="llama_fsdp",
    mesh=MeshSpec(dp_shard=2),
    train=TrainConfig(steps=20, global_batch=8, seq_len=256),
)
