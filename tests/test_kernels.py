"""The kernel table and the shared-core pipeline model: how the roofline prices ops by class and size, what the
probe classifies, and that measuring a table works end to end (at tiny sizes: no timing is asserted)."""

import math

import msgspec
import pytest
import torch

from shardlab import Config, MeshSpec, ModelConfig, PlanConfig, TrainConfig
from shardlab.estimate import kernels
from shardlab.estimate.devices import DEVICES, device
from shardlab.estimate.kernels import Kernels, efficiency
from shardlab.estimate.probe import Probe, probe
from shardlab.estimate.recorder import Collective
from shardlab.estimate.roofline import collective_seconds, compute_seconds, shared_pipeline_factor
from shardlab.sharding.pipeline import bubble_fraction

FLAT = Kernels(matmul=((1.0, 1.0),), attention=((1.0, 1.0),), memory=((1.0, 1.0),), overhead_s=0.0, command="test")


def test_curve_is_log_linear_between_points_and_held_outside():
    curve = ((1e3, 0.2), (1e5, 0.6), (1e6, 0.9))
    assert efficiency(curve, 1e4) == pytest.approx(0.4)  # halfway in log size
    assert efficiency(curve, 10**5.5) == pytest.approx(0.75)
    assert (efficiency(curve, 1.0), efficiency(curve, 1e9)) == (0.2, 0.9)


@pytest.mark.parametrize("curve", [(), ((2.0, 0.5), (1.0, 0.5)), ((1.0, 0.0),)], ids=["empty", "unsorted", "zero"])
def test_a_bad_curve_is_one_line(curve):
    with pytest.raises(ValueError, match=r"Kernels\.matmul"):
        msgspec.structs.replace(FLAT, matmul=curve)


def ops_probe(ops) -> Probe:
    return Probe(collectives=(), flops=0, ops=tuple(ops), activation_bytes=0, block_activation_bytes=0)


def test_each_class_is_priced_by_its_own_curve_plus_the_per_op_cost():
    h100 = DEVICES["h100"]
    p = ops_probe(
        [(2 * 8192**3, 3 * 2 * 8192**2, 4, "matmul"), (10**9, 10**6, 2, "attention"), (0, 10**8, 5, "memory")]
    )
    peak, bandwidth = h100.bf16_tflops * 1e12, h100.hbm_tb_s * 1e12
    flat = msgspec.structs.replace(h100, kernels=FLAT)
    assert compute_seconds(p, flat) == pytest.approx(4 * 2 * 8192**3 / peak + 2 * 1e9 / peak + 5 * 1e8 / bandwidth)
    # a table at the flat efficiencies prices every op as the flat roofline does
    same = Kernels(matmul=((1.0, 0.8),), attention=((1.0, 0.8),), memory=((1.0, 0.9),), overhead_s=0.0, command="")
    assert compute_seconds(p, msgspec.structs.replace(h100, kernels=same)) == pytest.approx(compute_seconds(p, h100))
    slow = msgspec.structs.replace(FLAT, attention=((1.0, 0.25),), overhead_s=1e-5)
    want = compute_seconds(p, flat) + 3 * 2 * 1e9 / peak + 11 * 1e-5
    assert compute_seconds(p, msgspec.structs.replace(h100, kernels=slow)) == pytest.approx(want)


def test_named_devices_keep_the_flat_roofline_without_a_measured_table():
    for name in DEVICES:
        assert device(name).kernels is kernels.MEASURED.get(name)


def test_probe_classifies_attention_matmuls_and_memory_ops():
    model = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=256)
    c = Config(mesh=MeshSpec(dp_shard=1), model=model, plan=PlanConfig(), train=TrainConfig(global_batch=2, seq_len=32))
    p = probe(c.resolve(1))
    by_kind = {k: sum(f * n for f, _, n, kind in p.ops if kind == k) for k in ("matmul", "attention", "memory")}
    # forward 4 s d and backward 10 s d per token and layer (flash recomputes), causal: half
    assert by_kind["attention"] == 7 * 2 * 32 * 64 * 2 * 32
    assert by_kind["memory"] == 0 and by_kind["matmul"] + by_kind["attention"] == p.flops
    assert sum(n for _, _, n, kind in p.ops if kind == "attention") == 2 * 2  # one forward, one backward per layer


@pytest.mark.parametrize("schedule,pp,m", [("gpipe", 4, 4), ("gpipe", 2, 8), ("interleaved_1f1b", 4, 8)])
def test_shared_cores_that_do_not_speed_up_pay_the_whole_bubble(schedule, pp, m):
    v = 2 if schedule == "interleaved_1f1b" else 1
    b = bubble_fraction(schedule, pp, v, m)
    assert shared_pipeline_factor([1.0] * pp, pp, 1, b) == pytest.approx(1 / (1 - b))


def test_shared_cores_price_gpipe_slot_by_slot():
    """4 one-thread ranks on 2 cores: alone or in pairs a rank runs twice as fast as with all 4 busy, three busy
    4/3 as fast. GPipe, 4 micro batches: slots with 1, 2, 3, 4, 3, 2, 1 busy ranks."""
    speed = [2.0, 2.0, 4 / 3, 1.0]
    b = bubble_fraction("gpipe", 4, 1, 4)
    want = (0.5 + 0.5 + 0.75 + 1 + 0.75 + 0.5 + 0.5) / 4
    assert shared_pipeline_factor(speed, 4, 1, b) == pytest.approx(want)
    # pp 2 of 2 ranks each: a lone pp rank is two busy processes
    assert shared_pipeline_factor(speed, 2, 2, bubble_fraction("gpipe", 2, 1, 2)) == pytest.approx((0.5 + 0.5 + 1) / 2)
    assert shared_pipeline_factor(speed, 4, 1, 0.0) == 1.0


@pytest.mark.world  # the block counts and probes, forked side by side: the full suite's tier
def test_shared_cores_pace_a_pipeline_by_its_ranks_mean_compute():
    """On ranks that time-share cores, a pp rank that finishes its share early leaves its cores to the others: the
    compute that sets the pace is the mean of pp - 1 ranks like the busiest and the one holding the last stage, but
    never below the slower one alone at its group's best speed. The estimate paces by it, and the floor stays below."""
    from shardlab.estimate import estimate
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.layouts import Layout
    from shardlab.estimate.roofline import shared_compute
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.training.loop import plan_model

    speed = (2.0, 1.8, 1.3, 1.0)
    assert shared_compute(2.0, 3.0, 2, 2, speed) == pytest.approx(2.5)
    assert shared_compute(2.0, 3.0, 4, 1, speed) == pytest.approx(2.25)
    assert shared_compute(1.0, 10.0, 2, 2, speed) == pytest.approx(10.0 / 1.8)  # the head rank alone at its best
    model = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=4096)  # a large head
    base = Config(model=model, train=TrainConfig(global_batch=8, seq_len=64))
    layout = Layout(mesh=MeshSpec(pp=2, dp_shard=2), activation_checkpoint="full", micro_batches=4, pp_schedule="1f1b")
    cfg = layout.config(base).resolve(4)
    shared = msgspec.structs.replace(device("h100"), kernels=FLAT, busy_speed=speed)
    dedicated = msgspec.structs.replace(shared, busy_speed=())
    plan = plan_model(cfg)[1]
    on_shared, on_dedicated = (
        estimate(cfg, plan, dev=d, compare_checkpointing=False).time for d in (shared, dedicated)
    )
    assert on_shared.compute_s < on_dedicated.compute_s  # the last stage's output layer and loss: the slower rank
    assert 0 < on_shared.recompute_s < on_shared.compute_s
    provider = LlamaProvider(model)
    floors = Floors.of(cfg, provider, provider.meta_model(), shared, own_rules=False)
    assert 0 < floors.time(cfg, layout, shared) <= on_shared.step_s


def test_a_measured_device_prices_each_collective_kind_at_its_own_speed():
    """gloo's all-gather at half its all-reduce's speed per counted byte: twice the time; unlisted kinds and named
    devices run at the link bandwidth."""
    mesh, h100 = MeshSpec(dp_shard=4), device("h100")
    gloo = msgspec.structs.replace(h100, collective_speed=(("all_gather", 0.5),))

    def seconds(kind, dev):
        c = Collective(axis="dp_shard", kind=kind, phase="forward", count=1, bytes=2**20, group_size=4)
        return collective_seconds(c, mesh, dev)

    assert seconds("all_gather", gloo) == pytest.approx(2 * seconds("all_gather", h100))
    assert seconds("all_gather", h100) == pytest.approx(2**20 * 3 / 4 / 450e9)
    assert seconds("all_reduce", gloo) == seconds("all_reduce", h100)
    assert all(not device(name).collective_speed for name in DEVICES)


def test_a_measured_device_adds_its_latency_per_collective_by_group_size():
    """gloo on shared cores: milliseconds per collective whatever its bytes; a group size not measured takes the
    largest measured size below it; named devices have none."""
    mesh, h100 = MeshSpec(dp_shard=8), device("h100")
    gloo = msgspec.structs.replace(h100, collective_latency=((2, 1e-3), (4, 5e-3)))

    def seconds(group_size, dev, count=3):
        c = Collective(axis="dp_shard", kind="all_gather", phase="forward", count=count, bytes=2**20,
                       group_size=group_size)  # fmt: skip
        return collective_seconds(c, mesh, dev)

    assert seconds(4, gloo) == pytest.approx(seconds(4, h100) + 3 * 5e-3)
    assert seconds(2, gloo) == pytest.approx(seconds(2, h100) + 3 * 1e-3)
    assert seconds(3, gloo) == pytest.approx(seconds(3, h100) + 3 * 1e-3)
    assert seconds(8, gloo, count=1) == pytest.approx(seconds(8, h100, count=1) + 5e-3)
    assert all(not device(name).collective_latency for name in DEVICES)


def test_measuring_a_table_runs_end_to_end(monkeypatch):
    """The microbenchmarks at tiny sizes, for a moment each: a valid table, every class measured at each size."""
    monkeypatch.setattr(kernels, "MATMULS", (8, 16))
    monkeypatch.setattr(kernels, "ATTENTION", ((2, 8, 8),))
    monkeypatch.setattr(kernels, "ELEMENTWISE", (64, 128))
    cpu = torch.device("cpu")
    rates = kernels.median_rates([kernels.measure(kernels.timer(cpu, 0.001), cpu, torch.float32)] * 3)
    table = kernels.table(rates, max(r for _, r in rates.matmul), 1e9, "test")
    assert [s for s, _ in table.matmul] == [2 * 8**3, 2 * 16**3] and max(e for _, e in table.matmul) == 1.0
    assert len(table.attention) == 1 and len(table.memory) == 2 and math.isfinite(table.overhead_s)


def test_a_pipeline_runs_at_its_slowest_stage():
    """Stages of equal blocks: the last pp rank also runs the norm, the output layer and the loss, so its compute,
    not the first rank's (the busiest by blocks), is the step's."""
    from shardlab.estimate import estimate, per_step
    from shardlab.training.loop import plan_model

    model = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=1024)
    c = Config(mesh=MeshSpec(pp=2, dp_shard=1), model=model, train=TrainConfig(global_batch=2, seq_len=32)).resolve(2)
    _, plan = plan_model(c)
    h100 = device("h100")
    probes = {}
    e = estimate(c, plan, dev=h100, probes=probes, compare_checkpointing=False)
    first, last = sorted(probes.values(), key=lambda p: p.flops)  # the one with the output layer does more
    assert compute_seconds(last, h100) > compute_seconds(first, h100)
    assert e.time.compute_s == pytest.approx(compute_seconds(per_step(last, e.micro_batches, plan, 1), h100))
    assert e.time.compute_s > e.micro_batches * compute_seconds(last, h100)  # and the adds accumulating gradients
