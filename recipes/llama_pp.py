"""Pipeline parallelism on 2 CPU ranks: the debug model's 6 blocks in 2 stages, 1F1B over 4 micro batches.
Same loss curve as one rank (fp32). Try --plan.pp-schedule gpipe, or --mesh.dp-shard 2 --world 4 for PP x FSDP."""

from shardlab import Config, MeshSpec, PlanConfig, TrainConfig

config = Config(
    name="llama_pp",
    mesh=MeshSpec(pp=2, dp_shard=1),
    plan=PlanConfig(pp_schedule="1f1b", pp_microbatches=4),
    train=TrainConfig(steps=20, global_batch=8, seq_len=256),
)
