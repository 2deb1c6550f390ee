"""Models: what shardlab asks of a model (`provider`), shardlab's Llama (`llama/`), transformers causal LMs from a
local directory (`transformers/`) and a recipe's own module (`custom`). Models only: no collectives, no process
groups; what parallel code needs from a model, its provider declares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardlab._errors import ShardlabError
from shardlab.models.llama.provider import LlamaProvider
from shardlab.models.provider import ModelProvider
from shardlab.models.transformers.provider import HFCausalLM

if TYPE_CHECKING:
    from shardlab.config import Config


def provider_for(cfg: Config, custom: ModelProvider | None = None) -> ModelProvider:
    """The provider a config names: a recipe's own model (`custom`), a transformers directory (model.hf_path), or
    shardlab's Llama."""
    if custom is not None:
        if cfg.model.hf_path is not None:
            raise ShardlabError(
                "model.hf_path is set but the recipe defines its own model; use one of them (drop --model.hf-path)"
            )
        return custom
    if cfg.model.hf_path is not None:
        return HFCausalLM.from_dir(cfg.model.hf_path)
    return LlamaProvider(cfg.model)
