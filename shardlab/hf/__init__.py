"""Hugging Face checkpoints: safetensors directories in and out of any model a provider describes (`io`), and the
checkpoint names of shardlab's own Llama and MoE parameters (`names`)."""

from shardlab.hf.io import from_hf, has_weights, initial_weights, load_hf_weights, read_hf_config, to_hf

__all__ = ["from_hf", "has_weights", "initial_weights", "load_hf_weights", "read_hf_config", "to_hf"]
