"""search(cfg, world) -> Search: the fastest layouts that fit, ranked by the estimator's step time.

The layouts are `shardlab.estimate.layouts.enumerate_layouts`'s. Each has a floor (`shardlab.estimate.floors`: step
time and memory from its shape alone) and they are looked at lowest floor first, until the next floor is above the
K-th fastest layout that fits: every later one is at least that slow, so the top K are the exhaustive search's
(`prune=False` looks at them all; tests/test_search.py compares the two). What is cheap and exact comes next: each
layout's parameters, gradients, AdamW state and FSDP buffers are read off its plan (one plan per mesh and pipeline
shape, on one meta model), and a layout whose state and the activations it keeps at least (`Floors.activations`)
exceed the memory is dropped before any probe. Once a layout of the same local shapes (`_block_key`), pipelined or
not, has been estimated, each block of a pipelined one is taken to keep, compute and communicate (tp, cp, ep) what
one of its blocks does in each micro batch (`Estimate.block`): one whose micro batches in flight then exceed the
memory is dropped, and one whose step time then exceeds the K-th fastest is not estimated. What a block keeps
bounds that of other shapes too, scaled to their tp, cp and rows (`kept_at_least`). A pipelined layout that passes
these bounds while no layout of its local shapes has been estimated, and needs more than half the memory by them,
has a block of them probed first, without its pipeline (`_without_pipeline`: one probe of a few blocks, where the
pipeline's own are of a few in each stage, and of its last stage's rank too), and is bounded by it (where the memory
is far from binding that block seldom drops the pipeline: its own probes decide).
The rest are estimated (`shardlab.estimate.twin`) with probes shared through one cache (one per twin shape: every row
count on the line through two, keeping FSDP's weights gathered from the probe that reshards them). The pp rank
holding a pipeline's last stage, whose probe only its compute needs, is probed only for a layout that fits and may
enter the top K (without it the step time is a lower bound, as its floor is: the higher of the two; the memory
exact). A layout is dropped without a probe of its own where an estimated layout of its mesh and schedule that
needs no more memory (more checkpointing, resharding after forward, fewer rows) did not fit. Within one mesh and
schedule, fewer micro batches and less recomputation never make a step slower in the estimator's model (the same
work in larger kernels, fewer FSDP gathers; recomputation only adds work), nor does keeping the weights gathered
between forward and backward (reshard_after_forward=False: fewer gathers), so once a layout fits, the ones it beats
that way are not estimated: they cannot win, and they are not shown.

A budget of seconds stops the search early, once a layout fits: the layouts not looked at are then each at least
as slow as the lowest floor among them (`Search.floor_left`), which bounds how far the pick can be from the
fastest (`Search.pick_within`). A search run again reads its probes (and its block counts) from the store and goes
further in the same time.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Mapping

import msgspec
import torch

from shardlab._errors import ShardlabError
from shardlab.config import Config
from shardlab.estimate import check_fp8, estimate_memory, fsdp_buffer_bytes, probed_rank
from shardlab.estimate.device import Device
from shardlab.estimate.floors import Floors, model_bytes, state_at_least
from shardlab.estimate.layouts import AC_MODES, Layout, enumerate_layouts, recomputes_no_more
from shardlab.estimate.measurement import Probe
from shardlab.estimate.peak import beside_state
from shardlab.estimate.probe_store import ProbeStore
from shardlab.estimate.roofline import DP_AXES, collective_seconds, compute_seconds
from shardlab.estimate.search_result import Candidate, Search, as_candidate, readable_bytes
from shardlab.estimate.twin import Shape, block_shared, estimate_shared, needs_last_rank
from shardlab.models.flops import module_flops
from shardlab.models.provider import ModelProvider, check_layout
from shardlab.sharding.pipeline import LOOPED, ONE_STAGE, V_SHAPED, bubble_fraction, in_flight, stage_shape
from shardlab.sharding.plan import Plan, make_plan
from shardlab.sharding.rules import Rules

RulesOf = Callable[[Config], Rules | None]


def search(
    cfg: Config,
    world: int,
    provider: ModelProvider,
    rules_of: RulesOf,
    dev: Device,
    memory: int,
    *,
    fixed: Mapping[str, int] | None = None,
    top: int = 5,
    prune: bool = True,
    probes: dict[bytes, Shape] | None = None,
    store: ProbeStore | None = None,
    budget: float | None = None,
    fp8: tuple[str, ...] = (),
    blocks: dict | None = None,
) -> Search:
    """The `top` fastest layouts of `cfg`'s model and batch on `world` ranks of `dev` within `memory` bytes per rank.

    fixed: mesh axes the user pinned (axis -> size); rules_of: the recipe's rules for a config (None: the model's);
    prune=False looks at every layout its floor would skip (the ranking is the same); probes: a cache of the twins'
    probes that searches of one model and rules share; store: where probes are kept between searches (`ProbeStore`);
    budget: seconds after which the search stops, once a layout fits (None: it looks at every layout it must);
    fp8: the plan.fp8 values every layout is tried with (empty: the config's alone); blocks: a cache of the model's
    block counts for the floors that searches of one model share (`Floors.of`).
    A request nothing satisfies is a ValueError of one line saying what was tried and what came closest.
    """
    start = time.perf_counter()
    choices = {f: cfg if f is None else _with_fp8(cfg, f) for f in (fp8 or (None,))}
    for chosen in choices.values():
        check_fp8(chosen, dev)
    layouts, refused = enumerate_layouts(
        cfg, world, fixed=fixed, tp_divisors=provider.tp_divisors(), n_layers=provider.n_layers,
        n_experts=provider.moe.n_experts if provider.moe is not None else 0,
        one_stage_pipelines=(rules_of(cfg) or provider.rules(cfg.plan)).stage_call != "tensor", fp8=fp8,
    )  # fmt: skip
    if not layouts:
        pinned = " x ".join(f"mesh.{a}={s}" for a, s in (fixed or {}).items())
        if not refused:
            raise ShardlabError(f"search: {pinned} = {math.prod(fixed.values())} ranks does not divide --world {world}")
        raise ShardlabError(
            f"search: no valid layout of {world} ranks{' with ' + pinned if pinned else ''}: {len(refused)} "
            f"mesh(es) tried, none fits the model and batch; the first: {refused[0]}"
        )
    model = provider.meta_model()
    param_bytes = model_bytes(model)
    least = min(((state_at_least(param_bytes, s.mesh), s) for s in layouts), key=lambda n: n[0])
    if least[0] > memory:  # every layout's state alone exceeds it: said without counting a block or making a plan
        n = len(layouts)
        raise ShardlabError(_nothing_fits(world, memory, n, n, 0, None, least, refused))
    flops = _stage_flops(cfg, model, provider)
    plans: dict[bytes, Plan] = {}
    runs: dict[Layout, Config] = {}

    def run_of(layout: Layout) -> Config:
        """`cfg` laid out as `layout`, resolved: made once per layout, which its memory bound, its blocks' time bound
        and its estimate each read."""
        if layout not in runs:
            runs[layout] = layout.config(cfg).resolve(world)
        return runs[layout]

    def plan_of(run: Config) -> Plan:
        """One make_plan per mesh and stage placement: checkpointing, resharding and the schedule within a placement
        change only the plan's own fields for them and its pipeline's schedule, micro batches and bubble
        (`_derived`)."""
        placement = {ONE_STAGE: "1f1b", LOOPED: "looped_bfs", V_SHAPED: "zbv_zero_bubble"}[
            stage_shape(run.plan.pp_schedule)
        ]
        base_plan = msgspec.structs.replace(run.plan, reshard_after_forward=False, pp_schedule=placement,
                                            pp_microbatches=None, activation_checkpoint="none")  # fmt: skip
        key = msgspec.json.encode(run.mesh) + msgspec.json.encode(base_plan)
        if key not in plans:
            check_layout(run, provider)
            plans[key] = make_plan(model, run.mesh, rules_of(run) or provider.rules(base_plan), base_plan, flops)
        return _derived(plans[key], run)

    def state(shape: Layout) -> tuple[int, int]:
        """Bytes the plan fixes (all but activations), and the gradients' of them: the same for every checkpointing
        and micro batch count."""
        plan = plan_of(run_of(shape))
        m = estimate_memory(plan)
        return m.total + fsdp_buffer_bytes(plan), 0 if m.on_host else m.grads

    splits = tuple(axis for axis in ("tp", "cp", "ep") if any(layout.mesh.size(axis) > 1 for layout in layouts))
    own_rules = rules_of(cfg) is not None
    floors = {  # per plan.fp8 choice: its matmul peak, its gathers' bytes, its casts' traffic
        f: Floors.of(c, provider, model, dev, own_rules, store=store, blocks=blocks, splits=splits)
        for f, c in choices.items()
    }
    time_floor = [  # arithmetic: 0.3 s for 405B's 21,648
        floors[layout.fp8].time(choices[layout.fp8], layout, dev) for layout in layouts
    ]
    order = sorted(range(len(layouts)), key=lambda i: (time_floor[i], _cheapest_first(layouts[i]), i))
    measured = {} if probes is None else probes  # probes of twins, shared by every layout with the same twin
    known = _probed(measured)
    read = store.read if store is not None else 0  # probes read from the store before this search
    actions: dict[tuple, dict[int, str]] = {}  # pipeline schedule orders
    states: dict[Layout, tuple[int, int] | None] = {}  # per `_state_shape`: bytes the plan fixes; None: refused
    estimates: dict[Layout, Candidate] = {}
    seen: dict[tuple, Probe] = {}  # per `_block_key`: one more block of a micro batch, as estimated
    bounds: set[Layout] = set()  # estimated without their last stage's rank: a lower bound on their step time
    done: dict[tuple, list[Layout]] = {}  # per mesh and schedule: the layouts that fit
    too_large: dict[tuple, list[Layout]] = {}  # per mesh and schedule: every estimated layout that did not fit
    fits: list[tuple[float, int, Candidate]] = []
    kth: list[float] = []  # the `top` fastest step times so far, negated (a heap: the K-th fastest first)
    over = too_big = pruned = unsearched = slower = 0
    floor_left = None
    closest: Candidate | None = None
    closest_state: tuple[int, Layout] | None = None

    def fixed_bytes(layout: Layout) -> tuple[int, int] | None:
        shape = _state_shape(layout)
        if shape not in states:
            try:
                states[shape] = state(shape)
            except ValueError as err:  # the model's own limits (e.g. tp vs a transformers model's heads)
                refused.append(f"{layout.mesh.describe()}: {err}")
                states[shape] = None
        return states[shape]

    def estimated(layout: Layout, exact: bool = False) -> Candidate:
        """The layout's estimate; exact=False: its step time may be a lower bound (`bounds`), its peak is exact."""
        first = layout not in estimates
        if first or (exact and layout in bounds):
            run = run_of(layout)
            plan = plan_of(run)
            e = estimate_shared(run, plan, rules_of(run), dev, provider, measured, actions, last_rank=exact,
                                store=store)  # fmt: skip
            estimates[layout] = as_candidate(layout, e, run, dev)
            if e.block is not None:  # measured apart from the rest of the model
                seen[_block_key(layout, cfg)] = e.block
            if not exact and needs_last_rank(run, plan):
                bounds.add(layout)
            else:
                bounds.discard(layout)
            if e.peak > memory and first:
                too_large.setdefault(_frame(layout), []).append(layout)
        return estimates[layout]

    def blocks_need(layout: Layout, key: tuple, fixed_by_plan: tuple[int, int]) -> int:
        """The bytes `layout` needs at least by the blocks seen (`kept_at_least`; 0: none bounds it)."""
        kept = kept_at_least(seen, key)
        if not kept:
            return 0
        plan = plan_of(run_of(layout))
        first = floors[layout.fp8].micro_batch_activations(choices[layout.fp8], layout)
        return beside_state(fixed_by_plan, in_flight_activations(plan, first, kept), layout.forward_without_grads)

    def probe_block(layout: Layout, key: tuple) -> None:
        """Probe a block of pipelined `layout`'s local shapes (`_block_key`) without its pipeline, as the twin of the
        layout of its micro batch's rows on its mesh without pp (two probes of 2 and 3 blocks, where a pipeline's
        twin runs 2 and 3 in each of its stages, and probes again for the rank holding its last stage): each block
        of its stages keeps, computes and sends over tp, cp and ep what this one does, so a pipeline too large or
        too slow by its blocks alone is dropped without its own probes."""
        try:
            flat, flat_cfg = _without_pipeline(layout, cfg)
            run = flat_cfg.resolve(flat.mesh.world_size)
            plan = plan_of(run)
        except ValueError:  # the config's or the model's own limits: the pipeline's own probe decides
            return
        block = block_shared(run, plan, rules_of(run), provider, measured, store)
        if block is not None:
            seen[key] = block

    for n, i in enumerate(order):
        layout = layouts[i]
        if prune and len(kth) == top and time_floor[i] > -kth[0]:
            pruned = len(order) - n  # the rest are at least as slow as their floors: none enters the top
            break
        if budget is not None and fits and time.perf_counter() - start > budget:
            unsearched, floor_left = len(order) - n, time_floor[i]  # the lowest floor left: `order` ascends
            break
        frame, floor, chosen = _frame(layout), floors[layout.fp8], choices[layout.fp8]
        need, block = floor.memory(chosen, layout), None
        if need <= memory:
            if any(_beats(d, layout) for d in done.get(frame, ())):
                continue
            if any(_needs_no_more(other, layout) for other in too_large.get(frame, ())):
                too_big += 1
                continue
            fixed_by_plan = fixed_bytes(layout)
            if fixed_by_plan is None:
                continue
            key = _block_key(layout, cfg)
            need = max(
                beside_state(fixed_by_plan, floor.activations(chosen, layout), layout.forward_without_grads),
                blocks_need(layout, key, fixed_by_plan),
            )
            if layout.mesh.pp > 1 and key not in seen and memory / 2 < need <= memory:
                probe_block(layout, key)
                need = max(need, blocks_need(layout, key, fixed_by_plan))
            block = seen.get(key) if layout.mesh.pp > 1 else None
        if need > memory:
            over += 1
            if closest_state is None or need < closest_state[0]:
                closest_state = (need, layout)
            continue
        may_prune = prune and len(kth) == top and not dev.busy_speed  # (ranks time-sharing cores: paced otherwise)
        if may_prune and block is not None:
            plan = plan_of(run_of(layout))
            if blocks_time(plan, block, floor, chosen, layout, dev) > -kth[0]:
                slower += 1  # what its blocks take makes it slower than the K-th fastest
                continue
        candidate = estimated(layout)
        if candidate.peak <= memory:
            # a bound's floor, which counts the last stage's rank, may be the higher of the two
            at_least = max(candidate.step_s, time_floor[i]) if layout in bounds else candidate.step_s
            if layout in bounds and (len(kth) < top or at_least <= -kth[0]):
                candidate = estimated(layout, exact=True)  # it may enter the top: its last stage's rank probed too
                at_least = candidate.step_s
            fits.append((at_least, i, candidate))
            done.setdefault(frame, []).append(layout)
            heapq.heappush(kth, -at_least)
            if len(kth) > top:
                heapq.heappop(kth)
        elif closest is None or candidate.peak < closest.peak:
            closest = candidate
    if not fits:
        raise ShardlabError(
            _nothing_fits(world, memory, len(layouts), over, len(estimates), closest, closest_state, refused)
        )
    fits.sort(key=lambda f: f[:2])
    stored = (store.read if store is not None else 0) - read
    return Search(
        best=tuple(c for _, _, c in fits[:top]), layouts=len(layouts), over_memory=over, too_big=too_big,
        estimated=len(estimates), bounded=len(bounds), pruned=pruned + slower, unsearched=unsearched,
        floor_left=floor_left, probes=_probed(measured) - known - stored, stored=stored,
        seconds=time.perf_counter() - start,
    )  # fmt: skip


def _without_pipeline(layout: Layout, cfg: Config) -> tuple[Layout, Config]:
    """`layout`'s mesh without pp, one micro batch of the rows of each of its micro batches (the same `_block_key`),
    and `cfg` laid out so, with the global batch that makes them (raises the config's ValueError where it cannot)."""
    m = layout.mesh
    rows = cfg.train.global_batch // m.size("dp") // layout.micro_batches
    flat = msgspec.structs.replace(
        layout, mesh=msgspec.structs.replace(m, pp=1), micro_batches=1, pp_schedule=None, pp_stages_per_rank=1
    )
    run = flat.config(cfg)
    train = msgspec.structs.replace(run.train, global_batch=rows * m.size("dp"), micro_batch=None)
    return flat, msgspec.structs.replace(run, train=train)


def _state_shape(layout: Layout) -> Layout:
    """The layout whose plan fixes the same bytes as `layout`'s: any checkpointing, any micro batch count."""
    return Layout(
        mesh=layout.mesh, activation_checkpoint="none", micro_batches=layout.mesh.pp, pp_schedule=layout.pp_schedule,
        pp_stages_per_rank=layout.pp_stages_per_rank, reshard_after_forward=layout.reshard_after_forward,
        fp8=layout.fp8,
    )  # fmt: skip


def _block_key(layout: Layout, cfg: Config) -> tuple:
    """What a block keeps alive, computes and sends over tp, cp and ep per micro batch depends on (its probe's local
    shapes): tp, cp, ep and the rows of a micro batch, the checkpointing, FP8, and whether FSDP (its mixed precision)
    and replicas are there; not the pipeline, its schedule and stages, nor the size of the data-parallel axes (each
    block is its own FSDP unit)."""
    m = layout.mesh
    rows = cfg.train.global_batch // m.size("dp") // layout.micro_batches
    dp = (m.dp_shard > 1, m.dp_replicate > 1, m.experts.dp_shard_mod_ep > 1)
    return m.tp, m.cp, m.ep, *dp, layout.activation_checkpoint, layout.fp8, rows


def kept_at_least(seen: Mapping[tuple, Probe], key: tuple) -> float:
    """What one block of a micro batch of local shapes `key` (`_block_key`) keeps alive at least, from the blocks
    estimated (`seen`, by key): its own, or, scaled, one of the same checkpointing, FP8, ep and data-parallel axes at
    no larger tp and cp (0: none). A block's kept bytes are a sum of terms that each grow with the rows (or not) and
    shrink as 1 / tp, 1 / cp (or not): what tp or cp leave whole (a norm's output, sequence parallelism's gathered
    input, cp's gathered K and V) only adds. So at tp' >= tp a block keeps at least tp / tp' of what it does at tp (the
    same for cp), and with r' rows at least min(1, r' / r) of what it does with r."""
    tp, cp, *rest, rows = key
    best = 0.0
    for (t, c, *other, r), block in seen.items():
        if other == rest and t <= tp and c <= cp:
            best = max(best, block.activation_bytes * min(1.0, rows / r) * t / tp * c / cp)
    return best


def in_flight_activations(plan: Plan, first: float, per_block: float) -> int:
    """What the estimate of a layout (laid out by `plan`) keeps alive at least: for each micro batch its schedule
    keeps in flight (one without a pipeline), `per_block` (what a block keeps, `kept_at_least`) for each block of the
    busiest rank, as `estimate_from` counts them; the first of them at least its floor `first` (at the peak it also
    holds what lies outside the blocks)."""
    pipe, blocks = plan.pipeline, probed_rank(plan)[1]
    held = 1 if pipe is None else in_flight(pipe.schedule, plan.mesh.pp, pipe.stages_per_rank, pipe.microbatches)
    mine = (len(plan.blocks) if blocks is None else blocks) * per_block
    return int(max(first, mine) + (held - 1) * mine)


def blocks_time(plan: Plan, block: Probe, floor: Floors, cfg: Config, layout: Layout, dev: Device) -> float:
    """The step time the estimate of pipelined `layout` (laid out by `plan`) gives at least: its floor, with the
    busiest rank's blocks each computing and communicating over tp, cp and ep what `block` (one of a layout of the
    same `_block_key`, as estimated) does, in each micro batch (`Floors.time`; not on ranks that time-share cores)."""
    blocks = plan.pipeline.microbatches * probed_rank(plan)[1]
    comm = sum(collective_seconds(c, layout.mesh, dev) for c in block.collectives if c.axis not in (*DP_AXES, "pp"))
    return floor.time(cfg, layout, dev, compute=blocks * compute_seconds(block, dev), comm=blocks * comm)


def _with_fp8(cfg: Config, fp8: str) -> Config:
    return msgspec.structs.replace(cfg, plan=msgspec.structs.replace(cfg.plan, fp8=fp8))


def _probed(measured: dict[bytes, Shape]) -> int:
    return sum(len(shape.probed) for shape in measured.values())


def _frame(layout: Layout) -> tuple:
    """Layouts of one frame differ only in checkpointing, micro batches and resharding (FP8 changes what each
    costs and keeps)."""
    return layout.mesh, layout.pp_schedule, layout.pp_stages_per_rank, layout.fp8


def _needs_no_more(small: Layout, other: Layout) -> bool:
    """`small` (of `other`'s frame) never needs more memory than `other`: it checkpoints at least as much (its
    forward keeps no more alive; op keeps more than selective under TP with SP, and less on one process), reshards
    FSDP's weights after forward if `other` does (it does not hold every unit's gathered weights), and without a
    pipeline runs no more rows per micro batch (a pipeline's in-flight micro batches depend on their count: only the
    same)."""
    more_ac = recomputes_no_more(other.activation_checkpoint, small.activation_checkpoint)  # op vs selective: unordered
    resharded = small.reshard_after_forward or not other.reshard_after_forward
    if small.mesh.pp > 1:
        return more_ac and resharded and small.micro_batches == other.micro_batches
    return more_ac and resharded and small.micro_batches >= other.micro_batches


def _derived(base: Plan, run: Config) -> Plan:
    """`base` (the plan of `run`'s mesh and stage placement) with `run`'s checkpointing, resharding, schedule and
    micro batches."""
    reshard, why = run.plan.resharding(run.mesh)
    fsdp = base.fsdp and msgspec.structs.replace(base.fsdp, reshard_after_forward=reshard, resharding=why)
    pipe = base.pipeline
    if pipe is not None:
        schedule, m = run.plan.pp_schedule, run.micro_batches
        bubble = bubble_fraction(schedule, run.mesh.pp, pipe.stages_per_rank, m)
        pipe = msgspec.structs.replace(pipe, schedule=schedule, microbatches=m, bubble=bubble)
    return msgspec.structs.replace(base, fsdp=fsdp, pipeline=pipe, activation_checkpoint=run.plan.activation_checkpoint)


def _cheapest_first(layout: Layout) -> tuple[int, int, bool]:
    """The order in which a frame's layouts are tried: less recomputation and fewer micro batches first (they beat
    the rest), resharding before keeping the weights gathered (which needs more memory: skipped where resharding did
    not fit)."""
    return AC_MODES.index(layout.activation_checkpoint), layout.micro_batches, not layout.reshard_after_forward


def _beats(fit: Layout, other: Layout) -> bool:
    """`fit` (which fits) is never slower than `other` of the same mesh and schedule: no more recomputation, no more
    FSDP gathers (it keeps its weights gathered from forward to backward, or `other` does not) and, without a
    pipeline, no more micro batches (a pipeline's bubble shrinks with more of them: only the same count)."""
    less_ac = recomputes_no_more(fit.activation_checkpoint, other.activation_checkpoint)
    fewer_gathers = not fit.reshard_after_forward or other.reshard_after_forward
    if fit.mesh.pp > 1:
        return less_ac and fewer_gathers and fit.micro_batches == other.micro_batches
    return less_ac and fewer_gathers and fit.micro_batches <= other.micro_batches


def _stage_flops(cfg: Config, model: torch.nn.Module, provider: ModelProvider) -> dict[str, float] | None:
    """Each module's FLOPs, which make_plan needs to balance pipeline stages by FLOPs (counted once per search)."""
    if cfg.plan.pp_balance != "flops":
        return None
    sample = torch.zeros(1, cfg.train.seq_len, dtype=torch.long, device="meta")
    return module_flops(model, sample, provider.forward)


def _nothing_fits(
    world: int,
    memory: int,
    layouts: int,
    over: int,
    estimated: int,
    closest: Candidate | None,
    closest_state: tuple[int, Layout] | None,
    refused: list[str],
) -> str:
    tried = f"search: none of the {layouts} layouts of {world} ranks fits {readable_bytes(memory)} per rank"
    if closest is not None:
        near = f"the closest, {closest.layout.describe()}, peaks at {readable_bytes(closest.peak)}"
    elif closest_state is not None:
        near = f"the closest, {closest_state[1].describe()}, needs {readable_bytes(closest_state[0])} or more"
    else:
        near = f"the model refused every mesh ({refused[0]})" if refused else "no layout could be planned"
    counts = f"{over} exceed it by their state and the activations they keep at least, {estimated} estimated"
    return f"{tried} ({counts}); {near}; raise --memory or --world, or shrink the batch"
