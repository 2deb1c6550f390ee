"""shardlab's own Llama 3 (dense or with MoE layers) as a model provider, from the config's `model` fields."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from torch import nn

from shardlab.config import ModelConfig, MoEConfig, PlanConfig
from shardlab.models.flops import flops_per_token
from shardlab.models.llama.hf_names import llama_names
from shardlab.models.llama.model import Llama, to_hf_config
from shardlab.models.llama.rules import llama_rules
from shardlab.models.provider import HFNames, ModelProvider
from shardlab.sharding.rules import Rules


class LlamaProvider(ModelProvider):
    """shardlab's own Llama 3, dense or with MoE layers, from the config's `model` fields."""

    packs_documents = True

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.name = "llama" if cfg.moe is None else "llama-moe"

    def build(self) -> nn.Module:
        return Llama(self.cfg)

    def init_weights(self, model: nn.Module, seed: int) -> None:
        model.init_weights(seed)

    def rules(self, options: PlanConfig) -> Rules:
        return llama_rules(self.cfg, options)

    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def dim(self) -> int:
        return self.cfg.dim

    @property
    def moe(self) -> MoEConfig | None:
        return self.cfg.moe

    @property
    def tp_reduced_dim(self) -> int:
        return self.cfg.dim

    @property
    def kv_dim(self) -> int:
        return self.cfg.n_kv_heads * self.cfg.head_dim

    def flops_per_token(self, seq_len: int) -> float:
        m = self.cfg
        matmul_params = m.n_active_params - (0 if m.tie_embeddings else m.vocab_size * m.dim)
        return flops_per_token(matmul_params, m.n_layers, m.dim, seq_len)

    def tp_divisors(self) -> dict[str, int]:
        return self.cfg.tp_divisors()

    def with_layers(self, n_layers: int) -> LlamaProvider:
        return LlamaProvider(msgspec.structs.replace(self.cfg, n_layers=n_layers))

    def identity(self) -> dict[str, Any]:
        return {f"model.{f}": msgspec.to_builtins(getattr(self.cfg, f)) for f in LLAMA_FIELDS}

    def hf_config(self) -> dict[str, Any]:
        return to_hf_config(self.cfg)

    def hf_names(self, name: str, shape: Sequence[int]) -> HFNames:
        return llama_names(name, shape)

    def hf_tied(self) -> bool:
        return self.cfg.tie_embeddings


LLAMA_FIELDS = tuple(f for f in ModelConfig.__struct_fields__ if f not in ("hf_path", "from_scratch"))
"""The fields that describe shardlab's Llama (the others say where a transformers model comes from)."""
