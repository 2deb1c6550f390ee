"""make_plan on meta-device models: placements and local shapes per parameter, torchtitan's Llama TP layout,
FSDP units, tied embeddings, JSON round trip, explain/table, every planner error, 405B at 4096 ranks, golden plans.

Pure: no process group, no real tensors. Run: pytest tests/test_plan.py -q
Golden plans: `python tests/golden/regenerate.py` rewrites tests/golden/plans/*.json (review the diff).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import msgspec
import pytest
import torch
from msgspec.structs import replace
from torch import nn

from shardlab.config import ModelConfig, PlanConfig
from shardlab.models.llama.model import SIZES, Llama
from shardlab.models.llama.rules import llama_rules
from shardlab.sharding.mesh import AXES, MeshSpec
from shardlab.sharding.plan import PLAN_VERSION, FsdpPlan, Plan, make_plan
from shardlab.sharding.rules import Activation, Rule, Rules
from shardlab.sharding.tensor_parallel import ModulePlan

TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
TINY_TIED = replace(TINY, tie_embeddings=True)  # Llama 3.2 1B-like: lm_head.weight is the embedding

_MODELS: dict[ModelConfig, nn.Module] = {}


def meta_llama(cfg: ModelConfig) -> nn.Module:
    """Llama on the meta device (cached: make_plan only reads names, shapes and dtypes)."""
    if cfg not in _MODELS:
        with torch.device("meta"):
            _MODELS[cfg] = Llama(cfg)
    return _MODELS[cfg]


def llama_plan(
    cfg: ModelConfig, mesh: MeshSpec, options: PlanConfig = PlanConfig(), rules: Rules | None = None
) -> Plan:
    return make_plan(meta_llama(cfg), mesh, rules or llama_rules(cfg, options), options)


def pl(**placements: str) -> tuple[str, ...]:
    """Placements per mesh axis in AXES order; axes not named are Replicate ('R')."""
    return tuple(placements.get(a, "R") for a in AXES)


def with_params(rules: Rules, *extra: Rule, drop: tuple[str, ...] = ()) -> Rules:
    return replace(rules, params=tuple(r for r in rules.params if r.pattern not in drop) + extra)


# -- placements and local shapes per parameter ----------------------------------------------------------------

EMB, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
# Per block (checked in layers 0 and 1); W* after torchtitan's wq/wk/wv/wo.
WQ, WK, WV, WO = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
)
GATE, UP, DOWN = "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"
LN1, LN2 = "input_layernorm.weight", "post_attention_layernorm.weight"
RULE_INDEX = {EMB: 0, WQ: 1, WK: 2, WV: 3, WO: 4, GATE: 5, UP: 6, DOWN: 7, LN1: 8, LN2: 9, NORM: 10, HEAD: 11}
TP_S0_FSDP = pl(dp_shard="_S(0, 2)", tp="S(0)")  # FSDP2 on a TP-sharded dim 0: each TP shard is split over dp_shard

# Global shapes (TINY): embed/lm_head 256x64, q/o 64x64, k/v 32x64, gate/up 128x64, down 64x128, norms 64.
# name -> (spec, placements, local shape); names without "model." are per block (checked for layers 0 and 1).
LAYOUTS: dict[str, tuple[MeshSpec, dict | str]] = {
    "single": (MeshSpec(dp_shard=1), {  # specs name tp even where it has size 1 (placements: Replicate)
        EMB: (("tp", None), pl(), (256, 64)),
        WQ: (("tp", None), pl(), (64, 64)),
        WK: (("tp", None), pl(), (32, 64)),
        WV: (("tp", None), pl(), (32, 64)),
        WO: ((None, "tp"), pl(), (64, 64)),
        GATE: (("tp", None), pl(), (128, 64)),
        UP: (("tp", None), pl(), (128, 64)),
        DOWN: ((None, "tp"), pl(), (64, 128)),
        LN1: ((None,), pl(), (64,)),
        LN2: ((None,), pl(), (64,)),
        NORM: ((None,), pl(), (64,)),
        HEAD: (("tp", None), pl(), (256, 64)),
    }),
    "fsdp2": (MeshSpec(dp_shard=2), {
        EMB: ((("tp", "dp_shard"), None), pl(dp_shard="S(0)"), (128, 64)),
        WQ: ((("tp", "dp_shard"), None), pl(dp_shard="S(0)"), (32, 64)),
        WK: ((("tp", "dp_shard"), None), pl(dp_shard="S(0)"), (16, 64)),
        WV: ((("tp", "dp_shard"), None), pl(dp_shard="S(0)"), (16, 64)),
        WO: (("dp_shard", "tp"), pl(dp_shard="S(0)"), (32, 64)),
        GATE: ((("tp", "dp_shard"), None), pl(dp_shard="S(0)"), (64, 64)),
        UP: ((("tp", "dp_shard"), None), pl(dp_shard="S(0)"), (64, 64)),
        DOWN: (("dp_shard", "tp"), pl(dp_shard="S(0)"), (32, 128)),
        LN1: (("dp_shard",), pl(dp_shard="S(0)"), (32,)),
        LN2: (("dp_shard",), pl(dp_shard="S(0)"), (32,)),
        NORM: (("dp_shard",), pl(dp_shard="S(0)"), (32,)),
        HEAD: ((("tp", "dp_shard"), None), pl(dp_shard="S(0)"), (128, 64)),
    }),
    # replicated over dp_replicate, sharded over dp_shard: per parameter the same as FSDP 2
    "hsdp2x2": (MeshSpec(dp_replicate=2, dp_shard=2), "fsdp2"),
    "tp2": (MeshSpec(dp_shard=1, tp=2), {  # colwise: weight dim 0; rowwise: dim 1; vocab-parallel embedding: dim 0
        EMB: (("tp", None), pl(tp="S(0)"), (128, 64)),
        WQ: (("tp", None), pl(tp="S(0)"), (32, 64)),
        WK: (("tp", None), pl(tp="S(0)"), (16, 64)),
        WV: (("tp", None), pl(tp="S(0)"), (16, 64)),
        WO: ((None, "tp"), pl(tp="S(1)"), (64, 32)),
        GATE: (("tp", None), pl(tp="S(0)"), (64, 64)),
        UP: (("tp", None), pl(tp="S(0)"), (64, 64)),
        DOWN: ((None, "tp"), pl(tp="S(1)"), (64, 64)),
        LN1: ((None,), pl(), (64,)),
        LN2: ((None,), pl(), (64,)),
        NORM: ((None,), pl(), (64,)),
        HEAD: (("tp", None), pl(tp="S(0)"), (128, 64)),
    }),
    "fsdp2xtp2": (MeshSpec(dp_shard=2, tp=2), {  # FSDP's dp_shard is the minor part of dim 0 (after tp)
        EMB: ((("tp", "dp_shard"), None), TP_S0_FSDP, (64, 64)),
        WQ: ((("tp", "dp_shard"), None), TP_S0_FSDP, (16, 64)),
        WK: ((("tp", "dp_shard"), None), TP_S0_FSDP, (8, 64)),
        WV: ((("tp", "dp_shard"), None), TP_S0_FSDP, (8, 64)),
        WO: (("dp_shard", "tp"), pl(dp_shard="S(0)", tp="S(1)"), (32, 32)),
        GATE: ((("tp", "dp_shard"), None), TP_S0_FSDP, (32, 64)),
        UP: ((("tp", "dp_shard"), None), TP_S0_FSDP, (32, 64)),
        DOWN: (("dp_shard", "tp"), pl(dp_shard="S(0)", tp="S(1)"), (32, 64)),
        LN1: (("dp_shard",), pl(dp_shard="S(0)"), (32,)),
        LN2: (("dp_shard",), pl(dp_shard="S(0)"), (32,)),
        NORM: (("dp_shard",), pl(dp_shard="S(0)"), (32,)),
        HEAD: ((("tp", "dp_shard"), None), TP_S0_FSDP, (64, 64)),
    }),
}  # fmt: skip
LAYOUTS["hsdp2x2"] = (LAYOUTS["hsdp2x2"][0], LAYOUTS["fsdp2"][1])


def _fqns(name: str, n_layers: int = 2) -> list[str]:
    return [name] if name.startswith(("model.", "lm_head")) else [f"model.layers.{i}.{name}" for i in range(n_layers)]


LAYOUT_ROWS = [
    pytest.param(mesh_id, name, *row, id=f"{mesh_id}-{name}")
    for mesh_id, (_, table) in LAYOUTS.items()
    for name, row in table.items()
]


@pytest.mark.parametrize(("mesh_id", "name", "spec", "placements", "local"), LAYOUT_ROWS)
def test_param_layout(
    mesh_id: str, name: str, spec: tuple, placements: tuple[str, ...], local: tuple[int, ...]
) -> None:
    mesh = LAYOUTS[mesh_id][0]
    plan = llama_plan(TINY, mesh)
    for fqn in _fqns(name):
        p = plan.param(fqn)
        assert (p.spec, p.placements, p.local_shape) == (spec, placements, local), fqn
        assert p.rule == RULE_INDEX[name]
        assert p.bytes_per_rank == math.prod(local) * 4
        assert p.dtype == "float32"
        assert not p.padded and p.shadowed == () and p.fallbacks == () and p.aliases == ()


@pytest.mark.parametrize("mesh_id", LAYOUTS)
def test_every_parameter_is_in_the_layout_table(mesh_id: str) -> None:
    mesh, table = LAYOUTS[mesh_id]
    plan = llama_plan(TINY, mesh)
    assert sorted(p.fqn for p in plan.params) == sorted(f for name in table for f in _fqns(name))
    assert sum(math.prod(p.shape) for p in plan.params) == TINY.n_params
    assert plan.mesh == mesh and plan.version == PLAN_VERSION


@pytest.mark.parametrize(
    "options", [PlanConfig(sequence_parallel=False), PlanConfig(loss_parallel=False)], ids=["no_sp", "no_lp"]
)
def test_sequence_and_loss_parallel_do_not_change_parameter_layouts(options: PlanConfig) -> None:
    mesh = MeshSpec(dp_shard=2, tp=2)
    assert llama_plan(TINY, mesh, options).params == llama_plan(TINY, mesh).params


# -- torchtitan's Llama TP layout, placement for placement ---------------------------------------------------

STYLE_CLASS = {
    "colwise": "ColwiseParallel",
    "rowwise": "RowwiseParallel",
    "embedding_rowwise": "RowwiseParallel",
    "sequence_parallel": "SequenceParallel",
    "prepare_input": "PrepareModuleInput",
}
# torch's defaults for a layout the plan leaves as None (RowwiseParallel on nn.Embedding takes Replicate ids).
DEFAULT_INPUT = {
    "colwise": "Replicate()",
    "rowwise": "Shard(-1)",
    "embedding_rowwise": "Replicate()",
    "sequence_parallel": "Shard(1)",
    "prepare_input": None,
}
DEFAULT_OUTPUT = {
    "colwise": "Shard(-1)",
    "rowwise": "Replicate()",
    "embedding_rowwise": "Replicate()",
    "sequence_parallel": "Shard(1)",
    "prepare_input": None,
}


def _tp_layout(spec: tuple | None) -> str:
    """The tp-axis placement of an activation spec, as torch writes it (the last dim of [b, s, h] is Shard(-1))."""
    assert spec is not None
    dims = [d for d, e in enumerate(spec) if e == "tp" or (isinstance(e, tuple) and "tp" in e)]
    if not dims:
        return "Replicate()"
    return f"Shard({-1 if dims[0] == len(spec) - 1 else dims[0]})"


def torch_style(m: ModulePlan) -> tuple:
    """(style class, input layout, desired input layout, output layout, use_local_output) over the tp mesh dim."""
    return (
        STYLE_CLASS[m.style],
        _tp_layout(m.inputs[0]) if m.inputs else DEFAULT_INPUT[m.style],
        _tp_layout(m.desired_inputs[0]) if m.desired_inputs else None,
        _tp_layout(m.output) if m.output else DEFAULT_OUTPUT[m.style],
        m.local_output,
    )


# torchtitan/models/llama3/infra/parallelize.py `apply_tp`, with Hugging Face names:
#   tok_embeddings -> model.embed_tokens, norm -> model.norm, output -> lm_head; per block: attention_norm ->
#   input_layernorm, attention -> self_attn, wq/wk/wv/wo -> q/k/v/o_proj, ffn_norm -> post_attention_layernorm,
#   feed_forward -> mlp, w1/w3/w2 -> gate/up/down_proj.
COLWISE = ("ColwiseParallel", "Replicate()", None, "Shard(-1)", True)  # colwise_parallel()
SP = ("SequenceParallel", "Shard(1)", None, "Shard(1)", False)  # SequenceParallel()
# prepare_module_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
PREPARE_SP = ("PrepareModuleInput", "Shard(1)", "Replicate()", None, False)
ROWWISE_SP = ("RowwiseParallel", "Shard(-1)", None, "Shard(1)", True)  # rowwise_parallel(output_layouts=Shard(1))
TORCHTITAN_TP = {
    # RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    "model.embed_tokens": ("RowwiseParallel", "Replicate()", None, "Shard(1)", True),
    "model.layers.{i}.input_layernorm": SP,
    "model.layers.{i}.self_attn": PREPARE_SP,
    "model.layers.{i}.self_attn.q_proj": COLWISE,
    "model.layers.{i}.self_attn.k_proj": COLWISE,
    "model.layers.{i}.self_attn.v_proj": COLWISE,
    "model.layers.{i}.self_attn.o_proj": ROWWISE_SP,
    "model.layers.{i}.post_attention_layernorm": SP,
    "model.layers.{i}.mlp": PREPARE_SP,
    "model.layers.{i}.mlp.gate_proj": COLWISE,
    "model.layers.{i}.mlp.up_proj": COLWISE,
    "model.layers.{i}.mlp.down_proj": ROWWISE_SP,
    "model.norm": SP,
    # ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False): loss parallel
    "lm_head": ("ColwiseParallel", "Shard(1)", None, "Shard(-1)", False),
}
# torchtitan with parallelism.disable_loss_parallel: output=ColwiseParallel(..., output_layouts=Replicate(), use_local_output=True)
TORCHTITAN_TP_NO_LOSS_PARALLEL = {
    **TORCHTITAN_TP,
    "lm_head": ("ColwiseParallel", "Shard(1)", None, "Replicate()", True),
}
# No sequence parallel (torchtitan always pairs TP with SP): the residual stream stays replicated over tp, so norms
# get no style, attention/MLP inputs need no redistribution, and o/down use RowwiseParallel's Replicate output.
ROWWISE = ("RowwiseParallel", "Shard(-1)", None, "Replicate()", True)
NO_SP = {
    "model.embed_tokens": ("RowwiseParallel", "Replicate()", None, "Replicate()", True),
    "model.layers.{i}.self_attn.q_proj": COLWISE,
    "model.layers.{i}.self_attn.k_proj": COLWISE,
    "model.layers.{i}.self_attn.v_proj": COLWISE,
    "model.layers.{i}.self_attn.o_proj": ROWWISE,
    "model.layers.{i}.mlp.gate_proj": COLWISE,
    "model.layers.{i}.mlp.up_proj": COLWISE,
    "model.layers.{i}.mlp.down_proj": ROWWISE,
    "lm_head": ("ColwiseParallel", "Replicate()", None, "Shard(-1)", False),
}
NO_SP_NO_LOSS_PARALLEL = {**NO_SP, "lm_head": ("ColwiseParallel", "Replicate()", None, "Replicate()", True)}

TP_LAYOUTS = [
    # (options, expected module styles, plan.loss_parallel)
    pytest.param(PlanConfig(), TORCHTITAN_TP, True, id="sp+lp(torchtitan)"),
    pytest.param(PlanConfig(loss_parallel=False), TORCHTITAN_TP_NO_LOSS_PARALLEL, False, id="sp"),
    pytest.param(PlanConfig(sequence_parallel=False), NO_SP, True, id="lp"),
    pytest.param(PlanConfig(sequence_parallel=False, loss_parallel=False), NO_SP_NO_LOSS_PARALLEL, False, id="none"),
]


@pytest.mark.parametrize(
    "mesh",
    [MeshSpec(dp_shard=1, tp=2), MeshSpec(dp_shard=2, tp=2), MeshSpec(dp_replicate=2, dp_shard=1, tp=4)],
    ids=lambda m: m.describe(),
)
@pytest.mark.parametrize(("options", "expected", "loss_parallel"), TP_LAYOUTS)
def test_tp_layout_matches_torchtitan(mesh: MeshSpec, options: PlanConfig, expected: dict, loss_parallel: bool) -> None:
    plan = llama_plan(replace(TINY, n_heads=4, n_kv_heads=4), mesh, options)
    want = {k.format(i=i): v for k, v in expected.items() for i in range(2)}
    got = {m.fqn: torch_style(m) for m in plan.modules}
    assert got == want
    assert plan.loss_parallel is loss_parallel
    # The batch dim of every declared activation is sharded over the data-parallel axes.
    for m in plan.modules:
        for spec in (m.output, *(m.inputs or ()), *(m.desired_inputs or ())):
            if spec is not None:
                assert spec[0] == ("dp_replicate", "dp_shard"), (m.fqn, spec)


@pytest.mark.parametrize(
    "mesh",
    [MeshSpec(dp_shard=1), MeshSpec(dp_shard=2), MeshSpec(dp_replicate=2, dp_shard=2)],
    ids=lambda m: m.describe(),
)
def test_no_tp_no_module_styles(mesh: MeshSpec) -> None:
    plan = llama_plan(TINY, mesh)
    assert plan.modules == ()
    assert plan.loss_parallel is False


# -- FSDP units -------------------------------------------------------------------------------------------

UNITS = (("model.embed_tokens",), ("model.layers.0",), ("model.layers.1",), ("model.norm", "lm_head"))
UNIT_OF = {EMB: "model.embed_tokens", NORM: "model.norm + lm_head", HEAD: "model.norm + lm_head"}

FSDP = [
    # (mesh, options, expected FsdpPlan or None)
    (MeshSpec(dp_shard=1), PlanConfig(), None),
    (MeshSpec(dp_shard=1, tp=2), PlanConfig(), None),
    (
        MeshSpec(dp_shard=2),
        PlanConfig(),
        FsdpPlan(axes=("dp_shard",), units=UNITS, reshard_after_forward=True, param_dtype="float32", reduce_dtype="float32", cpu_offload=False, last_kept=True, resharding="default"),
    ),
    (
        MeshSpec(dp_shard=2, tp=2),
        PlanConfig(reshard_after_forward=False, param_dtype="bfloat16", cpu_offload=True),
        FsdpPlan(axes=("dp_shard",), units=UNITS, reshard_after_forward=False, param_dtype="bfloat16", reduce_dtype="float32", cpu_offload=True, last_kept=True),
    ),
    (
        MeshSpec(dp_replicate=2, dp_shard=2),
        PlanConfig(),
        FsdpPlan(axes=("dp_replicate", "dp_shard"), units=UNITS, reshard_after_forward=True, param_dtype="float32", reduce_dtype="float32", cpu_offload=False, last_kept=True, resharding="default", all_reduce_once=True),
    ),
    (  # micro batches summed in bf16 would round where fp32 gradients did not: each all-reduces
        MeshSpec(dp_replicate=2, dp_shard=2),
        PlanConfig(param_dtype="bfloat16", reduce_dtype="bfloat16"),
        FsdpPlan(axes=("dp_replicate", "dp_shard"), units=UNITS, reshard_after_forward=True, param_dtype="bfloat16", reduce_dtype="bfloat16", cpu_offload=False, last_kept=True, resharding="default"),
    ),
    (  # pure replication (DDP-like) is HSDP with a size-1 shard axis: nothing to free after forward
        MeshSpec(dp_replicate=2, dp_shard=1),
        PlanConfig(),
        FsdpPlan(axes=("dp_replicate", "dp_shard"), units=UNITS, reshard_after_forward=False, param_dtype="float32", reduce_dtype="float32", cpu_offload=False, last_kept=True, resharding="one shard: nothing to free", all_reduce_once=True),
    ),
    (  # one rank with mixed precision still needs fully_shard (for MixedPrecisionPolicy), which keeps its gathers
        MeshSpec(dp_shard=1),
        PlanConfig(param_dtype="bfloat16"),
        FsdpPlan(axes=("dp_shard",), units=UNITS, reshard_after_forward=False, param_dtype="bfloat16", reduce_dtype="float32", cpu_offload=False, last_kept=True, resharding="one shard: nothing to free"),
    ),
    (  # an explicit setting wins over the one-shard default
        MeshSpec(dp_shard=1),
        PlanConfig(param_dtype="bfloat16", reshard_after_forward=True),
        FsdpPlan(axes=("dp_shard",), units=UNITS, reshard_after_forward=True, param_dtype="bfloat16", reduce_dtype="float32", cpu_offload=False, last_kept=True),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("mesh", "options", "fsdp"), FSDP)
def test_fsdp_units(mesh: MeshSpec, options: PlanConfig, fsdp: FsdpPlan | None) -> None:
    plan = llama_plan(TINY, mesh, options)
    assert plan.fsdp == fsdp
    for p in plan.params:
        if fsdp is None:
            assert p.fsdp_unit is None
        else:
            layer = re.match(r"model\.layers\.\d+", p.fqn)
            assert p.fsdp_unit == (layer.group(0) if layer else UNIT_OF[p.fqn]), p.fqn
        if mesh.dp_shard == 1:
            assert "dp_shard" not in _spec_axes(p.spec), p.fqn


def test_the_table_says_why_fsdp_reshards_or_not() -> None:
    one = llama_plan(TINY, MeshSpec(dp_shard=1), PlanConfig(param_dtype="bfloat16")).table()
    assert "reshard_after_forward=False (one shard: nothing to free)" in one
    two = llama_plan(TINY, MeshSpec(dp_shard=2)).table()
    assert "reshard_after_forward=True (default; not model.norm + lm_head)" in two
    set_ = llama_plan(TINY, MeshSpec(dp_shard=1), PlanConfig(param_dtype="bfloat16", reshard_after_forward=True))
    assert "reshard_after_forward=True (not model.norm + lm_head) param" in set_.table()


def _spec_axes(spec: tuple) -> tuple[str, ...]:
    return tuple(a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))


# -- tied embeddings ---------------------------------------------------------------------------------------


def test_tied_embeddings_lm_head_is_an_alias() -> None:
    plan = llama_plan(TINY_TIED, MeshSpec(dp_shard=2, tp=2))
    assert "lm_head.weight" not in {p.fqn for p in plan.params}
    head = plan.param("lm_head.weight")
    assert head.fqn == EMB and head.aliases == ("lm_head.weight",)
    assert head.spec == (("tp", "dp_shard"), None) and head.local_shape == (64, 64)
    assert sum(math.prod(p.shape) for p in plan.params) == TINY_TIED.n_params
    assert "lm_head.weight" not in [r.pattern for r in plan.rules.params]


def test_tied_embeddings_fsdp_units_exclude_embedding_and_head() -> None:
    plan = llama_plan(TINY_TIED, MeshSpec(dp_shard=2, tp=2))
    assert plan.fsdp is not None
    assert plan.fsdp.units == (("model.layers.0",), ("model.layers.1",))
    assert not plan.fsdp.last_kept  # the output layer is the root's, which torch keeps gathered itself
    assert plan.param(EMB).fsdp_unit == "" and plan.param(NORM).fsdp_unit == ""  # the root


def test_tied_embeddings_with_untied_units_is_an_error() -> None:
    rules = llama_rules(TINY)  # puts embed_tokens and lm_head in different FSDP units
    with pytest.raises(
        ValueError,
        match=r"^model\.embed_tokens\.weight: this tied parameter lies in FSDP units \['model\.embed_tokens', "
        r"'model\.norm \+ lm_head'\]; leave those modules to the root \(drop them from rules\.fsdp_units\)$",
    ):
        llama_plan(TINY_TIED, MeshSpec(dp_shard=2, tp=2), rules=with_params(rules, drop=(HEAD,)))


def test_tied_embeddings_keep_lm_head_colwise_and_loss_parallel() -> None:
    plan = llama_plan(TINY_TIED, MeshSpec(dp_shard=2, tp=2))
    head = plan.module("lm_head")
    assert head is not None and torch_style(head) == TORCHTITAN_TP["lm_head"]
    assert plan.loss_parallel


def test_rule_for_a_tied_alias_says_it_is_an_alias() -> None:
    rules = with_params(llama_rules(TINY_TIED), Rule(pattern=HEAD, axes=("vocab", "embed")))
    with pytest.raises(ValueError, match=r"lm_head\.weight.*(tied|alias)"):
        llama_plan(TINY_TIED, MeshSpec(dp_shard=2, tp=2), rules=rules)


# -- JSON round trip, versions, mesh check ---------------------------------------------------------------


def _round_trip_plans() -> list:
    out = [pytest.param(TINY, mesh, PlanConfig(), id=mesh_id) for mesh_id, (mesh, _) in LAYOUTS.items()]
    out += [
        pytest.param(TINY_TIED, MeshSpec(dp_shard=2, tp=2), PlanConfig(), id="tied"),
        pytest.param(
            TINY,
            MeshSpec(dp_shard=2, tp=2),
            PlanConfig(activation_checkpoint="selective", ac_every=3, compile=True),
            id="ac",
        ),
    ]
    return out


@pytest.mark.parametrize(("cfg", "mesh", "options"), _round_trip_plans())
def test_plan_json_round_trip(cfg: ModelConfig, mesh: MeshSpec, options: PlanConfig) -> None:
    plan = llama_plan(cfg, mesh, options)
    data = plan.to_json()
    assert Plan.from_json(data) == plan
    assert Plan.from_json(data.decode()) == plan
    assert Plan.from_json(data).to_json() == data


def test_plan_json_round_trip_with_uncovered_and_logical_fallbacks() -> None:
    plan = make_plan(_net(), MeshSpec(dp_shard=2, tp=2), NET_LOGICAL_RULES, PlanConfig(allow_uncovered=True))
    assert any(p.rule is None for p in plan.params) and any(p.fallbacks for p in plan.params)
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_from_json_wrong_version() -> None:
    data = llama_plan(TINY, MeshSpec(dp_shard=2)).to_json().replace(b'"version": 2,', b'"version": 1,', 1)
    with pytest.raises(
        ValueError, match=r"^plan: version 1 is not supported \(this shardlab reads 2\); re-run make_plan$"
    ):
        Plan.from_json(data)


def test_plan_check_mesh() -> None:
    plan = llama_plan(TINY, MeshSpec(dp_shard=2, tp=2))
    plan.check_mesh(MeshSpec(dp_shard=2, tp=2))
    with pytest.raises(
        ValueError,
        match=r"^plan: made for mesh dp_shard=2 x tp=2 \(4 ranks\) but used with dp_shard=4 \(4 ranks\); re-run make_plan for this mesh$",
    ):
        plan.check_mesh(MeshSpec(dp_shard=4))
    with pytest.raises(
        ValueError, match=r"^plan: made for mesh dp_shard=2 x tp=2 \(4 ranks\) but used with dp_shard=2 x tp=2 x ep=2"
    ):
        plan.check_mesh(MeshSpec(dp_shard=2, tp=2, ep=2))


def test_plan_param_lookup() -> None:
    plan = llama_plan(TINY, MeshSpec(dp_shard=2))
    assert plan.param("model.layers.1." + WQ).shape == (64, 64)
    with pytest.raises(KeyError, match="'nope' is not a parameter of this plan"):
        plan.param("nope")
    assert plan.module("nope") is None
    assert plan.bytes_per_rank == sum(p.bytes_per_rank for p in plan.params) == TINY.n_params * 4 // 2


# -- explain and table -----------------------------------------------------------------------------------


def test_explain_names_the_rule_and_the_shadowed_ones() -> None:
    rules = with_params(
        llama_rules(TINY), Rule(pattern="**.weight", spec=()), Rule(pattern="model.layers.*.mlp.*.weight", spec=())
    )
    plan = llama_plan(TINY, MeshSpec(dp_shard=2, tp=2), rules=rules)
    assert plan.explain("model.layers.1.mlp.gate_proj.weight").splitlines() == [
        "model.layers.1.mlp.gate_proj.weight  shape (128, 64)  spec P(('tp', 'dp_shard'), None)",
        "  rule 5: 'model.layers.*.mlp.gate_proj.weight' -> axes ('mlp', 'embed')  (first match wins)",
        "  shadowed rule 12: '**.weight' -> P()",
        "  shadowed rule 13: 'model.layers.*.mlp.*.weight' -> P()",
        "  FSDP unit model.layers.1 over dp_shard: dim 0 gets them as its minor axes",
        "  placements dp_shard:_S(0, 2) tp:S(0)  local (32, 64)  8,192 bytes/rank",
    ]
    assert plan.explain(NORM).splitlines() == [
        "model.norm.weight  shape (64,)  spec P('dp_shard')",
        "  rule 10: 'model.norm.weight' -> axes ('embed',)  (first match wins)",
        "  shadowed rule 12: '**.weight' -> P()",
        "  FSDP unit model.norm + lm_head over dp_shard: dim 0 gets them as its minor axes",
        "  placements dp_shard:S(0) tp:R  local (32,)  128 bytes/rank",
    ]


def test_explain_without_shadowing_fsdp_or_tp() -> None:
    plan = llama_plan(TINY, MeshSpec(dp_shard=1))
    assert plan.explain(EMB).splitlines() == [
        "model.embed_tokens.weight  shape (256, 64)  spec P('tp', None)",
        "  rule 0: 'model.embed_tokens.weight' -> axes ('vocab', 'embed')  (first match wins)",
        "  placements R  local (256, 64)  65,536 bytes/rank",
    ]


def test_explain_tied_alias() -> None:
    plan = llama_plan(TINY_TIED, MeshSpec(dp_shard=2))
    text = plan.explain("lm_head.weight")
    assert text.startswith("model.embed_tokens.weight  shape (256, 64)")
    assert "  FSDP unit <root> over dp_shard" in text
    assert text.endswith("  alias lm_head.weight")


def test_table_collapses_repeated_layers() -> None:
    plan = llama_plan(TINY, MeshSpec(dp_shard=2, tp=2))
    text = plan.table()
    assert str(plan) == text
    lines = text.splitlines()
    assert lines[0] == "Plan for mesh dp_shard=2 x tp=2 (4 ranks)  params 106,816  0.1 MiB/rank (params)"
    assert re.search(
        r"^model\.layers\.\*\.self_attn\.q_proj\.weight \(x2\) +64x64 +P\(\(tp,dp_shard\), None\) +dp_shard:_S\(0, 2\) tp:S\(0\) +16x64 ",
        text,
        re.M,
    )
    assert re.search(r"^model\.embed_tokens\.weight +256x64 ", text, re.M)
    assert re.search(
        r"^model\.layers\.\*\.self_attn \(x2\) +prepare_input +P\(dp, tp, None\) -> P\(dp, None, None\) +-$", text, re.M
    )
    assert re.search(r"^lm_head +colwise +P\(dp, tp, None\) +P\(dp, None, tp\)$", text, re.M)
    assert "model.layers.0" not in text and "model.layers.1" not in text
    assert text.count("(x2)") == 9 + 11  # 9 parameters and 11 modules per block
    assert "FSDP over dp_shard: 4 units + root (model.embed_tokens, model.layers.*, model.norm + lm_head); " in text
    assert lines[-1] == "loss_parallel=True  activation_checkpoint=none  compile=False"


def test_table_without_collapse_lists_every_layer() -> None:
    text = llama_plan(TINY, MeshSpec(dp_shard=2, tp=2)).table(collapse=False)
    assert "(x2)" not in text and "model.layers.*" not in text.split("\n\n")[0]
    for i in range(2):
        assert f"model.layers.{i}.mlp.down_proj.weight " in text
        assert f"model.layers.{i}.self_attn.o_proj " in text


def test_table_keeps_layers_that_differ_apart() -> None:
    base = llama_rules(TINY)
    rules = replace(base, params=(Rule(pattern="model.layers.0.self_attn.q_proj.weight", spec=()), *base.params))
    text = llama_plan(TINY, MeshSpec(dp_shard=2), rules=rules).table()
    assert "model.layers.0.self_attn.q_proj.weight " in text and "model.layers.1.self_attn.q_proj.weight " in text
    assert "q_proj.weight (x2)" not in text
    assert "model.layers.*.self_attn.k_proj.weight (x2)" in text


def test_table_single_rank_without_fsdp_or_modules() -> None:
    text = llama_plan(TINY, MeshSpec(dp_shard=1)).table()
    assert "FSDP" not in text and "module " not in text
    assert re.search(r"^model\.norm\.weight +64 +P\(None\) +R +64 ", text, re.M)


# -- planner errors ------------------------------------------------------------------------------------------

BASE = llama_rules(TINY)
TP2 = MeshSpec(dp_shard=1, tp=2)
FSDP2_TP2 = MeshSpec(dp_shard=2, tp=2)

PLAN_ERRORS = [
    # (id, model config, mesh, rules, options, message regex)
    (
        "unused_rule", TINY, FSDP2_TP2, with_params(BASE, Rule(pattern="model.layers.*.attn.wqkv.weight", spec=(None,))), PlanConfig(),
        r"^rules\[12\] 'model\.layers\.\*\.attn\.wqkv\.weight' matched no parameter; fix the glob or set plan\.allow_unused_rules=True$",
    ),
    (
        "uncovered", TINY, FSDP2_TP2, with_params(BASE, drop=(HEAD,)), PlanConfig(),
        r"^lm_head\.weight: no rule covers this parameter; add a rule for it \(spec=\(None,\) \* ndim replicates\) "
        r"or set plan\.allow_uncovered=True$",
    ),
    (
        "uncovered_many", TINY, FSDP2_TP2, with_params(BASE, drop=("model.layers.*.input_layernorm.weight", "model.norm.weight")), PlanConfig(),
        r"^model\.layers\.0\.input_layernorm\.weight \(and 2 more\): no rule covers this parameter; ",
    ),
    (
        "indivisible", replace(TINY, ffn_dim=100), MeshSpec(dp_shard=1, tp=8), llama_rules(replace(TINY, ffn_dim=100)), PlanConfig(),
        r"^model\.layers\.0\.mlp\.gate_proj\.weight: dim 0 \(size 100\) is not divisible by tp=8; pick axis sizes that divide it$",
    ),
]  # fmt: skip

SPEC_RULE_ERRORS = [
    # (id, spec given to q_proj by a leading rule, message regex after the parameter name)
    ("unknown_axis", ("tq", None), r"unknown mesh axis 'tq' in P\('tq', None\); valid axes are pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp, batch$"),
    ("axis_twice", ("tp", "tp"), r"mesh axis 'tp' is used twice in P\('tp', 'tp'\); an axis can shard one dim once$"),
    ("axis_twice_in_tuple", (("tp", "cp"), "cp"), r"mesh axis 'cp' is used twice in P\(\('tp', 'cp'\), 'cp'\); "),
    ("axis_twice_via_view", ("dp", "dp_shard"), r"mesh axis 'dp_shard' is used twice in P\('dp', 'dp_shard'\); "),
    ("dp_shard", ("dp_shard", None), r"rules\[0\] 'model\.layers\.\*\.self_attn\.q_proj\.weight' puts 'dp_shard' in a parameter spec; "
     r"FSDP shards parameters over the data-parallel axes itself: use model-parallel axes \(tp\) in rules$"),
    ("dp_replicate", (None, "dp_replicate"), r"rules\[0\] .* puts 'dp_replicate' in a parameter spec; "),
    ("dp_view", ("dp", None), r"rules\[0\] .* puts 'dp' in a parameter spec; "),
    ("batch_view", (("tp", "batch"), None), r"rules\[0\] .* puts 'batch' in a parameter spec; "),
    ("pp", ("pp", None), r"rules\[0\] .* puts 'pp' in a parameter spec; "),
    ("too_many_entries", ("tp", None, None), r"rule 0 'model\.layers\.\*\.self_attn\.q_proj\.weight' gives 3 entries for a 2-dim parameter; fix the rule$"),
]  # fmt: skip

for _id, _spec, _msg in SPEC_RULE_ERRORS:
    _rules = replace(BASE, params=(Rule(pattern="model.layers.*.self_attn.q_proj.weight", spec=_spec), *BASE.params))
    PLAN_ERRORS.append(
        (_id, TINY, FSDP2_TP2, _rules, PlanConfig(), r"^model\.layers\.0\.self_attn\.q_proj\.weight: " + _msg)
    )

PLAN_ERRORS += [
    (
        "unknown_axis_in_logical_table", TINY, FSDP2_TP2, replace(BASE, logical=(("heads", "tq"), *BASE.logical)), PlanConfig(),
        r"^model\.layers\.0\.self_attn\.q_proj\.weight: unknown mesh axis 'tq' in P\('tq', None\); ",
    ),
    (
        "unknown_logical_name", TINY, FSDP2_TP2, replace(BASE, logical=tuple(p for p in BASE.logical if p[0] != "mlp")), PlanConfig(),
        r"^model\.layers\.0\.mlp\.gate_proj\.weight: logical axis 'mlp' has no entry in the logical table; add \('mlp', None\) to replicate it$",
    ),
    (
        "ac_without_blocks", TINY, FSDP2_TP2, replace(BASE, blocks=()), PlanConfig(activation_checkpoint="full"),
        r"^plan\.activation_checkpoint is set but rules\.blocks matched no module; add the block glob \(e\.g\. 'model\.layers\.\*'\)$",
    ),
    (
        "ac_blocks_match_nothing", TINY, FSDP2_TP2, replace(BASE, blocks=("model.blocks.*",)), PlanConfig(activation_checkpoint="selective"),
        r"^plan\.activation_checkpoint is set but rules\.blocks matched no module; ",
    ),
    (
        "activation_glob", TINY, FSDP2_TP2, replace(BASE, activations=(*BASE.activations, Activation(pattern="model.layers.*.attn"))), PlanConfig(),
        r"^rules\.activations\[9\] 'model\.layers\.\*\.attn' matched no module; fix the glob$",
    ),
    (
        "fsdp_unit_glob", TINY, FSDP2_TP2, replace(BASE, fsdp_units=(("model.blocks.*",),)), PlanConfig(),
        r"^rules\.fsdp_units\[0\] 'model\.blocks\.\*' matched no module; fix the glob$",
    ),
    (
        "unresolved_mesh", TINY, MeshSpec(tp=2), BASE, PlanConfig(),
        r"^make_plan: the mesh has a -1 axis; call MeshSpec\.resolve\(world_size\) first$",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "mesh", "rules", "options", "message"), [pytest.param(*e[1:], id=e[0]) for e in PLAN_ERRORS]
)
def test_plan_errors(cfg: ModelConfig, mesh: MeshSpec, rules: Rules, options: PlanConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llama_plan(cfg, mesh, options, rules=rules)


def test_allow_unused_rules_opt_out() -> None:
    rules = with_params(BASE, Rule(pattern="model.layers.*.attn.wqkv.weight", spec=(None,)))
    plan = llama_plan(TINY, FSDP2_TP2, PlanConfig(allow_unused_rules=True), rules=rules)
    assert plan.rules.params[12].pattern == "model.layers.*.attn.wqkv.weight"
    assert all(p.rule != 12 for p in plan.params)


def test_allow_uncovered_opt_out_replicates_and_still_fsdp_shards() -> None:
    rules = with_params(BASE, drop=(HEAD,))
    plan = llama_plan(TINY, FSDP2_TP2, PlanConfig(allow_uncovered=True), rules=rules)
    head = plan.param(HEAD)
    assert (head.rule, head.spec, head.placements, head.local_shape) == (
        None,
        ("dp_shard", None),
        pl(dp_shard="S(0)"),
        (128, 64),
    )
    assert "no rule matched: replicated because plan.allow_uncovered=True" in plan.explain(HEAD)
    assert re.search(r"^lm_head\.weight .* -$", plan.table(), re.M)
    # A replicated lm_head is no longer colwise: no loss parallel (the plan says so rather than pretending).
    assert plan.module("lm_head") is None and plan.loss_parallel is False


def test_activation_checkpoint_blocks() -> None:
    plan = llama_plan(TINY, FSDP2_TP2, PlanConfig(activation_checkpoint="selective", ac_every=3, compile=True))
    assert plan.blocks == ("model.layers.0", "model.layers.1")
    assert (plan.activation_checkpoint, plan.ac_every, plan.compile) == ("selective", 3, True)


def test_compile_without_blocks_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"rules\.blocks matched no module"):
        llama_plan(TINY, FSDP2_TP2, PlanConfig(compile=True), rules=replace(BASE, blocks=()))


def test_activation_glob_checked_without_tp() -> None:
    rules = replace(BASE, activations=(*BASE.activations, Activation(pattern="model.layers.*.attn")))
    with pytest.raises(ValueError, match=r"^rules\.activations\[9\] 'model\.layers\.\*\.attn' matched no module"):
        llama_plan(TINY, MeshSpec(dp_shard=2), rules=rules)


def test_fsdp_unit_glob_checked_without_dp() -> None:
    with pytest.raises(ValueError, match=r"^rules\.fsdp_units\[0\] 'model\.blocks\.\*' matched no module"):
        llama_plan(TINY, TP2, rules=replace(BASE, fsdp_units=(("model.blocks.*",),)))


# -- real Llama 3 shapes --------------------------------------------------------------------------------------

BIG = [
    # (size, world, mesh, number of tensors, {fqn: (local shape, padded)})
    (
        "405B", 4096, MeshSpec(dp_shard=-1, tp=8), 1 + 126 * 9 + 2,
        {
            EMB: ((32, 16384), True),  # 128256 / 8 = 16032 rows per tp shard, over 512 FSDP shards: 31.3 -> 32 (padded)
            "model.layers.125.self_attn.q_proj.weight": ((4, 16384), False),
            # 1024 / 8 = 128 rows over 512 shards: dim 0 would leave 3/4 of the shards padding, so FSDP shards dim 1
            "model.layers.0.self_attn.k_proj.weight": ((128, 32), False),
            "model.layers.7.mlp.down_proj.weight": ((32, 6656), False),
            NORM: ((32,), False),
            HEAD: ((32, 16384), True),
        },
    ),
    (
        "8B", 1024, MeshSpec(pp=1, dp_shard=128, tp=8), 1 + 32 * 9 + 2,
        {
            EMB: ((126, 4096), True),  # 16032 / 128 = 125.25
            "model.layers.31.self_attn.q_proj.weight": ((4, 4096), False),
            "model.layers.0.self_attn.v_proj.weight": ((1, 4096), False),
            "model.layers.3.mlp.gate_proj.weight": ((14, 4096), False),
            "model.layers.3.mlp.down_proj.weight": ((32, 1792), False),
            HEAD: ((126, 4096), True),
        },
    ),
]  # fmt: skip


@pytest.mark.parametrize(("size", "world", "mesh", "n_tensors", "locals_"), BIG, ids=[b[0] for b in BIG])
def test_real_llama3_shapes_plan_on_a_laptop(
    size: str, world: int, mesh: MeshSpec, n_tensors: int, locals_: dict
) -> None:
    cfg = SIZES[size]
    mesh = mesh.resolve(world)
    plan = make_plan(meta_llama(cfg), mesh, llama_rules(cfg))
    assert len(plan.params) == n_tensors
    assert sum(math.prod(p.shape) for p in plan.params) == cfg.n_params
    for fqn, (local, padded) in locals_.items():
        p = plan.param(fqn)
        assert (p.local_shape, p.padded) == (local, padded), fqn
    assert plan.fsdp is not None and len(plan.fsdp.units) == 1 + cfg.n_layers + 1
    assert len(plan.modules) == 1 + 11 * cfg.n_layers + 2
    assert plan.loss_parallel


# -- any nn.Module, by names --------------------------------------------------------------------------------


class Net(nn.Module):
    """Not a Llama: custom names, a ModuleDict, a bias, a loose Parameter on a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict({"proj_in": nn.Linear(32, 64), "proj_out": nn.Linear(64, 32)})
        self.gain = nn.Module()
        self.gain.scale = nn.Parameter(torch.ones(32))
        self.head = nn.Linear(32, 10, bias=False)


def _net() -> Net:
    with torch.device("meta"):
        return Net()


NET_RULES = Rules(
    params=(
        Rule(pattern="encoder.proj_in.*", spec=("tp",)),  # colwise: weight dim 0 and the bias
        Rule(pattern="encoder.proj_out.weight", spec=(None, "tp")),  # rowwise
        Rule(pattern="**", spec=()),  # everything else replicated
    )
)
NET_LAYOUT = [
    # (mesh, fqn, spec, placements, local, rule)
    (TP2, "gain.scale", (None,), pl(), (32,), 2),
    (TP2, "encoder.proj_in.weight", ("tp", None), pl(tp="S(0)"), (32, 32), 0),
    (TP2, "encoder.proj_in.bias", ("tp",), pl(tp="S(0)"), (32,), 0),
    (TP2, "encoder.proj_out.weight", (None, "tp"), pl(tp="S(1)"), (32, 32), 1),
    (TP2, "encoder.proj_out.bias", (None,), pl(), (32,), 2),
    (TP2, "head.weight", (None, None), pl(), (10, 32), 2),
    (FSDP2_TP2, "gain.scale", ("dp_shard",), pl(dp_shard="S(0)"), (16,), 2),
    (FSDP2_TP2, "encoder.proj_in.weight", (("tp", "dp_shard"), None), TP_S0_FSDP, (16, 32), 0),
    (FSDP2_TP2, "encoder.proj_in.bias", (("tp", "dp_shard"),), TP_S0_FSDP, (16,), 0),
    (FSDP2_TP2, "encoder.proj_out.weight", ("dp_shard", "tp"), pl(dp_shard="S(0)", tp="S(1)"), (16, 32), 1),
    (FSDP2_TP2, "head.weight", ("dp_shard", None), pl(dp_shard="S(0)"), (5, 32), 2),
    # 10 rows over 4 FSDP shards: padded to 3 per rank
    (MeshSpec(dp_shard=4), "head.weight", ("dp_shard", None), pl(dp_shard="S(0)"), (3, 32), 2),
]


@pytest.mark.parametrize(("mesh", "fqn", "spec", "placements", "local", "rule"), NET_LAYOUT)
def test_any_module_by_names(mesh: MeshSpec, fqn: str, spec: tuple, placements: tuple, local: tuple, rule: int) -> None:
    plan = make_plan(_net(), mesh, NET_RULES)
    p = plan.param(fqn)
    assert (p.spec, p.placements, p.local_shape, p.rule) == (spec, placements, local, rule)
    assert p.padded is (mesh.dp_shard == 4 and fqn == "head.weight")
    assert [(m.fqn, m.style) for m in plan.modules] == (
        [("encoder.proj_in", "colwise"), ("encoder.proj_out", "rowwise")] if mesh.tp > 1 else []
    )
    if mesh.dp_shard > 1:
        assert plan.fsdp is not None and plan.fsdp.units == () and p.fsdp_unit == ""  # no units: the root takes all


NET_LOGICAL_RULES = Rules(
    params=(
        Rule(pattern="encoder.proj_in.weight", axes=("mlp", "embed")),
        Rule(pattern="encoder.proj_out.weight", axes=("embed", "mlp")),
        Rule(pattern="encoder.proj_in.bias", axes=("mlp",)),
        Rule(pattern="encoder.proj_out.bias", axes=(None,)),
    ),
    logical=(("mlp", "tp"), ("embed", "tp"), ("embed", None)),
)


def test_any_module_with_logical_axes_reports_fallbacks() -> None:
    plan = make_plan(_net(), TP2, NET_LOGICAL_RULES, PlanConfig(allow_uncovered=True))
    p = plan.param("encoder.proj_out.weight")
    assert (p.spec, p.fallbacks) == ((None, "tp"), ("embed->None",))
    assert "  logical fallback: embed->None" in plan.explain("encoder.proj_out.weight").splitlines()
    assert plan.param("head.weight").rule is None


NET_ERRORS = [
    (
        Rules(params=(Rule(pattern="encoder.proj_in.weight", spec=("tp",)), Rule(pattern="**", spec=()))),
        r"^encoder\.proj_in\.bias: a colwise Linear needs its bias sharded over tp; fix its rule$",
    ),
    (
        Rules(params=(Rule(pattern="encoder.proj_out.*", spec=(None, "tp")), Rule(pattern="**", spec=()))),
        r"^encoder\.proj_out\.bias: rule 0 'encoder\.proj_out\.\*' gives 2 entries for a 1-dim parameter; fix the rule$",
    ),
    (
        Rules(params=(Rule(pattern="encoder.proj_out.weight", spec=(None, "tp")), Rule(pattern="encoder.proj_out.bias", spec=("tp",)), Rule(pattern="**", spec=()))),
        r"^encoder\.proj_out\.bias: a rowwise Linear needs its bias replicated over tp; fix its rule$",
    ),
    (
        Rules(params=(Rule(pattern="gain.scale", spec=("tp",)), Rule(pattern="**", spec=()))),
        r"^gain\.scale: tp-sharded parameters of a Module; shardlab derives TP styles for nn\.Linear and nn\.Embedding "
        r"weights only: replicate these parameters over tp$",
    ),
    (
        Rules(params=(Rule(pattern="head.weight", spec=("tp",)), Rule(pattern="**", spec=()))),
        r"^head\.weight: dim 0 \(size 10\) is not divisible by tp=4; pick axis sizes that divide it$",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("rules", "message"), NET_ERRORS)
def test_any_module_errors(rules: Rules, message: str) -> None:
    mesh = MeshSpec(dp_shard=1, tp=4) if "size 10" in message else TP2
    with pytest.raises(ValueError, match=message):
        make_plan(_net(), mesh, rules)


class RootParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(32))


def test_root_module_error_names_the_parameter() -> None:
    with torch.device("meta"):
        model = RootParam()
    with pytest.raises(ValueError, match=r"^scale: "):
        make_plan(model, TP2, Rules(params=(Rule(pattern="scale", spec=("tp",)),)))


# -- golden plans -------------------------------------------------------------------------------------------

_spec = importlib.util.spec_from_file_location("golden_regenerate", Path(__file__).parent / "golden" / "regenerate.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


def _first_difference(want: Plan, got: Plan) -> str:
    a, b = msgspec.to_builtins(want), msgspec.to_builtins(got)
    for key in a:
        if a[key] != b[key]:
            if isinstance(a[key], list) and isinstance(b[key], list):
                for x, y in zip(a[key], b[key]):
                    if x != y:
                        return f"{key}: golden {x} != now {y}"
                return f"{key}: golden has {len(a[key])} entries, now {len(b[key])}"
            return f"{key}: golden {a[key]} != now {b[key]}"
    return "(no field differs)"


@pytest.mark.parametrize("name", list(golden.CASES))
def test_golden_plan(name: str) -> None:
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    file = golden.path(name)
    assert file.exists(), f"{file} is missing; run `python tests/golden/regenerate.py`"
    want = Plan.from_json(file.read_bytes())
    got = golden.build(name)
    assert got == want, (
        f"make_plan no longer gives {file.name}: {_first_difference(want, got)}\n"
        "If the change is intended, run `python tests/golden/regenerate.py` and review the diff of tests/golden/plans/."
    )
