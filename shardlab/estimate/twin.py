"""estimate_shared(cfg, plan) -> Estimate: a layout estimated from the probe of its smallest twin, for the search.

What one rank computes, keeps alive and sends per micro batch depends on its local shapes (tp, cp, ep, the micro
batch's rows, checkpointing, dtypes, FSDP and HSDP present or not) and, under a pipeline, on which stages it runs
and how many blocks they hold. It does not depend on how many ranks share the data-parallel axes, except through
the group sizes of their collectives, which the mesh gives; nor on how many pp ranks hold the other stages. So a
layout is probed as its twin (`twin`): dp_replicate 2 and dp_shard the smallest size that keeps every axis, and
the expert mesh's dp_shard_mod_ep, trivial or not as they were; pp 2 where the probed (busiest) pp rank is the
first, which then runs the same kinds of stages (the first; the last too under a V-shaped schedule); the global
batch cut so each micro batch keeps its rows. Many layouts share one twin, hence one probe; twins that differ only
in their rows per micro batch share two (`Shape`: every other row count is on the line through them), a twin of
HSDP (dp_replicate 2, FSDP over dp_shard x cp > 1) is its twin of one replica plus the replicas' gradient all-reduces
(`Measurement.replicated`: no probe of its own), and those that differ only in FSDP's resharding after forward
share one (the one that reshards, without the backward's gathers for the one that does not). A pipelined twin's
rank is the sum of its stages, each its own module: every looped and V-shaped twin, and the first rank of a twin
of one stage per rank, is put together from the stages of one base twin (`BASE`). The pp rank holding a pipeline's
last stage, whose compute (it also runs the norm, output and loss) may be the slower, is probed as the twin's rank
holding its last stage. The twin's probe is extrapolated to the layout's blocks as the exact one is, its collectives
get the layout's group sizes and stages, and everything else (memory, micro batches, the schedule's order, sends,
bubble) comes from the layout's own plan (`estimate_from`), as on the exact path (`shardlab.estimate.estimate`,
which `python -m shardlab estimate` runs).

What the twin does not see: FSDP pads the dim it shards to a multiple of the shards and copies each shard into the
gathered buffer, so its gathered bytes and copy traffic differ by a few bytes per parameter with the shard count
(tests/test_estimate_shared.py bounds the step time and peak memory against the exact estimate).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from shardlab.config import Config, TrainConfig
from shardlab.estimate import Estimate, estimate_from, head_rank, probed_rank
from shardlab.estimate.device import Device
from shardlab.estimate.layouts import uses_fsdp
from shardlab.estimate.measurement import Measurement, Probe, staged
from shardlab.estimate.probe import measure
from shardlab.estimate.probe_store import ProbeStore
from shardlab.estimate.recorder import Collective
from shardlab.models.provider import ModelProvider
from shardlab.sharding.mesh import MeshSpec
from shardlab.sharding.pipeline import LOOPED, ZERO_BUBBLE, stage_ranks, stage_shape
from shardlab.sharding.plan import Plan
from shardlab.sharding.rules import Rules

TWIN_PP = 2
"""A pipeline's twin keeps two pp ranks: the first holds stage 0, the last stage is on another rank unless the
schedule is V-shaped, as with any pp."""


def twin(cfg: Config, plan: Plan, n_layers: int) -> tuple[Config, int]:
    """The smallest layout whose probed rank has `cfg`'s local shapes and stages, and the pp rank to probe in it.

    n_layers: the model's blocks; a pipeline keeps its pp where the probe would run the whole model (the twin's
    stages would then hold other blocks than the layout's) or where the probed rank is not the first."""
    m = cfg.mesh
    dp_shard = next(
        d
        for d in range(1, m.dp_shard + 1)
        if m.dp_shard % d == 0
        and (d > 1) == (m.dp_shard > 1)
        and (d * m.cp) % m.ep == 0
        and (d * m.cp // m.ep > 1) == (m.dp_shard * m.cp // m.ep > 1)
    )
    rank, _ = probed_rank(plan)
    pp = m.pp
    if plan.pipeline is not None and rank == 0 and not cfg.plan.pp_split:
        k = cfg.plan.ac_every if cfg.plan.activation_checkpoint == "selective" else 1
        if n_layers > 3 * k * TWIN_PP * plan.pipeline.stages_per_rank:  # the probe extrapolates over blocks
            pp = min(pp, TWIN_PP)
    mesh = msgspec.structs.replace(m, pp=pp, dp_replicate=min(m.dp_replicate, 2), dp_shard=dp_shard)
    rows = cfg.train.global_batch // m.size("dp") // cfg.micro_batches
    if plan.pipeline is None:
        micro = 1
        train = msgspec.structs.replace(cfg.train, global_batch=rows * mesh.size("dp"), micro_batch=None)
        run_plan = cfg.plan
    else:
        micro = 2 * pp * plan.pipeline.stages_per_rank  # valid for every schedule; the probe sees only the rows
        train = msgspec.structs.replace(cfg.train, global_batch=rows * mesh.size("dp") * micro)
        run_plan = msgspec.structs.replace(cfg.plan, pp_microbatches=micro)
    twin_cfg = msgspec.structs.replace(cfg, mesh=mesh, train=train, plan=run_plan).resolve(mesh.world_size)
    return twin_cfg, rank if pp == m.pp else 0


def _group_size(mesh: MeshSpec, c: Collective) -> int:
    """The size of `c`'s group on `mesh` (its axis or flattened view; the expert mesh's for ep's)."""
    if c.axis == "ep":
        return mesh.ep
    if c.axis == "dp_shard_mod_ep":
        return mesh.experts.dp_shard_mod_ep
    try:
        return mesh.size(c.axis)
    except ValueError:  # a group no axis names: as probed
        return c.group_size


def _translated(p: Probe, twin_cfg: Config, twin_rank: int, cfg: Config, plan: Plan) -> Probe:
    """The twin's probe with the layout's group sizes and stage numbers (its probed rank's stages, in order)."""
    stages: dict[int | None, int | None] = {None: None}
    if plan.pipeline is not None:
        v = plan.pipeline.stages_per_rank
        ranks = stage_ranks(twin_cfg.mesh.pp, v, plan.pipeline.schedule)
        mine = [s for s, r in enumerate(ranks) if r == twin_rank]
        rank, _ = probed_rank(plan)
        stages |= dict(zip(mine, (s.index for s in plan.pipeline.stages_of(rank)), strict=True))
    collectives = tuple(
        msgspec.structs.replace(c, group_size=_group_size(cfg.mesh, c), stage=stages[c.stage]) for c in p.collectives
    )
    return msgspec.structs.replace(p, collectives=collectives)


class Shape:
    """The measurements of one twin at each number of rows per micro batch: probed, or on the line through two
    probed ones (`Measurement.at_rows`)."""

    def __init__(self) -> None:
        self.probed: dict[int, Measurement] = {}
        self.derived: dict[int, Measurement] = {}

    def at(self, rows: int, probe: Callable[[int], Measurement]) -> Measurement:
        """The measurement at `rows` rows, from two probed ones where they ran the same ops (never at one row: a
        dimension of size 1 may take other paths, as SP's gather of one sequence does), else probed now."""
        found = self.probed.get(rows) or self.derived.get(rows)
        if found is not None:
            return found
        if rows > 1:
            bases = sorted(self.probed)
            for i, mine in enumerate(bases):
                for theirs in bases[i + 1 :]:
                    found = self.probed[mine].at_rows(rows, mine, self.probed[theirs], theirs)
                    if found is not None:
                        self.derived[rows] = found
                        return found
        self.probed[rows] = probe(rows)
        return self.probed[rows]


def estimate_shared(
    cfg: Config,
    plan: Plan,
    rules: Rules | None,
    dev: Device | None,
    provider: ModelProvider,
    measured: dict[bytes, Shape],
    actions: dict[tuple, dict[int, str]] | None = None,
    *,
    last_rank: bool = True,
    store: ProbeStore | None = None,
) -> Estimate:
    """The estimate of `cfg` (resolved) laid out by `plan`, probed as its twin (measured: the cache of the twins'
    probes, by shape; actions: the cache of pipeline schedule orders).
    Without the forward of the other checkpointing choice. last_rank=False: without the probe of the pp rank
    holding a pipeline's last stage where another is the probed one (`needs_last_rank`), whose compute only the
    step time takes (the slower rank's): the step time is then at most the estimate's, the memory the same. store:
    where probes are kept between searches (`ProbeStore`; None: only in `measured`)."""
    twin_cfg, twin_rank = twin(cfg, plan, provider.n_layers)
    _, blocks = probed_rank(plan)
    regather = _regathers(twin_cfg, provider.n_layers, plan)
    found = _measurement(twin_cfg, twin_rank, rules, provider, measured, plan, store)
    p = _translated(found.at(blocks, regather), twin_cfg, twin_rank, cfg, plan)
    block = found.middle_block
    last = None
    if last_rank and needs_last_rank(cfg, plan):
        # the last stage also runs the norm, output and loss (only its rank's compute is used): the twin's rank
        # holding its last stage runs the same kinds of stages, extended to the blocks of the layout's
        pipe = plan.pipeline
        held = sum(len(s.blocks) for s in pipe.stages_of(head_rank(plan)))
        twin_head = stage_ranks(twin_cfg.mesh.pp, pipe.stages_per_rank, pipe.schedule)[-1]
        last = _measurement(twin_cfg, twin_head, rules, provider, measured, plan, store).at(held, regather)
    e = estimate_from(cfg, plan, p, p, cfg.plan.activation_checkpoint, dev, provider, actions, last=last)
    return msgspec.structs.replace(e, block=block and _translated(block, twin_cfg, twin_rank, cfg, plan))


def block_shared(
    cfg: Config,
    plan: Plan,
    rules: Rules | None,
    provider: ModelProvider,
    measured: dict[bytes, Shape],
    store: ProbeStore | None = None,
) -> Probe | None:
    """One more block of a micro batch of `cfg` (resolved, laid out by `plan`), from its twin's probe, shared through
    `measured` and `store` as `estimate_shared`'s (`Measurement.middle_block`; None for a model probed whole)."""
    twin_cfg, twin_rank = twin(cfg, plan, provider.n_layers)
    block = _measurement(twin_cfg, twin_rank, rules, provider, measured, plan, store).middle_block
    return block and _translated(block, twin_cfg, twin_rank, cfg, plan)


def needs_last_rank(cfg: Config, plan: Plan) -> bool:
    """Whether `cfg`'s estimate probes the pp rank holding a pipeline's last stage too (it is not the busiest)."""
    return plan.pipeline is not None and probed_rank(plan)[0] != head_rank(plan)


def _regathers(cfg: Config, n_layers: int, plan: Plan) -> bool:
    """Whether `cfg`'s probe counts the backward's gathers of FSDP's weights that its measurement recorded: where the
    twin reshards them after forward, or where the measurement kept them gathered and recorded none (`_reshards`;
    plan: the layout's)."""
    return cfg.plan.resharding(cfg.mesh)[0] or not _reshards(cfg, n_layers, plan)


def _reshards(cfg: Config, n_layers: int, plan: Plan) -> bool:
    """Whether the measurement of `cfg` reshards FSDP's weights after forward: where its schedule allows it (a rank
    put together from `BASE`'s stages: as BASE does)."""
    first = stage_shape(cfg.plan.pp_schedule)[0]
    return cfg.plan.resharding(cfg.mesh)[0] or first not in ZERO_BUBBLE or _pieces(cfg, 0, n_layers, plan) is not None


def _measurement(
    cfg: Config,
    rank: int,
    rules: Rules | None,
    provider: ModelProvider,
    measured: dict[bytes, Shape],
    plan: Plan,
    store: ProbeStore | None,
) -> Measurement:
    """Kept under what it depends on: not the schedule within its shape of stages (the probe runs stages, not
    schedules), nor the rows per micro batch (`Shape`), nor FSDP's resharding after forward (measured resharding
    where the schedule allows it, and taken without the backward's gathers where the layout keeps its weights
    gathered). A pipeline's rank is put together from the stages of `BASE`'s ranks where it can be (`_pieces`)."""
    reshard = _reshards(cfg, provider.n_layers, plan)
    canonical = msgspec.structs.replace(cfg.plan, pp_schedule=stage_shape(cfg.plan.pp_schedule)[0],
                                        reshard_after_forward=reshard)  # fmt: skip
    rows = _rows(cfg)
    per_row = cfg.train.global_batch // rows
    keyed = cfg.train if plan.experts is not None else _train(cfg, per_row)  # loads may round with the rows
    key = msgspec.json.encode((msgspec.structs.replace(cfg, plan=canonical, train=keyed), rank))
    found = measured.setdefault(key, Shape())
    one = _one_replica(cfg)
    if one is not None and rows not in found.derived:  # HSDP: FSDP's measurement and its replicas' all-reduces
        derived = _measurement(one, rank, rules, provider, measured, plan, store).replicated(cfg.mesh.dp_replicate)
        if derived is not None:
            found.derived[rows] = derived
    if one is not None and rows in found.derived:
        return found.derived[rows]
    pieces = _pieces(cfg, rank, provider.n_layers, plan)
    if pieces is not None:
        if rows not in found.derived:
            v, micro = BASE[1], 2 * TWIN_PP * BASE[1]  # as `twin` makes them
            options = msgspec.structs.replace(canonical, pp_schedule=BASE[0], pp_stages_per_rank=v,
                                              pp_microbatches=micro)  # fmt: skip
            base = msgspec.structs.replace(cfg, plan=options, train=_train(cfg, rows * cfg.mesh.size("dp") * micro))
            ranks = {r: _measurement(base, r, rules, provider, measured, plan, store) for r, _, _ in pieces}
            stages = TWIN_PP * cfg.plan.pp_stages_per_rank
            found.derived[rows] = staged([(ranks[r], s, to) for r, s, to in pieces], stages)
        return found.derived[rows]

    def probe(rows: int) -> Measurement:
        run = msgspec.structs.replace(cfg, plan=canonical, train=_train(cfg, rows * per_row))
        run = run.resolve(cfg.mesh.world_size)
        if store is None:
            return measure(run, rules, pp_rank=rank, provider=provider)
        return store.measured(run, rank, rules, lambda: measure(run, rules, pp_rank=rank, provider=provider))

    return found.at(rows, probe)


def _one_replica(cfg: Config) -> Config | None:
    """The twin `cfg` of HSDP (dp_replicate > 1, FSDP sharding over dp_shard x cp) with one replica, the same rows per
    rank: its measurement gives `cfg`'s (`Measurement.replicated`). None for other twins, and where experts have a
    mesh of their own (ep > 1) whose FSDP shards them over one rank (dp_shard_mod_ep 1): FSDP reduce-scatters
    nothing there, so the one replica's run has no collective that the replicas' all-reduce of the experts'
    gradients follows."""
    m = cfg.mesh
    alone = m.ep > 1 and m.experts.dp_shard_mod_ep == 1
    if m.dp_replicate == 1 or m.size("dp_shard_cp") == 1 or alone or not uses_fsdp(cfg, m):
        return None
    mesh = msgspec.structs.replace(m, dp_replicate=1)
    train = _train(cfg, cfg.train.global_batch // m.dp_replicate)
    return msgspec.structs.replace(cfg, mesh=mesh, train=train).resolve(mesh.world_size)


BASE = ("interleaved_1f1b", 2)
"""The twin whose stages make up every twin of several stages per rank: its rank 0 runs the first stage, then a
middle one; its rank 1 a middle one, then the last."""


def _pieces(cfg: Config, rank: int, n_layers: int, plan: Plan) -> list[tuple[int, int, int]] | None:
    """Each stage of pp rank `rank` of twin `cfg` as (rank of `BASE`, its stage of the same kind run first or not as
    here, the stage): for twins of two pp ranks (other than `BASE`), whose probes hold 2k and 3k blocks in every
    stage; else None. A rank of one stage runs the model itself, not a stage module: the first stage's is the
    same (tests/test_estimate_shared.py), the last stage's is probed on its own."""
    v = cfg.plan.pp_stages_per_rank if cfg.mesh.pp > 1 else 0
    k = cfg.plan.ac_every if cfg.plan.activation_checkpoint == "selective" else 1
    schedule = cfg.plan.pp_schedule
    if cfg.mesh.pp != TWIN_PP or cfg.plan.pp_split or (schedule in LOOPED and v == BASE[1]):
        return None
    if plan.pipeline is None or plan.pipeline.call != "tensor":  # stages that are not stage modules
        return None
    if v == 1 and rank != 0:  # the last stage run first on its rank: BASE runs it second
        return None
    if n_layers <= 3 * k * TWIN_PP * max(v, BASE[1]):  # the probes would hold the whole model, maybe uneven stages
        return None
    mine = [s for s, r in enumerate(stage_ranks(TWIN_PP, v, schedule)) if r == rank]
    last = TWIN_PP * v - 1
    return [
        (0, 0, s) if s == 0 else (1, 2 * TWIN_PP - 1, s) if s == last else (1, 1, s) if i == 0 else (0, 2, s)
        for i, s in enumerate(mine)
    ]


def _rows(cfg: Config) -> int:
    """Rows per micro batch."""
    return cfg.train.global_batch // cfg.mesh.size("dp") // cfg.micro_batches


def _train(cfg: Config, global_batch: int) -> TrainConfig:
    return msgspec.structs.replace(cfg.train, global_batch=global_batch)
