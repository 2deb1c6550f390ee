"""Context parallelism on 4 CPU ranks: cp 2 x FSDP 2 (FSDP shards over dp_shard x cp). Each cp rank holds two
of the four chunks of every 256-token sequence (a head and a tail, so causal attention costs both the same);
attention all-gathers K and V over cp. Same loss curve as one rank (fp32)."""

from shardlab import Config, MeshSpec, TrainConfig

config = Config(
    name="llama_cp",
    mesh=MeshSpec(dp_shard=2, cp=2),
    train=TrainConfig(steps=20, global_batch=8, seq_len=256),
)
