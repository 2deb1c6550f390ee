"""Your own nn.Module, trained by the CLI: a GPT written from scratch (head-major fused QKV, learned positions,
LayerNorm, GELU MLP), FSDP 2 x TP 2 (+SP, loss parallel) on 4 ranks from a factory and 15 lines of rules.

    python -m shardlab recipes/custom_gpt.py
    python -m shardlab plan recipes/custom_gpt.py
    python -m shardlab export runs/custom_gpt --to-hf gpt2_out --recipe recipes/custom_gpt.py

The model's hyperparameters are CustomModel's keyword arguments; every module draws its weights in its own
reset_parameters() (seeded per module name, so every layout starts from the same model). The model is GPT-2's
(exact GELU, untied head), so `hf=` exports it as transformers' GPT2LMHeadModel."""

import torch
import torch.nn.functional as F
from torch import nn

from shardlab import Activation, Config, CustomModel, HFExport, MeshSpec, PlanConfig, Rule, Rules, TrainConfig


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim)  # rows are head-major: [head][q, k, v][head_dim], so TP splits by heads
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, 3, self.head_dim).transpose(1, 2).unbind(3)  # -1: the local heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = (
            nn.LayerNorm(dim),
            Attention(dim, n_heads),
            nn.LayerNorm(dim),
            MLP(dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """tokens [b, s] -> logits [b, s, vocab_size]."""

    def __init__(self, vocab_size: int, dim: int, n_layers: int, n_heads: int, max_seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, dim), nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


RESIDUAL, FULL = ("batch", "residual_seq", "embed"), ("batch", "seq", "embed")


def gpt_rules(plan: PlanConfig) -> Rules:
    """torchtitan's layout for this model: colwise qkv/fc, rowwise proj, vocab-parallel wte and head, SP norms."""
    colwise = {"attn.qkv": "heads", "mlp.fc": "mlp"}
    return Rules(
        params=(
            Rule(pattern="wte.weight", axes=("vocab", "embed")),
            Rule(pattern="head.weight", axes=("vocab", "embed")),
            *(Rule(pattern=f"blocks.*.{m}.weight", axes=(n, "embed")) for m, n in colwise.items()),
            *(Rule(pattern=f"blocks.*.{m}.bias", axes=(n,)) for m, n in colwise.items()),
            Rule(pattern="blocks.*.attn.proj.weight", axes=("embed", "heads")),
            Rule(pattern="blocks.*.mlp.proj.weight", axes=("embed", "mlp")),
            Rule(pattern="**", spec=()),  # the rest (positions, norms, rowwise biases) is replicated over tp
        ),
        logical=(
            ("vocab", "tp"),
            ("heads", "tp"),
            ("mlp", "tp"),
            ("embed", None),
            ("seq", None),
            ("batch", ("dp_replicate", "dp_shard")),
            ("residual_seq", "tp" if plan.sequence_parallel else None),
            ("logits_vocab", "tp" if plan.loss_parallel else None),
        ),
        activations=(
            Activation(pattern="wte", output=FULL),  # positions are added to the whole sequence
            Activation(pattern="blocks.0", inputs=(FULL,), desired_inputs=(RESIDUAL,), local_output=True),
            Activation(pattern="**ln*", inputs=(RESIDUAL,), output=RESIDUAL, local_output=True),
            Activation(pattern="blocks.*.attn", inputs=(RESIDUAL,), desired_inputs=(FULL,)),
            Activation(pattern="blocks.*.mlp", inputs=(RESIDUAL,), desired_inputs=(FULL,)),
            Activation(pattern="blocks.*.*.proj", output=RESIDUAL),
            Activation(pattern="head", inputs=(RESIDUAL,), output=("batch", "seq", "logits_vocab")),
        ),
        fsdp_units=(("blocks.*",),),
        blocks=("blocks.*",),
    )


def gpt2_config(vocab_size: int, dim: int, n_layers: int, n_heads: int, max_seq: int) -> dict:
    """GPT's arguments as transformers' GPT2Config fields."""
    return dict(
        vocab_size=vocab_size, n_embd=dim, n_layer=n_layers, n_head=n_heads, n_positions=max_seq,
        activation_function="gelu", tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def gpt2_tensors(name: str, t: torch.Tensor, *, n_heads: int, **_) -> list[tuple[str, torch.Tensor]]:
    """One GPT parameter as GPT2LMHeadModel's: its names, Conv1D weights stored [in, out], q, k and v each whole."""
    if name == "head.weight":
        return [("lm_head.weight", t)]
    hf = "transformer." + name.replace("blocks.", "h.").replace("ln1", "ln_1").replace("ln2", "ln_2")
    hf = hf.replace("attn.qkv", "attn.c_attn").replace("proj", "c_proj").replace("mlp.fc", "mlp.c_fc")
    if ".attn.qkv." in name:  # head-major [head][q, k, v][head_dim] -> [q, k, v][head][head_dim]
        t = t.unflatten(0, (n_heads, 3, -1)).transpose(0, 1).flatten(0, 2)
    return [(hf, t.T if name.endswith("weight") and t.dim() == 2 and "blocks." in name else t)]


model = CustomModel(
    GPT,
    rules=gpt_rules,
    hf=HFExport("GPT2LMHeadModel", config=gpt2_config, tensors=gpt2_tensors),
    vocab_size=2048, dim=256, n_layers=4, n_heads=8, max_seq=256,
)  # fmt: skip
config = Config(
    name="custom_gpt",
    mesh=MeshSpec(dp_shard=2, tp=2),
    plan=PlanConfig(sequence_parallel=True, loss_parallel=True),
    train=TrainConfig(steps=20, global_batch=8, seq_len=256),
)
