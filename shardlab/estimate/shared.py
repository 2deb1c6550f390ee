"""estimate_shared(cfg, plan) -> Estimate: a layout estimated from the probe of its smallest twin, for the search.

What one rank computes, keeps alive and sends per micro batch depends on its local shapes (tp, cp, ep, the micro
batch's rows, checkpointing, dtypes, FSDP and HSDP present or not) and, under a pipeline, on which stages it runs
and how many blocks they hold. It does not depend on how many ranks share the data-parallel axes, except through
the group sizes of their collectives, which the mesh gives; nor on how many pp ranks hold the other stages. So a
layout is probed as its twin (`twin`): dp_replicate 2 and dp_shard the smallest size that keeps every axis, and
the expert mesh's dp_shard_mod_ep, trivial or not as they were; pp 2 where the probed (busiest) pp rank is the
first, which then runs the same kinds of stages (the first; the last too under a V-shaped schedule); the global
batch cut so each micro batch keeps its rows. Many layouts share one twin, hence one probe. A pipeline's last pp
rank, whose compute (it also runs the norm, output and loss) may be the slower, is probed as the twin's last. The twin's probe is
extrapolated to the layout's blocks as the exact one is, its collectives get the layout's group sizes and stages,
and everything else (memory, micro batches, the schedule's order, sends, bubble) comes from the layout's own plan
(`estimate_from`), as on the exact path (`shardlab.estimate.estimate`, which `python -m shardlab estimate` runs).

What the twin does not see: FSDP pads the dim it shards to a multiple of the shards and copies each shard into the
gathered buffer, so its gathered bytes and copy traffic differ by a few bytes per parameter with the shard count
(tests/test_estimate_shared.py bounds the step time and peak memory against the exact estimate).
"""

from __future__ import annotations

import msgspec

from shardlab.config import Config
from shardlab.estimate import Estimate, estimate_from, probed_rank
from shardlab.estimate.probe import Measurement, Probe, measure
from shardlab.estimate.recorder import Collective
from shardlab.estimate.roofline import Device
from shardlab.mesh import MeshSpec
from shardlab.models.provider import ModelProvider
from shardlab.pipeline import LOOPED, ONE_STAGE, V_SHAPED, stage_ranks
from shardlab.plan import Plan
from shardlab.rules import Rules

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


def estimate_shared(
    cfg: Config,
    plan: Plan,
    rules: Rules | None,
    dev: Device | None,
    provider: ModelProvider,
    measured: dict[bytes, Measurement],
    actions: dict[tuple, dict[int, str]] | None = None,
) -> Estimate:
    """The estimate of `cfg` (resolved) laid out by `plan`, probed as its twin (measured: the cache of the twins'
    probes, before they are extended to a number of blocks; actions: the cache of pipeline schedule orders).
    Without the forward of the other checkpointing choice."""
    twin_cfg, twin_rank = twin(cfg, plan, provider.n_layers)
    _, blocks = probed_rank(plan)
    p = _translated(
        _measured(twin_cfg, twin_rank, rules, provider, measured).at(blocks), twin_cfg, twin_rank, cfg, plan
    )
    last = None
    if plan.pipeline is not None and probed_rank(plan)[0] != cfg.mesh.pp - 1:
        # the last stages also run the norm, output and loss (only their compute is used): the twin's last pp rank
        # runs the same kinds of stages, extended to the blocks of the layout's last rank
        held = sum(len(s.blocks) for s in plan.pipeline.stages_of(cfg.mesh.pp - 1))
        last = _measured(twin_cfg, twin_cfg.mesh.pp - 1, rules, provider, measured).at(held)
    return estimate_from(cfg, plan, p, p, cfg.plan.activation_checkpoint, dev, provider, actions, last=last)


def _measured(
    cfg: Config, rank: int, rules: Rules | None, provider: ModelProvider, measured: dict[bytes, Measurement]
) -> Measurement:
    """`cfg`'s probes as pp rank `rank`, from `measured` or measured now; layouts whose schedules differ only within
    one shape of stages share them (the probe runs stages, not schedules)."""
    shape = next(group for group in (ONE_STAGE, LOOPED, V_SHAPED) if cfg.plan.pp_schedule in group)
    canonical = msgspec.structs.replace(cfg.plan, pp_schedule=shape[0])
    key = msgspec.json.encode((msgspec.structs.replace(cfg, plan=canonical), rank))
    if key not in measured:
        measured[key] = measure(cfg, rules, pp_rank=rank, provider=provider)
    return measured[key]
