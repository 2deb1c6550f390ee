"""Qwen2.5-72B with its published config.json values written here (nothing is downloaded; q/k/v carry biases):
FSDP over dp_shard x TP 8 (+SP, loss parallel) from the layout shardlab derives from transformers' TP plan, bf16
compute, full activation checkpointing. For `plan` and `estimate` (e.g. --world 512)."""

from shardlab import Config, HFCausalLM, MeshSpec, OptimConfig, PlanConfig, TrainConfig

model = HFCausalLM.from_dict(
    {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    source="Qwen2.5-72B",
)
config = Config(
    name="qwen2_5_72b",
    mesh=MeshSpec(dp_shard=-1, tp=8),
    plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32", activation_checkpoint="full"),
    optim=OptimConfig(lr=1e-5, warmup_steps=100, weight_decay=0.0),
    train=TrainConfig(steps=1000, global_batch=512, seq_len=8192, device="cuda"),
)
