"""The main job: FSDP 2 x TP 2 on 4 CPU ranks (gloo), torchtitan's Llama layout stated as rules:
colwise q/k/v/gate/up, rowwise o/down, vocab-parallel embedding and head with loss parallel,
sequence-parallel norms, FSDP per block. Same loss curve as one rank (fp32)."""

from shardlab import Config, MeshSpec, PlanConfig, TrainConfig

config = Config(
    name="llama_fsdp_tp",
    mesh=MeshSpec(dp_shard=2, tp=2),
    plan=PlanConfig(sequence_parallel=True, loss_parallel=True),
    train=TrainConfig(steps=20, global_batch=8, seq_len=256),
)
