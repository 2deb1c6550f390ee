"""Llama 3.1 405B as torchtitan runs it on 512 H100s: PP 8 x FSDP 8 x TP 8 (sequence and loss parallel), bf16,
full activation checkpointing, interleaved 1F1B with 2 stages per rank (16 stages of 7-8 blocks) and 16 micro
batches per data-parallel rank. For `plan` until pipelines run (issue 4):
python -m shardlab plan recipes/llama3_405b_pp.py --world 512"""

from shardlab import Config, MeshSpec, OptimConfig, PlanConfig, TrainConfig, llama_config

config = Config(
    name="llama3_405b_pp",
    mesh=MeshSpec(pp=8, dp_shard=-1, tp=8),
    model=llama_config("405B"),
    plan=PlanConfig(
        param_dtype="bfloat16",
        reduce_dtype="float32",
        activation_checkpoint="full",
        pp_schedule="interleaved_1f1b",
        pp_stages_per_rank=2,
    ),
    optim=OptimConfig(lr=8e-5, warmup_steps=600),
    train=TrainConfig(steps=1000, global_batch=128, seq_len=8192, device="cuda", init="sharded"),
)
