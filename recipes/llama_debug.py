"""One rank, fp32: the smallest end-to-end run (torchtitan's llama3 debug model on stdlib text)."""

from shardlab import Config, MeshSpec, TrainConfig

config = Config(
    name="llama_debug",
    mesh=MeshSpec(dp_shard=1),
    train=TrainConfig(steps=20, global_batch=8, seq_len=256),
)
