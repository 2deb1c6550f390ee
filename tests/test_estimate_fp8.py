"""The estimator and the search with FP8 (plan.fp8): the probe runs torchao's Float8Linear on fake tensors, its
`_scaled_mm` FLOPs are priced at the device's FP8 peak, FSDP gathers the FP8 linears' weights in float8 (a byte per
element), a device without float8 matmuls is refused, and a search keeps a pinned plan.fp8 in its pick."""

from __future__ import annotations

import functools

import msgspec
import pytest

from shardlab import Config, MeshSpec, ModelConfig, PlanConfig, TrainConfig
from shardlab._errors import ShardlabError
from shardlab.estimate import estimate
from shardlab.estimate.devices import DEVICES, device
from shardlab.estimate.probe import Probe, probe
from shardlab.estimate.roofline import compute_seconds
from shardlab.training.loop import plan_model

pytest.importorskip("torchao")

MODEL = ModelConfig(dim=128, n_layers=5, n_heads=4, n_kv_heads=4, ffn_dim=256, vocab_size=512)
LINEAR_PARAMS = MODEL.n_layers * (4 * 128 * 128 + 3 * 128 * 256)
"""Elements of the blocks' linear weights (q, k, v, o; gate, up, down): the FP8 linears of the plan."""


def cfg(fp8: str = "none", mesh: MeshSpec = MeshSpec(dp_shard=2), world: int = 2) -> Config:
    plan = PlanConfig(fp8=fp8, param_dtype="bfloat16")
    return Config(mesh=mesh, model=MODEL, plan=plan, train=TrainConfig(global_batch=4, seq_len=64)).resolve(world)


@functools.cache
def probed(fp8: str) -> Probe:
    return probe(cfg(fp8))


def _by_kind(p: Probe, *kinds: str) -> Probe:
    return msgspec.structs.replace(p, ops=tuple(op for op in p.ops if op[3] in kinds))


def _gathers(p: Probe) -> dict[str, int]:
    return {c.phase: c.bytes for c in p.collectives if c.kind == "all_gather"}


def test_the_probe_runs_float8_matmuls_and_gathers_float8_weights():
    """Every block linear's forward and two backward matmuls are `_scaled_mm` (6 N T FLOPs on the rank's 128 tokens),
    the bf16 plan's matmuls are the same FLOPs; FSDP gathers those weights at 1 byte where bf16 took 2, and reads the
    scales the last step computed (no all-reduce of amaxes per gather)."""
    bf16, fp8 = probed("none"), probed("tensorwise")
    tokens = 4 // 2 * 64
    assert sum(f * n for f, _, n, kind in fp8.ops if kind == "fp8_matmul") == 6 * LINEAR_PARAMS * tokens
    assert not any(kind == "fp8_matmul" for *_, kind in bf16.ops)
    assert fp8.flops == bf16.flops
    casts = sum(n for f, _, n, kind in fp8.ops if kind == "memory") - sum(n for f, _, n, k in bf16.ops if k == "memory")
    assert casts > 0  # amax, scale, cast: memory-bound ops of their own
    assert _gathers(bf16)["forward"] - _gathers(fp8)["forward"] == LINEAR_PARAMS  # bf16's 2 bytes -> 1
    again = _gathers(bf16)["backward"] - _gathers(fp8)["backward"]  # the backward gathers some blocks again
    assert 0 < again <= LINEAR_PARAMS and again % (LINEAR_PARAMS // MODEL.n_layers) == 0
    assert not any(c.kind == "all_reduce" for c in fp8.collectives)
    rowwise = probe(cfg("rowwise"))  # torchao gathers float8 under tensorwise only
    assert _gathers(rowwise) == _gathers(bf16)


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_compiled_a_float8_cast_reads_its_source_twice_and_writes_its_result_once(rowwise):
    """torch.compile fuses each of torchao's casts into two passes over the source (its amax; the scaled, clamped
    cast), writing only the amax and the float8 result: a recorder counting compiled casts counts exactly that, a
    recorder counting eager ones counts each op's own pass (fp32 intermediates read and written: over 5x as much)."""
    import torch
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from shardlab.estimate.recorder import Recorder

    x = torch.randn(64, 128, dtype=torch.bfloat16)
    granularity = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE
    moved = {}
    for fused in (True, False):
        recorder = Recorder({}, fused_casts=fused)
        with recorder:
            hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig(), scaling_granularity=granularity,
                                        axiswise_dim=-1 if rowwise else None)  # fmt: skip
        moved[fused] = sum(m * n for (f, m, kind), n in recorder.ops.items() if kind == "memory")
    assert moved[True] == 2 * x.nbytes + x.numel()
    assert moved[False] > 5 * moved[True]


def test_compiled_a_float8_linear_moves_its_casts_fused_and_its_bias_add_whole():
    """torchao's Float8Linear (bias on) compiled: its input's and weight's casts, two passes over each source writing
    a byte per element, and its bias add as eager runs it (reads the output and the bias, writes the output)."""
    import torch
    from torchao.float8 import convert_to_float8_training

    from shardlab.estimate.recorder import Recorder

    linear = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(128, 256).to(torch.bfloat16)))[0]
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    recorder = Recorder({}, fused_casts=True)
    with recorder:
        out = linear(x)
    casts = sum(2 * t.nbytes + t.numel() for t in (x, linear.weight))
    moved = sum(m * n for (f, m, kind), n in recorder.ops.items() if kind == "memory")
    assert moved == casts + 2 * out.nbytes + linear.bias.nbytes


def test_a_compiled_fp8_step_counts_its_casts_fused_and_nothing_else_changes():
    """Under plan.compile the probe counts FP8's casts as compiled blocks run them: less traffic than eager, the same
    FLOPs, matmuls and collectives; a bf16 plan's probe is the same compiled or not (only the casts are fused)."""
    compiled = lambda fp8: probe(msgspec.structs.replace(  # noqa: E731
        cfg(fp8), plan=msgspec.structs.replace(cfg(fp8).plan, compile=True)))  # fmt: skip
    eager, fused = probed("tensorwise"), compiled("tensorwise")
    memory = lambda p: sum(m * n for _, m, n, kind in p.ops if kind == "memory")  # noqa: E731
    assert memory(probed("none")) < memory(fused) < memory(eager) / 2
    assert fused.flops == eager.flops and fused.collectives == eager.collectives
    assert [op for op in fused.ops if op[3] != "memory"] == [op for op in eager.ops if op[3] != "memory"]
    assert compiled("none").ops == probed("none").ops


def test_float8_matmuls_are_priced_at_the_fp8_peak():
    """With the bytes free (bandwidth without limit), the matmuls' seconds fall by exactly what the linears' FLOPs
    take at 989 rather than 1979 TFLOP/s (the flat efficiency of both); attention stays at the bf16 peak."""
    h100 = msgspec.structs.replace(DEVICES["h100"], hbm_tb_s=1e30)
    bf16, fp8 = (_by_kind(probed(r), "matmul", "fp8_matmul", "attention") for r in ("none", "tensorwise"))
    linear_flops = 6 * LINEAR_PARAMS * 128
    saved = compute_seconds(bf16, h100) - compute_seconds(fp8, h100)
    assert saved == pytest.approx(linear_flops / 0.8e12 * (1 / 989 - 1 / 1979), rel=1e-9)
    b200 = msgspec.structs.replace(DEVICES["b200"], hbm_tb_s=1e30)
    assert compute_seconds(_by_kind(probed("tensorwise"), "fp8_matmul"), b200) == pytest.approx(
        linear_flops / (4500e12 * 0.8), rel=1e-9
    )


def test_an_fp8_estimate_gathers_a_byte_per_fp8_weight_and_a100_refuses_it():
    c = cfg("tensorwise")
    plan = plan_model(c)[1]
    with pytest.raises(ShardlabError, match=r"^plan.fp8='tensorwise': the A100 SXM 80GB has no float8 matmuls; set "):
        estimate(c, plan, dev=device("a100"))
    fast = estimate(c, plan, dev=device("h100"), compare_checkpointing=False)
    slow = estimate(cfg(), plan_model(cfg())[1], dev=device("h100"), compare_checkpointing=False)
    gathered = {x.phase: x.bytes for x in fast.collectives if x.kind == "all_gather"}
    assert (
        gathered["forward"]
        == {x.phase: x.bytes for x in slow.collectives if x.kind == "all_gather"}["forward"] - LINEAR_PARAMS
    )
    assert fast.time.fsdp_comm_s < slow.time.fsdp_comm_s


@pytest.mark.world  # whole searches, probes forked side by side: the full suite's tier
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_search_keeps_a_pinned_fp8_recipe_and_its_floors_stay_below_its_estimates(compiled):
    """plan.fp8 is a field of the recipe's plan: every candidate keeps it, and the pick written as a recipe runs it.
    The floors (at the FP8 peak, float8 gathers, compiled casts fused as the estimate counts them) never prune a
    layout the exhaustive search would have ranked."""
    from shardlab.estimate.search import search
    from shardlab.estimate.search_report import layout_recipe
    from shardlab.models.llama.provider import LlamaProvider

    c = Config(model=MODEL, plan=PlanConfig(fp8="tensorwise", param_dtype="bfloat16", compile=compiled),
               train=TrainConfig(global_batch=4, seq_len=64))  # fmt: skip
    fixed = {"pp": 1, "cp": 1, "tp": 1, "dp_replicate": 1}
    provider, dev, probes, blocks = LlamaProvider(MODEL), device("h100"), {}, {}
    run = lambda prune: search(c, 2, provider, lambda _: None, dev, 2**40, fixed=fixed, top=2, prune=prune,  # noqa: E731
                               probes=probes, blocks=blocks)  # fmt: skip
    pruned, every = run(True), run(False)
    assert [(b.layout, b.step_s) for b in pruned.best] == [(b.layout, b.step_s) for b in every.best]
    best = pruned.best[0]
    assert best.layout.config(c).plan.fp8 == "tensorwise"
    assert "'fp8': 'tensorwise'" in layout_recipe(c, best.layout, 2, "recipe.py", False, "note")
    with pytest.raises(ShardlabError, match="A100"):
        search(c, 2, provider, lambda _: None, device("a100"), 2**40, fixed=fixed)


def test_a_kernel_table_prices_float8_matmuls_on_its_matmul_curve_at_the_fp8_peak():
    from shardlab.estimate.kernels import Kernels

    table = Kernels(matmul=((1.0, 0.5),), attention=((1.0, 0.25),), memory=((1.0, 1.0),), overhead_s=0.0, command="")
    dev = msgspec.structs.replace(DEVICES["h100"], kernels=table)
    ops = ((10**12, 0, 1, "fp8_matmul"), (10**12, 0, 2, "matmul"))
    p = Probe(collectives=(), flops=3 * 10**12, ops=ops, activation_bytes=0, block_activation_bytes=0)
    assert compute_seconds(p, dev) == pytest.approx(1 / (1979 * 0.5) + 2 / (989 * 0.5), rel=1e-12)


SMALL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=512)


@functools.cache
def small_provider():
    """One provider for the searches below, which share its probes and block counts (PROBES, BLOCKS)."""
    from shardlab.models.llama.provider import LlamaProvider

    return LlamaProvider(SMALL)


PROBES: dict = {}
"""Probes shared by the searches below."""
BLOCKS: dict = {}
"""The floors' block counts shared by the searches below (the caller's cache: nothing is kept on the provider)."""


@pytest.mark.world  # whole searches, probes forked side by side: the full suite's tier
@pytest.mark.parametrize(("fp8_tflops", "winner"), [(1e6, "tensorwise"), (1.0, "none")])
def test_a_search_given_fp8_choices_picks_the_faster_one(fp8_tflops, winner):
    """`--fp8-choices none,tensorwise`: every layout twice, once per choice; on a device whose FP8 matmuls (and
    bytes) are nearly free tensorwise wins, on one where they crawl none does; the floors, per choice, prune nothing
    the exhaustive search would rank."""
    from shardlab.estimate.search import search

    c = Config(model=SMALL, plan=PlanConfig(param_dtype="bfloat16"), train=TrainConfig(global_batch=2, seq_len=64))
    fixed = {"pp": 1, "cp": 1, "tp": 1, "dp_replicate": 1}
    dev = msgspec.structs.replace(DEVICES["h100"], fp8_tflops=fp8_tflops, hbm_tb_s=1e6)
    run = lambda prune: search(c, 2, small_provider(), lambda _: None, dev, 2**40, fixed=fixed, top=3,  # noqa: E731
                               prune=prune, probes=PROBES, fp8=("none", "tensorwise"), blocks=BLOCKS)  # fmt: skip
    pruned, every = run(True), run(False)
    assert [(b.layout, b.step_s) for b in pruned.best] == [(b.layout, b.step_s) for b in every.best]
    assert pruned.layouts == 2 * 8  # dp_shard=2, one micro batch: 4 checkpointing modes x resharding or not
    assert pruned.best[0].layout.fp8 == winner
    assert f"fp8 {winner}" in pruned.best[0].layout.describe()
    with pytest.raises(ShardlabError, match="A100"):
        search(c, 2, small_provider(), lambda _: None, device("a100"), 2**40, fixed=fixed, fp8=("none", "rowwise"))


def test_the_fp8_choices_flag_is_a_list_of_recipes_each_once():
    from shardlab.cli.flags import SearchFlags, parse

    config = Config(model=SMALL)
    assert parse(SearchFlags, ["--world", "2"], "prog", config)[0].fp8_choices is None
    flags, _ = parse(SearchFlags, ["--world", "2", "--fp8-choices", "none,tensorwise"], "prog", config)
    assert flags.fp8_choices == ("none", "tensorwise")
    for bad in ("none,bogus", "none,none", ""):
        with pytest.raises(ShardlabError, match=rf"^--fp8-choices '{bad}': expected plan.fp8 values separated by "):
            parse(SearchFlags, ["--world", "2", "--fp8-choices", bad], "prog", config)


def test_a_pipelined_fp8_layout_is_probed_with_each_stage_gathering_float8():
    """Each stage is its own FSDP root: each is initialized before the scales are computed, and gathers float8."""
    mesh, model = MeshSpec(pp=2, dp_shard=2), msgspec.structs.replace(SMALL, n_layers=4)
    gathered = {}
    for fp8 in ("none", "tensorwise"):
        plan = PlanConfig(fp8=fp8, param_dtype="bfloat16", pp_stages_per_rank=2, pp_schedule="interleaved_1f1b")
        c = Config(mesh=mesh, model=model, plan=plan, train=TrainConfig(global_batch=8, seq_len=64)).resolve(4)
        p = probe(c)
        gathered[fp8] = {x.stage: x.bytes for x in p.collectives if x.kind == "all_gather" and x.phase == "forward"}
    per_block = 4 * 64 * 64 + 3 * 64 * 128  # the FP8 linears' weights of one block: a byte each less
    assert {s: gathered["none"][s] - b for s, b in gathered["tensorwise"].items()} == {0: per_block, 2: per_block}
