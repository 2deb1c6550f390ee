"""The estimator and the search with FP8 (plan.fp8): the probe runs torchao's Float8Linear on fake tensors, its
`_scaled_mm` FLOPs are priced at the device's FP8 peak, FSDP gathers the FP8 linears' weights in float8 (a byte per
element), a device without float8 matmuls is refused, and a search keeps a pinned plan.fp8 in its pick."""

from __future__ import annotations

import functools

import msgspec
import pytest

from shardlab import Config, MeshSpec, ModelConfig, PlanConfig, TrainConfig
from shardlab.estimate.probe import Probe, probe

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
