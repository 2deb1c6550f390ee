"""Any local transformers causal LM (Llama, Qwen2/Qwen3, Mistral, Gemma 3 text, Phi-3, ...), FSDP 2 x TP 2 (+SP,
loss parallel) on 4 ranks, its layout derived from transformers' own TP plan:

    python -m shardlab recipes/hf_causal_lm.py --model.hf-path DIR

DIR holds config.json and, to start from trained weights, safetensors (each rank reads only its shards);
--model.from-scratch starts from the seed instead. `python -m shardlab plan recipes/hf_causal_lm.py --model.hf-path
DIR` prints the derived layout."""

from shardlab import Config, MeshSpec, ModelConfig, OptimConfig, PlanConfig, TrainConfig

config = Config(
    name="hf_causal_lm",
    mesh=MeshSpec(dp_shard=2, tp=2),
    model=ModelConfig(hf_path="path/to/model"),
    plan=PlanConfig(sequence_parallel=True, loss_parallel=True),
    optim=OptimConfig(lr=1e-5, warmup_steps=2, weight_decay=0.0),
    train=TrainConfig(steps=20, global_batch=8, seq_len=256),
)
