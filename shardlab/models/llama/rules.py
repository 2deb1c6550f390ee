"""The default layout of Llama as data: torchtitan's FSDP x TP (+SP, loss parallel) layout, stated as rules.

Parameters name their dims logically (`("heads", "embed")`); the logical table maps those names to
mesh axes; activation layouts say where the residual stream is sequence-sharded. Change the layout
by changing this data, not the model.
"""

from __future__ import annotations

from shardlab.config import ModelConfig, PlanConfig
from shardlab.sharding.rules import Activation, LogicalTable, Rule, Rules

PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    ("model.embed_tokens.weight", ("vocab", "embed")),
    ("model.layers.*.self_attn.q_proj.weight", ("heads", "embed")),
    ("model.layers.*.self_attn.k_proj.weight", ("kv_heads", "embed")),
    ("model.layers.*.self_attn.v_proj.weight", ("kv_heads", "embed")),
    ("model.layers.*.self_attn.o_proj.weight", ("embed", "heads")),
    ("model.layers.*.mlp.gate_proj.weight", ("mlp", "embed")),
    ("model.layers.*.mlp.up_proj.weight", ("mlp", "embed")),
    ("model.layers.*.mlp.down_proj.weight", ("embed", "mlp")),
    ("model.layers.*.input_layernorm.weight", ("embed",)),
    ("model.layers.*.post_attention_layernorm.weight", ("embed",)),
    ("model.norm.weight", ("embed",)),
    ("lm_head.weight", ("vocab", "embed")),
)
"""Logical dim names of every Llama parameter (Hugging Face names)."""

DENSE_MLP = (
    "model.layers.*.mlp.gate_proj.weight",
    "model.layers.*.mlp.up_proj.weight",
    "model.layers.*.mlp.down_proj.weight",
)
MOE_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    ("model.layers.*.mlp.router.weight", (None, "embed")),  # every rank scores every expert
    ("model.layers.*.mlp.experts.gate_proj", ("experts", "expert_mlp", "embed")),
    ("model.layers.*.mlp.experts.up_proj", ("experts", "expert_mlp", "embed")),
    ("model.layers.*.mlp.experts.down_proj", ("experts", "embed", "expert_mlp")),
)
"""The MoE block's own parameters (its shared expert is a dense MLP under `mlp.shared_expert`)."""
SHARED_EXPERT_AXES = tuple(
    (p.replace(".mlp.", ".mlp.shared_expert."), axes) for p, axes in PARAM_AXES if p in DENSE_MLP
)

RESIDUAL = ("batch", "residual_seq", "embed")
"""The residual stream between blocks: sequence-sharded over tp under sequence parallelism."""
FULL = ("batch", "seq", "embed")
"""What attention and the MLP need: the whole sequence."""


def logical_table(options: PlanConfig) -> LogicalTable:
    """Logical name -> mesh axes; sequence and loss parallelism are two switches of this table."""
    return (
        ("vocab", "tp"),
        ("heads", "tp"),
        ("kv_heads", "tp"),
        ("mlp", "tp"),
        ("embed", None),
        ("experts", "ep"),
        ("expert_mlp", "tp"),
        ("batch", ("dp_replicate", "dp_shard")),
        ("seq", None),
        ("residual_seq", "tp" if options.sequence_parallel else None),
        ("logits_vocab", "tp" if options.loss_parallel else None),
    )


ACTIVATIONS: tuple[Activation, ...] = (
    Activation(pattern="model.embed_tokens", output=RESIDUAL),
    Activation(pattern="model.layers.*.input_layernorm", inputs=(RESIDUAL,), output=RESIDUAL),
    Activation(pattern="model.layers.*.post_attention_layernorm", inputs=(RESIDUAL,), output=RESIDUAL),
    Activation(pattern="model.layers.*.self_attn", inputs=(RESIDUAL,), desired_inputs=(FULL,)),
    Activation(pattern="model.layers.*.mlp", inputs=(RESIDUAL,), desired_inputs=(FULL,)),
    Activation(pattern="model.layers.*.self_attn.o_proj", output=RESIDUAL),
    Activation(pattern="model.layers.*.mlp.down_proj", output=RESIDUAL),
    Activation(pattern="model.norm", inputs=(RESIDUAL,), output=RESIDUAL),
    Activation(pattern="lm_head", inputs=(RESIDUAL,), output=("batch", "seq", "logits_vocab")),
)


def llama_rules(model: ModelConfig, options: PlanConfig = PlanConfig()) -> Rules:
    """torchtitan's Llama layout: FSDP per block (+ embedding, + norm/head), colwise q/k/v/gate/up,
    rowwise o/down, vocab-parallel embedding and head with loss parallel, sequence-parallel norms."""
    tied = model.tie_embeddings
    axes = PARAM_AXES
    if model.moe is not None:  # the MoE block in place of the MLP, with its shared expert if any
        axes = (
            *(x for x in PARAM_AXES if x[0] not in DENSE_MLP),
            *MOE_AXES,
            *(SHARED_EXPERT_AXES if model.moe.shared_expert else ()),
        )
    params = tuple(Rule(pattern=p, axes=a) for p, a in axes if not (tied and p == "lm_head.weight"))
    # A tied embedding is shared with lm_head: both must stay in the root FSDP unit.
    units = (
        (("model.layers.*",),) if tied else (("model.embed_tokens",), ("model.layers.*",), ("model.norm", "lm_head"))
    )
    activations = ACTIVATIONS
    if model.moe is not None:  # the MoE layer takes and returns whole local tensors (its experts sum over tp)
        activations = tuple(
            a for a in ACTIVATIONS if a.pattern not in ("model.layers.*.mlp", "model.layers.*.mlp.down_proj")
        )
        activations += (
            Activation(pattern="model.layers.*.mlp", inputs=(RESIDUAL,), desired_inputs=(FULL,), output=FULL,
                       desired_output=RESIDUAL),
        )  # fmt: skip
    return Rules(
        params=params,
        logical=logical_table(options),
        activations=activations,
        fsdp_units=units,
        fsdp_last_kept=not tied,
        blocks=("model.layers.*",),
        attention=("model.layers.*.self_attn",),
        fp8_exclude=("model.layers.*.mlp.router",) if model.moe is not None else (),  # its scores pick the experts
    )
