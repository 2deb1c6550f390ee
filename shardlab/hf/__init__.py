"""Hugging Face checkpoints: safetensors directories into (`io`) and out of (`export`) any model a provider describes, and the
checkpoint names of shardlab's own Llama and MoE parameters (`names`)."""

from shardlab.hf.export import to_hf
from shardlab.hf.io import from_hf, initial_weights, load_hf_weights, read_hf_config
from shardlab.models.hf_dir import has_weights

__all__ = ["from_hf", "has_weights", "initial_weights", "load_hf_weights", "read_hf_config", "to_hf"]
