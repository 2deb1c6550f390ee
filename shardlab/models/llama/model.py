"""Llama 3 (GQA, RoPE with Llama-3.1 scaling, RMSNorm, SwiGLU) built from a ModelConfig, with no parallel code.

Parameter names and the RoPE convention (rotate_half) are Hugging Face's, so a `LlamaForCausalLM` state_dict
loads by name. Every reshape infers the head count from the tensor, so tensor parallelism can hand the
modules local shards without changing this file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from shardlab._errors import ShardlabError
from shardlab.config import ModelConfig, MoEConfig, RopeScaling
from shardlab.data.packing import packed_mask
from shardlab.models.llama.moe import MoE
from shardlab.models.provider import Attend, param_seed


def _llama3(*, dim: int, n_layers: int, n_heads: int, ffn_dim: int, factor: float, tied: bool = False) -> ModelConfig:
    """A released Llama 3 shape: 8 kv heads, 128256-token vocabulary, theta 5e5, Llama-3.1 RoPE scaling."""
    return ModelConfig(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_dim=ffn_dim,
        vocab_size=128_256,
        norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=factor),
        tie_embeddings=tied,
    )


# The public Hugging Face config.json values: Llama 3.2 1B/3B, Llama 3.1 8B/70B/405B.
SIZES: dict[str, ModelConfig] = {
    "debug": ModelConfig(),
    "1B": _llama3(dim=2048, n_layers=16, n_heads=32, ffn_dim=8192, factor=32.0, tied=True),
    "3B": _llama3(dim=3072, n_layers=28, n_heads=24, ffn_dim=8192, factor=32.0, tied=True),
    "8B": _llama3(dim=4096, n_layers=32, n_heads=32, ffn_dim=14_336, factor=8.0),
    "70B": _llama3(dim=8192, n_layers=80, n_heads=64, ffn_dim=28_672, factor=8.0),
    "405B": _llama3(dim=16_384, n_layers=126, n_heads=128, ffn_dim=53_248, factor=8.0),
}


def llama_config(size: str, **overrides: Any) -> ModelConfig:
    """The named size, with `overrides` applied to its fields (validated like any ModelConfig)."""
    if size not in SIZES:
        raise ShardlabError(f"model size {size!r} is unknown; choose one of {', '.join(SIZES)}")
    return msgspec.structs.replace(SIZES[size], **overrides)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2], bit-identical to transformers' "default" and "llama3" rope types."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    low_freq_wavelen = rs.original_max_position / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Attention over the whole (local) sequence, each query seeing the keys at or before it: [b, heads, s, hd].
    k and v may have fewer (grouped) heads. `positions` [s] are 0..s-1; [b, s] are packed rows' positions in their
    documents, and a query sees only its own document (`shardlab.data.packing`). Context parallelism passes
    `Attention` another one, which gathers the other ranks' keys and masks by position."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:  # explicit repeat rather than enable_gqa: every SDPA backend accepts it
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    if positions.dim() == 2:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=packed_mask(positions), scale=q.shape[-1] ** -0.5)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; head counts come from the (possibly sharded) projections.

    The forward's keyword `attend(q, k, v, positions)` computes the attention proper (default `causal_attention`):
    under context parallelism apply passes one with every call (`shardlab.models.provider.Attend`), so the module
    holds no slot for it. `positions` are each token's place in the sequence (RoPE angles): [s], or [b, s] for
    packed rows, each token's place in its document (`shardlab.data.packing`)."""

    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor | None = None) -> None:
        """inv_freq: `rope_inv_freq(cfg)`, computed once for a model's blocks (each gets its own copy)."""
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Non-persistent so the state_dict holds exactly HF's parameters; init_weights rebuilds it after to_empty.
        inv_freq = rope_inv_freq(cfg) if inv_freq is None else inv_freq.clone()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, attend: Attend | None = None
    ) -> torch.Tensor:
        s = x.shape[1]
        # The head count comes from the tensor, not cfg.n_heads: under tensor parallelism a rank has its local heads.
        q, k, v = (
            rearrange(p(x), "b s (h d) -> b h s d", d=self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        if positions is None:
            positions = torch.arange(s, device=x.device)
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        if positions.dim() == 2:  # packed rows: [b, s, hd] -> [b, 1, s, hd], the same angles for every head
            cos, sin = cos[:, None], sin[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = (causal_attention if attend is None else attend)(q, k, v, positions)
        return self.o_proj(rearrange(out, "b h s d -> b s (h d)"))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm transformer block; submodules take one positional tensor (positions go by keyword) so TP input and
    output hooks can wrap them."""

    def __init__(self, cfg: ModelConfig, layer_id: int, inv_freq: torch.Tensor | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = Attention(cfg, inv_freq)
        self.mlp: nn.Module = (
            MLP(cfg) if cfg.moe is None else MoE(cfg, shared_expert=MLP(cfg) if cfg.moe.shared_expert else None)
        )
        self.input_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions=positions)  # a keyword: TP hooks take positionals
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, blocks and final norm (HF's `model.` prefix): tokens [b, s] -> hidden states [b, s, dim]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        inv_freq = rope_inv_freq(cfg)  # once: a dozen ops, each slow under torch.device("meta") (0.6 s for 405B)
        self.layers = nn.ModuleList(LlamaBlock(cfg, i, inv_freq) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h) if positions is None else layer(h, positions=positions)  # a pipeline prunes to Identity
        return self.norm(h)


class Llama(nn.Module):
    """Llama 3 causal LM: tokens LongTensor[b, s] -> logits [b, s, vocab_size]; the loss lives outside.

    Build on the meta device, then `materialize(model, device, seed)` (to_empty + init_weights).
    With `tie_embeddings`, `lm_head.weight` is the embedding Parameter, as in HF: the state_dict holds both
    names, and a load may omit `lm_head.weight` (HF's safetensors files do).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.register_load_state_dict_pre_hook(_fill_tied_head)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """positions: each token's place in the sequence (default 0..s-1; a context-parallel rank's chunks)."""
        return self.lm_head(self.model(tokens, positions=positions))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Re-tie, rebuild the RoPE buffers and draw every parameter the module still holds (torchtitan's scheme).

        Projections into a block get std init_std; projections out of it (o, down) and up_proj get
        init_std / sqrt(2 (layer_id + 1)); all cut at 3 std. A tied matrix gets the output-projection
        init (std dim**-0.5), because std-1 embeddings as the head would give logits of std sqrt(dim).
        Each parameter is drawn from its own generator, seeded with (seed, its name), so a weight does not depend
        on which others exist: a pipeline rank that pruned the other stages draws the same weights as one
        process. torch's global RNG is left alone. Works on plain tensors and on DTensors (in-place init only).
        """
        cfg, embed = self.cfg, self.model.embed_tokens
        both = isinstance(embed, nn.Embedding) and isinstance(self.lm_head, nn.Linear)  # not pruned by a pipeline
        if (
            cfg.tie_embeddings and both and self.lm_head.weight is not embed.weight
        ):  # to_empty / distribute_module untie
            if getattr(self.lm_head.weight, "placements", None) != getattr(embed.weight, "placements", None):
                raise ShardlabError(
                    "Llama.init_weights: tied embed_tokens and lm_head are placed differently; give both the same layout"
                )
            self.lm_head.weight = embed.weight
        for block in self.modules():
            if isinstance(block, LlamaBlock):
                block.self_attn.inv_freq = rope_inv_freq(self.cfg).to(block.self_attn.inv_freq.device)
            if isinstance(block, MoE) and hasattr(block, "expert_bias"):
                block.expert_bias.zero_()
        draws = list(self._draws())
        missed = {name for name, _ in self.named_parameters()} - {name for name, _, _ in draws}
        if missed:
            raise ShardlabError(f"Llama.init_weights: no initialiser for {sorted(missed)[0]}; add it to Llama._draws")
        for name, weight, draw in draws:
            draw(weight, torch.Generator(device=weight.device).manual_seed(param_seed(seed, name)))

    def _draws(self) -> Iterator[tuple[str, torch.Tensor, Init]]:
        """(name, parameter, initialiser) for every parameter present (pruned pipeline stages are nn.Identity)."""
        cfg = self.cfg
        head_std = cfg.dim**-0.5

        def trunc(std: float) -> Init:
            return lambda w, g: _trunc_normal(w, std, g)

        for name, module in self.named_modules():
            if isinstance(module, nn.Embedding):
                init = trunc(head_std) if cfg.tie_embeddings else (lambda w, g: nn.init.normal_(w, 0.0, 1.0, g))
                yield f"{name}.weight", module.weight, init
            elif isinstance(module, nn.RMSNorm):
                yield f"{name}.weight", module.weight, lambda w, g: nn.init.ones_(w)
            elif isinstance(module, LlamaBlock):
                depth_std = cfg.init_std / math.sqrt(2 * (module.layer_id + 1))
                mlps = ("mlp",) if cfg.moe is None else ("mlp.shared_expert",) if cfg.moe.shared_expert else ()
                for proj, std in (
                    ("self_attn.q_proj", cfg.init_std), ("self_attn.k_proj", cfg.init_std),
                    ("self_attn.v_proj", cfg.init_std), ("self_attn.o_proj", depth_std),
                    *((f"{mlp}.{p}", s) for mlp in mlps for p, s in
                      (("gate_proj", cfg.init_std), ("up_proj", depth_std), ("down_proj", depth_std))),
                    *((("mlp.router", cfg.init_std),) if cfg.moe is not None else ()),
                ):  # fmt: skip
                    yield f"{name}.{proj}.weight", module.get_submodule(proj).weight, trunc(std)
                if cfg.moe is not None:
                    experts = module.get_submodule("mlp.experts")
                    for proj, std in (("gate_proj", cfg.init_std), ("up_proj", depth_std), ("down_proj", depth_std)):
                        yield f"{name}.mlp.experts.{proj}", getattr(experts, proj), trunc(std)
            elif module is self.lm_head and isinstance(module, nn.Linear) and not cfg.tie_embeddings:
                yield f"{name}.weight", module.weight, trunc(head_std)


def materialize(model: Llama, device: torch.device | str = "cpu", seed: int = 0) -> Llama:
    """Allocate a meta-device Llama (or what a pipeline rank kept of it) on `device` and draw its weights."""
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


Init = Callable[[torch.Tensor, torch.Generator], Any]
"""Fills a parameter in place, drawing from the generator."""


def _trunc_normal(w: torch.Tensor, std: float, generator: torch.Generator) -> None:
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)


def _fill_tied_head(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load pre-hook: HF drops `lm_head.weight` from tied checkpoints; take it from the embedding."""
    head, embed = prefix + "lm_head.weight", prefix + "model.embed_tokens.weight"
    if head not in state_dict and embed in state_dict:
        state_dict[head] = state_dict[embed]


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers `LlamaConfig(**d)` / config.json dict (classic rope_theta + rope_scaling keys); an MoE model's
    is a `MixtralConfig`'s (every MLP a top-k softmax router over SwiGLU experts, renormalised over the chosen).

    Tokenizer ids (bos/eos) are not part of ModelConfig; add them before exporting a real checkpoint.
    """
    rs = cfg.rope_scaling
    rope_scaling = None
    if rs is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position,
        }
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        # Llama 3.1/3.2 publish 131072; nothing here depends on it (RoPE needs no cache length).
        "max_position_embeddings": 131_072 if rs is not None else 8192,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    m = cfg.moe
    if m is None:
        return d
    unmapped = (
        "a shared expert" if m.shared_expert else
        "sigmoid router scores" if m.score != "softmax" else
        "a selection bias (balance='bias')" if m.balance == "bias" else
        "a capacity limit (capacity_factor)" if m.capacity_factor is not None else
        "top_k=1 (Mixtral weighs a single expert by 1, shardlab by its score)" if m.top_k == 1 else None
    )  # fmt: skip
    if unmapped:
        raise ShardlabError(
            f"to_hf: an MoE model exports as Mixtral, which cannot express {unmapped}; this model.moe has no "
            "Hugging Face mapping yet"
        )
    return d | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": m.expert_ffn_dim,
        "num_local_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "router_aux_loss_coef": m.aux_loss_coef if m.balance == "aux_loss" else 0.0,
        "sliding_window": None,
    }


def from_hf_config(d: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a Llama (or Mixtral: MoE) config.json dict, old (rope_scaling) or transformers 5
    (rope_parameters) form."""
    missing = [
        k
        for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
        if k not in d
    ]
    if missing:
        raise ShardlabError(f"from_hf_config: config.json has no {', '.join(missing)}; is it a Llama config?")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ShardlabError(
            f"from_hf_config: rope_type={rope_type!r} is not supported; only 'default' and 'llama3' are"
        )
    if d.get("attention_bias") or d.get("mlp_bias") or d.get("hidden_act", "silu") != "silu":
        raise ShardlabError(
            "from_hf_config: biases or a non-silu activation are not Llama 3; use a plain Llama 3 config"
        )
    moe = None
    if d.get("model_type") == "mixtral":
        if d.get("sliding_window") is not None or d.get("num_experts_per_tok", 2) == 1:
            raise ShardlabError(
                "from_hf_config: a Mixtral with sliding-window attention or one expert per token is not supported "
                "(shardlab attends to the whole sequence and weighs a single expert by its score)"
            )
        moe = MoEConfig(
            n_experts=d.get("num_local_experts", 8),
            top_k=d.get("num_experts_per_tok", 2),
            expert_ffn_dim=d["intermediate_size"],
            balance="aux_loss" if d.get("router_aux_loss_coef", 0.001) > 0 else "none",
            aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)) or 0.01,  # 0 means none: keep the default
        )
    dim, n_heads = d["hidden_size"], d["num_attention_heads"]
    if d.get("head_dim") not in (None, dim // n_heads):
        raise ShardlabError(
            f"from_hf_config: head_dim={d['head_dim']} != hidden_size / num_attention_heads = {dim // n_heads}; not supported"
        )
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope["original_max_position_embeddings"]),
        )
    return ModelConfig(
        dim=dim,
        n_layers=d["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=d.get("num_key_value_heads") or n_heads,
        ffn_dim=d["intermediate_size"],
        vocab_size=d["vocab_size"],
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10_000.0))),
        rope_scaling=scaling,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=float(d.get("initializer_range", 0.02)),
        moe=moe,
    )
