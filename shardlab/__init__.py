"""shardlab: JAX-style, functional sharding for PyTorch.

Config -> MeshSpec -> make_plan (rules, logical axes, PartitionSpecs) -> apply -> step.
"""

from shardlab import _version
from shardlab._errors import ShardlabError
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
from shardlab.hf import from_hf, load_hf_weights, to_hf
from shardlab.models import provider_for
from shardlab.models.custom import CustomModel, HFExport
from shardlab.models.llama.model import Llama, llama_config
from shardlab.models.llama.provider import LlamaProvider
from shardlab.models.llama.rules import llama_rules
from shardlab.models.provider import ModelProvider
from shardlab.models.transformers.provider import HFCausalLM
from shardlab.parallel.apply import Parallelized, apply, constrain, parallelize, shard, shard_map
from shardlab.parallel.device_mesh import make_mesh
from shardlab.parallel.visualize import visualize, visualize_spec
from shardlab.sharding.mesh import MeshSpec
from shardlab.sharding.plan import Plan, make_plan
from shardlab.sharding.rules import Activation, Rule, Rules
from shardlab.sharding.spec import P, placements
from shardlab.training.checkpoint import load, save
from shardlab.training.loop import build_model, train
from shardlab.training.step import TrainState, init_state, make_step

__version__ = _version.version()

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
    "Parallelized",
    "Plan",
    "PlanConfig",
    "Rule",
    "Rules",
    "ShardlabError",
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
    "parallelize",
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
