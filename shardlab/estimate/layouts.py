"""Layout search as data: every valid layout of a run on N ranks (`enumerate_layouts`), pure and without torch.

A layout is what a recipe may change without changing the model or the batch: the mesh (pp, dp_replicate, dp_shard,
cp, tp, and ep borrowed from dp_shard x cp), activation checkpointing, micro batches, the pipeline schedule with its
stages per rank, and FSDP's reshard_after_forward. Validity is the config's own: each candidate is built as a Config
and resolved, so every divisibility rule `Config.check` knows applies here too, and nothing is restated.
`shardlab.estimate.search` ranks them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping

import msgspec

from shardlab._base import Frozen
from shardlab.config import Config, check_tp_divisors
from shardlab.estimate.peak import forward_without_grads
from shardlab.sharding.mesh import AXES, MeshSpec
from shardlab.sharding.pipeline import LOOPED, ONE_STAGE, V_SHAPED, ZERO_BUBBLE, Schedule, split_stages

AC_MODES = ("none", "selective", "op", "full")
"""Least recomputation first (`recomputes_no_more` orders them: selective and op recompute different things)."""
PIPELINE_MICRO_PER_STAGE = (1, 2, 4, 8)
"""A pipeline's micro batches, in multiples of pp (torch's looped schedules need m % pp == 0): the 1F1B bubble
(p - 1) / (m + p - 1) is below 1/9 at m = 8 p, and each further micro batch shrinks every kernel."""
LOOPED_STAGES_PER_RANK = (2, 4)
"""Stages per rank tried for looped schedules (V-shaped ones run exactly 2, one-stage ones 1)."""


def recomputes_no_more(a: str, b: str) -> bool:
    """Whether activation checkpointing `a` never recomputes more than `b`: none least, full most; selective (half
    the blocks whole) and op (every block's cheap ops and every other matmul, never attention) are not ordered:
    which costs less depends on the model, the sequence and the device (op keeps less memory)."""
    return a == b or a == "none" or b == "full"


class Layout(Frozen):
    """One candidate: the parts of a config the search changes."""

    mesh: MeshSpec
    """Resolved (no -1 axis)."""
    activation_checkpoint: str
    micro_batches: int
    """Micro batches per step on every rank: gradient accumulation steps, or the pipeline's micro batches."""
    pp_schedule: Schedule | None = None
    """None without pipeline stages (mesh.pp == 1)."""
    pp_stages_per_rank: int = 1
    reshard_after_forward: bool = True
    fp8: str | None = None
    """plan.fp8 where the search chooses it (`search --fp8-choices`); None: the recipe's."""

    def config(self, cfg: Config) -> Config:
        """`cfg` laid out this way (raises the config's own ValueError where the layout does not fit it)."""
        mesh = self.mesh
        dp = mesh.size("dp")
        per_rank = cfg.train.global_batch // dp if cfg.train.global_batch % dp == 0 else None
        pp = mesh.pp > 1
        plan = msgspec.structs.replace(
            cfg.plan,
            activation_checkpoint=self.activation_checkpoint,
            reshard_after_forward=self.reshard_after_forward,
            pp_schedule=self.pp_schedule or "1f1b",  # without pp the schedule is unused; 1f1b is valid for v=1
            pp_stages_per_rank=self.pp_stages_per_rank,
            pp_microbatches=self.micro_batches if pp else None,
            pp_split=cfg.plan.pp_split if pp and mesh.pp == cfg.mesh.pp else (),
            fp8=cfg.plan.fp8 if self.fp8 is None else self.fp8,
        )
        micro_batch = None if pp or per_rank is None else per_rank // self.micro_batches
        train = msgspec.structs.replace(cfg.train, micro_batch=micro_batch)
        return msgspec.structs.replace(cfg, mesh=mesh, plan=plan, train=train)

    @property
    def forward_without_grads(self) -> bool:
        """Whether its forward runs with no gradient held (`peak.forward_without_grads`)."""
        return forward_without_grads(self.activation_checkpoint, self.micro_batches, self.mesh.pp)

    def describe(self) -> str:
        """`pp=8 x dp_shard=8 x tp=8, AC full, 32 micro batches, interleaved_1f1b x2`."""
        mesh = self.mesh.describe().rsplit(" (", 1)[0]
        parts = [mesh, f"AC {self.activation_checkpoint}", f"{self.micro_batches} micro"]
        if self.pp_schedule is not None:
            parts.append(self.pp_schedule + (f" x{self.pp_stages_per_rank}" if self.pp_stages_per_rank > 1 else ""))
        if not self.reshard_after_forward:
            parts.append("no reshard")
        if self.fp8 is not None:
            parts.append(f"fp8 {self.fp8}")
        return ", ".join(parts)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(world: int, fixed: Mapping[str, int]) -> Iterator[dict[str, int]]:
    """Every assignment of sizes to AXES whose product is `world`, with the `fixed` axes at their sizes."""
    free = [a for a in AXES if a not in fixed]
    rest, remainder = divmod(world, math.prod(fixed.values()))
    if remainder:
        return

    def split(n: int, axes: list[str]) -> Iterator[dict[str, int]]:
        if len(axes) == 1:
            yield {axes[0]: n}
            return
        for d in divisors(n):
            for tail in split(n // d, axes[1:]):
                yield {axes[0]: d, **tail}

    for sizes in split(rest, free) if free else iter([{}] if rest == 1 else []):
        yield {a: fixed.get(a, sizes.get(a)) for a in AXES}


def enumerate_layouts(
    cfg: Config,
    world: int,
    *,
    fixed: Mapping[str, int] | None = None,
    tp_divisors: Mapping[str, int] | None = None,
    n_layers: int,
    n_experts: int = 0,
    one_stage_pipelines: bool = False,
    fp8: tuple[str, ...] = (),
) -> tuple[list[Layout], list[str]]:
    """Every valid layout of `cfg`'s model and batch on `world` ranks, and why the meshes that were refused were.

    fixed: axis -> size the user pinned (ep among them); tp_divisors: the model sizes tp must divide (the provider's);
    n_layers: blocks a pipeline cuts into stages (pp x stages per rank may not exceed it); n_experts: with shardlab's
    MoE, ep ranges over its divisors that divide dp_shard x cp (else ep stays 1); one_stage_pipelines: the model runs
    one stage per pp rank (a transformers model); fp8: the plan.fp8 values each layout is tried with (empty: the
    config's alone, Layout.fp8 None). Layouts come in a stable order, without duplicates.
    """
    fixed, tp_divisors = fixed or {}, dict(tp_divisors or {})
    layouts: list[Layout] = []
    refused: list[str] = []
    for sizes in factorizations(world, {a: s for a, s in fixed.items() if a != "ep"}):
        mesh = MeshSpec(**sizes)
        ep_options = [fixed["ep"]] if "ep" in fixed else divisors(n_experts) if n_experts else [1]
        for ep in ep_options:
            if (sizes["dp_shard"] * sizes["cp"]) % ep:
                continue
            with_ep = msgspec.structs.replace(mesh, ep=ep)
            try:
                check_tp_divisors(tp_divisors, with_ep.tp)
                split_stages([1.0] * n_layers, 0.0, 0.0, with_ep.pp)  # every stage needs a block
                Layout(mesh=with_ep, activation_checkpoint="none", micro_batches=1).config(cfg).resolve(world)
            except ValueError as err:
                refused.append(f"{with_ep.describe()}: {err}")
                continue
            for variant in _variants(cfg, with_ep, n_layers, one_stage_pipelines):
                layouts.extend(msgspec.structs.replace(variant, fp8=f) for f in fp8) if fp8 else layouts.append(variant)
    return layouts, refused


def uses_fsdp(cfg: Config, mesh: MeshSpec) -> bool:
    """Whether `cfg`'s plan on `mesh` wraps the model in FSDP (which then reshards after forward or not)."""
    return mesh.size("batch") > 1 or cfg.plan.param_dtype != "float32" or cfg.plan.reduce_dtype != "float32"


def _variants(cfg: Config, mesh: MeshSpec, n_layers: int, one_stage: bool) -> Iterator[Layout]:
    """The layouts of one mesh: schedules, micro batches, checkpointing and resharding."""
    per_rank = cfg.train.global_batch // mesh.size("dp")
    fsdp = uses_fsdp(cfg, mesh)
    reshard = (True, False) if fsdp else (cfg.plan.resharding(mesh)[0],)
    if mesh.pp == 1:
        schedules: list[tuple[Schedule | None, int]] = [(None, 1)]
        micro = divisors(per_rank)
    else:
        schedules = [(s, 1) for s in ONE_STAGE]
        if not one_stage:
            schedules += [(s, v) for s in LOOPED for v in LOOPED_STAGES_PER_RANK]
            schedules += [(s, 2) for s in V_SHAPED]
        schedules = [(s, v) for s, v in schedules if mesh.pp * v <= n_layers]
        micro = [k * mesh.pp for k in PIPELINE_MICRO_PER_STAGE if per_rank % (k * mesh.pp) == 0]
    for (schedule, v), m, ac, r in itertools.product(schedules, micro, AC_MODES, reshard):
        if schedule in ZERO_BUBBLE and fsdp and r:  # the weight gradients come after FSDP resharded (make_plan refuses)
            continue
        if schedule == "dualpipev" and m < mesh.pp * v:  # torch's DualPipeV needs a micro batch per stage
            continue
        yield Layout(
            mesh=mesh, activation_checkpoint=ac, micro_batches=m, pp_schedule=schedule, pp_stages_per_rank=v,
            reshard_after_forward=r,
        )  # fmt: skip
