"""Model providers: everything shardlab asks of a model, so the loop, the step, the estimator, checkpoints and
Hugging Face I/O never name a model class.

A provider answers, for one configuration: build the model (on whatever device is current: the meta device for
plans), initialise it (each weight a function of the seed and its name), its rules (parameter layout, blocks,
attention modules, FSDP units), how tokens become logits, its FLOPs per token, the model facts the mesh must divide,
a shallower copy for the estimator's probe, what identifies it on resume, and its Hugging Face names. shardlab's
Llama (dense or MoE) is `shardlab.models.llama.provider.LlamaProvider`; a transformers causal LM from a local directory
is `shardlab.models.transformers.provider.HFCausalLM`; a recipe's own nn.Module is `CustomModel`; `shardlab.models`
picks one for a config (`provider_for`).
"""

from __future__ import annotations

import abc
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardlab._errors import ShardlabError
from shardlab.config import MoEConfig, PlanConfig, check_tp_divisors
from shardlab.sharding.rules import Rules

if TYPE_CHECKING:
    from shardlab.config import Config

Attend = Callable[..., torch.Tensor]
"""attend(q, k, v, positions, *, scale=None, window=None) -> the attention output [b, heads, s, head_dim].

What a model declares for context parallelism: each attention module its rules name (`Rules.attention`) takes the
attention function as the keyword `attend` of its forward (shardlab's Llama names it; a transformers model's
attention modules hand it on to shardlab's attention function). `apply` passes one that sees every cp rank's keys
with each call; nothing is set on the modules."""

HFNames = str | tuple[str | tuple[str, ...], ...]
"""The checkpoint tensor(s) holding a parameter: one name, or per slice of dim 0 (a stacked expert weight) one name
or the names of equal row blocks concatenated into that slice (transformers' gate_up_proj: gate, then up)."""


class ModelProvider(abc.ABC):
    """What shardlab needs to know about a model; subclasses answer for one model family."""

    name: str
    """Shown in plans and errors (e.g. "llama", "transformers Qwen3ForCausalLM")."""
    packs_documents: bool = False
    """Its attention keeps packed documents apart when given their positions [rows, s] (`shardlab.data.packing`), so it
    can train with data.document_masks."""

    @abc.abstractmethod
    def build(self) -> nn.Module:
        """The model, on the current default device (call under `torch.device("meta")` to plan without memory)."""

    @abc.abstractmethod
    def init_weights(self, model: nn.Module, seed: int) -> None:
        """Fill every parameter and buffer of an allocated model: each weight a function of (seed, its name), so
        every layout (and a pipeline rank that holds only its stages) starts from the same numbers."""

    def materialize(self, model: nn.Module, device: torch.device | str, seed: int) -> nn.Module:
        """Allocate a meta-device model (or what a pipeline rank kept of it) on `device` and initialise it."""
        model.to_empty(device=device)
        self.init_weights(model, seed)
        return model

    def meta_model(self) -> nn.Module:
        """The model on the meta device, built once (for counting parameters and deriving rules)."""
        if self.__dict__.get("_meta") is None:
            with torch.device("meta"):
                self.__dict__["_meta"] = self.build()
        return self.__dict__["_meta"]

    @abc.abstractmethod
    def rules(self, options: PlanConfig) -> Rules:
        """The default layout: parameter rules, logical table, activations, FSDP units, blocks, attention."""

    def forward(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, s, vocab] of `tokens` [b, s]; positions: each token's place in its sequence (a
        context-parallel rank's chunks; None: 0..s-1)."""
        out = model(tokens) if positions is None else model(tokens, positions=positions)
        return logits_of(out)

    @property
    @abc.abstractmethod
    def n_layers(self) -> int:
        """Repeated blocks (what pipeline stages and the probe's depth extrapolation count)."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def dim(self) -> int:
        """Width of the residual stream (what pipeline stages hand each other)."""

    @property
    def moe(self) -> MoEConfig | None:
        """shardlab's MoE layers, whose routers the step balances; None for every other model."""
        return None

    @property
    def tp_reduced_dim(self) -> int:
        """The residual stream's width where the provider's own rules split every block over tp as Megatron does
        (its attention and its MLP each in projections split by their output, then one split by its input): tp
        reduces it at least twice in each block's forward and twice in its backward, which the search counts as a
        floor (`shardlab.estimate.comm_floors`). 0: they may split otherwise (no such floor)."""
        return 0

    @property
    def kv_dim(self) -> int:
        """The width of K (and of V) over every kv head, which context parallelism's attention gathers per block and
        token (`shardlab.parallel.context`), for the search's floor. 0: not known (no such floor)."""
        return 0

    @abc.abstractmethod
    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token as MFU counts them: 6 N (matmul weights a token goes through) + 12 L d S."""

    @abc.abstractmethod
    def tp_divisors(self) -> dict[str, int]:
        """Model facts that tensor parallelism splits, by the name an error shows (`model.n_heads`): tp must
        divide each one."""

    def check(self, cfg: Config) -> None:
        """Errors that need the model and the layout together (beyond `tp_divisors`); one line each."""
        return None

    @abc.abstractmethod
    def with_layers(self, n_layers: int) -> ModelProvider:
        """The same model with `n_layers` blocks (the estimator probes two shallow copies)."""

    @abc.abstractmethod
    def identity(self) -> dict[str, Any]:
        """What must match for a checkpoint to load into this model: display name -> value (saved as model.json)."""

    def describe(self) -> str:
        """A few defining values, for errors (`dim=256, n_layers=6, ...`)."""
        return ", ".join(f"{k.rpartition('.')[2]}={v}" for k, v in list(self.identity().items())[:4])

    def hf_config(self) -> dict[str, Any]:
        """A transformers config.json for this model, or a ValueError saying why it has none."""
        raise ShardlabError(f"{self.name}: no Hugging Face mapping; this model cannot be exported to transformers")

    def hf_names(self, name: str, shape: Sequence[int]) -> HFNames:
        """The checkpoint tensor(s) of parameter `name` (its shape: a stacked weight is one tensor per slice)."""
        return name

    def hf_tensors(self, name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint tensors that parameter `name` (whole, on the cpu) is exported as: by default its
        `hf_names`, a stacked weight split per slice of dim 0."""
        stored = self.hf_names(name, full.shape)
        if not isinstance(stored, tuple):
            return [(stored, full)]
        out = []
        for entry, piece in zip(stored, full.unbind(0), strict=True):
            parts = (entry,) if isinstance(entry, str) else entry
            out.extend(zip(parts, piece.chunk(len(parts), 0), strict=True))
        return out

    def hf_tied(self) -> bool:
        """Whether the exported checkpoint leaves out the tied head (`lm_head.weight`), as transformers does."""
        return False


def logits_of(output: Any) -> torch.Tensor:
    """A model's logits: its output itself, or the `.logits` of a transformers-style output object."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"the model returned a {type(output).__name__}; shardlab needs logits [batch, seq, vocab] or an object "
            "with .logits"
        )
    return logits


def first_difference(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first key whose value differs between two identities (a key only one of them has counts too)."""
    return next((k for k in (*saved, *(k for k in now if k not in saved)) if saved.get(k) != now.get(k)), None)


def param_seed(seed: int, name: str) -> int:
    """The RNG seed a parameter is drawn with: a function of the run's seed and the parameter's name only."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)


def check_layout(cfg: Config, provider: ModelProvider) -> None:
    """The model facts tensor parallelism splits must divide by mesh.tp; then the provider's own checks."""
    check_tp_divisors(provider.tp_divisors(), cfg.mesh.tp)
    if cfg.data.document_masks and not provider.packs_documents:
        raise ShardlabError(
            f"data.document_masks: {provider.name} does not say its attention keeps packed documents apart "
            "(ModelProvider.packs_documents); drop --data.document-masks"
        )
    provider.check(cfg)
