"""Llama 3.1 405B: FSDP over dp_shard x TP 8 with sequence and loss parallel, bf16, full activation
checkpointing, 2 sequences per micro batch (with pipeline stages: llama3_405b_pp.py). Try: python -m shardlab plan
recipes/llama3_405b.py --world 4096"""

from shardlab import Config, MeshSpec, OptimConfig, PlanConfig, TrainConfig, llama_config

config = Config(
    name="llama3_405b",
    mesh=MeshSpec(dp_shard=-1, tp=8),
    model=llama_config("405B"),
    plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32", activation_checkpoint="full"),
    optim=OptimConfig(lr=8e-5, warmup_steps=600),
    train=TrainConfig(steps=1000, global_batch=2048, seq_len=8192, micro_batch=2, device="cuda", init="sharded"),
)
