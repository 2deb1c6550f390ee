"""Pipeline stages as data: which blocks each stage holds, which pp rank runs it, and the schedule's bubble.

Pure (no process group, no torch): `make_plan` calls `pipeline_plan` with each parameter's name and size; it
cuts the blocks into contiguous stages (`split_stages`), and what comes before and after the blocks goes with
them (embeddings to the first stage, the final norm and the head to the last). Stages are numbered in model order; `stage_ranks` says which pp rank runs each: looped schedules
deal them out round robin (rank r holds stages r, r + pp, ...), V-shaped ones give rank r stages r and
2 pp - 1 - r, so the first and the last stage share a rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from shardlab._base import Frozen
from shardlab._errors import ShardlabError

Schedule = Literal[
    "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"
]
Balance = Literal["blocks", "params", "flops"]
StageCall = Literal["tensor", "transformers"]
"""How a pipeline stage calls the model (shardlab.parallel.stages): "tensor", its forward is the sequence of its parts with a
tensor in and out (the stage runs its parts); "transformers", a transformers causal LM, whose forward (rotary
tables, masks) runs whole, fed token ids or the previous stage's hidden states."""
ONE_STAGE = ("gpipe", "1f1b")
LOOPED = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
V_SHAPED = ("zbv_zero_bubble", "dualpipev")
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
"""Schedules that split the backward into an input-gradient and a later weight-gradient step."""


def stage_shape(schedule: Schedule) -> tuple[Schedule, ...]:
    """The schedules that place stages on ranks as `schedule` does: one per rank (ONE_STAGE), looped (LOOPED) or
    V-shaped (V_SHAPED). What a rank computes depends on its stages, not on the order the schedule runs them in."""
    return next(group for group in (ONE_STAGE, LOOPED, V_SHAPED) if schedule in group)


class StagePlan(Frozen):
    """One pipeline stage: a contiguous run of blocks, plus the embeddings (first) or the norm and head (last)."""

    index: int
    pp_rank: int
    """The pp coordinate that runs it."""
    blocks: tuple[str, ...]
    others: tuple[str, ...]
    """Modules outside the blocks that it owns (the embeddings, the final norm, the head)."""
    params: int
    """Parameters it holds (whole tensors, before any sharding)."""


class PipelinePlan(Frozen):
    """Stages, their pp ranks, the schedule, and its bubble (analytic, see shardlab.sharding.pipeline.bubble_fraction)."""

    schedule: Schedule
    stages_per_rank: int
    microbatches: int
    stages: tuple[StagePlan, ...]
    bubble: float
    call: StageCall = "tensor"

    def stages_of(self, pp_rank: int) -> tuple[StagePlan, ...]:
        """The stages pp rank `pp_rank` runs, in model order."""
        return tuple(s for s in self.stages if s.pp_rank == pp_rank)


def pipeline_plan(
    params: list[tuple[str, tuple[str, ...], int]],
    names: list[str],
    blocks: tuple[str, ...],
    pp: int,
    schedule: Schedule,
    stages_per_rank: int,
    microbatches: int | None,
    balance: Balance,
    split: tuple[int, ...],
    flops: Mapping[str, float] | None = None,
    call: StageCall = "tensor",
) -> tuple[PipelinePlan, dict[str, int]]:
    """Stages for `params` ((name, tied aliases, element count)) cut from `blocks` (module fqns), and each
    parameter's stage. `names`: every parameter name, aliases included, in model order; what precedes the blocks
    goes to the first stage, what follows them to the last. `flops`: training FLOPs per token of each module
    (by fqn), needed for balance="flops". `call`: how a stage calls the model (rules.stage_call)."""
    if not blocks:
        raise ShardlabError(f"mesh.pp={pp} needs rules.blocks to name the repeated blocks the stages are cut from")
    if call == "transformers" and stages_per_rank > 1:
        raise ShardlabError(
            f"plan.pp_stages_per_rank={stages_per_rank}: a transformers model's forward runs whole, so each pp rank "
            "runs one stage; set pp_stages_per_rank=1 with pp_schedule='1f1b' or 'gpipe'"
        )
    block_of = {b: i for i, b in enumerate(blocks)}
    owner = {n: _first_block(n, block_of) for n in names}
    first_block_at = next((k for k, n in enumerate(names) if owner[n] is not None), len(names))
    order = {n: k for k, n in enumerate(names)}

    def place(name: str) -> int | str:
        """The block holding a parameter name, or 'first' / 'last' for what precedes / follows the blocks."""
        i = owner[name]
        return i if i is not None else ("first" if order[name] < first_block_at else "last")

    for fqn, aliases, _ in params:
        if len({place(n) for n in (fqn, *aliases)}) > 1:
            raise ShardlabError(
                f"mesh.pp={pp}: {fqn} is tied to {aliases[0]}, which another pipeline stage holds; untie them "
                "(model.tie_embeddings=False; tie_word_embeddings: false in a transformers config.json)"
            )
    sizes: list[float] = [0] * len(blocks)
    ends: dict[str, float] = {"first": 0, "last": 0}
    if balance == "flops" and not split:
        if flops is None:
            raise ShardlabError("plan.pp_balance='flops' needs each module's FLOPs: pass make_plan(..., flops=...)")
        outside = dict.fromkeys(fqn.rpartition(".")[0] for fqn, _, _ in params if owner[fqn] is None)
        sizes = [flops.get(b, 0.0) for b in blocks]
        for module in outside:
            ends[place(next(f for f, _, _ in params if f.rpartition(".")[0] == module))] += flops.get(module, 0.0)
    else:
        for fqn, _, numel in params:
            where = place(fqn)
            if isinstance(where, int):
                sizes[where] += numel
            else:
                ends[where] += numel
    n_stages = pp * stages_per_rank
    starts = split_stages(sizes, ends["first"], ends["last"], n_stages, balance, split)
    stage_of_block = [sum(1 for start in starts if start <= i) - 1 for i in range(len(blocks))]
    stage_of = {}
    for fqn, _, _ in params:
        where = place(fqn)
        stage_of[fqn] = stage_of_block[where] if isinstance(where, int) else (0 if where == "first" else n_stages - 1)
    ranks = stage_ranks(pp, stages_per_rank, schedule)
    stages = tuple(
        StagePlan(
            index=s,
            pp_rank=ranks[s],
            blocks=tuple(b for i, b in enumerate(blocks) if stage_of_block[i] == s),
            others=tuple(dict.fromkeys(
                fqn.rpartition(".")[0] for fqn, _, _ in params if owner[fqn] is None and stage_of[fqn] == s
            )),
            params=sum(numel for fqn, _, numel in params if stage_of[fqn] == s),
        )
        for s in range(n_stages)
    )  # fmt: skip
    m = microbatches or n_stages
    plan = PipelinePlan(
        schedule=schedule, stages_per_rank=stages_per_rank, microbatches=m, stages=stages,
        bubble=bubble_fraction(schedule, pp, stages_per_rank, m), call=call,
    )  # fmt: skip
    return plan, stage_of


def check_schedule(schedule: Schedule, stages_per_rank: int) -> None:
    """A schedule's shape needs its number of stages per rank: one, several (looped), or exactly two (V)."""
    if schedule in ONE_STAGE and stages_per_rank != 1:
        raise ShardlabError(
            f"plan.pp_schedule={schedule!r} runs one stage per rank but plan.pp_stages_per_rank={stages_per_rank}; "
            "set pp_stages_per_rank=1, or pick a looped schedule (interleaved_1f1b, looped_bfs, interleaved_zero_bubble)"
        )
    if schedule in LOOPED and stages_per_rank < 2:
        raise ShardlabError(
            f"plan.pp_schedule={schedule!r} loops over several stages per rank but plan.pp_stages_per_rank="
            f"{stages_per_rank}; set pp_stages_per_rank >= 2, or use 1f1b or gpipe"
        )
    if schedule in V_SHAPED and stages_per_rank != 2:
        raise ShardlabError(
            f"plan.pp_schedule={schedule!r} is V-shaped (two stages per rank) but plan.pp_stages_per_rank="
            f"{stages_per_rank}; set pp_stages_per_rank=2"
        )


def stage_ranks(pp: int, stages_per_rank: int, schedule: Schedule) -> tuple[int, ...]:
    """The pp rank of each stage, in model order."""
    n = pp * stages_per_rank
    if schedule in V_SHAPED:
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(n))
    return tuple(s % pp for s in range(n))


def stage_sends(pp: int, stages_per_rank: int, schedule: Schedule) -> tuple[tuple[int, int], ...]:
    """Per pp rank, the sends one micro batch makes from it: its stages' outputs whose next stage another rank runs
    (forward), and its stages' input gradients whose previous stage another rank runs (backward)."""
    owner = stage_ranks(pp, stages_per_rank, schedule)
    n = len(owner)
    return tuple((sum(owner[s] == r != owner[s + 1] for s in range(n - 1)),
                  sum(owner[s] == r != owner[s - 1] for s in range(1, n))) for r in range(pp))  # fmt: skip


def _first_block(name: str, block_of: dict[str, int]) -> int | None:
    """The first of the blocks (fqn -> index) holding parameter `name` (a block is a dotted prefix of it), or None:
    looked up by each prefix, not tried block by block (a 126-block model has a thousand names)."""
    parts = name.split(".")
    held = [block_of[p] for p in (".".join(parts[:k]) for k in range(1, len(parts))) if p in block_of]
    return min(held, default=None)


def split_stages(
    block_costs: list[float],
    first_cost: float,
    last_cost: float,
    n_stages: int,
    balance: Balance = "blocks",
    split: tuple[int, ...] = (),
) -> tuple[int, ...]:
    """The first block of each stage (stage 0 starts at block 0), for `n_stages` contiguous stages.

    split: explicit first blocks of stages 1..n-1. balance "blocks": as even a count of blocks as can be (earlier
    stages take the extra ones); "params" or "flops": the split whose largest stage (the embeddings' cost with the
    first, the norm's and head's with the last) costs least, in parameters or FLOPs as the costs are given.
    """
    n = len(block_costs)
    if n_stages > n:
        raise ShardlabError(
            f"mesh.pp x plan.pp_stages_per_rank = {n_stages} stages but the model has {n} blocks; every stage needs "
            "at least one block: lower pp or pp_stages_per_rank"
        )
    if split:
        if len(split) != n_stages - 1:
            raise ShardlabError(
                f"plan.pp_split={list(split)} gives {len(split) + 1} stages but mesh.pp x plan.pp_stages_per_rank = "
                f"{n_stages}; give {n_stages - 1} first blocks"
            )
        if list(split) != sorted(set(split)) or split[0] < 1 or split[-1] > n - 1:
            raise ShardlabError(
                f"plan.pp_split={list(split)} must be strictly increasing block indices in 1..{n - 1} (the first block "
                "of each stage after the first)"
            )
        return (0, *split)
    if balance == "blocks":
        base, extra = divmod(n, n_stages)
        starts, at = [], 0
        for s in range(n_stages):
            starts.append(at)
            at += base + (1 if s < extra else 0)
        return tuple(starts)
    return _balanced(block_costs, first_cost, last_cost, n_stages)


def _balanced(block_costs: list[float], first: float, last: float, n_stages: int) -> tuple[int, ...]:
    """Linear partition: the contiguous split minimising the largest stage, by dynamic programming."""
    n = len(block_costs)
    cost = list(block_costs)
    cost[0] += first
    cost[-1] += last
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest possible largest stage when the first i blocks form s stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    starts, i = [], n
    for s in range(n_stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return tuple(reversed(starts))


def bubble_fraction(schedule: Schedule, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """Idle fraction of a step, with forward, backward-for-inputs and backward-for-weights taking equal time.

    GPipe and 1F1B: (p - 1) / (m + p - 1) (GPipe paper). Looped schedules with v stages per rank:
    (p - 1) / (v m + p - 1) (Megatron's interleaved 1F1B; looped BFS has the same bubble). The zero-bubble
    schedules (interleaved zero bubble, ZB-V, DualPipeV) split the backward and fill the rest with weight
    gradients, but not the wait before the first forward reaches the rank holding stage p - 1: p - 1 forwards
    (a third of a micro batch's work each) against its 3 v m, (p - 1) / (3 v m + p - 1). This is what torch's own
    order for each schedule gives under these times (tests/test_pipeline.py runs every rank's order with its
    dependencies), not the zero of the ZB-V and DualPipe papers.
    """
    p, v, m = pp, stages_per_rank, microbatches
    if p == 1:
        return 0.0
    if schedule in ONE_STAGE:
        return (p - 1) / (m + p - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * v * m + p - 1)


def in_flight(schedule: Schedule, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """Micro batches whose activations the busiest rank (the first) holds at its peak, in units of one micro batch
    through all of the rank's layers.

    GPipe and looped BFS run every forward before any backward: m. 1F1B and ZB-V: p (ZB-V's paper keeps 1F1B's
    memory). Interleaved 1F1B and interleaved zero bubble: p + (p - 1) / v (Megatron's interleaved schedule).
    DualPipeV: p + 1 (DualPipe's paper). Never more than m.
    """
    p, v, m = pp, stages_per_rank, microbatches
    if schedule in ("gpipe", "looped_bfs"):
        return float(m)
    peak = {"1f1b": p, "zbv_zero_bubble": p, "dualpipev": p + 1}.get(schedule, p + (p - 1) / v)
    return float(min(m, peak))
