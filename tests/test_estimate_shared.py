"""The search's estimate from a twin's probe agrees with the exact estimate (`shardlab.estimate.estimate`).

The twin keeps each rank's local shapes and stages but only 2 ranks on each data-parallel axis and on pp, so many
layouts share one probe. What it cannot see is FSDP's per-shard copy and padding traffic, which shrinks with the
tokens per micro batch against the parameters; at one 256-token sequence per micro batch on this model it stays within STEP_TOLERANCE.
"""

from functools import partial

import msgspec
import pytest

from shardlab import Config, MeshSpec, ModelConfig, MoEConfig, PlanConfig, TrainConfig
from shardlab.estimate import estimate
from shardlab.estimate._forked import run_forked
from shardlab.estimate.devices import device
from shardlab.estimate.layouts import Layout
from shardlab.estimate.twin import twin
from shardlab.models import provider_for
from shardlab.training.loop import plan_model

STEP_TOLERANCE = 0.03
"""Relative step time: FSDP's copies into and out of the gathered buffers read and write each rank's shard."""
PEAK_TOLERANCE = 0.002
"""Relative peak memory: FSDP pads each sharded dim to a multiple of the shards."""

DENSE = ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512)
DEEP = msgspec.structs.replace(DENSE, n_layers=16)
"""Deep enough that both estimates extrapolate over blocks with pp 4 (the exact one probes 8 and 12 blocks)."""
MOE = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=512,
                  moe=MoEConfig(n_experts=4, expert_ffn_dim=64))  # fmt: skip


def lay(mesh: MeshSpec, ac: str = "none", micro: int = 1, schedule=None, v: int = 1, reshard: bool = True) -> Layout:
    return Layout(mesh=mesh, activation_checkpoint=ac, micro_batches=micro, pp_schedule=schedule,
                  pp_stages_per_rank=v, reshard_after_forward=reshard)  # fmt: skip


CASES = {  # each case probes twice on 8 fake ranks (10-20 s): the axes the twin changes, in three cases
    "hsdp 4 x tp 2, full, no reshard": (DENSE, lay(MeshSpec(dp_replicate=4, dp_shard=1, tp=2), "full", reshard=False)),
    "pp 4 x fsdp 2, 1f1b, full": (DEEP, lay(MeshSpec(pp=4, dp_shard=2), "full", micro=8, schedule="1f1b")),
    "ep 2 of fsdp 8, 2 micro": (MOE, lay(MeshSpec(dp_shard=8, ep=2), micro=2)),
}


@pytest.mark.world  # the exact estimate's probes and the twin's, forked side by side: the full suite's tier
@pytest.mark.parametrize("name", CASES)
def test_the_twin_estimate_agrees_with_the_exact_one(name):
    from shardlab.estimate.twin import estimate_shared

    model, layout = CASES[name]
    base = Config(model=model, plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32"),
                  train=TrainConfig(global_batch=16, seq_len=256))  # fmt: skip
    cfg = layout.config(base).resolve(8)
    _, plan = plan_model(cfg)
    provider, dev = provider_for(cfg), device("h100")
    twin_cfg, _ = twin(cfg, plan, provider.n_layers)
    assert twin_cfg.mesh.world_size < cfg.mesh.world_size  # the case shares its probe with larger layouts
    exact = estimate(cfg, plan, None, dev, provider, compare_checkpointing=False)
    shared = estimate_shared(cfg, plan, None, dev, provider, {})
    assert shared.time.step_s == pytest.approx(exact.time.step_s, rel=STEP_TOLERANCE)
    assert shared.peak == pytest.approx(exact.peak, rel=PEAK_TOLERANCE)
    assert shared.executed_flops == exact.executed_flops
    comm = {(c.axis, c.kind, c.phase, c.group_size, c.count) for c in exact.collectives}
    assert {(c.axis, c.kind, c.phase, c.group_size, c.count) for c in shared.collectives} == comm


def test_layouts_that_differ_in_data_parallel_size_and_pp_share_one_twin():
    base = Config(model=DENSE, plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32"),
                  train=TrainConfig(global_batch=64, seq_len=64))  # fmt: skip
    twins = set()
    for layout in (lay(MeshSpec(dp_shard=16), micro=4), lay(MeshSpec(dp_replicate=2, dp_shard=4), micro=8),
                   lay(MeshSpec(dp_replicate=4, dp_shard=8), micro=2)):  # fmt: skip
        cfg = layout.config(base).resolve(layout.mesh.world_size)
        twin_cfg, _ = twin(cfg, plan_model(cfg)[1], DENSE.n_layers)
        twins.add((twin_cfg.mesh.dp_shard, twin_cfg.train.global_batch // twin_cfg.mesh.size("dp")))
    assert twins == {(2, 1)}  # one row per micro batch, FSDP over 2
    pipes = set()
    for pp in (4, 8):
        cfg = lay(MeshSpec(pp=pp, dp_shard=2), micro=pp, schedule="1f1b").config(msgspec.structs.replace(
            base, train=msgspec.structs.replace(base.train, global_batch=2 * pp))).resolve(2 * pp)  # fmt: skip
        twin_cfg, rank = twin(cfg, plan_model(cfg)[1], DENSE.n_layers)
        pipes.add(
            (twin_cfg.mesh.pp, rank, twin_cfg.train.global_batch // twin_cfg.mesh.size("dp") // twin_cfg.micro_batches)
        )
    assert pipes == {(2, 0, 1)}


SMALL = msgspec.structs.replace(DENSE, n_layers=3)
"""Three blocks: one fake run per probe (the whole model; 4 for 4 pipeline stages)."""
ROWS = {  # the shape, the pp rank probed, whether one row runs other ops than two
    "fsdp 2 x tp 2 with SP, full": (SMALL, lay(MeshSpec(dp_shard=2, tp=2), "full"), 0, True),
    "pp 2 x fsdp 2, interleaved x2, last rank": (
        msgspec.structs.replace(DENSE, n_layers=4), lay(MeshSpec(pp=2, dp_shard=2), "none", 4, "interleaved_1f1b", 2),
        1, False,
    ),
}  # fmt: skip


@pytest.mark.world  # five probes of each case, forked side by side: the full suite's tier
@pytest.mark.parametrize("name", ROWS)
def test_probes_at_two_row_counts_give_every_other_and_resharding_gives_keeping_the_weights_gathered(name):
    """The search's sharing is exact: a measurement on the line through rows 2 and 3 equals the probe at 5 rows,
    and so does the one through rows 1 and 2 where they ran the same ops (not under SP, whose all-gather of one
    sequence is a view instead of a split and a cat: that pair is refused); a probe that reshards FSDP's weights
    after forward, without its backward's gathers, equals the probe that keeps them gathered."""
    from shardlab.estimate.probe import measure

    model, layout, rank, one_row_differs = ROWS[name]

    def probe(rows: int, reshard: bool = True):
        base = Config(model=model, plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32"),
                      train=TrainConfig(global_batch=rows * layout.mesh.size("dp") * layout.micro_batches, seq_len=64))  # fmt: skip
        cfg = (
            msgspec.structs.replace(layout, reshard_after_forward=reshard).config(base).resolve(layout.mesh.world_size)
        )
        return measure(cfg, pp_rank=rank, provider=provider_for(cfg))

    two, three, five, one, kept_gathered = run_forked(  # side by side: one fake run each
        [partial(probe, 2), partial(probe, 3), partial(probe, 5), partial(probe, 1), partial(probe, 2, reshard=False)]
    )
    line = two.at_rows(5, 2, three, 3)
    assert line is not None and line.at() == five.at() != two.at()
    from_one = one.at_rows(5, 1, two, 2)
    assert from_one is None if one_row_differs else from_one.at() == five.at()
    kept = two.at(regather=False)
    assert kept == kept_gathered.at() != two.at()
    assert line.at(regather=False) == five.at(regather=False)


@pytest.mark.world  # four probes: the full suite's tier
def test_a_rank_of_several_stages_is_the_sum_of_stages_probed_elsewhere():
    """A twin of two pp ranks holding two stages each (V-shaped, without resharding as its zero bubble needs) is put
    together from the stages of interleaved 1F1B with two per rank, which its probes then equal exactly."""
    from shardlab.estimate.probe import measure
    from shardlab.estimate.twin import _measurement

    model = msgspec.structs.replace(DENSE, n_layers=13)  # enough blocks for probes of 2 x 4 and 3 x 4
    layout = lay(MeshSpec(pp=2, dp_shard=2), "none", 8, "zbv_zero_bubble", 2, reshard=False)
    base = Config(model=model, plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32"),
                  train=TrainConfig(global_batch=32, seq_len=64))  # fmt: skip
    cfg = layout.config(base).resolve(4)
    provider, measured = provider_for(cfg), {}
    for rank in (0, 1):  # the first and the last stage on rank 0, two middle ones on rank 1
        put_together = _measurement(cfg, rank, None, provider, measured, plan_model(cfg)[1], None).at(regather=False)
        assert put_together == measure(cfg, pp_rank=rank, provider=provider).at(), rank
    assert sum(len(shape.probed) for shape in measured.values()) == 2  # the two ranks of the base


REPLICATED = {  # the HSDP twin (dp_replicate 2), the pp rank probed
    "hsdp 2 x 2 x tp 2 with SP, op": (SMALL, lay(MeshSpec(dp_replicate=2, dp_shard=2, tp=2), "op"), 0),
    "hsdp 2 x 2 x cp 2, full, kept gathered": (
        SMALL, lay(MeshSpec(dp_replicate=2, dp_shard=2, cp=2), "full", reshard=False), 0,
    ),
    "hsdp 2 x cp 2 (FSDP over cp alone)": (SMALL, lay(MeshSpec(dp_replicate=2, dp_shard=1, cp=2)), 0),
    "pp 2 x hsdp 2 x 2, interleaved x2, last rank": (
        msgspec.structs.replace(DENSE, n_layers=4),
        lay(MeshSpec(pp=2, dp_replicate=2, dp_shard=2), "selective", 4, "interleaved_1f1b", 2), 1,
    ),
    "moe, hsdp 2 x 2": (MOE, lay(MeshSpec(dp_replicate=2, dp_shard=2)), 0),
    "moe, ep 2 of hsdp 2 x 4 (experts' shards of 2)": (MOE, lay(MeshSpec(dp_replicate=2, dp_shard=4, ep=2)), 0),
    "moe, pp 2 x ep 2 of hsdp 2 x 2 x cp 2, interleaved x2, last rank": (
        msgspec.structs.replace(MOE, n_layers=4),
        lay(MeshSpec(pp=2, dp_replicate=2, dp_shard=2, cp=2, ep=2), micro=4, schedule="interleaved_1f1b", v=2), 1,
    ),
    "transformers qwen2, hsdp 2 x 2 x tp 2, full": ("qwen2", lay(MeshSpec(dp_replicate=2, dp_shard=2, tp=2), "full"), 0),
}  # fmt: skip


def _two_rows(model: ModelConfig, layout: Layout) -> Config:
    """`layout` of `model` in bf16, two 64-token sequences per micro batch on each rank, resolved."""
    base = Config(model=model, plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32"),
                  train=TrainConfig(global_batch=2 * layout.mesh.size("dp") * layout.micro_batches, seq_len=64))  # fmt: skip
    return layout.config(base).resolve(layout.mesh.world_size)


def test_hsdp_of_experts_sharded_over_one_rank_is_not_derived():
    """Where the expert mesh's FSDP shards the experts over one rank (dp_shard_mod_ep 1), FSDP reduce-scatters none of
    their gradients, so the one replica's run has nothing the replicas' all-reduce of them follows: that HSDP twin is
    probed itself; with shards of 2 it is derived."""
    from shardlab.estimate.twin import _one_replica

    def hsdp(dp_shard: int) -> Config:
        return _two_rows(MOE, lay(MeshSpec(dp_replicate=2, dp_shard=dp_shard, ep=2)))

    assert hsdp(2).mesh.experts.dp_shard_mod_ep == 1 and _one_replica(hsdp(2)) is None
    one = _one_replica(hsdp(4))
    assert one is not None and (one.mesh.dp_replicate, one.mesh.dp_shard, one.mesh.ep) == (1, 4, 2)


@pytest.mark.world  # two probes of each case, forked side by side: the full suite's tier
@pytest.mark.parametrize("name", REPLICATED)
def test_an_hsdp_measurement_is_fsdps_with_its_replicas_all_reduces(name):
    """HSDP's rank runs FSDP's ops, collectives and activations, plus an all-reduce over dp_replicate of each gradient
    reduce-scatter's output: derived from the twin with one replica, it equals the HSDP twin's own probe exactly
    (the search then probes one of the two)."""
    from shardlab.estimate.probe import measure
    from shardlab.estimate.twin import _one_replica

    model, layout, rank = REPLICATED[name]
    provider = None
    if model == "qwen2":
        pytest.importorskip("transformers")
        from shardlab.models.transformers.provider import HFCausalLM

        provider = HFCausalLM.from_dict({"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64,
                                         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                         "num_key_value_heads": 2}, "qwen2")  # fmt: skip
        model = DENSE
    cfg = _two_rows(model, layout)
    one = _one_replica(cfg)
    assert one is not None and one.mesh.dp_replicate == 1
    provider = provider or provider_for(cfg)
    hsdp, fsdp = run_forked([partial(measure, c, pp_rank=rank, provider=provider) for c in (cfg, one)])
    derived = fsdp.replicated(2)
    assert derived is not None and derived.runs == hsdp.runs != fsdp.runs
    assert derived.at() == hsdp.at() and derived.at(regather=False) == hsdp.at(regather=False)


def test_hsdp_micro_batches_all_reduce_over_the_replicas_once_per_step():
    """HSDP accumulating micro batches reduce-scatters each one's gradients but all-reduces over the replicas once
    per step (`FsdpPlan.all_reduce_once`): 2 micro batches cost the all-reduce of one and twice its reduce-scatters;
    a plan that all-reduces each micro batch (reduce_dtype below float32) is priced per micro batch."""
    dev, probes = device("h100"), {}

    def priced(micro: int, once: bool = True) -> dict:
        base = Config(model=SMALL, plan=PlanConfig(param_dtype="bfloat16", reduce_dtype="float32"),
                      train=TrainConfig(global_batch=4 * micro, seq_len=64))  # fmt: skip
        cfg = lay(MeshSpec(dp_replicate=2, dp_shard=2), micro=micro).config(base).resolve(4)
        plan = plan_model(cfg)[1]  # one row per micro batch
        assert plan.fsdp.all_reduce_once
        plan = msgspec.structs.replace(plan, fsdp=msgspec.structs.replace(plan.fsdp, all_reduce_once=once))
        e = estimate(cfg, plan, None, dev, provider_for(cfg), probes, compare_checkpointing=False)
        return {(c.axis, c.kind): (c.count, c.bytes) for c in e.collectives if c.phase == "backward"}

    one, two, each = priced(1), priced(2), priced(2, once=False)
    reduced, scattered = ("dp_replicate", "all_reduce"), ("dp_shard", "reduce_scatter")
    assert one[reduced][0] > 0 and two[reduced] == one[reduced]
    assert two[scattered] == each[scattered] == (2 * one[scattered][0], 2 * one[scattered][1])
    assert each[reduced] == (2 * one[reduced][0], 2 * one[reduced][1])
    bf16 = PlanConfig(param_dtype="bfloat16", reduce_dtype="bfloat16")
    cfg = lay(MeshSpec(dp_replicate=2, dp_shard=2), micro=2).config(Config(model=SMALL, plan=bf16)).resolve(4)
    assert not plan_model(cfg)[1].fsdp.all_reduce_once  # a bf16 sum over micro batches would round more
