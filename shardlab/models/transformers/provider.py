"""A transformers causal LM from a local directory (config.json, optionally safetensors), as a model provider.

The model is transformers' own class (`AutoModelForCausalLM.from_config`, SDPA attention), built on the meta device
from the directory's config.json; nothing is ever downloaded. Its layout is derived from transformers' TP plan
(`shardlab.models.transformers.rules`); its weights are read by name from the directory's safetensors, each rank reading only
its own block. transformers is imported only when such a model is used (it takes seconds).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardlab._errors import ShardlabError
from shardlab._quiet import quiet_imports
from shardlab.config import PlanConfig
from shardlab.models.flops import flops_per_token
from shardlab.models.hf_dir import has_weights
from shardlab.models.provider import HFNames, ModelProvider, param_seed
from shardlab.models.stand_in import OtherStage
from shardlab.models.transformers.rules import (
    Decoder,
    attention_by_position,
    blocks_planned,
    hf_rules,
    per_head_norms,
    rowwise_into_residual,
    unsplittable,
    whole_width_norms,
)
from shardlab.models.transformers.stage import TransformersStage, call_causal_lm
from shardlab.sharding.experts import is_stacked_experts
from shardlab.sharding.rules import Rules

if TYPE_CHECKING:
    from shardlab.config import Config

IDENTITY_PREFIX = "config.json:"
NOT_IDENTITY = (
    "transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "attn_implementation",
    "_attn_implementation_autoset", "output_attentions", "output_hidden_states", "return_dict",
)  # fmt: skip
"""config.json keys that say how a model was saved or is run, not what it is."""


def _transformers() -> Any:
    """transformers, its model classes imported quietly (they import torchao where it is installed)."""
    try:
        with quiet_imports():
            import transformers
            import transformers.modeling_utils
    except ImportError:
        raise ShardlabError("model.hf_path needs the transformers package: pip install 'shardlab[hf]'") from None
    return transformers


ATTENTION = "shardlab"
"""The attention transformers models are built with: transformers' SDPA (and its masks), unless the attention
module's call was given the keyword `attend` (`shardlab.models.provider.Attend`: context parallelism's, which attends
over the whole sequence's keys). transformers' attention modules hand their call's keywords on to the attention
function, so the function travels with each call and nothing is written onto transformers' modules."""


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q, k, v [b, heads, s, head_dim] in, [b, s, heads, head_dim] out."""
    attend = kwargs.pop("attend", None)
    if attend is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        kwargs["sliding_window"] = sliding_window
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    positions = kwargs.get("position_ids")
    if positions is None:
        raise ShardlabError(
            f"{type(module).__name__}: context parallelism needs the tokens' positions, but transformers passed no "
            "position_ids to the attention"
        )
    out = attend(query, key, value, positions, scale=scaling, window=sliding_window)  # [1 or b, s]: packed rows too
    return out.transpose(1, 2).contiguous(), None


def _register_attention(transformers: Any) -> None:
    """Make `ATTENTION` a transformers attention implementation, with SDPA's masks (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    transformers.AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class HFCausalLM(ModelProvider):
    """A transformers `*ForCausalLM` from its config (see `from_dir`)."""

    def __init__(self, config: Any, source: str = "model.hf_path") -> None:
        self.config = config
        self.source = source
        arch = (getattr(config, "architectures", None) or [None])[0] or config.model_type
        self.name = f"transformers {arch}"

    @classmethod
    def from_dir(cls, path: str | Path) -> HFCausalLM:
        """The model of a local transformers directory (its config.json); one-line errors for anything else."""
        root = Path(path)
        file = root / "config.json"
        if not file.is_file():
            raise ShardlabError(
                f"model.hf_path={str(path)!r}: no {file}; pass a local transformers model directory (config.json, "
                "safetensors)"
            )
        try:
            d = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ShardlabError(f"{file}: not readable JSON ({e}); re-download or re-export the model") from None
        return cls.from_dict(d, source=str(file))

    @classmethod
    def from_identity(cls, identity: dict[str, Any]) -> HFCausalLM:
        """The model a checkpoint's model.json describes."""
        return cls.from_dict({k.removeprefix(IDENTITY_PREFIX): v for k, v in identity.items()}, source="model.json")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str) -> HFCausalLM:
        transformers = _transformers()
        model_type = d.get("model_type")
        mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if model_type not in mapping:
            raise ShardlabError(
                f"{source}: model_type={model_type!r} has no causal-LM class in transformers "
                f"{transformers.__version__}; shardlab trains *ForCausalLM models"
            )
        fields = {k: v for k, v in d.items() if k != "model_type"}
        try:
            config = transformers.AutoConfig.for_model(model_type, **fields)
        except (ValueError, TypeError, KeyError) as e:
            raise ShardlabError(f"{source}: transformers cannot read this config ({e})") from None
        config.use_cache = False
        return cls(config, source)

    def build(self) -> nn.Module:
        """transformers' model with shardlab's attention (`ATTENTION`), which takes context parallelism's `attend`
        from the attention modules' keywords."""
        transformers = _transformers()
        _register_attention(transformers)
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                self.config, attn_implementation=ATTENTION, dtype=torch.float32
            )
        except (AssertionError, ValueError, TypeError, KeyError, AttributeError) as e:  # a user's config.json
            raise ShardlabError(f"{self.source}: transformers cannot build {self.name} from it ({e})") from None
        return model

    def init_weights(self, model: nn.Module, seed: int) -> None:
        """transformers' own initialisation, module by module, each drawn with a seed of (seed, module name), so a
        weight does not depend on the layout or on which other modules exist; torch's global RNG is restored."""
        if getattr(self.config, "tie_word_embeddings", False):
            model.tie_weights()  # to_empty unties
        with torch.random.fork_rng(devices=[]):
            for name, module in model.named_modules():
                torch.manual_seed(param_seed(seed, name))
                model._init_weights(module)

    def rules(self, options: PlanConfig) -> Rules:
        return hf_rules(self.meta_model(), options)

    @property
    def packs_documents(self) -> bool:  # type: ignore[override]
        """Whether the model builds its masks with transformers' `masking_utils`, which reads positions that restart
        as packed sequences (the shardlab attention, plain or context-parallel, then keeps documents apart)."""
        import sys

        return hasattr(sys.modules[type(self.meta_model()).__module__], "create_causal_mask")

    def forward(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return call_causal_lm(model, positions, input_ids=tokens)

    @property
    def _text(self) -> Any:
        return self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config

    @property
    def n_layers(self) -> int:
        return self._text.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self._text.vocab_size

    @property
    def dim(self) -> int:
        return self._text.hidden_size

    @property
    def tp_reduced_dim(self) -> int:
        """The hidden size where transformers' plan splits every block as Megatron does: two projections split by
        their input write the residual stream (the attention's and the MLP's last), and no experts are stacked (their
        MoE block takes whole tensors)."""
        model = self.meta_model()
        if any(is_stacked_experts(m) for m in model.modules()) or rowwise_into_residual(model) < 2:
            return 0
        return self.dim

    @property
    def kv_dim(self) -> int:
        t = self._text
        return (getattr(t, "num_key_value_heads", None) or t.num_attention_heads) * self._head_dim

    @property
    def _head_dim(self) -> int:
        t = self._text
        return getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads

    def flops_per_token(self, seq_len: int) -> float:
        model = self.meta_model()
        t = self._text
        n = sum(p.numel() for p in model.parameters())
        if not getattr(t, "tie_word_embeddings", False):
            n -= model.get_input_embeddings().weight.numel()  # a lookup, no FLOPs
        experts = getattr(t, "num_local_experts", None) or getattr(t, "num_experts", None)
        top_k = getattr(t, "num_experts_per_tok", None)
        if experts and top_k:  # a token goes through top_k of the experts
            stacked = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
            n -= round(stacked * (1 - top_k / experts))
        return flops_per_token(n, t.num_hidden_layers, t.num_attention_heads * self._head_dim, seq_len)

    def tp_divisors(self) -> dict[str, int]:
        t = self._text
        where = f"{self.source} "
        out = {f"{where}num_attention_heads": t.num_attention_heads}
        out[f"{where}num_key_value_heads"] = getattr(t, "num_key_value_heads", None) or t.num_attention_heads
        for key in ("intermediate_size", "vocab_size", "num_local_experts", "num_experts"):
            if getattr(t, key, None):
                out[f"{where}{key}"] = getattr(t, key)
        return out

    def check(self, cfg: Config) -> None:
        where = f"model.hf_path ({self.name})"
        self._check_causal(where)
        if cfg.mesh.tp > 1:
            self._check_tensor_parallel(cfg, where)
        root = Path(cfg.model.hf_path) if cfg.model.hf_path is not None and not cfg.model.from_scratch else None
        loads = root is not None and has_weights(root)
        if root is not None and not loads:
            _check_no_other_weights(root, where)
        if loads:
            try:
                for name, p in self.meta_model().named_parameters():
                    self.hf_names(name, p.shape)
            except ValueError as e:
                raise ShardlabError(f"{where}: {e}; or train it from the seed with --model.from-scratch") from None
        t = self._text
        if getattr(t, "attn_logit_softcapping", None):
            raise ShardlabError(
                f"{where}: attn_logit_softcapping={t.attn_logit_softcapping}, which the attention shardlab builds the "
                "model with (transformers' SDPA, or all-gather attention under cp) does not compute; this model "
                "cannot train here as configured"
            )
        if cfg.mesh.cp > 1 and getattr(t, "attention_dropout", 0):
            raise ShardlabError(
                f"{where}: mesh.cp={cfg.mesh.cp} with attention dropout, which shardlab's context-parallel attention "
                "does not compute; use mesh.cp=1 for this model"
            )
        if cfg.mesh.ep > 1:
            experts = [m.num_experts for m in self.meta_model().modules() if is_stacked_experts(m)]
            if not experts:
                raise ShardlabError(
                    f"{where}: mesh.ep={cfg.mesh.ep}, but the model has no stacked experts to split over ep; set "
                    "mesh.ep=1"
                )
            if experts[0] % (cfg.mesh.ep * cfg.mesh.tp):
                raise ShardlabError(
                    f"{where}: {experts[0]} experts do not split over mesh.ep={cfg.mesh.ep} x mesh.tp={cfg.mesh.tp}; "
                    "pick ep and tp whose product divides them"
                )
        if cfg.mesh.pp > 1:
            self._check_pipeline(cfg, where)

    def _check_tensor_parallel(self, cfg: Config, where: str) -> None:
        """What transformers' TP plan and this model's code leave tensor parallelism unable to split exactly."""
        model = self.meta_model()
        across = whole_width_norms(model)  # before `unsplittable`: the projections transformers gathers for them
        if across:
            width = next(p.numel() for p in model.get_submodule(across[0]).parameters(recurse=False))
            raise ShardlabError(
                f"{where}: mesh.tp={cfg.mesh.tp}, but {across[0]} normalises over all heads together (one weight "
                f"across their {width} features), which a rank holding a share of the heads cannot compute; use "
                "mesh.tp=1 (FSDP/HSDP) for this model"
            )
        whole = unsplittable(model)
        if whole:
            raise ShardlabError(
                f"{where}: mesh.tp={cfg.mesh.tp}, but {whole[0]} is a fused weight that tensor "
                "parallelism cannot split by heads exactly; use mesh.tp=1 (FSDP/HSDP) for this model"
            )
        if not blocks_planned(model):
            raise ShardlabError(
                f"{where}: mesh.tp={cfg.mesh.tp}, but transformers ships no tensor-parallel plan for this model's "
                "blocks (config base_model_tp_plan), so none of their weights would be split; use mesh.tp=1 "
                "(FSDP/HSDP) for this model"
            )
        per_head = per_head_norms(model)
        if per_head:
            raise ShardlabError(
                f"{where}: mesh.tp={cfg.mesh.tp}, but {per_head[0]} normalises each head with weights of its "
                "own, which shardlab keeps whole rather than split with the heads; use mesh.tp=1 (FSDP/HSDP) "
                "for this model"
            )
        positional = attention_by_position(model) if cfg.plan.sequence_parallel else None
        if positional:
            raise ShardlabError(
                f"{where}: mesh.tp={cfg.mesh.tp} with sequence parallelism, but the blocks hand {positional} "
                "its hidden states by position, where shardlab cannot gather the sequence for it; set "
                "plan.sequence_parallel=False"
            )

    def _check_causal(self, where: str) -> None:
        """An encoder that transformers also offers as a causal LM (BERT, RoBERTa, ...) attends both ways unless
        its config says it is a decoder: trained on next tokens it would see each token it predicts."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

        built = self.meta_model().config  # a causal class that is always a decoder (BART's) says so here
        if self._text.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(built, "is_decoder", False):
            raise ShardlabError(
                f"{where}: {self._text.model_type} is an encoder whose attention sees the whole sequence unless "
                'config.json sets "is_decoder": true; set it to train the model as a causal LM'
            )

    def _check_pipeline(self, cfg: Config, where: str) -> None:
        """A stage after the first feeds the model its hidden states as `inputs_embeds`, so whatever the forward
        does outside its modules must leave them as they are; and transformers sizes its masks by their length."""
        if cfg.mesh.tp > 1 and cfg.plan.sequence_parallel:
            raise ShardlabError(
                f"{where}: mesh.pp={cfg.mesh.pp} with sequence parallelism: transformers sizes its masks by the "
                "hidden states a stage receives, which SP shards; set plan.sequence_parallel=False"
            )
        changed = self._changes_hidden_states()
        if changed:
            raise ShardlabError(
                f"{where}: mesh.pp={cfg.mesh.pp}, but the model's forward {changed} outside its modules, so a "
                "pipeline stage cannot take the previous stage's hidden states; use mesh.pp=1 for this model"
            )

    def _changes_hidden_states(self) -> str | None:
        """What the model's own forward does to `inputs_embeds` once its blocks and every module holding weights
        pass their input on (a later stage's view of the model), or None when it leaves them unchanged."""
        model = self.with_layers(1).meta_model()  # a provider of its own: this model is changed below
        layers = Decoder(model).layers
        blocks = [f"{layers}.{i}" for i in range(len(model.get_submodule(layers)))]
        owners = (n.rpartition(".")[0] for n, _ in model.named_parameters(remove_duplicate=False))
        for fqn in (*blocks, *dict.fromkeys(o for o in owners if not o.startswith(f"{layers}."))):
            model.set_submodule(fqn, OtherStage(like=model.get_submodule(fqn)))
        model.to_empty(device="cpu")  # what is left: buffers such as the rotary tables
        x = torch.randn(1, 3, self.dim, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            y = TransformersStage(model, first=False, last=True)(x)
        if y.shape != x.shape or y.dtype != x.dtype:
            return f"turns hidden states of shape {tuple(x.shape)} into {tuple(y.shape)} ({y.dtype})"
        return None if torch.equal(x, y) else "changes the hidden states (e.g. scales them or soft-caps the logits)"

    def with_layers(self, n_layers: int) -> HFCausalLM:
        config = copy.deepcopy(self.config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text.num_hidden_layers = n_layers
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = text.layer_types[:n_layers]
        return HFCausalLM(config, self.source)

    def identity(self) -> dict[str, Any]:
        d = self.config.to_dict()
        return {f"{IDENTITY_PREFIX}{k}": v for k, v in sorted(d.items()) if k not in NOT_IDENTITY}

    def describe(self) -> str:
        t = self._text
        return f"{self.name}, hidden_size={t.hidden_size}, num_hidden_layers={t.num_hidden_layers}"

    def hf_config(self) -> dict[str, Any]:
        d = {k: v for k, v in self.config.to_dict().items() if k not in ("torch_dtype", "dtype")}
        return d | {"use_cache": True}

    def hf_names(self, name: str, shape: Sequence[int]) -> HFNames:
        """As transformers' `save_pretrained` writes it (its own conversion, reverted: Mixtral's per-expert
        `w1`/`w3`/`w2` for the stacked `gate_up_proj` and `down_proj`)."""
        from shardlab.models.transformers.names import checkpoint_names

        return checkpoint_names(self.meta_model(), name, shape)

    def hf_tied(self) -> bool:
        return bool(getattr(self._text, "tie_word_embeddings", False))


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
"""Files a model directory may hold its weights in; shardlab reads only safetensors under transformers' names."""


def _check_no_other_weights(root: Path, where: str) -> None:
    """A directory without safetensors whose weights are in files shardlab does not read would otherwise train from
    the seed silently."""
    if not root.is_dir():
        return
    other = sorted(f.name for f in root.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    if other:
        raise ShardlabError(
            f"{where}: the weights are in {other[0]}, but shardlab reads only model.safetensors (or "
            "model.safetensors.index.json and its shards): save them as safetensors (transformers' save_pretrained "
            "does), or train from the seed with --model.from-scratch"
        )
