"""Expert parallelism on 4 CPU ranks: 8 experts per layer, ep 4 of FSDP 4, so each rank holds 2 experts of every
layer and tokens travel to them by all-to-all (and back). The rest of the model is FSDP 4. Top-2 softmax router
with the Switch balancing loss over the global batch: the same loss curve as one rank (fp32). Try --mesh.ep 2:
then 2 ranks hold each expert and FSDP shards it between them (dp_shard_mod_ep)."""

from shardlab import Config, MeshSpec, ModelConfig, MoEConfig, TrainConfig

config = Config(
    name="moe_ep",
    mesh=MeshSpec(dp_shard=4, ep=4),
    model=ModelConfig(moe=MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=256)),
    train=TrainConfig(steps=20, global_batch=8, seq_len=256),
)
