"""Rules derived from a transformers model instead of written: its TP plan, completed by what shardlab knows of a
decoder.

transformers ships, per model class, a TP plan (`config.base_model_tp_plan` under the base model's prefix, plus the
class's own `_tp_plan` for the head): module globs -> "colwise", "rowwise", "replicated_with_grad_allreduce", ...
`hf_rules(model, options)` turns it into shardlab `Rules` over logical axes, and adds what the plan does not say:
the vocabulary-parallel embedding, the loss-parallel head, sequence-parallel norms (the residual stream split over
tp between the projections), the blocks (FSDP units, checkpointing, compile) and the attention modules. Fused
projections that transformers shards by gathering their output (Phi-3's `qkv_proj`, `gate_up_proj`) are kept whole
over tp; `unsplittable` names them so a layout with tp > 1 is refused in one line (and `whole_width_norms` the norms
over all heads, OLMo2's, for which transformers gathers plain q/k/v projections). Stacked experts (Mixtral,
Qwen3-MoE) are split by experts over ep x tp (`shardlab.sharding.experts.stacked_experts`), their MoE block
taking the whole sequence and handing back its shard.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator

from torch import nn

from shardlab._errors import ShardlabError
from shardlab.config import PlanConfig
from shardlab.models.llama.rules import FULL, RESIDUAL
from shardlab.models.llama.rules import logical_table as llama_logical_table
from shardlab.sharding.experts import is_stacked_experts
from shardlab.sharding.rules import Activation, LogicalTable, Rule, Rules, matches

LOGITS = ("batch", "seq", "logits_vocab")

SPLIT_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", "colwise_gather_output", "embedding_rowwise")
"""TP styles of transformers' plans that shardlab shards (the head's colwise_gather_output becomes loss parallel)."""
WHOLE_STYLES = (
    "colwise_gather_output", "rowwise_split_input", "packed_colwise", "moe_tp_experts", "grouped_gemm",
    "ep_dispatch_experts", "local_colwise", "local_rowwise", "local_packed_rowwise", "local", "gather",
    "sequence_parallel", "replicated", "isolated",
)  # fmt: skip
"""Styles whose modules shardlab keeps whole over tp (fused or stacked weights it cannot split by heads exactly)."""


def logical_table(options: PlanConfig) -> LogicalTable:
    """shardlab's Llama table (the same logical names, so a user's overrides read the same for every model), plus
    the dims that stay whole: a q/k norm's head_dim and the weights kept whole over tp."""
    return llama_logical_table(options) + (("head_dim", None), ("whole", None), ("stacked_experts", ("ep", "tp")))


class Decoder:
    """Where the parts of a transformers causal LM are, found from its own API (input/output embeddings, the
    ModuleList of `num_hidden_layers` blocks) and its TP plan, on a model built on the meta device."""

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        names = {id(m): n for n, m in model.named_modules()}
        self.embed = names.get(id(model.get_input_embeddings()))
        head = model.get_output_embeddings()
        self.head = names.get(id(head)) if head is not None else None
        if self.embed is None or self.head is None:
            raise ShardlabError(
                f"{type(model).__name__}: no input embedding or output head found (get_input_embeddings / "
                "get_output_embeddings); shardlab derives rules for causal LMs only, write rules for this model"
            )
        n = text.num_hidden_layers
        lists = [f for f, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n and f]
        if len(lists) != 1:
            raise ShardlabError(
                f"{type(model).__name__}: expected one ModuleList of num_hidden_layers={n} blocks, found "
                f"{lists or 'none'}; write rules for this model"
            )
        self.layers = lists[0]
        self.blocks = f"{self.layers}.*"
        self.tied = self.head is not None and head.weight is model.get_input_embeddings().weight
        prefix = getattr(model, "base_model_prefix", "")
        plan = {
            f"{prefix}.{k}" if prefix else k: v for k, v in (getattr(config, "base_model_tp_plan", None) or {}).items()
        }
        plan |= dict(getattr(type(model), "_tp_plan", None) or {})
        self.tp_plan = plan
        self.heads = text.num_attention_heads
        self.kv_heads = getattr(text, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.heads
        block = model.get_submodule(f"{self.layers}.0")
        self.attention = tuple(
            f"{self.blocks}.{n}" for n, m in block.named_children() if "attention" in type(m).__name__.lower()
        )
        if not self.attention:
            raise ShardlabError(f"{type(model).__name__}: no attention module in {self.layers}.0; write rules for it")

    def style(self, module: str) -> str | None:
        """transformers' TP style of a module (its plan's globs use `*` for the block index)."""
        return next((s for g, s in self.tp_plan.items() if matches(g, module)), None)

    def pattern(self, fqn: str) -> str:
        """The fqn with its block index replaced by `*` (one rule for every block)."""
        return re.sub(rf"^{re.escape(self.layers)}\.\d+\.", f"{self.layers}.*.", fqn)


def _split_name(d: Decoder, fqn: str, features: int) -> str:
    """The logical name of the dim a colwise/rowwise projection splits: heads, kv_heads or mlp."""
    if any(re.match(re.escape(a).replace(r"\*", r"[^.]*") + r"\.", fqn) for a in d.attention):
        return "kv_heads" if features == d.kv_heads * d.head_dim != d.heads * d.head_dim else "heads"
    return "mlp"


def _param_axes(d: Decoder, model: nn.Module) -> Iterator[tuple[str, tuple[str | None, ...]]]:
    """(pattern, logical axes) for every parameter of the model, one per block-relative name."""
    seen: set[str] = set()
    for fqn, param in model.named_parameters():
        pattern = d.pattern(fqn)
        if pattern in seen:
            continue
        seen.add(pattern)
        owner, _, leaf = fqn.rpartition(".")
        module = model.get_submodule(owner)
        style = d.style(d.pattern(owner))
        whole = (("whole",) * param.ndim)[: param.ndim]
        if owner == d.embed:
            yield pattern, ("vocab", "embed")
        elif owner == d.head:
            yield pattern, ("vocab", "embed") if leaf == "weight" else ("vocab",)
        elif style in ("colwise", "rowwise") and isinstance(module, nn.Linear):
            colwise = style == "colwise"
            name = _split_name(d, owner, module.out_features if colwise else module.in_features)
            if leaf == "weight":
                yield pattern, (name, "embed") if colwise else ("embed", name)
            else:
                yield pattern, (name,) if colwise else ("embed",)
        elif style == EXPERTS and is_stacked_experts(module):  # split by experts over ep x tp
            yield pattern, ("stacked_experts",) + (None,) * (param.ndim - 1)
        elif style == "replicated_with_grad_allreduce" or "norm" in type(module).__name__.lower():
            yield pattern, (("head_dim",) if style else ("embed",)) + (None,) * (param.ndim - 1)
        elif style is None or style in WHOLE_STYLES:
            yield pattern, whole
        else:
            raise ShardlabError(
                f"{pattern}: transformers' TP plan gives {owner} the style {style!r}, which shardlab does not map; "
                "write rules for this model (a recipe's `rules`)"
            )


def unsplittable(model: nn.Module) -> tuple[str, ...]:
    """Modules whose weights tensor parallelism cannot split by heads exactly (fused q/k/v or gate/up projections;
    or plain q/k/v projections whose output a norm over all heads needs whole, see `whole_width_norms`):
    transformers' plan gathers them; shardlab refuses tp > 1 for these models. Stacked experts split by experts."""
    d = Decoder(model)
    experts = _experts_globs(d, model)
    return tuple(
        g for g, s in d.tp_plan.items()
        if s in WHOLE_STYLES and not matches(g, d.head) and not any(g == e or g.startswith(e + ".") for e in experts)
    )  # fmt: skip


def blocks_planned(model: nn.Module) -> bool:
    """Whether transformers' TP plan names anything inside the blocks: without it tensor parallelism would split
    no weight of theirs, only the sequence between them."""
    d = Decoder(model)
    inside = [f for f, _ in model.named_modules() if f.startswith(f"{d.layers}.0.")]
    return any(matches(g, f) for g in d.tp_plan for f in inside)


def rowwise_into_residual(model: nn.Module) -> int:
    """How many projections of a block transformers' plan splits by their input (rowwise) that write the residual
    stream (the attention's output, the MLP's down projection): tp reduces each one's output in the forward, and
    the input gradient of the projections feeding it in the backward."""
    d = Decoder(model)
    hidden = model.get_input_embeddings().weight.shape[-1]
    return sum(
        1 for f, m in model.named_modules()
        if f.startswith(f"{d.layers}.0.") and isinstance(m, nn.Linear) and m.out_features == hidden
        and d.style(d.pattern(f)) == "rowwise"
    )  # fmt: skip


def per_head_norms(model: nn.Module) -> tuple[str, ...]:
    """Norms in the first block with a weight per head ([heads, head_dim]: Cohere's q/k norms), which tensor
    parallelism would have to split with the heads; shardlab keeps norms whole and refuses tp > 1 for these."""
    d = Decoder(model)
    return tuple(
        f for f, m in model.named_modules()
        if f.startswith(f"{d.layers}.0.") and "norm" in type(m).__name__.lower()
        and any(p.ndim > 1 for p in m.parameters(recurse=False))
    )  # fmt: skip


def whole_width_norms(model: nn.Module) -> tuple[str, ...]:
    """Norms in the first block's attention with one weight across every head's features ([heads * head_dim]: OLMo2's
    q/k norms normalise the whole projection's output at once), which a rank holding a share of the heads cannot
    compute; transformers' plan gathers the q/k/v outputs for them, and shardlab refuses tp > 1 for these models."""
    d = Decoder(model)
    widths = {d.heads * d.head_dim, d.kv_heads * d.head_dim} - {d.head_dim}  # a norm of head_dim is per head
    inside = tuple(a.replace(d.blocks, f"{d.layers}.0", 1) + "." for a in d.attention)
    return tuple(
        f for f, m in model.named_modules()
        if f.startswith(inside) and "norm" in type(m).__name__.lower()
        and any(p.ndim == 1 and p.numel() in widths for p in m.parameters(recurse=False))
    )  # fmt: skip


def attention_by_position(model: nn.Module) -> str | None:
    """The attention module a block hands its hidden states by position rather than as `hidden_states=`
    (GPT-NeoX's), if any: sequence parallelism gathers the sequence for attention at that keyword only."""
    d = Decoder(model)
    block = model.get_submodule(f"{d.layers}.0")
    source = inspect.getsource(type(block).forward)
    for name, _ in block.named_children():
        if f"{d.blocks}.{name}" in d.attention and not re.search(rf"self\.{name}\(\s*hidden_states\s*=", source):
            return f"{d.layers}.0.{name}"
    return None


EXPERTS = "moe_tp_experts"
"""transformers' plan style of a stacked-experts module."""


def _experts_globs(d: Decoder, model: nn.Module) -> tuple[str, ...]:
    """The plan's globs of stacked-experts modules that shardlab splits by experts."""
    block = f"{d.layers}.0"
    out = []
    for glob, style in d.tp_plan.items():
        if style != EXPERTS:
            continue
        hits = [m for f, m in model.named_modules() if f.startswith(block + ".") and matches(glob, f)]
        if hits and all(is_stacked_experts(m) for m in hits):
            out.append(glob)
    return tuple(out)


def _activations(d: Decoder, model: nn.Module) -> tuple[Activation, ...]:
    """Sequence parallelism and loss parallelism for a pre-norm decoder: the residual stream is split over tp
    along the sequence between blocks' projections; norms run on it (handing back local tensors, since the
    decoder layer adds them to its local residual); attention (called with `hidden_states=`) and the MLP gather
    the sequence; the rowwise projections reduce-scatter back into it; the head keeps the logits vocab-sharded.

    The embeddings leave the embedding whole and the first block takes its sequence shard: transformers builds
    positions and attention masks from the embeddings' length, which must be the whole sequence's."""
    block = model.get_submodule(f"{d.layers}.0")
    experts = _experts_globs(d, model)
    acts = [
        Activation(pattern=d.embed, output=FULL),
        Activation(pattern=f"{d.layers}.0", inputs=(FULL,), desired_inputs=(RESIDUAL,), local_output=True),
    ]
    for name, child in block.named_children():
        fqn = f"{d.blocks}.{name}"
        kind = type(child).__name__.lower()
        if "norm" in kind:
            acts.append(Activation(pattern=fqn, inputs=(RESIDUAL,), output=RESIDUAL, local_output=True))
        elif fqn in d.attention:
            acts.append(Activation(pattern=fqn, kwarg_inputs=(("hidden_states", RESIDUAL),),
                                   desired_kwarg_inputs=(("hidden_states", FULL),)))  # fmt: skip
        elif any(f"{fqn}.{n}" == e for e in experts for n, _ in child.named_modules()):  # an MoE block: its
            acts.append(Activation(pattern=fqn, inputs=(RESIDUAL,), desired_inputs=(FULL,),  # experts sum over tp
                                   output=FULL, desired_output=RESIDUAL))  # fmt: skip
        elif any(p.ndim for p in child.parameters()):  # the MLP
            acts.append(Activation(pattern=fqn, inputs=(RESIDUAL,), desired_inputs=(FULL,)))
    linears = [f for f, m in model.named_modules() if isinstance(m, nn.Linear)]
    for glob, style in d.tp_plan.items():
        if style == "rowwise" and any(matches(glob, f) for f in linears):  # not a stacked experts' weight
            acts.append(Activation(pattern=glob, output=RESIDUAL))
        elif style == "replicated_with_grad_allreduce":  # q/k norms on the local heads [b, s, heads, head_dim]
            heads = ("batch", "seq", "kv_heads" if "k_" in glob.rpartition(".")[2] else "heads", None)
            acts.append(Activation(pattern=glob, inputs=(heads,), output=heads, local_output=True))
    base = d.layers.rpartition(".")[0]
    for name, child in model.get_submodule(base).named_children() if base else ():
        if "norm" in type(child).__name__.lower():  # the final norm
            fqn = f"{base}.{name}"
            acts.append(Activation(pattern=fqn, inputs=(RESIDUAL,), output=RESIDUAL, local_output=True))
    acts.append(Activation(pattern=d.head, inputs=(RESIDUAL,), output=LOGITS))
    return tuple(acts)


def hf_rules(model: nn.Module, options: PlanConfig = PlanConfig()) -> Rules:
    """The layout of a transformers causal LM (built on the meta device), derived from its TP plan and structure:
    torchtitan's FSDP x TP (+SP, loss parallel) layout, as shardlab's own Llama has it."""
    d = Decoder(model)
    params = tuple(
        Rule(pattern=p, axes=a) for p, a in _param_axes(d, model) if not (d.tied and p == f"{d.head}.weight")
    )
    base = d.layers.rpartition(".")[0]
    rest = tuple(
        f"{base}.{n}" if base else n
        for n, m in (model.get_submodule(base).named_children() if base else ())
        if f"{base}.{n}" not in (d.embed, d.layers) and any(True for _ in m.parameters())
    )
    units = ((d.blocks,),) if d.tied else ((d.embed,), (d.blocks,), (*rest, d.head))
    return Rules(
        params=params,
        logical=logical_table(options),
        activations=_activations(d, model),
        fsdp_units=units,
        fsdp_last_kept=not d.tied,
        blocks=(d.blocks,),
        attention=d.attention,
        stage_call="transformers",
    )
