"""Expert and tensor parallelism together on 4 CPU ranks: ep 2 x tp 2 (with FSDP 2 for the rest). Each ep rank
holds 4 of the 8 experts of every layer, and tp splits each expert's hidden dim (gate/up by rows, down by
columns), as it splits attention and the shared expert; sequence parallelism gathers the residual around the
MoE layer. Same loss curve as one rank (fp32)."""

from shardlab import Config, MeshSpec, ModelConfig, MoEConfig, TrainConfig

config = Config(
    name="moe_ep_tp",
    mesh=MeshSpec(dp_shard=2, tp=2, ep=2),
    model=ModelConfig(moe=MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=256, shared_expert=True)),
    train=TrainConfig(steps=20, global_batch=8, seq_len=256),
)
