"""Llama 3.1 405B as torchtitan benchmarked it on 512 H100s (benchmarks/llama3_h100_202412_torchtitan.md,
Table 5): PP 8 x FSDP 8 x TP 8 (sequence and loss parallel), bf16, full activation checkpointing, global batch
256 (32 sequences of 8192 tokens per data-parallel rank, one per micro batch), interleaved 1F1B with 2 stages
per rank (16 stages of 7-8 blocks). For `plan` and `estimate` (running it needs train.init='sharded' with
pipelines, not supported yet):
python -m shardlab estimate recipes/llama3_405b_pp.py --world 512
python -m shardlab estimate recipes/llama3_405b_pp.py --world 512 --plan.pp-schedule 1f1b --plan.pp-stages-per-rank 1"""

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
        pp_microbatches=32,
    ),
    optim=OptimConfig(lr=8e-5, warmup_steps=600),
    train=TrainConfig(steps=1000, global_batch=256, seq_len=8192, device="cuda", init="sharded"),
)
