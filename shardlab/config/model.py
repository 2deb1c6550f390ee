"""ModelConfig: the model a run trains, as data: shardlab's Llama 3 (optionally with MoE layers) or a transformers
directory (hf_path), and the model sizes tensor parallelism must divide."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shardlab._base import Frozen, Positive
from shardlab._errors import ShardlabError


class RopeScaling(Frozen):
    """Llama-3.1 RoPE frequency scaling (long-context interpolation of the low frequencies)."""

    factor: float = 8.0
    """Divides the frequencies whose wavelength exceeds original_max_position / low_freq_factor."""
    low_freq_factor: float = 1.0
    """Wavelengths longer than original_max_position / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths shorter than original_max_position / high_freq_factor are kept."""
    original_max_position: Positive = 8192
    """Context length the base model was trained with."""

    def check(self) -> None:
        if self.factor < 1:
            raise ShardlabError(f"model.rope_scaling.factor={self.factor}: must be >= 1")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ShardlabError(
                f"model.rope_scaling: low_freq_factor={self.low_freq_factor} and high_freq_factor={self.high_freq_factor} "
                "need 0 < low_freq_factor < high_freq_factor"
            )


class MoEConfig(Frozen):
    """Mixture of experts in place of every block's MLP: a top-k router over SwiGLU experts (Mixtral, Qwen-MoE,
    DeepSeek-V3 style)."""

    n_experts: Positive = 8
    top_k: Positive = 2
    """Experts each token is sent to; their outputs are summed with the router's scores (renormalised over the
    chosen experts when top_k > 1; a single expert is weighted by its raw score, so the router learns)."""
    expert_ffn_dim: Positive = 256
    """Hidden width of each expert's SwiGLU."""
    score: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts (Mixtral) or independent sigmoids (DeepSeek-V3)."""
    shared_expert: bool = False
    """Add a dense SwiGLU of width model.ffn_dim that every token goes through (Qwen-MoE, DeepSeek)."""
    balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    """aux_loss: add aux_loss_coef x E x sum_e(tokens share_e x mean score_e) over each global micro batch (the
    micro batch of every data-parallel rank together, the same tokens in every layout with as many micro batches;
    Switch);
    bias: the auxiliary-loss-free scheme, a per-expert bias on the selection scores nudged each step towards
    even loads (DeepSeek-V3); none."""
    aux_loss_coef: float = 0.01
    bias_rate: float = 1e-3
    """Step of the bias update (balance="bias")."""
    capacity_factor: float | None = None
    """None: every expert takes every token routed to it (nothing is dropped). A number: each expert takes at
    most ceil(capacity_factor x tokens x top_k / n_experts) of a rank's micro batch, in token order; the rest
    of its tokens skip it (their residual passes), and the metrics count them. Which tokens overflow depends on
    how the batch is split over ranks, so runs with a capacity differ between layouts."""

    def check(self) -> None:
        if self.top_k > self.n_experts:
            raise ShardlabError(
                f"model.moe.top_k={self.top_k} exceeds model.moe.n_experts={self.n_experts}; pick top_k <= n_experts"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ShardlabError(
                f"model.moe.capacity_factor={self.capacity_factor}: must be > 0, or None to drop nothing"
            )
        if self.aux_loss_coef < 0 or self.bias_rate < 0:
            raise ShardlabError("model.moe: aux_loss_coef and bias_rate must be >= 0")


class ModelConfig(Frozen):
    """The model: shardlab's Llama 3 (the defaults are torchtitan's llama3 `debugmodel`, 6.2M parameters), or a
    transformers causal LM from a local directory (hf_path), which takes its shape from its own config.json."""

    hf_path: str | None = None
    """A local transformers model directory (config.json, optionally safetensors weights): train that model
    (AutoModelForCausalLM, never downloaded) instead of shardlab's Llama; the Llama fields below then stay unset."""
    from_scratch: bool = False
    """With hf_path: start from the seed's random weights even where the directory holds safetensors weights."""

    dim: Positive = 256
    """Width of the residual stream."""
    n_layers: Positive = 6
    """Number of transformer blocks."""
    n_heads: Positive = 16
    """Query heads; head_dim = dim / n_heads."""
    n_kv_heads: Positive = 16
    """Key/value heads (grouped-query attention when < n_heads)."""
    ffn_dim: Positive = 768
    """Hidden width of the SwiGLU MLP."""
    vocab_size: Positive = 2048
    """Rows of the embedding and of the output projection."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: Annotated[float, msgspec.Meta(gt=0)] = 500_000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | None = RopeScaling()
    """Llama-3.1 frequency scaling; None for plain RoPE."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output projection (Llama 3.2 1B/3B)."""
    init_std: Annotated[float, msgspec.Meta(gt=0)] = 0.02
    """Std of the truncated-normal init of the projections."""
    moe: MoEConfig | None = None
    """Mixture of experts in place of the MLPs; None for the dense Llama."""

    def check(self) -> None:
        if self.hf_path is not None:
            changed = next(
                (f.name for f in msgspec.structs.fields(self) if f.name not in ("hf_path", "from_scratch")
                 and getattr(self, f.name) != f.default),
                None,
            )  # fmt: skip
            if changed is not None:
                raise ShardlabError(
                    f"model.{changed} is set but model.hf_path is too: a transformers model takes its shape from "
                    f"{self.hf_path}/config.json; drop --model.{changed.replace('_', '-')}"
                )
        elif self.from_scratch:
            raise ShardlabError(
                "model.from_scratch is set without model.hf_path; it only applies to transformers models"
            )
        if self.dim % self.n_heads:
            raise ShardlabError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; pick n_heads dividing dim"
            )
        if self.n_heads % self.n_kv_heads:
            raise ShardlabError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}; "
                "grouped-query attention needs n_kv_heads dividing n_heads"
            )
        if (self.dim // self.n_heads) % 2:
            raise ShardlabError(f"model: head_dim={self.dim // self.n_heads} is odd; RoPE needs an even head_dim")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def tp_divisors(self) -> dict[str, int]:
        """The sizes tensor parallelism splits, by field name: tp must divide each one."""
        out = {"model.n_heads": self.n_heads, "model.n_kv_heads": self.n_kv_heads, "model.ffn_dim": self.ffn_dim}
        out["model.vocab_size"] = self.vocab_size
        if self.moe is not None:
            out["model.moe.expert_ffn_dim"] = self.moe.expert_ffn_dim
        return out

    def first_difference(self, other: ModelConfig) -> str | None:
        """The first field whose value differs from `other`'s (for errors naming what differs), or None."""
        return next((f for f in self.__struct_fields__ if getattr(self, f) != getattr(other, f)), None)

    @property
    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, h, kv = self.dim, self.head_dim, self.n_kv_heads
        attn = d * self.n_heads * h * 2 + d * kv * h * 2
        block = attn + self._ffn_params(active=False) + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * block + d + head

    @property
    def n_active_params(self) -> int:
        """Parameters a token goes through: with MoE, top_k of the experts (and the router and shared expert)."""
        return self.n_params - self.n_layers * (self._ffn_params(active=False) - self._ffn_params(active=True))

    def _ffn_params(self, active: bool) -> int:
        d, m = self.dim, self.moe
        if m is None:
            return 3 * d * self.ffn_dim
        experts = m.top_k if active else m.n_experts
        return m.n_experts * d + experts * 3 * d * m.expert_ffn_dim + (3 * d * self.ffn_dim if m.shared_expert else 0)


def check_tp_divisors(divisors: dict[str, int], tp: int) -> None:
    """Each model size that tensor parallelism splits (`name -> size`) must be a multiple of tp."""
    for name, value in divisors.items():
        if tp > 1 and value % tp:
            raise ShardlabError(f"{name}={value} is not divisible by mesh.tp={tp}; pick a tp that divides it")
