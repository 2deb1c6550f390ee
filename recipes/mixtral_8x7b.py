"""Mixtral 8x7B's shapes (46.7B parameters, 12.9B active): 8 SwiGLU experts, top 2, on every layer. Experts over
ep 8 (borrowed from dp_shard, within a node), FSDP over the rest; bf16 compute, full activation checkpointing. For `plan`, `estimate` and GPU clusters (e.g. --world 64); exports as a Hugging Face Mixtral."""

from shardlab import Config, MeshSpec, ModelConfig, MoEConfig, OptimConfig, PlanConfig, TrainConfig

MIXTRAL_8X7B = ModelConfig(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000, norm_eps=1e-5, rope_theta=1e6,
    moe=MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=14336, aux_loss_coef=0.02),
)  # fmt: skip

config = Config(
    name="mixtral_8x7b",
    mesh=MeshSpec(dp_shard=-1, ep=8),
    model=MIXTRAL_8X7B,
    plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32", activation_checkpoint="full"),
    optim=OptimConfig(lr=1e-4, warmup_steps=200),
    train=TrainConfig(steps=1000, global_batch=256, seq_len=4096, device="cuda", init="sharded"),
)
