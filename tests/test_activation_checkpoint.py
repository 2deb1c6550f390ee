"""Op-level selective activation checkpointing (plan.activation_checkpoint="op") on one process: the same curve as
none in fp32; inside every block it recomputes the cheap ops and every second matmul and keeps the rest (counted
op by op in the backward), and the estimator's probe measures its activations between none and full. The gloo
worlds check it laid out (tests/worlds: FSDP 2 x TP 2, pipelines, CP, MoE with EP, transformers models)."""

from collections import Counter

import msgspec
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardlab.config import Config, DataConfig, LogConfig, MeshSpec, ModelConfig, OptimConfig, PlanConfig, TrainConfig
from shardlab.estimate.probe import probe
from shardlab.parallel._activation_checkpoint import (
    MATMULS,
    in_backward,
    is_checkpointed,
    is_op_checkpointed,
    save_policy,
)
from shardlab.sharding.plan import Plan
from shardlab.training.loop import build_model, plan_model, train

aten = torch.ops.aten
LAYERS = 2
MATMULS_PER_BLOCK = 7
"""q, k, v, o, gate, up, down."""


def tiny(ac: str = "none", **plan: object) -> Config:
    """The gloo worlds' parity model (tests/worlds/layouts.py): dim 64, 2 blocks, GQA 4/2 heads, 4 steps, fp32."""
    return Config(
        mesh=MeshSpec(dp_shard=1),
        model=ModelConfig(dim=64, n_layers=LAYERS, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512),
        plan=PlanConfig(activation_checkpoint=ac, **plan),
        optim=OptimConfig(lr=1e-2, warmup_steps=2),
        train=TrainConfig(steps=4, seq_len=64, global_batch=8, run_dir="/tmp/shardlab-tests/{name}"),
        log=LogConfig(wandb="disabled", progress=False, every=1000),
        data=DataConfig(source="stdlib"),
    )


def test_op_trains_like_no_checkpointing():
    """Saved outputs are the forward's own tensors, recomputed ones the same ops on the same inputs: the loss and
    gradient norm of every step match none within 1e-5 (fp32)."""
    none, op = (train(tiny(ac), write=False) for ac in ("none", "op"))
    assert len(none) == len(op) == 4
    for a, b in zip(none, op, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * max(1.0, a["grad_norm"])
    assert op[-1]["loss"] < op[0]["loss"] - 0.5


def test_every_block_gets_op_checkpointing():
    model, plan, mesh = build_model(tiny("op"))
    assert mesh is None and plan.activation_checkpoint == "op"
    assert all(is_checkpointed(b) and is_op_checkpointed(b) for b in model.model.layers)
    full, _, _ = build_model(tiny("full"))
    assert all(is_checkpointed(b) and not is_op_checkpointed(b) for b in full.model.layers)


class _Ops(TorchDispatchMode):
    """Counts every op that runs, apart in the forward and in the backward (where recomputation happens)."""

    def __init__(self) -> None:
        super().__init__()
        self.forward: Counter = Counter()
        self.backward: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.backward if in_backward() else self.forward)[func] += 1
        return func(*args, **(kwargs or {}))


def ops_of(ac: str) -> _Ops:
    """One forward and backward of the tiny model with checkpointing `ac`. The mode is entered first, so torch's
    selective-checkpointing modes sit above it: an output served from what the forward kept never reaches it, a
    recomputed op does."""
    model, _, _ = build_model(tiny(ac))
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with _Ops() as ops:
        model(tokens).float().pow(2).mean().backward()
    return ops


ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default


def test_op_recomputes_every_second_matmul_and_keeps_attention():
    """Against none, the backward runs again per block: full, the whole forward (6 of its 7 matmuls, attention,
    SiLU); op, SiLU and 3 matmuls (k, o, up: the 2nd, 4th, 6th), never attention. A policy that kept nothing would
    recompute like full, one that kept everything like none."""
    none, op, full = ops_of("none"), ops_of("op"), ops_of("full")
    assert none.forward[aten.mm.default] == op.forward[aten.mm.default] == LAYERS * MATMULS_PER_BLOCK + 1  # + head

    def recomputed(run: _Ops, func) -> int:
        return run.backward[func] - none.backward[func]

    # torch stops recomputing at the last tensor the backward needs: down_proj's input, not its output
    assert recomputed(full, aten.mm.default) == LAYERS * (MATMULS_PER_BLOCK - 1)
    assert recomputed(op, aten.mm.default) == LAYERS * (MATMULS_PER_BLOCK // 2)
    assert (recomputed(full, ATTENTION), recomputed(op, ATTENTION)) == (LAYERS, 0)
    assert recomputed(full, aten.silu.default) == recomputed(op, aten.silu.default) == LAYERS  # cheap: recomputed


def test_policy_saves_every_other_matmul_attention_and_collectives():
    policy = save_policy()
    decisions = [policy(None, aten.mm.default).name for _ in range(4)]
    assert decisions == ["MUST_SAVE", "PREFER_RECOMPUTE"] * 2
    assert aten.addmm.default in MATMULS
    for op in (ATTENTION, torch.ops._c10d_functional.reduce_scatter_tensor.default, aten.max.default):
        assert policy(None, op).name == "MUST_SAVE", op
    for op in (
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.all_to_all_single.default,
    ):
        assert policy(None, op).name == "MUST_SAVE", op
    for op in (aten.silu.default, aten.mul.Tensor, aten.add.Tensor, aten.rsqrt.default, aten.max.dim):
        assert policy(None, op).name == "PREFER_RECOMPUTE", op
    assert save_policy()(None, aten.mm.default).name == "MUST_SAVE"  # each checkpointed forward counts anew


AC = ("none", "op", "full")


def test_probe_measures_op_activations_between_none_and_full():
    """The estimator's activations are measured (live storages after the forward on fake tensors), not scaled: op
    keeps, per block, exactly what its policy saves (the q, v, gate and down outputs and attention's) on top of
    full's block inputs, and less than none."""
    cfg = tiny().resolve(1)
    got = {ac: probe(msgspec.structs.replace(cfg, plan=PlanConfig(activation_checkpoint=ac))) for ac in AC}
    assert got["none"].activation_bytes > got["op"].activation_bytes > got["full"].activation_bytes
    m, tokens = cfg.model, cfg.train.global_batch * cfg.train.seq_len
    matmuls = tokens * (m.dim + m.n_kv_heads * m.head_dim + m.ffn_dim + m.dim) * 4  # q, v, gate, down (fp32)
    attention = tokens * m.dim * 4 + tokens * m.n_heads * 4  # its output and log-sum-exp
    assert got["op"].activation_bytes - got["full"].activation_bytes == LAYERS * (matmuls + attention)
    # recomputation: full reruns every block's forward, op only part of it
    assert got["none"].flops < got["op"].flops < got["full"].flops


def test_plan_shows_and_stores_op():
    _, plan = plan_model(tiny("op").resolve(1))
    assert plan.table().splitlines()[-1] == "loss_parallel=False  activation_checkpoint=op  compile=False"
    assert Plan.from_json(plan.to_json()).activation_checkpoint == "op"
