"""The run as data: frozen, validated structs from a recipe file plus tyro overrides (`run`), and the model it
trains (`model`)."""

from shardlab.config.model import ModelConfig, MoEConfig, Positive, RopeScaling, check_tp_divisors
from shardlab.config.run import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    LogConfig,
    OptimConfig,
    PlanConfig,
    TrainConfig,
)
from shardlab.sharding.mesh import MeshSpec

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "LogConfig",
    "MeshSpec",
    "MoEConfig",
    "ModelConfig",
    "OptimConfig",
    "PlanConfig",
    "Positive",
    "RopeScaling",
    "TrainConfig",
    "check_tp_divisors",
]
