"""Supervised fine-tuning of a local transformers causal LM on chat data, FSDP 2 x TP 2 (+SP, loss parallel) on 4
ranks, from the directory's weights:

    python scripts/make_chat_model.py /tmp/chat            # a small model, its tokenizer and chat.jsonl
    python -m shardlab recipes/sft_hf.py --model.hf-path /tmp/chat/model --data.paths /tmp/chat/chat.jsonl

Each JSONL line (or dataset row) holds `messages` ([{role, content}]); the model directory's tokenizer renders them
with its chat template and the loss learns the assistant's tokens only. Each row holds whole conversations (and
padding at its end), kept apart by document masks, so none attends to another."""

from shardlab import Config, DataConfig, MeshSpec, ModelConfig, OptimConfig, PlanConfig, TrainConfig

config = Config(
    name="sft_hf",
    mesh=MeshSpec(dp_shard=2, tp=2),
    model=ModelConfig(hf_path="path/to/model"),
    plan=PlanConfig(sequence_parallel=True, loss_parallel=True),
    data=DataConfig(source="files", paths=("path/to/chat.jsonl",), format="chat", document_masks=True),
    optim=OptimConfig(lr=3e-3, warmup_steps=5, weight_decay=0.0),
    train=TrainConfig(steps=40, global_batch=16, seq_len=128),
)
