"""A recipe's own nn.Module as a model provider: a factory, its keyword arguments and rules written for its names.

    model = CustomModel(GPT, rules=gpt_rules, vocab_size=2048, dim=256, n_layers=4, n_heads=8)

The factory's keyword arguments are the model's hyperparameters (and what a checkpoint must match on resume). Every
module's parameters are drawn by its own `reset_parameters()` under a seed of (run seed, module name), so all
layouts start from the same weights; a module that holds parameters and has no `reset_parameters` is an error.
FLOPs per token are counted by torch on the meta device. `hf=HFExport(...)` names the transformers class that
holds the same model, so `to_hf` and `export --to-hf` can write it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardlab._errors import ShardlabError
from shardlab.config import PlanConfig
from shardlab.models.flops import module_flops
from shardlab.models.provider import ModelProvider, param_seed
from shardlab.sharding.rules import Rules, matches

if TYPE_CHECKING:
    from shardlab.config import Config

DIVISOR_ARGS = ("n_heads", "n_kv_heads", "num_heads", "num_kv_heads", "ffn_dim", "hidden_dim", "vocab_size")
"""Factory arguments that tensor parallelism splits, when the factory has them: tp must divide each."""


@dataclass(frozen=True)
class HFExport:
    """How a recipe's own model is written as a transformers model: `architecture`, a transformers class name
    (e.g. "GPT2LMHeadModel"); `config`, the factory's keyword arguments -> that class's config.json fields (its
    `model_type` and `architectures` are filled in); `tensors`, (parameter name, whole tensor, the factory's keyword
    arguments) -> the checkpoint tensors it becomes, (name, tensor) pairs in that class's names and layout. The
    export checks the result against the class built from the config, name by name and shape by shape, before
    anything is gathered."""

    architecture: str
    config: Callable[..., dict[str, Any]]
    tensors: Callable[..., Iterable[tuple[str, torch.Tensor]]]


class CustomModel(ModelProvider):
    """`factory(**kwargs)` laid out by `rules` (a Rules, or a function PlanConfig -> Rules, so sequence and loss
    parallelism can switch the logical table). `layers_arg` names the argument that sets the number of blocks
    (the estimator probes shallower copies). `hf`: the transformers class this model can be exported as (None: it
    cannot)."""

    def __init__(
        self,
        factory: Callable[..., nn.Module],
        *,
        rules: Rules | Callable[[PlanConfig], Rules],
        layers_arg: str = "n_layers",
        hf: HFExport | None = None,
        **kwargs: Any,
    ) -> None:
        self.factory, self._rules, self.layers_arg, self.hf, self.kwargs = factory, rules, layers_arg, hf, kwargs
        self.name = f"recipe model {getattr(factory, '__qualname__', type(factory).__name__)}"

    def build(self) -> nn.Module:
        return self.factory(**self.kwargs)

    def init_weights(self, model: nn.Module, seed: int) -> None:
        with torch.random.fork_rng(devices=[]):
            for name, module in model.named_modules():
                if next(module.parameters(recurse=False), None) is None:
                    continue
                reset = getattr(module, "reset_parameters", None)
                if reset is None:
                    raise ShardlabError(
                        f"{self.name}: module {name or '(root)'} ({type(module).__name__}) holds parameters but has "
                        "no reset_parameters(); give it one (it draws that module's initial weights)"
                    )
                torch.manual_seed(param_seed(seed, name))
                reset()

    def rules(self, options: PlanConfig) -> Rules:
        return self._rules(options) if callable(self._rules) else self._rules

    @property
    def n_layers(self) -> int:
        blocks = self.rules(PlanConfig()).blocks
        names = [n for n, _ in self.meta_model().named_modules()]
        return sum(1 for n in names if any(matches(b, n) for b in blocks))

    @property
    def vocab_size(self) -> int:
        embed = self._embedding()
        return embed.num_embeddings

    @property
    def dim(self) -> int:
        return self._embedding().embedding_dim

    def _embedding(self) -> nn.Embedding:
        embed = next((m for m in self.meta_model().modules() if isinstance(m, nn.Embedding)), None)
        if embed is None:
            raise ShardlabError(f"{self.name}: no nn.Embedding found; shardlab trains token models (tokens -> logits)")
        return embed

    def flops_per_token(self, seq_len: int) -> float:
        """Forward and backward FLOPs per token as torch counts them on the meta device (attention as the math
        kernel runs it: the whole S x S square)."""
        sample = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
        with torch.device("meta"):
            model = self.build()
        return module_flops(model, sample, self.forward)[""]

    def tp_divisors(self) -> dict[str, int]:
        return {f"model.{k}": v for k, v in self.kwargs.items() if k in DIVISOR_ARGS and isinstance(v, int)}

    def check(self, cfg: Config) -> None:
        for axis in ("cp", "pp", "ep"):
            if getattr(cfg.mesh, axis) > 1:
                raise ShardlabError(
                    f"{self.name}: mesh.{axis}={getattr(cfg.mesh, axis)} is not supported for a recipe's own model "
                    "yet; use dp_replicate, dp_shard and tp"
                )

    def with_layers(self, n_layers: int) -> CustomModel:
        if self.layers_arg not in self.kwargs:
            raise ShardlabError(
                f"{self.name}: no argument {self.layers_arg!r} sets the number of blocks; pass it to CustomModel "
                "(or name it with layers_arg=)"
            )
        return self.with_args(**{self.layers_arg: n_layers})

    def with_args(self, **kwargs: Any) -> CustomModel:
        """The same factory and rules with some arguments changed (another size of the model)."""
        return CustomModel(
            self.factory, rules=self._rules, layers_arg=self.layers_arg, hf=self.hf, **(self.kwargs | kwargs)
        )

    def identity(self) -> dict[str, Any]:
        factory = f"{getattr(self.factory, '__module__', '?')}.{getattr(self.factory, '__qualname__', '?')}"
        return {"model.factory": factory, **{f"model.{k}": v for k, v in sorted(self.kwargs.items())}}

    def hf_config(self) -> dict[str, Any]:
        if self.hf is None:
            raise ShardlabError(
                f"{self.name}: no transformers class is named for this model, so it cannot be exported to Hugging "
                "Face; pass CustomModel(..., hf=HFExport(architecture, config, tensors))"
            )
        cls = _transformers_class(self.hf.architecture)
        config = {"model_type": cls.config_class.model_type, **self.hf.config(**self.kwargs)}
        config["architectures"] = [self.hf.architecture]
        _check_export(self, self.hf, cls, config)
        return config

    def hf_tensors(self, name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if self.hf is None:
            raise ShardlabError(
                f"{self.name}: no transformers class is named for this model (CustomModel(..., hf=...))"
            )
        return list(self.hf.tensors(name, full, **self.kwargs))

    def hf_names(self, name: str, shape: Sequence[int]) -> str:
        raise ShardlabError(
            f"{self.name}: reading Hugging Face weights into a recipe's own model is not supported; start it from "
            "its own initialisation or from a shardlab checkpoint (checkpoint.resume)"
        )


def _transformers_class(architecture: str) -> type:
    try:
        import transformers
    except ImportError:
        raise ShardlabError("exporting to Hugging Face needs transformers: pip install 'shardlab[hf]'") from None
    cls = getattr(transformers, architecture, None)
    if not isinstance(cls, type) or getattr(cls, "config_class", None) is None:
        raise ShardlabError(
            f"HFExport.architecture={architecture!r} is not a transformers model class; name one such as "
            "'GPT2LMHeadModel'"
        )
    return cls


def _check_export(provider: CustomModel, hf: HFExport, cls: type, config: dict[str, Any]) -> None:
    """The class built from `config` on the meta device must hold exactly the tensors `hf.tensors` writes, each of
    the shape written (its buffers and a tied head aside): one line naming the first difference."""
    with torch.device("meta"):
        reference = cls(cls.config_class.from_dict(dict(config)))
        model = provider.build()
    want = {n: tuple(p.shape) for n, p in reference.named_parameters()}  # a tied head appears once
    got = {n: tuple(t.shape) for name, p in model.named_parameters() for n, t in hf.tensors(name, p, **provider.kwargs)}
    where, cls_name = f"HFExport({hf.architecture!r})", hf.architecture
    for name, shape in got.items():
        if name not in want:
            raise ShardlabError(
                f"{where}: `tensors` writes {name!r}, which {cls_name} has no parameter of; fix `tensors`"
            )
        if want[name] != shape:
            raise ShardlabError(
                f"{where}: `tensors` writes {name!r} with shape {shape}; {cls_name} built from `config` has "
                f"{want[name]}; fix `tensors` or `config`"
            )
    missing = [n for n in want if n not in got]
    if missing:
        raise ShardlabError(
            f"{where}: `tensors` writes no {missing[0]!r} (and {len(missing) - 1} more of {cls_name}'s parameters); "
            "fix `tensors`"
        )
