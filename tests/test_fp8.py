"""FP8 (plan.fp8, torchao's Float8Linear) in one process: which linears the plan converts and why the others are
kept, the table, the bad inputs; each recipe's loss curve beside the bf16 run's, on shardlab's Llama and on a
transformers model; compile and op-level checkpointing with FP8. Multi-rank layouts, the scales FSDP's float8
all-gather reads, resume and export: tests/worlds/test_fp8.py.

Tolerance: FP8 rounds every matmul's operands to 3 mantissa bits, so its curve is not bf16's. Measured on `tiny`
(4 steps, lr 1e-2): at most 3.5e-3 from the fp32 curve for every recipe, 4.7e-3 from the bf16 one; FP8_TOL leaves
about 4x that. A broken cast (no scaling: e4m3 saturates at 448) or wrong gradients move it by far more.
"""

from __future__ import annotations

import re

import msgspec
import pytest
import torch
from torch import nn

from shardlab.config import MeshSpec, ModelConfig, MoEConfig, PlanConfig
from shardlab.models.llama.model import Llama
from shardlab.models.llama.rules import llama_rules
from shardlab.sharding.plan import make_plan

pytest.importorskip("torchao")

from worlds.layouts import curves, tiny, with_plan  # tests/ is on the path: the gloo worlds' parity model


@pytest.fixture(autouse=True)
def no_world_left():
    """bf16 on one rank trains under FSDP, so train() joins a world of one: leave none to the next tests."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


FP8_TOL = 0.02
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)


def plan_of(model_cfg: ModelConfig, mesh: MeshSpec = MeshSpec(dp_shard=1), rules=None, **options):
    opts = PlanConfig(**options)
    with torch.device("meta"):
        model = Llama(model_cfg)
    return make_plan(model, mesh.resolve(mesh.world_size), rules or llama_rules(model_cfg, opts), opts)


def test_every_block_linear_is_fp8_and_the_head_is_not():
    plan = plan_of(TINY, fp8="tensorwise")
    names = {f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}  # fmt: skip
    assert set(plan.fp8.linears) == names and plan.fp8.kept == ()
    assert not plan.fp8.all_gather  # one rank: nothing to gather
    assert plan_of(TINY, fp8="none").fp8 is None
    assert plan_of(TINY, MeshSpec(dp_shard=2), fp8="tensorwise").fp8.all_gather
    assert not plan_of(TINY, MeshSpec(dp_shard=2), fp8="rowwise").fp8.all_gather  # torchao gathers tensorwise only
    table = plan_of(TINY, MeshSpec(dp_shard=2), fp8="tensorwise").table()
    assert re.search(r"^model\.layers\.\*\.mlp\.up_proj\.weight .* float8$", table, re.M)
    assert re.search(r"^lm_head\.weight .* -$", table, re.M)
    assert "FP8 tensorwise (torchao Float8Linear): 14 linears" in table
    assert "FSDP all-gathers their weights in float8 over dp_shard" in table


def test_rules_name_more_fp8_linears_or_keep_some_out():
    rules = msgspec.structs.replace(llama_rules(TINY, PlanConfig()), fp8_modules=("lm_head",),
                                    fp8_exclude=("model.layers.*.mlp.down_proj",))  # fmt: skip
    plan = plan_of(TINY, rules=rules, fp8="rowwise")
    assert "lm_head" in plan.fp8.linears and not any("down_proj" in f for f in plan.fp8.linears)
    assert ("model.layers.0.mlp.down_proj", "rules.fp8_exclude") in plan.fp8.kept
    bad = msgspec.structs.replace(rules, fp8_modules=("model.norm",))
    with pytest.raises(ValueError, match=r"^rules.fp8_modules\[0\] 'model.norm' matched no nn.Linear; fix the glob$"):
        plan_of(TINY, rules=bad, fp8="rowwise")


def test_linears_whose_local_dims_do_not_align_are_kept_with_the_reason():
    """k/v projections of 2 kv heads x 16 dims are 32 rows: 8 per rank over tp 4, not a multiple of 16."""
    plan = plan_of(TINY, MeshSpec(dp_shard=1, tp=4), fp8="tensorwise", allow_unused_axes=True)
    assert ("model.layers.0.self_attn.k_proj", "out_features 8 per tp rank (32 / 4) is not a multiple of 16") in (
        plan.fp8.kept
    )
    assert "model.layers.0.self_attn.q_proj" in plan.fp8.linears
    assert "kept in the compute dtype: model.layers.*.self_attn.k_proj (out_features 8 per tp rank" in plan.table()


def test_the_moe_router_stays_in_the_compute_dtype():
    moe = msgspec.structs.replace(TINY, moe=MoEConfig(n_experts=16, top_k=2, expert_ffn_dim=64))
    plan = plan_of(moe, fp8="tensorwise")
    assert ("model.layers.0.mlp.router", "rules.fp8_exclude") in plan.fp8.kept
    assert not any("router" in f or "experts" in f for f in plan.fp8.linears)


def test_a_model_without_a_qualifying_linear_is_refused_in_one_line():
    odd = ModelConfig(dim=40, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=72, vocab_size=256)
    with pytest.raises(ValueError, match=r"^plan.fp8='tensorwise': no linear qualifies for float8 \(model.layers.0."
                       r"self_attn.q_proj: out_features 40 is not a multiple of 16\).*set plan.fp8='none'$"):  # fmt: skip
        plan_of(odd, fp8="tensorwise")


@pytest.fixture(scope="module")
def bf16():
    return curves(tiny(param_dtype="bfloat16"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_follows_the_bf16_curve(bf16, recipe):
    got = curves(tiny(param_dtype="bfloat16", fp8=recipe))
    diff = max(abs(a - b) for a, b in zip(got["loss"], bf16["loss"]))
    assert diff < FP8_TOL, (recipe, got["loss"], bf16["loss"])
    assert got["loss"] != bf16["loss"]  # the matmuls did run in float8


def test_a_transformers_model_trains_in_fp8(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    base = msgspec.structs.replace(tiny(param_dtype="bfloat16"), model=ModelConfig(hf_path=str(tmp_path)))
    want = curves(base)["loss"]
    got = curves(with_plan(base, fp8="tensorwise"))["loss"]
    assert max(abs(a - b) for a, b in zip(got, want)) < FP8_TOL and got != want, (got, want)


@pytest.mark.world  # a cold torch.compile (inductor on CPU): the full suite's tier
def test_fp8_compiles_and_checkpoints_by_op():
    """torch.compile of FP8 blocks (inductor on CPU) with op-level checkpointing, which keeps every other float8
    matmul's output: the same curve as eager FP8 without checkpointing, within float rounding."""
    eager = curves(tiny(fp8="tensorwise"))["loss"]
    got = curves(tiny(fp8="tensorwise", compile=True, activation_checkpoint="op"))["loss"]
    assert max(abs(a - b) for a, b in zip(got, eager)) < 1e-4, (got, eager)


def test_op_checkpointing_keeps_float8_matmuls():
    from shardlab.parallel._activation_checkpoint import MATMULS

    assert torch.ops.aten._scaled_mm.default in MATMULS


def test_float8_linears_keep_their_parameter_names():
    """Checkpoints stay plain: Float8Linear holds `weight` (and `bias`) where nn.Linear did."""
    from shardlab.parallel.fp8 import convert

    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 16, bias=False))
    plan = plan_of(TINY, fp8="rowwise").fp8
    names = [n for n, _ in model.named_parameters()]
    convert(model, msgspec.structs.replace(plan, linears=("0", "1")))
    assert [n for n, _ in model.named_parameters()] == names
    assert type(model[0]).__name__ == "Float8Linear"


def test_without_torchao_the_config_says_how_to_install_it(monkeypatch):
    import importlib.util

    from shardlab.config import run

    real = importlib.util.find_spec
    monkeypatch.setattr(run.importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name))
    with pytest.raises(ValueError, match=r"^plan.fp8='rowwise' needs torchao: pip install 'shardlab\[fp8\]', or set "):
        tiny(fp8="rowwise").validated().check()


def test_a_gpu_without_float8_is_refused_before_anything_is_built(monkeypatch):
    from shardlab.training.loop import check_init

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"^plan.fp8='tensorwise' needs float8 matmuls, which CUDA devices of compute "
                       r"capability 8.9 or more have .*this NVIDIA A100 is 8.0: set plan.fp8='none'$"):  # fmt: skip
        check_init(tiny(fp8="tensorwise"), torch.device("cuda", 0))
    check_init(tiny(), torch.device("cuda", 0))  # without FP8: no question asked
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _: (9, 0))
    check_init(tiny(fp8="tensorwise"), torch.device("cuda", 0))


def test_eager_fp8_on_a_gpu_gets_a_line_saying_to_compile():
    """FP8 without plan.compile is slower than bf16 on a GPU (its casts run as separate kernels): a run says so in
    one line, naming the flag. Compiled, on the CPU, or without FP8: nothing."""
    from shardlab.training.loop import eager_fp8_note

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    note = eager_fp8_note(tiny(fp8="tensorwise"), cuda)
    assert note is not None and "plan.fp8='tensorwise' without plan.compile" in note and note.endswith("--plan.compile")
    assert "\n" not in note
    for cfg, device in ((tiny(fp8="tensorwise", compile=True), cuda), (tiny(fp8="rowwise"), cpu), (tiny(), cuda)):
        assert eager_fp8_note(cfg, device) is None
