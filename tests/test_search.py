"""Layout search: the enumeration is exact and pure (every layout valid, none twice, pinned axes kept), memory
prunes before any probe, and the search ranks by the estimator's step time."""

import math

import msgspec
import pytest

from shardlab import Config, MeshSpec, ModelConfig, MoEConfig, PlanConfig, TrainConfig
from shardlab._errors import ShardlabError
from shardlab.estimate.layouts import AC_MODES, Layout, enumerate_layouts, factorizations, recomputes_no_more
from shardlab.sharding.mesh import AXES
from shardlab.sharding.pipeline import V_SHAPED

MODEL = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512)


def cfg(model=MODEL, global_batch=8, seq_len=64, **plan) -> Config:
    return Config(model=model, plan=PlanConfig(**plan), train=TrainConfig(global_batch=global_batch, seq_len=seq_len))


def layouts(c: Config, world: int, **kw):
    kw.setdefault("tp_divisors", c.model.tp_divisors())
    kw.setdefault("n_layers", c.model.n_layers)
    return enumerate_layouts(c, world, **kw)


def assert_parts_add_up(c) -> None:
    """A candidate's terms (`search --explain`'s) add up to its step time; it recomputes where it checkpoints."""
    assert math.fsum(seconds for _, seconds in c.parts) == pytest.approx(c.step_s, rel=1e-12, abs=0)
    assert (dict(c.parts)["recomputation"] > 0) == (c.layout.activation_checkpoint != "none"), c.layout.describe()


def test_factorizations_are_every_split_of_the_world_once():
    splits = [tuple(s.values()) for s in factorizations(8, {})]
    assert len(splits) == len(set(splits)) == math.comb(3 + 4, 4)  # 2^3 over 5 axes: stars and bars
    assert all(math.prod(s) == 8 for s in splits)
    assert {tuple(s.values()) for s in factorizations(8, {"tp": 2, "pp": 2})} == {
        (2, 2, 1, 1, 2), (2, 1, 2, 1, 2), (2, 1, 1, 2, 2),
    }  # fmt: skip
    assert list(factorizations(6, {"tp": 4})) == []


def test_every_layout_is_a_valid_config_and_none_repeats():
    c = cfg()
    found, _ = layouts(c, 4)
    assert len(found) == len(set(found)) > 0
    for layout in found:
        run = layout.config(c).resolve(4)  # the config's own checks: raises if the layout is invalid
        assert run.mesh.world_size == 4 and run.micro_batches == layout.micro_batches
        assert c.model.n_heads % run.mesh.tp == 0 and c.model.n_kv_heads % run.mesh.tp == 0
        assert run.mesh.pp * run.plan.pp_stages_per_rank <= c.model.n_layers
    meshes = {layout.mesh for layout in found}
    assert MeshSpec(dp_shard=2, tp=2) in meshes and MeshSpec(pp=2, dp_shard=1, cp=2) in meshes
    assert MeshSpec(dp_shard=1, tp=4) not in meshes  # n_kv_heads=2
    kinds = {(lay.mesh.pp > 1, lay.pp_schedule, lay.activation_checkpoint, lay.reshard_after_forward) for lay in found}
    assert (True, "interleaved_1f1b", "full", False) in kinds and (False, None, "selective", True) in kinds
    assert (False, None, "op", True) in kinds and (True, "1f1b", "op", True) in kinds


def test_checkpointing_modes_are_ordered_by_recomputation_where_they_can_be():
    """A layout that fits prunes the same layout with more recomputation; selective (half the blocks whole) and op
    (every block's cheap ops and every other matmul) prune neither each other nor themselves the wrong way."""
    assert AC_MODES == ("none", "selective", "op", "full")
    assert all(recomputes_no_more("none", ac) and recomputes_no_more(ac, "full") for ac in AC_MODES)
    assert not recomputes_no_more("selective", "op") and not recomputes_no_more("op", "selective")
    assert not recomputes_no_more("full", "op") and not recomputes_no_more("op", "none")


def test_pinned_axes_and_the_batch_bound_the_search():
    c = cfg(global_batch=4)
    found, _ = layouts(c, 8, fixed={"tp": 2})
    assert found and all(lay.mesh.tp == 2 for lay in found)
    assert all(c.train.global_batch % lay.mesh.size("dp") == 0 for lay in found)  # dp 8 cannot split 4 sequences
    assert {lay.micro_batches for lay in found if lay.mesh.pp == 1 and lay.mesh.size("dp") == 1} == {1, 2, 4}


def test_pipelines_keep_to_their_blocks_and_one_stage_models():
    found, _ = layouts(cfg(), 4, one_stage_pipelines=True)
    assert {lay.pp_stages_per_rank for lay in found} == {1}
    found, _ = layouts(cfg(), 4)
    assert {(lay.pp_schedule, lay.pp_stages_per_rank) for lay in found if lay.mesh.pp == 4} == {
        ("gpipe", 1),
        ("1f1b", 1),
    }  # 4 blocks: pp 4 leaves one stage per rank
    assert all(lay.pp_stages_per_rank == 2 for lay in found if lay.pp_schedule in V_SHAPED)
    assert all(lay.micro_batches % lay.mesh.pp == 0 for lay in found if lay.mesh.pp > 1)
    many, _ = layouts(cfg(global_batch=64), 2)
    assert {lay.micro_batches for lay in many if lay.mesh.pp == 2} == {2, 4, 8, 16}  # pp x (1, 2, 4, 8)


def test_expert_parallelism_borrows_from_dp_shard_and_cp():
    moe = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=512,
                      moe=MoEConfig(n_experts=4, expert_ffn_dim=64))  # fmt: skip
    found, _ = layouts(cfg(moe), 4, n_experts=4)
    eps = {(lay.mesh.dp_shard * lay.mesh.cp, lay.mesh.ep) for lay in found}
    assert (4, 4) in eps and (2, 2) in eps and (1, 2) not in eps
    assert all((lay.mesh.dp_shard * lay.mesh.cp) % lay.mesh.ep == 0 for lay in found)


def test_a_world_without_a_valid_mesh_says_what_was_refused():
    found, refused = layouts(cfg(model=ModelConfig(dim=64, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=128,
                                                   vocab_size=512)), 3)  # fmt: skip
    assert found == []
    assert len(refused) == len(list(factorizations(3, {}))) == len(AXES)
    assert any("model.n_heads=2 is not divisible by mesh.tp=3" in r for r in refused)


def test_layouts_whose_plan_exceeds_the_memory_are_dropped_before_any_probe():
    """FSDP 2 or DDP 2: with the memory just under DDP's state (whole parameters, gradients and AdamW state on each
    rank), no DDP layout is estimated and FSDP wins."""
    from shardlab.estimate import estimate_memory, fsdp_buffer_bytes
    from shardlab.estimate.devices import device
    from shardlab.estimate.search import search
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.training.loop import plan_model

    c = cfg(msgspec.structs.replace(MODEL, n_layers=2), global_batch=2)
    fixed = {"pp": 1, "cp": 1, "tp": 1}
    fsdp, ddp = MeshSpec(dp_shard=2), MeshSpec(dp_replicate=2, dp_shard=1)
    _, plan = plan_model(Layout(mesh=ddp, activation_checkpoint="none", micro_batches=1).config(c).resolve(2))
    memory = estimate_memory(plan).total + fsdp_buffer_bytes(plan) - 1
    blocks: dict = {}
    found = search(c, 2, LlamaProvider(c.model), lambda _: None, device("h100"), memory, fixed=fixed, top=9,
                   blocks=blocks)  # fmt: skip
    (((*_, splits), block),) = blocks.items()  # no layout splits the blocks: what tp and cp add is not counted
    assert splits == () and block.memory_bytes > 0 and block.tp_memory_bytes == block.cp_memory_bytes == 0
    assert found.over_memory == sum(lay.mesh == ddp for lay in layouts(c, 2, fixed=fixed)[0]) > 0
    assert all(b.layout.mesh == fsdp and b.peak <= memory for b in found.best)
    assert found.estimated < sum(lay.mesh == fsdp for lay in layouts(c, 2, fixed=fixed)[0])  # beaten ones skipped


def test_a_memory_below_every_layouts_state_is_one_line_before_any_block_is_counted():
    """Where even the most sharded layout's parameters, gradients and AdamW state exceed the memory, the search says
    so at once, with the closest layout and what it needs at least, without counting a block or making a plan (a
    user who typed MiB for GiB waits for nothing)."""
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import model_bytes, state_at_least
    from shardlab.estimate.search import search
    from shardlab.models.llama.provider import LlamaProvider

    c, provider, blocks = cfg(global_batch=4), LlamaProvider(MODEL), {}
    least = state_at_least(model_bytes(provider.meta_model()), MeshSpec(dp_shard=4))
    message = (
        r"^search: none of the (\d+) layouts of 4 ranks fits .* per rank \(\1 exceed it by their state and the "
        r"activations they keep at least, 0 estimated\); the closest, .*, needs .* or more; raise --memory"
    )
    with pytest.raises(ShardlabError, match=message):
        search(c, 4, provider, lambda _: None, device("h100"), least - 1, blocks=blocks)
    assert blocks == {}  # nothing counted
    with pytest.raises(ShardlabError, match=message):  # room for that state: the activations' floors decide
        search(c, 4, provider, lambda _: None, device("h100"), least, fixed={"tp": 1, "cp": 1}, blocks=blocks)
    assert blocks  # counted there


def test_keeping_the_weights_gathered_never_needs_less_memory():
    """What lets the search drop a layout with reshard_after_forward=False where the same layout resharding did not
    fit: it holds every unit's gathered weights, and its forward leaves at least as much for the backward."""
    from shardlab.estimate import estimate
    from shardlab.training.loop import plan_model

    c = cfg(msgspec.structs.replace(MODEL, n_layers=2), global_batch=2)
    found = []
    for reshard in (True, False):
        run = Layout(mesh=MeshSpec(dp_shard=2), activation_checkpoint="none", micro_batches=1,
                     reshard_after_forward=reshard).config(c).resolve(2)  # fmt: skip
        found.append(estimate(run, plan_model(run)[1], compare_checkpointing=False))
    assert 0 < found[0].activations <= found[1].activations
    assert found[0].fsdp_buffers < found[1].fsdp_buffers and found[0].peak < found[1].peak


def test_a_plan_derived_for_another_schedule_and_resharding_is_the_plan_made_for_it():
    """The search plans once per mesh and stage placement and derives the rest (`_derived`): it must be equal."""
    from shardlab.estimate.search import _derived
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.sharding.plan import make_plan

    c = cfg(global_batch=16, param_dtype="bfloat16")
    found, _ = layouts(c, 4, fixed={"pp": 2, "dp_shard": 2})
    model = LlamaProvider(c.model).meta_model()
    bases = {}
    checked = set()
    for layout in found:
        run = layout.config(c).resolve(4)
        kind = (run.plan.pp_schedule, run.plan.pp_stages_per_rank, run.micro_batches, run.plan.activation_checkpoint)
        if kind[:3] in checked and kind[3] != "selective":
            continue
        checked.add(kind[:3])
        schedule = run.plan.pp_schedule
        placement = (
            "zbv_zero_bubble" if schedule in V_SHAPED else "1f1b" if schedule in ("gpipe", "1f1b") else "looped_bfs"
        )
        base_plan = msgspec.structs.replace(run.plan, reshard_after_forward=False, pp_schedule=placement,
                                            pp_microbatches=None, activation_checkpoint="none")  # fmt: skip
        key = (run.mesh, base_plan)
        if key not in bases:
            bases[key] = make_plan(model, run.mesh, LlamaProvider(c.model).rules(base_plan), base_plan)
        made = make_plan(model, run.mesh, LlamaProvider(c.model).rules(run.plan), run.plan)
        assert _derived(bases[key], run) == made, layout.describe()
    assert len(checked) > len(bases) > 1


WIDE = ModelConfig(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=8192)
"""Probed on fake tensors, a wide model costs what a narrow one does; its matmuls dominate as a large model's do."""


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
def test_the_pruned_search_ranks_as_the_exhaustive_one_and_floors_are_below_the_estimates():
    """FSDP over 16 ranks spans two nodes: a layout's floor grows with its micro batches' gathers, so once the top 2
    fit, the rest are not looked at. At 4.5 GiB per rank memory decides too. Every floor is at most its layout's
    estimate, which is what makes the ranking exact, and what bounds how far from the fastest a search stopped by its
    budget leaves its pick."""
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.search import search
    from shardlab.estimate.twin import estimate_shared
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.training.loop import plan_model

    c = cfg(WIDE, global_batch=16, seq_len=4096, param_dtype="bfloat16", reduce_dtype="float32")
    provider, dev, fixed = LlamaProvider(WIDE), device("h100"), {"pp": 1, "cp": 1, "tp": 1}
    probes, blocks = {}, {}
    run = lambda prune, top: search(c, 16, provider, lambda _: None, dev, 9 * 2**29, fixed=fixed, top=top,  # noqa: E731
                                    prune=prune, probes=probes, blocks=blocks)  # fmt: skip
    pruned, every = run(True, 2), run(False, 100)
    assert pruned.pruned > 0 and pruned.estimated < every.estimated and every.pruned == 0
    assert pruned.unsearched == 0 and pruned.floor_left is None and pruned.pick_within == 1.0
    early = search(
        c, 16, provider, lambda _: None, dev, 9 * 2**29, fixed=fixed, top=2, probes=probes, budget=0.0, blocks=blocks
    )
    assert len(early.best) == 1 and early.unsearched > 0 and early.estimated < pruned.estimated  # one fit, then stop
    assert early.best[0].step_s <= early.pick_within * every.best[0].step_s  # how far the pick may be, truly
    assert early.floor_left <= every.best[0].step_s or early.best[0] == every.best[0]
    assert [(b.layout, b.step_s, b.peak) for b in pruned.best] == [(b.layout, b.step_s, b.peak) for b in every.best[:2]]
    floors = Floors.of(c, provider, provider.meta_model(), dev, own_rules=False, blocks=blocks)
    for b in every.best:
        assert 0 < floors.time(c, b.layout, dev) <= b.step_s and floors.memory(c, b.layout) <= b.peak
        assert_parts_add_up(b)
    piped = Layout(mesh=MeshSpec(pp=2, dp_shard=8), activation_checkpoint="full", micro_batches=2, pp_schedule="1f1b")
    split = Layout(mesh=MeshSpec(dp_shard=4, cp=2, tp=2), activation_checkpoint="selective", micro_batches=1)
    for layout in (piped, split):  # a bubble of a third; attention over cp (the probe's masked kernel) and tp
        run_cfg = layout.config(c).resolve(16)
        e = estimate_shared(run_cfg, plan_model(run_cfg)[1], None, dev, provider, probes)
        assert 0 < floors.time(c, layout, dev) <= e.time.step_s and floors.memory(c, layout) <= e.peak
    assert floors.memory(c, piped) > 4 * floors.param_bytes // 16  # the held stage's unsharded weights too


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
@pytest.mark.parametrize("family", ["shardlab", "transformers"])
def test_every_layout_of_a_search_is_estimated_at_or_above_its_floor(family):
    """What makes the pruned ranking exact, over every layout of 4 ranks of a model of 4 blocks whatever its axes
    (pp, HSDP, tp, cp), checkpointing, micro batches, schedules and resharding: no estimate, the last stage's rank
    probed, is below its floor, in time or memory (the floors' own terms are checked closer, layout by layout, in the
    tests below). shardlab's Llama, and a transformers Qwen2 of the same shape: its masks read a value, which meta
    tensors cannot give, so its block is counted on fake tensors, and it gets compute (attention's FLOPs as the fake
    runs count them), FSDP, activation, TP and CP floors."""
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.search import search
    from shardlab.models.llama.provider import LlamaProvider

    model = msgspec.structs.replace(WIDE, n_layers=4)
    c = cfg(model, global_batch=8, seq_len=4096, param_dtype="bfloat16", reduce_dtype="float32")
    provider, dev, blocks = LlamaProvider(model), device("h100"), {}
    if family == "transformers":
        pytest.importorskip("transformers")
        from shardlab.models.transformers.provider import HFCausalLM

        m = model
        shape = dict(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim, num_hidden_layers=4,
                     num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads)  # fmt: skip
        provider = HFCausalLM.from_dict({"model_type": "qwen2", **shape}, "qwen2")
    every = search(c, 4, provider, lambda _: None, dev, 2**40, top=10**6, prune=False, blocks=blocks)
    assert every.bounded == 0 and {b.layout.mesh.pp for b in every.best} == {1, 2, 4}
    floors = Floors.of(c, provider, provider.meta_model(), dev, own_rules=False, blocks=blocks, splits=("tp", "cp"))
    assert blocks.keys() == {(c.train.seq_len, msgspec.json.encode(c.plan), False, ("tp", "cp"))}
    block = floors.block
    assert block is not None and block.train_flops > 0 and block.attention_flops > 0 and block.params > 0
    assert (floors.tp_dim, floors.kv_dim) == (model.dim, model.n_kv_heads * model.head_dim)
    for b in every.best:
        assert floors.time(c, b.layout, dev) <= b.step_s and floors.memory(c, b.layout) <= b.peak, b.layout.describe()
        assert floors.activations(c, b.layout) > 0, b.layout.describe()


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
def test_a_pipelines_blocks_do_at_least_what_a_block_of_the_same_local_shapes_does():
    """The search drops a pipelined layout whose micro batches in flight exceed the memory, or whose step is slower
    than the K-th fastest, each block of each keeping, computing and communicating what a block of a layout of the
    same local shapes (`_block_key`), pipelined or not, was estimated to (`Estimate.block`); what it keeps, scaled
    (`kept_at_least`), bounds other shapes' blocks too: at a larger tp, or with fewer or more rows. Over every
    schedule, resharding and stage count (up to 2 a rank) of 2 x 2 ranks, of 4 pp ranks, and of 2 x 2 with TP 2, no
    estimate is below these bounds, and they are tighter than the floor alone. A model probed whole gives no such
    block (its blocks' mean includes the rest)."""
    from shardlab.estimate import estimate_memory, fsdp_buffer_bytes
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.search import _block_key, blocks_time, in_flight_activations, kept_at_least
    from shardlab.estimate.twin import estimate_shared
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.training.loop import plan_model

    model = msgspec.structs.replace(WIDE, n_layers=13)  # probed at 2 and 3 blocks a stage, 4 stages: measured apart
    c = cfg(model, global_batch=8, seq_len=4096, param_dtype="bfloat16", reduce_dtype="float32")
    provider, dev, probes = LlamaProvider(model), device("h100"), {}
    floors = Floors.of(c, provider, provider.meta_model(), dev, own_rules=False, splits=("tp",))
    meshes = (  # the last two without FSDP and replicas: tp 1 and 2 (, rows per micro batch, schedules)
        ({"pp": 2, "dp_shard": 2, "tp": 1}, (1,), None), ({"pp": 1, "dp_shard": 4, "tp": 1}, (1,), None),
        ({"pp": 4, "dp_shard": 1, "tp": 1}, (1, 2), ("1f1b", "interleaved_1f1b")),
        ({"pp": 2, "dp_shard": 1, "tp": 2}, (1,), None),
    )  # fmt: skip
    by_key: dict[tuple, list] = {}
    for fixed, rows_of, schedules in meshes:
        for layout in layouts(c, 4, fixed={**fixed, "cp": 1})[0]:
            rows = c.train.global_batch // layout.mesh.size("dp") // layout.micro_batches
            if (schedules is not None and layout.pp_schedule not in schedules) or layout.pp_stages_per_rank > 2:
                continue  # 4 stages a rank of pp 2 are 8 stages of 13 blocks, probed whole as pp 4's 2 a rank are
            if layout.activation_checkpoint in ("none", "full") and rows in rows_of:
                run = layout.config(c).resolve(4)
                plan = plan_model(run)[1]
                e = estimate_shared(run, plan, None, dev, provider, probes)
                fixed_bytes = estimate_memory(plan).total + fsdp_buffer_bytes(plan)
                first = floors.micro_batch_activations(c, layout)
                by_key.setdefault(_block_key(layout, c), []).append((layout, plan, e, fixed_bytes, first))
    assert len(by_key) == 8  # (FSDP, tp 1), (one rank, tp 1, 1 or 2 rows), (one rank, tp 2), each none and full
    less_memory = less_time = scaled = flat = 0
    for key, same in by_key.items():
        apart = [x for x in same if x[2].block is not None]  # not 8 stages of 13 blocks: probed whole
        assert all(x[0].mesh.pp * x[0].pp_stages_per_rank == 8 for x in same if x not in apart) and len(apart) > 3
        for _, _, known, _, _ in apart:
            for other, theirs in by_key.items():
                kept = kept_at_least({key: known.block}, other)
                for layout, plan, e, fixed_bytes, first in theirs if kept else ():
                    assert e.block is None or kept <= e.block.activation_bytes, (key, other)
                    need = fixed_bytes + in_flight_activations(plan, first, kept)
                    assert need <= e.peak, layout.describe()
                    tighter = need > fixed_bytes + floors.activations(c, layout)
                    less_memory += tighter
                    scaled += tighter and other != key
                    flat += tighter and layout.mesh.pp == 1
            for layout, plan, e, _, _ in same:
                if layout.mesh.pp > 1:
                    at_least = blocks_time(plan, known.block, floors, c, layout, dev)
                    assert at_least <= e.time.step_s, layout.describe()
                    less_time += at_least > floors.time(c, layout, dev)
    assert less_memory > 10 and less_time > 10 and scaled > 10 and flat > 1


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
def test_pipeline_floors_price_the_ranks_the_estimate_prices():
    """Split by blocks, a pipeline's floor counts the busiest pp rank and the one holding the last stage (its output
    layer too) as the plan splits them: under a V-shaped schedule the first rank holds both ends, with uneven stages
    the first ranks hold more, and selective checkpointing recomputes each rank's own multiples of ac_every. Each
    floor stays at most the estimate (both ranks probed), and for a large output layer it is far above what the
    average rank alone would give."""
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.twin import estimate_shared
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.training.loop import plan_model

    model = msgspec.structs.replace(WIDE, n_layers=6, vocab_size=65536)  # the output layer: a block and a half
    c = cfg(model, global_batch=8, seq_len=2048, param_dtype="bfloat16", reduce_dtype="float32")
    provider, dev, probes = LlamaProvider(model), device("h100"), {}
    floors = Floors.of(c, provider, provider.meta_model(), dev, own_rules=False)
    cases = [  # 6 blocks in 4 stages: 2, 2, 1, 1
        Layout(mesh=MeshSpec(pp=2, dp_shard=2), activation_checkpoint="selective", micro_batches=4,
               pp_schedule="zbv_zero_bubble", pp_stages_per_rank=2, reshard_after_forward=False),  # V-shaped
        Layout(mesh=MeshSpec(pp=4, dp_shard=1), activation_checkpoint="full", micro_batches=4, pp_schedule="1f1b"),
        Layout(mesh=MeshSpec(pp=2, dp_shard=1, tp=2), activation_checkpoint="op", micro_batches=4,
               pp_schedule="interleaved_1f1b", pp_stages_per_rank=2),
    ]  # fmt: skip
    by_params = msgspec.structs.replace(c, plan=msgspec.structs.replace(c.plan, pp_balance="params"))
    for layout in cases:
        run = layout.config(c).resolve(4)
        e = estimate_shared(run, plan_model(run)[1], None, dev, provider, probes)
        assert 0 < floors.time(c, layout, dev) <= e.time.step_s, layout
        assert 0 < floors.optimizer_seconds(layout, dev) <= e.time.optimizer_s, layout  # AdamW over the rank's share
        # split otherwise (here by parameters), the floor knows only that the busiest rank holds ceil(L / pp) blocks
        # and that some rank computes the average: the rank holding the last stage computes more
        assert floors.busy(c, layout, dev) > 1.05 * floors.busy(by_params, layout, dev), layout


def test_a_block_whose_flops_cannot_be_counted_gives_no_block(monkeypatch):
    """A model whose forward cannot run on meta tensors (`CANNOT_RUN`: data-dependent shapes, say) has no block
    counts, so no compute floor, whatever the other counts run in the same batch find."""
    from shardlab.estimate import block_counts
    from shardlab.models.llama.provider import LlamaProvider

    def cannot(*_args, **_kwargs):
        raise NotImplementedError("data-dependent output shape")

    monkeypatch.setattr(block_counts, "_count", cannot)  # forked children inherit it
    monkeypatch.setattr(block_counts, "_memory_bytes", cannot)  # (quicker: only the FLOPs decide)
    c = cfg()
    assert block_counts.count_block(LlamaProvider(c.model), c.train.seq_len, c.plan, False) is None


def test_the_floor_counts_the_adds_accumulating_the_micro_batches_gradients():
    """Each micro batch after the first adds its gradients to the others': under a pipeline with FSDP into the held
    blocks' unsharded gradients in reduce_dtype (a fifth of a 405B pipeline rank's step at 256 micro batches), else
    into the rank's share of the parameters. The floor counts what the estimate counts of the rank's blocks (the
    plan's parameters, `estimate._accumulation`): all of it but the rest of the model's, never more."""
    from shardlab.estimate import _accumulation, probed_rank
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.training.loop import plan_model

    model = msgspec.structs.replace(MODEL, n_layers=8, dim=256, ffn_dim=1024)  # the blocks outweigh the rest
    provider = LlamaProvider(model)
    c = cfg(model, global_batch=32, seq_len=256)
    floors = Floors.of(c, provider, provider.meta_model(), device("h100"), own_rules=True)  # parameters: any dtypes
    for plan, mesh, schedule in (
        (dict(param_dtype="bfloat16", reduce_dtype="float32"), MeshSpec(pp=4, dp_shard=2), "1f1b"),
        (dict(param_dtype="bfloat16", reduce_dtype="bfloat16"), MeshSpec(pp=2, dp_shard=2, tp=2), "interleaved_1f1b"),
        ({}, MeshSpec(pp=2, dp_shard=1, tp=2), "1f1b"),  # fp32 without FSDP: the parameters' own gradients
        (dict(param_dtype="bfloat16", reduce_dtype="float32"), MeshSpec(dp_shard=4, tp=2), None),
    ):
        c = cfg(model, global_batch=32, seq_len=256, **plan)
        v = 2 if schedule == "interleaved_1f1b" else 1
        layout = Layout(mesh=mesh, activation_checkpoint="full", micro_batches=8, pp_schedule=schedule,
                        pp_stages_per_rank=v)  # fmt: skip
        run = layout.config(c).resolve(mesh.world_size)
        run_plan = plan_model(run)[1]
        rank = probed_rank(run_plan)[0]
        counted = sum(moved * n for _, moved, n, _ in _accumulation(run_plan, rank, 8))
        floor = floors.accumulated_bytes(c, layout, floors._ranks(c, layout)[0])
        assert 0.9 * counted < floor <= counted, (mesh, plan)
        one = msgspec.structs.replace(layout, micro_batches=1)
        assert floors.accumulated_bytes(c, one, floors._ranks(c, one)[0]) == 0


def test_the_pipelines_sends_are_floored_by_the_pp_rank_sending_fewest():
    """Each micro batch's residual stream crosses every stage boundary between two pp ranks, forward and backward:
    the floor counts what the pp rank sending fewest sends, in param_dtype, where the estimate prices the busiest
    rank's sends (`_pipeline_sends`): never more, and the same where every rank sends alike (two pp ranks, each
    schedule) and in the same dtype."""
    from shardlab.estimate import _pipeline_sends
    from shardlab.estimate.comm_floors import pp_seconds
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.roofline import collective_seconds
    from shardlab.training.loop import plan_model

    model, dev = msgspec.structs.replace(MODEL, n_layers=8), device("h100")
    floors = Floors(block=None, tp_dim=0, param_bytes=0, param_numel=0, n_layers=8, rate=1.0, stage_dim=model.dim)
    bf16 = dict(param_dtype="bfloat16")
    for mesh, schedule, plan in (
        (MeshSpec(pp=2, dp_shard=2), "1f1b", bf16),
        (MeshSpec(pp=2, dp_shard=1, tp=2), "interleaved_1f1b", {}),  # sequence parallelism splits what a stage sends
        (MeshSpec(pp=2, cp=2, dp_shard=2), "zbv_zero_bubble", bf16),
        (MeshSpec(pp=4, dp_shard=2), "interleaved_zero_bubble", bf16),  # a middle rank sends 4 a micro batch: 3
        (MeshSpec(pp=4, dp_shard=1, tp=2), "zbv_zero_bubble", {}),  # the first rank 2, a middle one 4
    ):
        c = cfg(model, global_batch=16, seq_len=64, **plan)
        v = 1 if schedule == "1f1b" else 2
        layout = Layout(mesh=mesh, activation_checkpoint="none", micro_batches=4, pp_schedule=schedule,
                        pp_stages_per_rank=v, reshard_after_forward=False)  # fmt: skip
        run = layout.config(c).resolve(mesh.world_size)
        run_plan = plan_model(run)[1]
        priced = sum(collective_seconds(x, run_plan.mesh, dev) for x in _pipeline_sends(run, run_plan, 4, model.dim))
        floor = pp_seconds(floors, c, layout, dev)
        assert 0 < floor <= priced, (mesh, schedule)
        if mesh.pp == 2:
            assert floor == pytest.approx(priced, rel=1e-12), (mesh, schedule)
    flat = Layout(mesh=MeshSpec(dp_shard=8), activation_checkpoint="none", micro_batches=1)
    assert pp_seconds(floors, c, flat, dev) == 0


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
def test_the_fsdp_floor_counts_the_gathers_each_schedule_runs():
    """FSDP's floor is at most the data-parallel collectives of the layout's estimate and within a fifth of them.
    Without a pipeline each micro batch gathers the weights, and again in its backward where they are resharded
    after forward. With one, torch's schedule reduces once, and gathers resharded weights m + 1 times whatever its
    order (GPipe, 1F1B, interleaved), once where they stay gathered: counting one gather per step, as the floor did,
    put 1F1B's at a fifth of its estimate here."""
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.roofline import DP_AXES, collective_seconds
    from shardlab.estimate.twin import estimate_shared
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.training.loop import plan_model

    deep = msgspec.structs.replace(WIDE, n_layers=8)
    c = cfg(deep, global_batch=32, seq_len=4096, param_dtype="bfloat16", reduce_dtype="float32")
    dev, provider, probes = device("h100"), LlamaProvider(deep), {}
    floors = Floors.of(c, provider, provider.meta_model(), dev, own_rules=False)
    flat, piped = MeshSpec(dp_shard=16), MeshSpec(pp=2, dp_shard=8)
    layouts = [
        Layout(mesh=flat, activation_checkpoint="full", micro_batches=2),
        Layout(mesh=flat, activation_checkpoint="full", micro_batches=2, reshard_after_forward=False),
        Layout(mesh=piped, activation_checkpoint="full", micro_batches=4, pp_schedule="1f1b"),
        Layout(mesh=piped, activation_checkpoint="full", micro_batches=4, pp_schedule="gpipe"),
        Layout(mesh=piped, activation_checkpoint="full", micro_batches=4, pp_schedule="interleaved_1f1b",
               pp_stages_per_rank=2),
        Layout(mesh=piped, activation_checkpoint="full", micro_batches=4, pp_schedule="interleaved_1f1b",
               pp_stages_per_rank=2, reshard_after_forward=False),
    ]  # fmt: skip
    for layout in layouts:
        run = layout.config(c).resolve(16)
        e = estimate_shared(run, plan_model(run)[1], None, dev, provider, probes)
        dp = sum(collective_seconds(x, run.mesh, dev) for x in e.collectives if x.axis in DP_AXES)
        assert 0.8 * dp <= floors.fsdp_seconds(c, layout, dev) <= dp, layout.describe()


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
def test_a_model_with_experts_gets_floors_below_its_estimates():
    """Experts route every token evenly in the floors' counts as in the probe, so a model with experts gets every
    floor: compute, FSDP (the weights it gathers whole, and the experts, sharded over ep and gathered over the expert
    mesh's dp_shard_mod_ep), TP, CP, EP's all-to-alls and activations, each at most what its layout's estimate gives,
    under expert, tensor, context and pipeline parallelism. Without ep, FSDP gathers every expert: its floor is
    most of the estimate's."""
    from shardlab.estimate.comm_floors import ep_seconds, tp_seconds
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.roofline import DP_AXES, collective_seconds
    from shardlab.estimate.twin import estimate_shared
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.training.loop import plan_model

    moe = msgspec.structs.replace(WIDE, n_layers=4, ffn_dim=4096, moe=MoEConfig(n_experts=4, expert_ffn_dim=4096))
    c = cfg(moe, global_batch=16, seq_len=4096, param_dtype="bfloat16", reduce_dtype="float32")
    dev, provider, probes = device("h100"), LlamaProvider(moe), {}
    floors = Floors.of(c, provider, provider.meta_model(), dev, own_rules=False)
    block = provider.meta_model().model.layers[0]
    assert floors.block is not None and 0 < floors.block.params < sum(p.numel() for p in block.parameters()) / 2
    assert floors.block.expert_params == sum(p.numel() for p in block.mlp.experts.parameters())
    layouts = [
        Layout(mesh=MeshSpec(dp_shard=16), activation_checkpoint="full", micro_batches=1),
        Layout(mesh=MeshSpec(dp_shard=16, ep=4), activation_checkpoint="none", micro_batches=1),
        Layout(mesh=MeshSpec(dp_shard=8, tp=2, ep=4), activation_checkpoint="full", micro_batches=1),
        Layout(mesh=MeshSpec(dp_shard=4, cp=2, tp=2, ep=4), activation_checkpoint="selective", micro_batches=2),
        Layout(mesh=MeshSpec(pp=2, dp_shard=8, ep=4), activation_checkpoint="full", micro_batches=2, pp_schedule="1f1b"),
    ]  # fmt: skip
    for layout in layouts:
        run = layout.config(c).resolve(16)
        e = estimate_shared(run, plan_model(run)[1], None, dev, provider, probes)
        seconds = {axis: 0.0 for axis in ("tp", "ep", *DP_AXES)}
        for x in e.collectives:
            seconds[x.axis] = seconds.get(x.axis, 0.0) + collective_seconds(x, run.mesh, dev)
        assert 0 < floors.time(c, layout, dev) <= e.time.step_s, layout.describe()
        assert floors.activations(c, layout) > 0 and floors.memory(c, layout) <= e.peak, layout.describe()
        fsdp = sum(seconds[a] for a in DP_AXES)
        assert (0.5 if layout.mesh.ep == 1 else 0) * fsdp < floors.fsdp_seconds(c, layout, dev) <= fsdp, (
            layout.describe()
        )
        if layout.mesh.tp > 1:
            assert 0 < tp_seconds(floors, c, layout, dev) <= seconds["tp"], layout.describe()
        if layout.mesh.ep > 1:
            assert 0 < ep_seconds(floors, c, layout, dev) <= seconds["ep"], layout.describe()


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
def test_what_expert_parallelism_adds_to_the_traffic_is_below_what_each_layouts_probe_records():
    """Dispatching a rank's tokens to the experts' ranks and back moves bytes that one rank holding every expert does
    not: counted at ep 2 (`Block.ep_memory_bytes`, per token of the rank's, at one row too where its block runs the
    same ops there), as much again at ep 4, and counted for each block and token of a layout's rank (1 / tp of them
    under tp), the floor of the ops without FLOPs stays at most what the probe of each layout's rank records: at ep 2
    and 4, with one row per micro batch and with two, with checkpointing, cp and tp."""
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.probe import measure, probe
    from shardlab.models.llama.provider import LlamaProvider

    moe = msgspec.structs.replace(WIDE, n_layers=4, ffn_dim=4096, moe=MoEConfig(n_experts=4, expert_ffn_dim=4096))
    c = cfg(moe, global_batch=16, seq_len=4096, param_dtype="bfloat16", reduce_dtype="float32")
    dev, provider = device("h100"), LlamaProvider(moe)
    floors = Floors.of(c, provider, provider.meta_model(), dev, own_rules=False, splits=("ep",))
    without = Floors.of(c, provider, provider.meta_model(), dev, own_rules=False)
    b = floors.block
    assert b.ep_memory_bytes > 0 and b.ep_one_row_memory_bytes == b.ep_memory_bytes

    def moved(blocks: int, rows: int) -> int:  # on rank 0 of ep 4 (of dp_shard 4): its ops without FLOPs, not FSDP's
        run = (
            Layout(mesh=MeshSpec(dp_shard=4, ep=4), activation_checkpoint="none", micro_batches=1)
            .config(msgspec.structs.replace(c, train=msgspec.structs.replace(c.train, global_batch=4 * rows)))
            .resolve(4)
        )
        (only,) = measure(run, provider=provider.with_layers(blocks)).runs
        return sum(m for f, m, kind, role, _ in only.sequence if kind == "memory" and not role)

    per_row = (moved(2, 3) - moved(1, 3)) - (moved(2, 2) - moved(1, 2))  # one block, one more row
    assert per_row - b.memory_bytes * c.train.seq_len >= b.ep_memory_bytes * c.train.seq_len  # at ep 4 as at ep 2
    layouts = [
        Layout(mesh=MeshSpec(dp_shard=16, ep=4), activation_checkpoint="none", micro_batches=1),  # one row
        Layout(mesh=MeshSpec(dp_shard=8, cp=2, ep=2), activation_checkpoint="full", micro_batches=1),  # two
        Layout(mesh=MeshSpec(dp_shard=8, tp=2, ep=4), activation_checkpoint="op", micro_batches=1),
    ]  # fmt: skip
    for layout in layouts:
        m = layout.mesh
        tokens = c.train.global_batch // m.size("dp") * c.train.seq_len // m.cp
        added = (floors.memory_seconds(c, layout) - without.memory_seconds(c, layout)) * floors.bandwidth
        assert added == pytest.approx(moe.n_layers * tokens * b.ep_memory_bytes / m.tp), layout.describe()
        p = probe(layout.config(c).resolve(16), provider=provider)
        recorded = layout.micro_batches * sum(m * n for f, m, n, _ in p.ops if not f)
        assert floors.memory_seconds(c, layout) * floors.bandwidth <= recorded, layout.describe()


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
def test_what_tp_and_cp_add_at_one_row_leaves_out_the_weights_own_traffic():
    """At one row per micro batch what tp and cp add is counted at size 2 with one row, less what the line through
    2 and 3 rows moves at none: the weights' own traffic at the count's layout (FSDP's over cp's ranks; every expert,
    where the count has no ep), which a layout sharding them otherwise moves less of. With it left in, the floor of
    a model with 8 experts over ep 4 under tp 2 was above what its rank's probe records (1.003 of it; Mixtral 8x7B's
    pp 2 x dp_shard 16 x cp 2 x ep 8 at one row had a floor of 3.16 s a step against an estimate of 2.77 s).
    Dense weights split by tp keep theirs in tp's count (FSDP's copies are then counted apart, as at tp 2)."""
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.probe import probe
    from shardlab.models.llama.provider import LlamaProvider

    moe = msgspec.structs.replace(WIDE, n_layers=4, ffn_dim=4096, moe=MoEConfig(n_experts=8, expert_ffn_dim=4096))
    c = cfg(moe, global_batch=16, seq_len=4096, param_dtype="bfloat16", reduce_dtype="float32")
    provider = LlamaProvider(moe)
    floors = Floors.of(c, provider, provider.meta_model(), device("h100"), own_rules=False, splits=("tp", "cp"))
    for mesh in (MeshSpec(dp_shard=8, cp=2, ep=4), MeshSpec(dp_shard=8, tp=2, ep=4)):
        layout = Layout(mesh=mesh, activation_checkpoint="none", micro_batches=2)  # one row each
        p = probe(layout.config(c).resolve(16), provider=provider)
        recorded = layout.micro_batches * sum(m * n for f, m, n, _ in p.ops if not f)
        assert 0.5 * recorded < floors.memory_seconds(c, layout) * floors.bandwidth <= recorded, mesh.describe()


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
@pytest.mark.parametrize("family", ["qwen2", "gpt_neox"])
def test_a_transformers_models_tp_and_cp_floors_are_below_what_each_layouts_probe_records(family):
    """A dense transformers decoder split by its TP plan as Megatron does (Qwen2's q/k/v with biases; GPT-NeoX's
    attention and MLP side by side on the block's input) gets shardlab's Llama's TP floor (4 reductions of the
    residual stream per block, 1 more where recomputed) and CP's (K and V gathered): each at most the tp and cp
    collectives its layout's probe records, with sequence parallelism (Qwen2's) and without (GPT-NeoX's: its blocks
    hand the attention their input by position, where SP is refused), with each checkpointing mode; the activations
    its blocks keep, SP's gathered inputs included, at most what the probe finds alive; and the FLOPs, attention's
    included, those of the probe (at most them under cp). Stacked experts (their MoE block takes whole tensors) get
    no TP floor."""
    pytest.importorskip("transformers")
    from shardlab.estimate.comm_floors import cp_seconds, tp_seconds
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.probe import probe
    from shardlab.estimate.roofline import collective_seconds
    from shardlab.models.provider import check_layout
    from shardlab.models.transformers.provider import HFCausalLM

    shape = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
    provider = HFCausalLM.from_dict({"model_type": family, **shape}, family)
    assert provider.tp_reduced_dim == 1024 and provider.kv_dim == 512
    moe = HFCausalLM.from_dict({"model_type": "mixtral", **shape, "num_local_experts": 4}, "mixtral")
    assert moe.tp_reduced_dim == 0 and moe.kv_dim == 512
    dev, sp = device("h100"), family == "qwen2"
    c = cfg(global_batch=16, seq_len=1024, param_dtype="bfloat16", reduce_dtype="float32", sequence_parallel=sp)
    floors = Floors.of(c, provider, provider.meta_model(), dev, own_rules=False)
    cases = [
        (MeshSpec(dp_shard=4, tp=2), "none", 1), (MeshSpec(dp_shard=4, tp=2), "full", 2),
        (MeshSpec(dp_shard=4, tp=2), "selective", 2), (MeshSpec(dp_shard=2, cp=2, tp=2), "op", 2),
        (MeshSpec(dp_shard=4, cp=2), "full", 2),
    ]  # fmt: skip
    for mesh, ac, micro in cases:
        layout = Layout(mesh=mesh, activation_checkpoint=ac, micro_batches=micro)
        run = layout.config(c).resolve(8)
        check_layout(run, provider)
        p = probe(run, provider=provider)
        cp = micro * sum(collective_seconds(x, run.mesh, dev) for x in p.collectives if x.axis == "cp")
        assert (0 < cp_seconds(floors, c, layout, dev) <= cp) if mesh.cp > 1 else cp == 0, (mesh, ac)
        tp = micro * sum(collective_seconds(x, run.mesh, dev) for x in p.collectives if x.axis == "tp")
        assert (0 < tp_seconds(floors, c, layout, dev) <= tp) if mesh.tp > 1 else tp == 0, (mesh, ac)
        assert 0 < floors.activations(c, layout) <= p.activation_bytes, (mesh, ac)
        computed = micro * sum(f * n for f, m, n, _ in p.ops)  # attention's too, as the fake runs count it
        assert (0.9 if mesh.cp > 1 else 1) * computed <= floors.flops(c, layout) <= computed, (mesh, ac)


def test_a_sibling_checkpointing_more_or_with_fewer_rows_never_needs_more_memory():
    """What lets the search drop a layout where a sibling checkpointing every block, or running one sequence per
    micro batch, did not fit."""
    from shardlab.estimate.devices import device
    from shardlab.estimate.twin import estimate_shared
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.training.loop import plan_model

    c = cfg(msgspec.structs.replace(MODEL, n_layers=2), global_batch=4)
    peaks = {}
    for ac, micro in (("none", 1), ("none", 2), ("selective", 2), ("full", 2)):  # 2 micro batches: one row each
        run = Layout(mesh=MeshSpec(dp_shard=2), activation_checkpoint=ac, micro_batches=micro).config(c).resolve(2)
        e = estimate_shared(run, plan_model(run)[1], None, device("h100"), LlamaProvider(c.model), {})
        peaks[ac, micro] = e.peak
    assert peaks["none", 1] > peaks["none", 2] >= peaks["selective", 2] >= peaks["full", 2]


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
def test_the_floors_of_the_ops_without_flops_of_activations_and_of_cp_are_below_what_each_layouts_probe_records():
    """The blocks' memory-bound ops, counted per row on one rank in fp32 and taken at bf16 and 1 / (tp x cp), move
    no more bytes than the probe of the layout's rank records for its ops without FLOPs: under TP with sequence
    parallelism in bf16 and without it in fp32 (the gathered activations' ops are whole there), CP, full, op and
    selective checkpointing (what the backward's recomputation moves counted with the block, and what TP adds on a
    rank counted at tp 2: with sequence parallelism the floor is within 30% of the probe's traffic). Without it the floor of a large model misses a sixth of its step (its eager norms and adds). CP's
    floor (K and V gathered, their gradients reduce-scattered) is at most the probe's cp collectives, TP's (the
    blocks' reductions, once more in a recomputed block) at most its tp collectives. What the
    blocks' forwards keep, counted the same way (under SP with each block's inputs gathered whole over tp, which
    its linears or op-level's policy keep), is at most the activations the probe finds alive, with every
    checkpointing mode. The FLOPs are at most the probe's and within 10%: a block checkpointed whole recomputes its
    forward up to the last tensor its backward needs (torch's checkpoint stops there), not its last projection,
    which the floor counted and which put the floor of 70B's fastest layout above its estimate."""
    from shardlab.estimate.comm_floors import cp_seconds, tp_seconds
    from shardlab.estimate.devices import device
    from shardlab.estimate.floors import Floors
    from shardlab.estimate.probe import probe
    from shardlab.estimate.roofline import collective_seconds
    from shardlab.models.llama.provider import LlamaProvider

    deep = msgspec.structs.replace(WIDE, n_layers=6)  # the blocks outweigh the rest: the floor's per-block count shows
    dev, provider, blocks = device("h100"), LlamaProvider(deep), {}  # blocks: counted once per plan, as a search does
    cases = [
        (dict(param_dtype="bfloat16", reduce_dtype="float32"), MeshSpec(dp_shard=2, tp=8), "full"),
        (dict(sequence_parallel=False), MeshSpec(dp_shard=4, cp=2, tp=2), "selective"),
        (dict(param_dtype="bfloat16", reduce_dtype="float32"), MeshSpec(dp_shard=4, tp=4), "op"),
        (dict(sequence_parallel=False), MeshSpec(dp_shard=8, tp=2), "none"),
        (dict(param_dtype="bfloat16", reduce_dtype="float32"), MeshSpec(dp_shard=16), "op", 1),
        (dict(param_dtype="bfloat16", reduce_dtype="float32"), MeshSpec(dp_shard=2, tp=8), "full", 8),  # one row
        (dict(sequence_parallel=False), MeshSpec(dp_shard=4, cp=2, tp=2), "selective", 4),
        (dict(param_dtype="bfloat16", reduce_dtype="float32"), MeshSpec(dp_shard=2, cp=4, tp=2), "op", 8),
        (dict(param_dtype="bfloat16", reduce_dtype="float32"), MeshSpec(dp_shard=4, tp=4), "none"),
        (dict(param_dtype="bfloat16", reduce_dtype="float32"), MeshSpec(dp_shard=8, tp=2), "selective"),
    ]  # fmt: skip
    for plan, mesh, ac, *micro in cases:
        c = cfg(deep, global_batch=16, seq_len=4096, **plan)
        floors = Floors.of(c, provider, provider.meta_model(), dev, own_rules=False, blocks=blocks, splits=("tp", "cp"))
        assert floors.block.tp_memory_bytes > 0 and floors.block.cp_memory_bytes > 0  # counted at tp 2 and cp 2
        layout = Layout(mesh=mesh, activation_checkpoint=ac, micro_batches=micro[0] if micro else 2)
        p = probe(layout.config(c).resolve(16), provider=provider)
        moved = layout.micro_batches * sum(m * n for f, m, n, _ in p.ops if not f)
        assert 0 < floors.memory_seconds(c, layout) * floors.bandwidth <= moved, (mesh, ac)
        rows = 16 // layout.mesh.size("dp") // layout.micro_batches
        if plan.get("sequence_parallel", True) and rows > 1:  # the recomputation's and what TP adds counted: close
            assert floors.memory_seconds(c, layout) * floors.bandwidth > 0.7 * moved, (mesh, ac)
        assert 0 < floors.activations(c, layout) <= p.activation_bytes, (mesh, ac)
        if plan.get("sequence_parallel", True) and mesh.tp > 1 and ac != "full":  # SP's gathered inputs counted
            unsplit = msgspec.structs.replace(c, plan=msgspec.structs.replace(c.plan, sequence_parallel=False))
            assert floors.activations(c, layout) > floors.activations(unsplit, layout), (mesh, ac)
        computed = layout.micro_batches * sum(f * n for f, m, n, _ in p.ops)  # recomputed too, but where it stops
        assert 0.9 * computed < floors.flops(c, layout) <= computed, (mesh, ac)
        run_mesh = layout.config(c).resolve(16).mesh
        cp = layout.micro_batches * sum(collective_seconds(x, run_mesh, dev) for x in p.collectives if x.axis == "cp")
        assert (0 < cp_seconds(floors, c, layout, dev) <= cp) if mesh.cp > 1 else cp == 0, (mesh, ac)
        tp = layout.micro_batches * sum(collective_seconds(x, run_mesh, dev) for x in p.collectives if x.axis == "tp")
        assert (0 < tp_seconds(floors, c, layout, dev) <= tp) if mesh.tp > 1 else tp == 0, (mesh, ac)
    assert len(blocks) == 2  # the two plans' blocks


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
def test_a_pipelines_last_rank_is_probed_only_for_layouts_that_may_enter_the_top():
    """Without the probe of the pp rank holding a pipeline's last stage a layout's peak is exact and its step time a
    lower bound (that rank, with the output layer, is the slower one here): the search probes it only for the
    layouts that fit and may enter the top K, and ranks them as the exhaustive search does, exactly. With less memory
    than the largest two peaks, layouts are dropped where a sibling needing less did not fit, and the ranking is the
    exhaustive one's of those that fit."""
    from shardlab.estimate.devices import device
    from shardlab.estimate.search import search
    from shardlab.estimate.twin import estimate_shared
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.training.loop import plan_model

    model = msgspec.structs.replace(MODEL, dim=128, ffn_dim=256, vocab_size=4096)  # the blocks outweigh the output
    c = cfg(model, global_batch=4, param_dtype="bfloat16")
    provider, dev, fixed = LlamaProvider(model), device("h100"), {"pp": 2, "dp_shard": 2, "cp": 1, "tp": 1}
    probes, blocks = {}, {}
    run = lambda prune: search(c, 4, provider, lambda _: None, dev, 2**40, fixed=fixed, top=1, prune=prune,  # noqa: E731
                               probes=probes, blocks=blocks)  # fmt: skip
    pruned, every = run(True), run(False)
    assert every.bounded > 0 and [(b.layout, b.step_s, b.peak) for b in pruned.best] == [
        (b.layout, b.step_s, b.peak) for b in every.best
    ]
    for b in every.best:
        layout_cfg = b.layout.config(c).resolve(4)
        plan = plan_model(layout_cfg)[1]
        exact, bound = (estimate_shared(layout_cfg, plan, None, dev, provider, probes, last_rank=last)
                        for last in (True, False))  # fmt: skip
        assert exact.time.step_s == b.step_s and exact.peak == bound.peak == b.peak
        assert bound.time.step_s < exact.time.step_s
        assert_parts_add_up(b)
        assert dict(b.parts)["bubble"] > 0 and dict(b.parts)["pp sends"] > 0
    everything = search(c, 4, provider, lambda _: None, dev, 2**40, fixed=fixed, top=100, prune=False, probes=probes,
                        blocks=blocks)  # fmt: skip
    memory = sorted({b.peak for b in everything.best})[-2] - 1
    tight, exhaustive = (search(c, 4, provider, lambda _: None, dev, memory, fixed=fixed, top=3, prune=prune,
                                probes=probes, blocks=blocks) for prune in (True, False))  # fmt: skip
    assert exhaustive.too_big > 0 and all(b.peak <= memory for b in exhaustive.best)
    assert [(b.layout, b.step_s) for b in tight.best] == [(b.layout, b.step_s) for b in exhaustive.best]


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
def test_a_second_search_reads_its_probes_from_the_store(tmp_path, monkeypatch):
    """Probes kept on disk (`ProbeStore`) answer a later search of the same model: the same ranking, no probe of its
    own, and its floors' block counts are read too (not counted again for a new provider of the model). A damaged
    entry is measured again, another model's probes are not read, and a store that cannot be written keeps
    nothing."""
    from shardlab.estimate import floors
    from shardlab.estimate.devices import device
    from shardlab.estimate.probe_store import ProbeStore
    from shardlab.estimate.search import search
    from shardlab.models.llama.provider import LlamaProvider

    c = cfg(msgspec.structs.replace(MODEL, n_layers=2), global_batch=8)  # two blocks: one fake run per probe
    dev = device("h100")
    flat = {"pp": 1, "cp": 1, "dp_replicate": 1}  # FSDP or TP on 2 ranks: a few probes

    def run(provider):
        store = ProbeStore(provider, tmp_path)
        return search(c, 2, provider, lambda _: None, dev, 2**30, fixed=flat, top=2, store=store)

    provider = LlamaProvider(c.model)
    first = run(provider)
    again = run(provider)
    assert first.probes > 0 and first.stored == 0
    assert again.probes == 0 and again.stored == first.probes and again.best == first.best
    with monkeypatch.context() as patched:
        patched.setattr(floors, "count_block", lambda *_: pytest.fail("the block was counted again"))
        assert run(LlamaProvider(c.model)).best == first.best
    entries = sorted(tmp_path.rglob("*.probe"))
    assert len(entries) == first.probes
    entries[0].write_bytes(entries[0].read_bytes()[:10])
    mended = run(provider)
    assert mended.probes == 1 and mended.stored == first.probes - 1 and mended.best == first.best
    other = LlamaProvider(msgspec.structs.replace(c.model, ffn_dim=256))
    assert ProbeStore(other, tmp_path).model != ProbeStore(provider, tmp_path).model
    blocked = tmp_path / "file"  # a store under a file cannot be written: the search goes on without it
    blocked.write_text("")
    store = ProbeStore(provider, blocked / "probes")
    alone = search(c, 2, provider, lambda _: None, dev, 2**30, fixed=flat, top=2, store=store)
    assert alone.best == first.best and store.written == 0


@pytest.mark.world  # whole searches or many layouts' probes, forked side by side: the full suite's tier
def test_a_pipelines_block_is_probed_without_its_pipeline():
    """The search probes a block of a pipelined layout as the layout of its local shapes without pp (one micro batch of
    its rows): the same `_block_key`, and a block that keeps, computes and sends over tp what one of the pipeline's
    stages does: with FSDP and several stages per rank, and with TP, one stage per rank and checkpointing."""
    from shardlab.estimate.devices import device
    from shardlab.estimate.roofline import compute_seconds
    from shardlab.estimate.search import _block_key, _without_pipeline
    from shardlab.estimate.twin import block_shared, estimate_shared
    from shardlab.models.llama.provider import LlamaProvider
    from shardlab.training.loop import plan_model

    model = msgspec.structs.replace(WIDE, n_layers=13)  # 2 and 3 blocks in each of 4 stages: measured apart
    c = cfg(model, global_batch=8, seq_len=4096, param_dtype="bfloat16", reduce_dtype="float32")
    provider, dev, probes = LlamaProvider(model), device("h100"), {}
    compared = set()
    for fixed, schedule, ac in (
        ({"pp": 2, "dp_shard": 2}, "interleaved_1f1b", "none"),
        ({"pp": 2, "tp": 2}, "1f1b", "full"),
    ):
        for layout in layouts(c, 4, fixed={"tp": 1, "cp": 1, **fixed})[0]:
            if (layout.pp_schedule, layout.activation_checkpoint) != (schedule, ac) or (layout.mesh, ac) in compared:
                continue
            run = layout.config(c).resolve(4)
            plan = plan_model(run)[1]
            piped = estimate_shared(run, plan, None, dev, provider, probes, last_rank=False).block
            if piped is None:  # 8 stages of 13 blocks: probed whole
                continue
            flat, flat_cfg = _without_pipeline(layout, c)
            assert flat.mesh.pp == 1 and _block_key(flat, flat_cfg) == _block_key(layout, c)
            flat_run = flat_cfg.resolve(flat.mesh.world_size)
            block = block_shared(flat_run, plan_model(flat_run)[1], None, provider, probes)
            assert block.activation_bytes == piped.activation_bytes, layout.describe()
            assert compute_seconds(block, dev) == pytest.approx(compute_seconds(piped, dev), rel=1e-9)
            tp = sorted((k.kind, k.phase, k.count, k.bytes) for k in block.collectives if k.axis == "tp")
            assert tp == sorted((k.kind, k.phase, k.count, k.bytes) for k in piped.collectives if k.axis == "tp")
            compared.add((layout.mesh, ac))
    assert len(compared) == 2
    pinned = msgspec.structs.replace(c, mesh=MeshSpec(dp_shard=2, tp=2))  # a recipe's own mesh, 2 data-parallel ranks
    one_row = Layout(mesh=MeshSpec(pp=4), activation_checkpoint="none", micro_batches=8, pp_schedule="1f1b")
    flat, flat_cfg = _without_pipeline(one_row, pinned)  # one sequence: a batch the recipe's own mesh cannot split
    assert flat_cfg.mesh == flat.mesh and flat_cfg.train.global_batch == 1 and flat_cfg.resolve(1).micro_batches == 1
