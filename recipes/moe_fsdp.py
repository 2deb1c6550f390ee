"""A mixture-of-experts Llama on 2 CPU ranks with FSDP: every block's MLP is 8 SwiGLU experts with a top-2
softmax router and the Switch load-balancing loss over the global batch (same loss curve as one rank, fp32).
metrics.jsonl records the balancing loss, the busiest expert's load and tokens per expert. Try
--model.moe.balance bias (DeepSeek-V3's auxiliary-loss-free balancing) or --model.moe.shared-expert True.
Expert parallelism: recipes/moe_ep.py."""

from shardlab import Config, MeshSpec, ModelConfig, MoEConfig, TrainConfig

config = Config(
    name="moe_fsdp",
    mesh=MeshSpec(dp_shard=2),
    model=ModelConfig(moe=MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=256)),
    train=TrainConfig(steps=20, global_batch=8, seq_len=256),
)
