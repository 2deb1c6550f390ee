"""HSDP x TP on 8 ranks: replicate over dp_replicate 2, shard over dp_shard 2, tensor parallel 2.

On a 2-core machine 8 ranks are slow: this recipe is short; on GPUs raise the steps."""

from shardlab import Config, MeshSpec, TrainConfig

config = Config(
    name="llama_hsdp_tp",
    mesh=MeshSpec(dp_replicate=2, dp_shard=2, tp=2),
    train=TrainConfig(steps=5, global_batch=8, seq_len=256),
)
