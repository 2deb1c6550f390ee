"""A small local transformers model to fine-tune, with its tokenizer (chat template included) and chat data:

    python scripts/make_chat_model.py OUT [--seed 0]

writes OUT/model (config.json, model.safetensors, tokenizer files: a byte-level BPE trained here on the data, a
Llama-3-style chat template without generation marks) and OUT/chat.jsonl (arithmetic questions and their answers as
`messages`). Nothing is downloaded. Then `python -m shardlab recipes/sft_hf.py --model.hf-path OUT/model
--data.paths OUT/chat.jsonl` fine-tunes it from its weights on 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    """n short exchanges: a sum to compute, answered with its digits and a word."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        turns = [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
        if rng.random() < 0.5:
            turns = [{"role": "system", "content": "Answer with the number."}, *turns]
        out.append(turns)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=2000)
    args = parser.parse_args()
    import tokenizers
    import torch
    import transformers

    chats = conversations(args.conversations, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIAL, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([m["content"] for c in chats for m in c], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = TEMPLATE
    torch.manual_seed(args.seed)
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(args.out / "model")
    fast.save_pretrained(args.out / "model")
    print(f"wrote {args.out / 'model'} and {args.out / 'chat.jsonl'} ({len(chats)} conversations)")


if __name__ == "__main__":
    main()
