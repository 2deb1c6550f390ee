"""shardlab: JAX-style, functional sharding for PyTorch.

Config -> MeshSpec -> make_plan (rules, logical axes, PartitionSpecs) -> apply -> step.
"""

from shardlab._device_mesh import make_mesh
from shardlab.apply import apply, constrain, shard, shard_map
from shardlab.checkpoint import load, save
from shardlab.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    PlanConfig,
    TrainConfig,
)
from shardlab.debug import visualize, visualize_spec
from shardlab.hf import from_hf, load_hf_weights, to_hf
from shardlab.loop import build_model, train
from shardlab.mesh import MeshSpec
from shardlab.models.custom import CustomModel, HFExport
from shardlab.models.hf_causal_lm import HFCausalLM
from shardlab.models.llama import Llama, llama_config
from shardlab.models.llama_rules import llama_rules
from shardlab.models.provider import LlamaProvider, ModelProvider, provider_for
from shardlab.plan import Plan, make_plan
from shardlab.rules import Activation, Rule, Rules
from shardlab.spec import P, placements
from shardlab.step import TrainState, init_state, make_step

__all__ = [
    "Activation",
    "CheckpointConfig",
    "Config",
    "CustomModel",
    "DataConfig",
    "EvalConfig",
    "HFCausalLM",
    "HFExport",
    "Llama",
    "LlamaProvider",
    "LogConfig",
    "MeshSpec",
    "MoEConfig",
    "ModelConfig",
    "ModelProvider",
    "OptimConfig",
    "P",
    "Plan",
    "PlanConfig",
    "Rule",
    "Rules",
    "TrainConfig",
    "TrainState",
    "apply",
    "build_model",
    "constrain",
    "from_hf",
    "init_state",
    "llama_config",
    "llama_rules",
    "load",
    "load_hf_weights",
    "make_mesh",
    "make_plan",
    "make_step",
    "placements",
    "provider_for",
    "save",
    "shard",
    "shard_map",
    "to_hf",
    "train",
    "visualize",
    "visualize_spec",
]
