"""FP8 (torchao Float8Linear) on gloo ranks: fp32 master weights, layouts.STEPS steps.

- FSDP 2 (tensorwise: float8 weights all-gathered, their scales computed after each optimizer step), FSDP 2 x TP 2,
  HSDP 2 x 2, PP 2 and CP 2 against the one-process FP8 run of the same recipe. FP8 is not layout-exact: a tensorwise
  activation scale is the amax of a rank's micro batch (or sequence chunk), so other ranks' tokens change it.
  Measured against one process (tiny, 4 steps): loss within 1.4e-4, gradient norm within 3.1e-3 (FSDP 2 and FSDP 2 x
  TP 2 tensorwise, PP 2), 8e-5 and 5e-4 (rowwise), 1.3e-5 and 8e-5 (rowwise_with_gw_hp); CP 2 and HSDP 2 x 2 (each
  rank a quarter of the batch) loss within 1.3e-3 and 1.6e-3.
  The tolerances below leave about twice the largest.
- After each step every gathered weight's scale is that of its current values (a stale or missing scale fails).
- An FP8 run stopped and resumed is bitwise the uninterrupted one; its checkpoint resumes with plan.fp8='none' and
  exports to a Hugging Face directory as ordinary weights.

On gloo, whose collectives have no float8 types, TP gathers in the compute dtype (parallel/fp8.gathers_float8);
torchao's float8 TP styles run on NCCL only (a CUDA world, not in CI).
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardlab.config import MeshSpec
from shardlab.data.loader import make_loader
from shardlab.training.checkpoint import step_dir
from shardlab.training.export import export_to_hf
from shardlab.training.loop import build_model
from shardlab.training.step import init_state, make_step

from .layouts import MID, STEPS, ckpt, curves, tiny, with_plan

LOSS_TOL = 3e-3
GRAD_NORM_TOL = 1e-2
"""Relative to max(1, |norm|)."""

FSDP2, FSDP2_TP2 = MeshSpec(dp_shard=2), MeshSpec(dp_shard=2, tp=2)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
LAYOUTS_2 = {
    **{f"fsdp2-{r}": tiny(FSDP2, fp8=r) for r in ("tensorwise", "rowwise")},
    "pp2-tensorwise": tiny(MeshSpec(pp=2, dp_shard=1), fp8="tensorwise"),
    "cp2-tensorwise": tiny(MeshSpec(dp_shard=1, cp=2), fp8="tensorwise"),
}
LAYOUTS_4 = {
    **{f"fsdp2_tp2-{r}": tiny(FSDP2_TP2, fp8=r) for r in RECIPES},
    "hsdp2x2-tensorwise": tiny(MeshSpec(dp_replicate=2, dp_shard=2), fp8="tensorwise"),
}


def run_2(rank, world_size, tmp):
    return {name: curves(cfg) for name, cfg in LAYOUTS_2.items()}


def run_4(rank, world_size):
    return {name: curves(cfg) for name, cfg in LAYOUTS_4.items()}


def scales(rank, world_size, tmp):
    """Two steps of FSDP 2 tensorwise; then each float8 weight's precomputed scale against its current amax."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    cfg = LAYOUTS_2["fsdp2-tensorwise"]
    model, plan, mesh = build_model(cfg)
    assert plan.fp8.all_gather
    step, state = make_step(cfg, plan, mesh), init_state(model, cfg.optim)
    loader = make_loader(cfg.data, seq_len=64, global_batch=8, vocab_size=512, dp_rank=rank, dp_size=2)
    for _ in range(2):
        state, _ = step(state, next(loader))
    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(linears) == len(plan.fp8.linears) == 14
    for linear in linears:
        local = linear.weight._local_tensor  # to_local() makes a new tensor, without the scale
        assert isinstance(local, WeightWithDynamicFloat8CastTensor), type(local)
        amax = linear.weight.full_tensor().abs().max().to(torch.float64)
        want = (torch.finfo(torch.float8_e4m3fn).max / amax).to(torch.float32)
        assert local._precomputed_scale is not None, "no scale was precomputed"
        assert torch.equal(local._precomputed_scale.reshape(()), want), (local._precomputed_scale, want)


def resume(rank, world_size, tmp):
    """FSDP 2 tensorwise stopped after step MID and resumed; the same checkpoint resumed without FP8; exported."""
    cfg = ckpt(LAYOUTS_2["fsdp2-tensorwise"], Path(tmp) / "fp8", every=MID)
    straight = curves(ckpt(cfg, Path(tmp) / "straight", every=None))["loss"]
    resumed = curves(cfg, until=MID)["loss"] + curves(cfg)["loss"]
    saved = step_dir(Path(tmp) / "fp8" / "checkpoints", MID)
    plain = curves(ckpt(with_plan(cfg, fp8="none"), Path(tmp) / "plain", every=None, resume=str(saved)))["loss"]
    return straight, resumed, plain


CHECKS_2 = [run_2, scales, resume]
CHECKS_4 = [run_4]


@pytest.fixture(scope="module")
def fp8_reference():
    """The one-process FP8 curve of each recipe."""
    return {r: curves(tiny(fp8=r)) for r in RECIPES}


def _close(got, want, name):
    loss = max(abs(a - b) for a, b in zip(got["loss"], want["loss"]))
    norm = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got["grad_norm"], want["grad_norm"]))
    assert len(got["loss"]) == STEPS and loss <= LOSS_TOL, f"{name}: |loss diff| {loss:.2e}; {got} vs {want}"
    assert norm <= GRAD_NORM_TOL, f"{name}: grad-norm diff {norm:.2e}; {got} vs {want}"


@pytest.mark.world
@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_fp8_on_2_ranks_follows_one_process(shared_world2, fp8_reference, layout):
    _close(shared_world2.value(run_2)[layout], fp8_reference[layout.split("-")[1]], layout)


@pytest.mark.world
@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_fp8_on_4_ranks_follows_one_process(shared_world4, fp8_reference, layout):
    _close(shared_world4.value(run_4)[layout], fp8_reference[layout.split("-")[1]], layout)


@pytest.mark.world
def test_gathered_float8_weights_are_scaled_by_their_current_values(shared_world2):
    shared_world2.raise_for(scales)


@pytest.mark.world
def test_an_fp8_run_resumes_bitwise_resumes_without_fp8_and_exports_plain_weights(shared_world2, shared_tmp, tmp_path):
    straight, resumed, plain = shared_world2.value(resume)
    assert resumed == straight
    assert len(plain) == STEPS - MID and all(abs(a - b) < 0.05 for a, b in zip(plain, straight[MID:])), plain
    files = list((shared_tmp / "fp8" / "fp8" / "checkpoints").rglob("*.distcp"))
    assert files and not any(b"torchao" in f.read_bytes() for f in files)  # plain tensors: read without torchao
    export_to_hf(shared_tmp / "fp8" / "fp8", tmp_path / "hf")  # one process, as the export verb runs
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert {type(t) for t in weights.values()} == {torch.Tensor}
    assert {t.dtype for t in weights.values()} == {torch.float32}
