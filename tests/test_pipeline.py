"""Pipeline stages as data: splits, ranks, schedules, bubbles, the plan's stages and their errors.
Pure: no process group. Runs against one process are in tests/worlds/test_pipeline.py."""

from __future__ import annotations

import itertools
import math

import msgspec
import pytest
import torch

from shardlab import Config, MeshSpec, ModelConfig, PlanConfig, TrainConfig
from shardlab.estimate import estimate_memory
from shardlab.models.llama.model import Llama
from shardlab.models.llama.rules import llama_rules
from shardlab.sharding.pipeline import _first_block, bubble_fraction, split_stages, stage_ranks
from shardlab.sharding.plan import Plan, make_plan
from shardlab.training.loop import plan_model

MODEL = ModelConfig(dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)


def plan_for(mesh: MeshSpec, model: ModelConfig = MODEL, **options) -> Plan:
    with torch.device("meta"):
        llama = Llama(model)
    opts = PlanConfig(**options)
    return make_plan(llama, mesh.resolve(mesh.world_size if mesh.is_resolved else 4), llama_rules(model, opts), opts)


@pytest.mark.parametrize(
    ("n_blocks", "n_stages", "starts"),
    [(6, 2, (0, 3)), (7, 2, (0, 4)), (10, 4, (0, 3, 6, 8)), (4, 4, (0, 1, 2, 3))],
)
def test_even_split_gives_the_extra_blocks_to_the_first_stages(n_blocks, n_stages, starts):
    assert split_stages([1] * n_blocks, 0, 0, n_stages) == starts


def test_a_parameter_belongs_to_the_first_block_holding_it():
    """Looked up by the name's prefixes, as the first block (in the blocks' order) it starts with: nested blocks,
    a block that is a prefix of another's name but not of a dotted component, the root's parameters."""
    blocks = ("layers.1", "layers", "layers.10", "layers.1.mlp", "head")
    block_of = {b: i for i, b in enumerate(blocks)}
    names = ["layers.1.mlp.w", "layers.10.w", "layers.1.w", "layers.2.w", "layers.w", "head.w", "headx.w", "w",
             "layers.1", "layers.100.w"]  # fmt: skip
    for name in names:
        first = next((block_of[b] for b in blocks if name.startswith(b + ".")), None)
        assert _first_block(name, block_of) == first, name


def test_params_balance_gives_the_embedding_and_head_stages_fewer_blocks():
    starts = split_stages([1] * 8, 4, 4, 4, balance="params")
    costs = [1] * 8
    costs[0] += 4
    costs[-1] += 4
    bounds = [*starts, 8]
    largest = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
    assert largest == 5 and starts[1] == 1 and starts[-1] == 7  # the fewest parameters any split can manage


def test_explicit_split_wins():
    assert split_stages([1] * 8, 100, 100, 3, balance="params", split=(2, 5)) == (0, 2, 5)


@pytest.mark.parametrize(
    ("split", "message"),
    [
        (
            (2,),
            r"^plan\.pp_split=\[2\] gives 2 stages but mesh\.pp x plan\.pp_stages_per_rank = 3; give 2 first blocks$",
        ),
        ((5, 2), r"^plan\.pp_split=\[5, 2\] must be strictly increasing block indices in 1\.\.7"),
        ((0, 4), r"^plan\.pp_split=\[0, 4\] must be strictly increasing"),
        ((4, 8), r"^plan\.pp_split=\[4, 8\] must be strictly increasing"),
    ],
)
def test_bad_explicit_split_is_one_line(split, message):
    with pytest.raises(ValueError, match=message):
        split_stages([1] * 8, 0, 0, 3, split=split)


def test_more_stages_than_blocks_is_an_error_at_plan_time():
    with pytest.raises(ValueError, match=r"^mesh\.pp x plan\.pp_stages_per_rank = 8 stages but the model has 6 blocks"):
        plan_for(MeshSpec(pp=4, dp_shard=1), pp_schedule="interleaved_1f1b", pp_stages_per_rank=2)


@pytest.mark.parametrize(
    ("schedule", "v", "ranks"),
    [
        ("1f1b", 1, (0, 1, 2, 3)),
        ("interleaved_1f1b", 2, (0, 1, 2, 3, 0, 1, 2, 3)),
        ("zbv_zero_bubble", 2, (0, 1, 2, 3, 3, 2, 1, 0)),
    ],
)
def test_stage_ranks_loop_or_fold(schedule, v, ranks):
    assert stage_ranks(4, v, schedule) == ranks


@pytest.mark.parametrize(
    ("schedule", "v", "message"),
    [
        ("1f1b", 2, r"^plan\.pp_schedule='1f1b' runs one stage per rank but plan\.pp_stages_per_rank=2"),
        ("interleaved_1f1b", 1, r"^plan\.pp_schedule='interleaved_1f1b' loops over several stages per rank"),
        ("dualpipev", 3, r"^plan\.pp_schedule='dualpipev' is V-shaped \(two stages per rank\)"),
    ],
)
def test_schedule_and_stages_per_rank_must_agree(schedule, v, message):
    with pytest.raises(ValueError, match=message):
        PlanConfig(pp_schedule=schedule, pp_stages_per_rank=v)


@pytest.mark.parametrize(
    ("schedule", "p", "v", "m", "bubble"),
    [
        ("gpipe", 4, 1, 8, 3 / 11),
        ("1f1b", 4, 1, 8, 3 / 11),
        ("interleaved_1f1b", 4, 2, 8, 3 / 19),
        ("looped_bfs", 4, 2, 8, 3 / 19),
        ("interleaved_zero_bubble", 4, 2, 8, 3 / 51),
        ("zbv_zero_bubble", 4, 2, 8, 3 / 51),
        ("dualpipev", 4, 2, 4, 3 / 27),
        ("1f1b", 1, 1, 1, 0.0),
    ],
)
def test_bubble_fraction(schedule, p, v, m, bubble):
    assert bubble_fraction(schedule, p, v, m) == pytest.approx(bubble)


def _orders(schedule: str, pp: int, v: int, m: int) -> dict[int, list[tuple[int, str, int]]]:
    """Every pp rank's compute actions (stage, F / B / I / W, micro batch) in the order torch's schedule runs them."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    from shardlab.estimate._fake import fake_world
    from shardlab.training.pipeline_schedule import SCHEDULE_NAMES, compute_steps, stage_actions

    pipeline = _placeholder_pipeline(schedule, pp, v, m)
    with fake_world(pp, 0):
        group = dist.new_group(list(range(pp)))
        if v == 1:  # torch keeps no order for one stage per rank: its F and B each run the micro batches in turn
            counted = {r: stage_actions(pipeline, r, group)[r] for r in range(pp)}
            return {r: [(r, a, acts[:i].count(a)) for i, a in enumerate(acts)] for r, acts in counted.items()}
        own = [PipelineStage(nn.Linear(1, 1), s.index, len(pipeline.stages), torch.device("cpu"), group=group)
               for s in pipeline.stages_of(0)]  # fmt: skip
        order = get_schedule_class(SCHEDULE_NAMES[schedule])(own, n_microbatches=m).pipeline_order
    return {rank: list(compute_steps(actions)) for rank, actions in order.items()}


def _placeholder_pipeline(schedule: str, pp: int, v: int, m: int):
    """The PipelinePlan of `schedule` over pp ranks with v stages each and m micro batches; its stages hold nothing."""
    from shardlab.sharding.pipeline import PipelinePlan, StagePlan

    stages = tuple(StagePlan(index=i, pp_rank=r, blocks=(), others=(), params=0)
                   for i, r in enumerate(stage_ranks(pp, v, schedule)))  # fmt: skip
    return PipelinePlan(schedule=schedule, stages_per_rank=v, microbatches=m, stages=stages, bubble=0.0)


def _idle(orders: dict[int, list[tuple[int, str, int]]], n_stages: int) -> float:
    """1 - the busiest rank's work / the step, each rank running its actions in order as soon as their inputs are
    there (a stage's forward after the previous stage's, its backward after its forward and the next stage's
    backward, W after I) with F, I and W one unit each, B two, and sends free."""
    cost, done, clock = {"F": 1, "B": 2, "I": 1, "W": 1}, {}, dict.fromkeys(orders, 0)
    waiting = {rank: list(actions) for rank, actions in orders.items()}
    while any(waiting.values()):
        moved = False
        for rank, actions in waiting.items():
            while actions:
                stage, kind, i = actions[0]
                needs = {"F": [(stage - 1, "F")] if stage else [], "W": [(stage, "I")]}.get(
                    kind, [(stage, "F")] + ([(stage + 1, "B"), (stage + 1, "I")] if stage < n_stages - 1 else [])
                )
                ready = [done[s, k, i] for s, k in needs if (s, k, i) in done]
                if len(ready) < len(needs) - (kind in "BI" and stage < n_stages - 1):  # B or I of the next: either
                    break
                clock[rank] = done[stage, kind, i] = max([clock[rank], *ready]) + cost[kind]
                actions.pop(0)
                moved = True
        assert moved, "the order deadlocks"
    busy = max(sum(cost[k] for _, k, _ in actions) for actions in orders.values())
    return 1 - busy / max(clock.values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                                      "zbv_zero_bubble", "dualpipev"])  # fmt: skip
def test_the_bubble_is_what_torchs_order_for_the_schedule_idles(schedule):
    """bubble_fraction is the idle time of torch's own order for every rank, run with its dependencies under the
    equal times it assumes: the zero-bubble schedules idle while the first forward reaches the last stage's rank."""
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    for pp, m in [(2, 4), (4, 8), (4, 16), (8, 16)]:
        got = _idle(_orders(schedule, pp, v, m), pp * v)
        assert got == pytest.approx(bubble_fraction(schedule, pp, v, m), abs=1e-9), (pp, m)


def test_plan_puts_embeddings_first_and_the_head_last():
    plan = plan_for(MeshSpec(pp=2, dp_shard=2))
    pl = plan.pipeline
    assert [(s.index, s.pp_rank) for s in pl.stages] == [(0, 0), (1, 1)]
    assert pl.stages[0].blocks == tuple(f"model.layers.{i}" for i in range(3))
    assert pl.stages[0].others == ("model.embed_tokens",)
    assert pl.stages[1].others == ("model.norm", "lm_head")
    assert sum(s.params for s in pl.stages) == sum(math.prod(p.shape) for p in plan.params)
    assert plan.param("model.embed_tokens.weight").stage == 0
    assert plan.param("model.layers.3.mlp.up_proj.weight").stage == 1
    assert plan.param("lm_head.weight").stage == 1
    assert (pl.schedule, pl.microbatches, pl.bubble) == ("1f1b", 2, pytest.approx(1 / 3))
    assert Plan.from_json(plan.to_json()) == plan


def test_worst_pp_rank_holds_the_most_bytes():
    plan = plan_for(MeshSpec(pp=2, dp_shard=2))
    per_rank = [sum(p.bytes_per_rank for p in plan.params if p.stage == s) for s in (0, 1)]
    assert plan.bytes_per_rank == max(per_rank) < sum(per_rank)
    assert estimate_memory(plan).params == max(per_rank)


def test_v_shaped_plan_gives_rank_zero_the_first_and_last_stage():
    plan = plan_for(MeshSpec(pp=2, dp_shard=1), pp_schedule="zbv_zero_bubble", pp_stages_per_rank=2)
    stages = plan.pipeline.stages
    assert [s.pp_rank for s in stages] == [0, 1, 1, 0]
    assert stages[0].others == ("model.embed_tokens",) and stages[3].others == ("model.norm", "lm_head")


def test_table_shows_stages_and_bubble():
    text = plan_for(MeshSpec(pp=2, dp_shard=2), pp_microbatches=4).table()
    assert "Pipeline over pp=2: 1f1b, 2 stages (1 per rank), 4 micro batches, bubble 20.0% (analytic)" in text
    assert "model.layers.0-2 (3)" in text and "model.layers.3-5 (3)" in text


def test_tied_embeddings_cannot_span_stages():
    tied = msgspec.structs.replace(MODEL, tie_embeddings=True)
    with pytest.raises(ValueError, match=r"^mesh\.pp=2: model\.embed_tokens\.weight is tied to lm_head\.weight"):
        plan_for(MeshSpec(pp=2, dp_shard=1), tied)


def test_micro_batches_must_divide_each_dp_ranks_batch():
    cfg = Config(mesh=MeshSpec(pp=2, dp_shard=2), model=MODEL, train=TrainConfig(global_batch=8))
    assert cfg.resolve(4)  # 4 sequences per dp rank, 2 micro batches (one per stage)
    with pytest.raises(
        ValueError, match=r"^plan\.pp_microbatches=3 does not divide the 4 sequences each data-parallel"
    ):
        msgspec.structs.replace(cfg, plan=PlanConfig(pp_microbatches=3))
    with pytest.raises(ValueError, match=r"^train\.micro_batch with mesh\.pp=2: the pipeline splits each batch"):
        msgspec.structs.replace(cfg, train=TrainConfig(global_batch=8, micro_batch=2))


def test_flops_balance_weighs_the_head_but_not_the_embedding_lookup():
    """A large vocabulary: by parameters the embedding and the head weigh the same; by FLOPs (torch's counter on
    the meta device) the lookup costs nothing and the head's matmul as much as 11 blocks, so the last stage holds
    one block."""
    model = msgspec.structs.replace(MODEL, n_layers=8, vocab_size=8192)
    cfg = Config(mesh=MeshSpec(pp=2, dp_shard=1), model=model, train=TrainConfig(global_batch=8, seq_len=64))

    def blocks_per_stage(balance: str) -> list[int]:
        _, plan = plan_model(msgspec.structs.replace(cfg, plan=PlanConfig(pp_balance=balance)).resolve(2))
        return [len(s.blocks) for s in plan.pipeline.stages]

    assert blocks_per_stage("blocks") == blocks_per_stage("params") == [4, 4]
    assert blocks_per_stage("flops") == [7, 1]


def test_flops_balance_needs_the_flops():
    with pytest.raises(ValueError, match=r"^plan\.pp_balance='flops' needs each module's FLOPs"):
        plan_for(MeshSpec(pp=2, dp_shard=1), pp_balance="flops")


def test_zero_bubble_schedules_with_fsdp_need_the_weights_kept_after_forward():
    mesh = MeshSpec(pp=2, dp_shard=2)
    for schedule in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"):
        with pytest.raises(ValueError, match=rf"^plan\.pp_schedule='{schedule}' computes weight gradients after FSDP"):
            plan_for(mesh, pp_schedule=schedule, pp_stages_per_rank=2, reshard_after_forward=True)
        plan_for(mesh, pp_schedule=schedule, pp_stages_per_rank=2, reshard_after_forward=False)
        kept = plan_for(mesh, pp_schedule=schedule, pp_stages_per_rank=2).fsdp  # the default keeps them
        assert (kept.reshard_after_forward, kept.resharding) == (False, f"{schedule} computes weight gradients after "
                                                                 "the forward")  # fmt: skip
    assert plan_for(mesh, pp_schedule="1f1b").fsdp.reshard_after_forward


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble",
                                      "dualpipev"])  # fmt: skip
def test_stage_actions_are_the_order_torchs_schedule_builds(schedule):
    """The estimate reads each rank's compute order from torch's schedule built without its lowering to
    communication actions (seconds at scale); the order is the one the whole construction gives, on every rank."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    from shardlab.estimate._fake import fake_world
    from shardlab.training.pipeline_schedule import SCHEDULE_NAMES, compute_actions, stage_actions

    pp, m = 4, 8
    pipeline = _placeholder_pipeline(schedule, pp, 2, m)
    for rank in range(pp):
        with fake_world(pp, rank):
            group = dist.new_group(list(range(pp)))
            own = [PipelineStage(nn.Linear(1, 1), s.index, len(pipeline.stages), torch.device("cpu"), group=group)
                   for s in pipeline.stages_of(rank)]  # fmt: skip
            whole = get_schedule_class(SCHEDULE_NAMES[schedule])(own, n_microbatches=m).pipeline_order[rank]
            got = stage_actions(pipeline, rank, group)
        want = compute_actions(whole, [s.index for s in pipeline.stages_of(rank)])
        assert got == want and all(len(a) >= 2 * m for a in got.values()), (rank, got)
