"""3-D parallelism on 8 CPU ranks: pipeline 2 x FSDP 2 x TP 2 (sequence and loss parallel), 1F1B over 2 micro
batches per data-parallel rank. Same loss curve as one rank (fp32)."""

from shardlab import Config, MeshSpec, PlanConfig, TrainConfig

config = Config(
    name="llama_3d",
    mesh=MeshSpec(pp=2, dp_shard=2, tp=2),
    plan=PlanConfig(sequence_parallel=True, loss_parallel=True, pp_schedule="1f1b"),
    train=TrainConfig(steps=20, global_batch=8, seq_len=256),
)
