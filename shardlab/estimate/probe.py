"""probe(cfg) -> Probe: run one micro batch of the real layout on fake tensors and record what happens.

The estimator's measurements, so they cannot drift from what `apply` and `step` do: in a fake world of the config's
size (this process is rank 0, the worst rank; with pipelines, the first rank of the busiest pp rank), the model is
planned, built on the meta device, parallelized by `apply`, given fake storage, and one micro batch goes through
`forward_backward` (with pipeline stages: through each stage this pp rank runs, as torch's PipelineStage would; the
schedule's order and its sends are left to shardlab.estimate) under shardlab.estimate.recorder's dispatch mode, which
records every collective, every op's FLOPs and bytes moved, and what the forward leaves alive (activations).

A model of L identical blocks is probed with 2k and 3k blocks per stage (k = the activation-checkpointing
period); every quantity is linear in the number of blocks, so the two probes give it for L exactly (for
uneven pipeline stages, to the nearest byte), in seconds even for 405B on 4096 ranks. Likewise every op's FLOPs and
bytes are affine in the rows of a micro batch, so measurements at two row counts give every other
(`Measurement.at_rows`), and one probe that reshards FSDP's weights after forward gives the one that does not
(`Measurement.at`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel

from shardlab._base import Frozen
from shardlab.config import Config
from shardlab.estimate._fake import cached_sharding_propagation, fake_tensors, fake_world
from shardlab.estimate._forked import run_forked
from shardlab.estimate.recorder import Collective, OpKind, Recorder, Role, axis_names, param_storages
from shardlab.models import provider_for
from shardlab.models.flops import module_flops
from shardlab.models.llama.moe import balanced_routing
from shardlab.models.provider import ModelProvider
from shardlab.parallel.apply import Parallelized, parallelize
from shardlab.parallel.device_mesh import make_mesh
from shardlab.parallel.fp8 import refresh_scales
from shardlab.sharding.context import cp_positions
from shardlab.sharding.plan import Plan, make_plan
from shardlab.sharding.rules import Rules
from shardlab.training.loss import summed_loss
from shardlab.training.step import forward_backward


class Probe(Frozen):
    """One micro batch of forward + backward on the probed rank, for the whole model (with pipelines: for the
    probed pp rank's stages)."""

    collectives: tuple[Collective, ...]
    flops: int
    """Executed FLOPs: matmuls and attention (causal attention as run, half the square), recomputation included."""
    ops: tuple[tuple[int, int, int, OpKind], ...]
    """(FLOPs, bytes read + written, how many such ops, kind): the roofline's input, one entry per distinct op."""
    activation_bytes: int
    """Bytes the forward leaves alive for the backward (saved tensors, checkpoint inputs, logits, loss)."""
    block_activation_bytes: int
    """What one more block adds to activation_bytes (a model of at most 3 periods: the mean over its blocks)."""
    gather_ops: tuple[tuple[int, int, int, OpKind], ...] = ()
    """The part of `ops` FSDP ran to gather weights in the forward (copying shards in, gathered weights out)."""
    reduce_ops: tuple[tuple[int, int, int, OpKind], ...] = ()
    """The part of `ops` FSDP ran to reduce gradients (copying them into the reduce-scatter's buffer)."""
    recompute_ops: tuple[tuple[int, int, int, OpKind], ...] = ()
    """The part of `ops` that recomputed checkpointed activations in the backward (activation checkpointing's cost)."""


def _probe_layers(
    cfg: Config,
    rules: Rules | None,
    provider: ModelProvider,
    mesh: DeviceMesh,
    n_layers: int,
    forward_only: bool,
) -> Recorder:
    if n_layers != provider.n_layers:  # a smaller model of the same shape; its stages split evenly
        provider = provider.with_layers(n_layers)
        cfg = msgspec.structs.replace(cfg, plan=msgspec.structs.replace(cfg.plan, pp_split=(), pp_balance="blocks"))
    with torch.device("meta"):
        model = provider.build()
    flops = None
    if cfg.mesh.pp > 1 and cfg.plan.pp_balance == "flops":  # the model as configured: its stages split by FLOPs
        sample = torch.zeros(1, cfg.train.seq_len, dtype=torch.long, device="meta")
        flops = module_flops(model, sample, provider.forward)
    plan = make_plan(model, cfg.mesh, rules or provider.rules(cfg.plan), cfg.plan, flops)
    built = parallelize(model, plan, mesh)
    dp = cfg.mesh.size("dp")
    micro = cfg.micro_batches
    rows = cfg.train.global_batch // dp // micro
    e = plan.experts
    recorder = Recorder(
        axis_names(mesh, built.experts),
        1 / (e.ep * (plan.mesh.tp if e.tensor_parallel else 1)) if e and e.stacked else 1,
    )
    with fake_tensors():
        model.to_empty(device="cpu")
        if plan.fp8 is not None and plan.fp8.all_gather:
            _scale_float8_gathers(built, plan)
        positions = None
        # the mesh's coordinates are read here, not under the recorder: they are the mesh's own ops, sized by the
        # world, which no training step runs
        pp_rank = mesh["pp"].get_local_rank() if plan.pipeline is not None else 0
        if plan.context is not None:  # cp rank 0's chunks of every sequence
            positions = cp_positions(cfg.train.seq_len, cfg.mesh.cp, mesh["cp"].get_local_rank())
        tokens = torch.zeros((rows, cfg.train.seq_len // cfg.mesh.cp), dtype=torch.long)

        def after_forward() -> None:
            recorder.activation_bytes = recorder.live_bytes(param_storages(model))
            if forward_only:
                raise _ForwardDone

        # fake tensors hold no data to route by: every expert gets the same load
        with recorder, contextlib.suppress(_ForwardDone), warnings.catch_warnings(), balanced_routing():
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            if plan.pipeline is None:
                forward_backward(
                    model, tokens, tokens, 1.0, plan.loss_parallel, after_forward, positions, forward=provider.forward
                )
            else:
                _stages_forward_backward(
                    built, plan, pp_rank, cfg, provider.dim, tokens, after_forward, recorder, positions
                )
    return recorder


def _scale_float8_gathers(built: Parallelized, plan: Plan) -> None:
    """Give FSDP's float8 all-gathers the scales that each step's gathers read, as the optimizer step before computes
    them (`refresh_scales`); without them every gather would all-reduce its own amax, as only the first step does.
    FSDP's lazy init comes first: it re-wraps the shards, which fails on fake tensors holding a scale (torchao's
    `__tensor_flatten__` asks the scale's truth value)."""
    for root in built.stages:  # the model, or each of this rank's pipeline stages: FSDP roots
        if isinstance(root, FSDPModule):
            root._get_fsdp_state()._lazy_init()  # a root's initializes each unit under it
    refresh_scales(built.model, plan.fp8)


def stage_boundary(cfg: Config, plan: Plan, rows: int, dim: int) -> tuple[tuple[int, int, int], torch.dtype]:
    """Shape and dtype of what one pipeline stage hands the next for a micro batch of `rows` sequences: the
    residual stream of the rank's tokens (its cp chunks, sequence-sharded over tp under SP), in the parameters'
    compute dtype."""
    sp = cfg.mesh.tp if cfg.plan.sequence_parallel else 1
    dtype = getattr(torch, plan.fsdp.param_dtype) if plan.fsdp is not None else torch.float32
    return (rows, cfg.train.seq_len // cfg.mesh.cp // sp, dim), dtype


def _stages_forward_backward(
    built: Parallelized,
    plan: Plan,
    pp_rank: int,
    cfg: Config,
    dim: int,
    tokens: torch.Tensor,
    after_forward: Callable[[], None],
    recorder: Recorder,
    positions: torch.Tensor | None = None,
) -> None:
    """One micro batch through each of this rank's pipeline stages, as torch's PipelineStage runs them: the first
    stage takes the tokens, the others a residual-stream tensor from the previous stage (sequence-sharded under
    SP); the last stage's loss is backpropagated, the others' outputs get a gradient from the next stage."""
    stages = plan.pipeline.stages_of(pp_rank)
    last = len(plan.pipeline.stages) - 1
    hidden, dtype = stage_boundary(cfg, plan, tokens.shape[0], dim)
    outputs = []
    alive = 0
    with loss_parallel() if plan.loss_parallel else contextlib.nullcontext():
        for module, stage in zip(built.stages, stages, strict=True):
            recorder.stage = stage.index
            x = tokens if stage.index == 0 else torch.zeros(hidden, dtype=dtype, requires_grad=True)
            y = module(x) if positions is None else module(x, positions=positions)
            if stage.index == last:
                y = summed_loss(y, tokens)
            outputs.append((stage.index, y))
            now = recorder.live_bytes(param_storages(built.model))
            recorder.stage_activations[stage.index], alive = now - alive, now
        after_forward()
        for index, y in reversed(outputs):  # the schedule runs the backwards in reverse stage order
            recorder.stage = index
            y.backward() if y.ndim == 0 else y.backward(torch.ones_like(y))


class _ForwardDone(Exception):
    pass


def probe(
    cfg: Config,
    rules: Rules | None = None,
    *,
    forward_only: bool = False,
    pp_rank: int = 0,
    blocks: int | None = None,
    provider: ModelProvider | None = None,
) -> Probe:
    """What one micro batch of `cfg` (resolved: its mesh names the world) does on rank 0, for the whole model
    (with pipelines: on the first rank of pp rank `pp_rank`, for its stages).

    provider: the model (default: the one the config names); rules: its layout (default: the provider's); they
    must not depend on the number of blocks. forward_only stops
    after the forward: only activation_bytes and the forward's collectives and ops are then filled.
    With pipeline stages: one pipeline micro batch through the stages of pp rank `pp_rank` (this process is its
    first rank), which hold `blocks` blocks in cfg's plan (default: an even share).
    """
    return measure(cfg, rules, forward_only=forward_only, pp_rank=pp_rank, provider=provider).at(blocks)


SHARD_AXES = ("dp_shard", "dp_shard_cp")
"""The groups FSDP shards the model's weights over (not the experts': theirs is the expert mesh's)."""
CollectiveKey = tuple[str, str, str, int, int | None]
"""(axis, kind, phase, group size, stage): how a Recorder counts collectives."""


class Run(NamedTuple):
    """What one fake run recorded, as `Measurement` extends it."""

    collectives: dict[CollectiveKey, int]
    collective_bytes: dict[CollectiveKey, int]
    regathers: dict[CollectiveKey, int]
    """The collectives FSDP ran to gather weights again in the backward (none with reshard_after_forward=False)."""
    regather_bytes: dict[CollectiveKey, int]
    sequence: tuple[tuple[int, int, OpKind, Role, int | None], ...]
    """Every op as it ran: FLOPs, bytes, kind, whose it is (FSDP's gather, such a gather again, its reduction, or
    the step's own), its pipeline stage."""
    activation_bytes: int
    stage_activations: dict[int | None, int]
    """Each pipeline stage's share of activation_bytes (empty without a pipeline)."""

    @classmethod
    def of(cls, r: Recorder) -> Run:
        return cls(dict(r.collectives), dict(r.collective_bytes), dict(r.regathers), dict(r.regather_bytes),
                   tuple(r.sequence), r.activation_bytes, dict(r.stage_activations))  # fmt: skip

    def stage(self, stage: int | None, to: int | None) -> Run:
        """What pipeline stage `stage` ran (None: what the rank ran before any), as stage `to`: its collectives, ops
        and activations."""

        def moved(counts: dict[CollectiveKey, int]) -> dict[CollectiveKey, int]:
            return {(*key[:4], to): n for key, n in counts.items() if key[4] == stage}

        alive = self.stage_activations.get(stage, 0)
        return Run(
            moved(self.collectives), moved(self.collective_bytes), moved(self.regathers), moved(self.regather_bytes),
            tuple((*op[:4], to) for op in self.sequence if op[4] == stage), alive,
            {} if stage is None else {to: alive},
        )  # fmt: skip

    @staticmethod
    def joined(runs: list[Run]) -> Run:
        """The runs of distinct stages as one rank running them all, in that order."""
        return Run(
            *({key: n for r in runs for key, n in getattr(r, field).items()}
              for field in ("collectives", "collective_bytes", "regathers", "regather_bytes")),
            tuple(op for r in runs for op in r.sequence), sum(r.activation_bytes for r in runs),
            {s: n for r in runs for s, n in r.stage_activations.items()},
        )  # fmt: skip

    def counted(self, regather: bool) -> tuple[dict, dict, Counter, int, int, Counter, Counter, Counter]:
        """(collective counts, their bytes, ops, FLOPs, activations, FSDP's forward gathers' ops, its reductions'
        ops, the recomputation's ops), without the backward's gathers if not `regather`."""
        counts, nbytes = Counter(self.collectives), Counter(self.collective_bytes)
        if not regather:
            counts.subtract(self.regathers)
            nbytes.subtract(self.regather_bytes)
        ops = Counter((f, b, kind) for f, b, kind, role, _ in self.sequence if regather or role != "regather")
        flops = sum(f * n for (f, _, _), n in ops.items())
        gathers, reductions, recomputed = (Counter((f, b, kind) for f, b, kind, r, _ in self.sequence if r == role)
                                           for role in ("gather", "reduce", "recompute"))  # fmt: skip
        return dict(counts), dict(nbytes), ops, flops, self.activation_bytes, gathers, reductions, recomputed

    def replicated(self, replicas: int) -> Run | None:
        """This run of FSDP alone (dp_replicate 1) as the rank of HSDP with `replicas` replicas of its shard group runs
        it: FSDP then all-reduces each reduce-scatter's output (its buffer over the shard group's size) over
        dp_replicate; every op, every other collective and the activations are the same (tests/test_estimate_shared.py
        compares the result with the probe of the HSDP rank). None where it reduced nothing over a shard group."""
        counts, nbytes = dict(self.collectives), dict(self.collective_bytes)
        for key, n in self.collectives.items():
            axis, kind, phase, size, stage = key
            if kind != "reduce_scatter" or axis not in SHARD_AXES:
                continue
            buffer, rest = divmod(self.collective_bytes[key], size)
            if rest:
                return None
            reduced = ("dp_replicate", "all_reduce", phase, replicas, stage)
            counts[reduced] = counts.get(reduced, 0) + n
            nbytes[reduced] = nbytes.get(reduced, 0) + buffer
        if counts == self.collectives:
            return None
        return self._replace(collectives=counts, collective_bytes=nbytes)

    def at_rows(self, other: Run, t: tuple[int, int]) -> Run | None:
        """The run on the line through this one (at 0) and `other` (at 1) at t = t[0] / t[1], where both ran the same ops and
        collectives in the same order; None where they did not, or where a quantity is not a whole number there."""
        if (
            len(self.sequence) != len(other.sequence)
            or self.collectives != other.collectives
            or self.regathers != other.regathers
            or self.stage_activations.keys() != other.stage_activations.keys()
            or any(a[2:] != b[2:] for a, b in zip(self.sequence, other.sequence, strict=True))
        ):
            return None

        def line(x: int, y: int) -> int:
            step, rest = divmod(t[0] * (y - x), t[1])
            if rest or x + step < 0:
                raise _NotAffine
            return x + step

        try:
            return Run(
                self.collectives,
                {key: line(n, other.collective_bytes[key]) for key, n in self.collective_bytes.items()},
                self.regathers,
                {key: line(n, other.regather_bytes[key]) for key, n in self.regather_bytes.items()},
                tuple((line(a[0], b[0]), line(a[1], b[1]), *a[2:]) for a, b in zip(self.sequence, other.sequence)),
                line(self.activation_bytes, other.activation_bytes),
                {s: line(n, other.stage_activations[s]) for s, n in self.stage_activations.items()},
            )
        except _NotAffine:
            return None


class _NotAffine(Exception):
    pass


class Measurement:
    """The probes of a model cut to two sizes (or of the whole model), from which `at` gives any number of blocks."""

    def __init__(self, runs: list[Run], n: int, k: int, v: int, stages: int) -> None:
        self.runs = runs
        self.n, self.k, self.v, self.stages = n, k, v, stages
        self._counted: dict[bool, list[tuple]] = {}
        self._probes: dict[tuple[int | None, bool], Probe] = {}

    def at(self, blocks: int | None = None, regather: bool = True) -> Probe:
        """The probe of the probed rank holding `blocks` blocks (default: an even share of the model's);
        regather=False: as if FSDP kept the weights gathered from forward to backward (reshard_after_forward=False;
        the measurement must then reshard)."""
        if (blocks, regather) not in self._probes:
            self._probes[blocks, regather] = self._at(blocks, regather)
        return self._probes[blocks, regather]

    def _at(self, blocks: int | None, regather: bool) -> Probe:
        n, k, v = self.n, self.k, self.v
        held = (n * v // self.stages if blocks is None else blocks) if self.stages > 1 else n
        if regather not in self._counted:
            self._counted[regather] = [r.counted(regather) for r in self.runs]
        records = self._counted[regather]
        if len(records) == 1:
            a = b = records[0]
            scale = 0.0
            per_block = a[4] / held
        else:
            a, b = records
            # quantity(held) = quantity(2k v) + (held - 2k v) / (k v) * (quantity(3k v) - quantity(2k v))
            scale = (held - 2 * k * v) / (k * v)
            per_block = (b[4] - a[4]) / (k * v)
        exact = abs(scale - round(scale)) < 1e-9  # uneven pipeline stages land between two probed sizes

        def extend(x: int, y: int) -> int:
            value = x + scale * (y - x)
            if value < 0 or (exact and abs(value - round(value)) > 1e-6 * max(1.0, abs(value))):
                raise AssertionError(f"probe: a quantity is not linear in blocks ({x}, then {y} with {k * v} more)")
            return round(value)

        keys = a[0].keys() | b[0].keys()
        collectives = tuple(
            Collective(
                axis=axis, kind=kind, phase=phase, group_size=size, stage=stage,
                count=extend(a[0].get(key, 0), b[0].get(key, 0)), bytes=extend(a[1].get(key, 0), b[1].get(key, 0)),
            )
            for key in sorted(keys, key=str)
            for axis, kind, phase, size, stage in [key]
        )  # fmt: skip

        def extended(i: int) -> tuple[tuple[int, int, int, OpKind], ...]:
            ops = sorted((*key[:2], extend(a[i][key], b[i][key]), key[2]) for key in a[i].keys() | b[i].keys())
            return tuple(op for op in ops if op[2])

        return Probe(
            collectives=tuple(c for c in collectives if c.count),
            flops=extend(a[3], b[3]),
            ops=extended(2),
            gather_ops=extended(5),
            reduce_ops=extended(6),
            recompute_ops=extended(7),
            activation_bytes=extend(a[4], b[4]),
            block_activation_bytes=round(per_block),
        )

    def replicated(self, replicas: int) -> Measurement | None:
        """This measurement of FSDP alone as HSDP's with `replicas` replicas (`Run.replicated`); None where it cannot
        be derived."""
        runs = [r.replicated(replicas) for r in self.runs]
        if any(r is None for r in runs):
            return None
        return Measurement(runs, self.n, self.k, self.v, self.stages)

    def at_rows(self, rows: int, mine: int, other: Measurement, theirs: int) -> Measurement | None:
        """This measurement (of `mine` rows per micro batch) at `rows` rows, on the line through `other` (the same
        layout at `theirs` rows): each op's FLOPs and bytes, each collective's bytes and the activations are affine
        in the rows of a micro batch (attention is quadratic in the sequence, not in the rows), and the ops and
        collectives that run do not change with them, which is checked: ops are paired in the order they ran (an
        op's FLOPs and bytes change with the rows, its place does not). None where the two ran other ops (a
        dimension of size 1 takes other paths: one row is probed on its own) or a quantity is off the line."""
        if (self.n, self.k, self.v, self.stages, len(self.runs)) != (other.n, other.k, other.v, other.stages,
                                                                     len(other.runs)):  # fmt: skip
            return None
        t = (rows - mine, theirs - mine) if theirs > mine else (mine - rows, mine - theirs)
        runs = [a.at_rows(b, t) for a, b in zip(self.runs, other.runs, strict=True)]
        if any(r is None for r in runs):
            return None
        return Measurement(runs, self.n, self.k, self.v, self.stages)


def staged(pieces: list[tuple[Measurement, int, int]], stages: int) -> Measurement:
    """The measurement of a pp rank running, of a model's `stages` pipeline stages, those `pieces` name in the order
    it runs them: (a measurement, a stage it ran, the rank's stage that runs the same), the first one run first there
    too (a rank's first stage leaves a few more bytes alive than its others), with what the first measurement ran
    before any stage. Each stage of a rank holding several is its own module (and FSDP root) fed its own input, so
    what one records does not depend on the others the rank runs; both probes of a measurement hold 2k and 3k
    blocks in every stage (tests/test_estimate_shared.py checks the sum against the probe of the rank)."""
    first = pieces[0][0]
    runs = [
        Run.joined([first.runs[i].stage(None, None), *(m.runs[i].stage(s, to) for m, s, to in pieces)])
        for i in range(len(first.runs))
    ]
    return Measurement(runs, first.n, first.k, len(pieces), stages)


def measure(
    cfg: Config,
    rules: Rules | None = None,
    *,
    forward_only: bool = False,
    pp_rank: int = 0,
    provider: ModelProvider | None = None,
) -> Measurement:
    """`probe`'s runs, before they are extended to a number of blocks: probes of one model serve every count. A layout
    with CPU offload is probed as without: the device runs the same (the shards' copies to and from the host are not
    counted), and fake tensors cannot be pinned."""
    if cfg.plan.cpu_offload:
        cfg = msgspec.structs.replace(cfg, plan=msgspec.structs.replace(cfg.plan, cpu_offload=False))
    provider = provider or provider_for(cfg)
    n = provider.n_layers
    k = cfg.plan.ac_every if cfg.plan.activation_checkpoint == "selective" else 1
    pp, v = cfg.mesh.pp, cfg.plan.pp_stages_per_rank if cfg.mesh.pp > 1 else 1
    stages = pp * v  # the model's blocks split into `stages` stages, v of them on this rank
    # Two and three periods per stage: the first and the last block differ from the middle ones (FSDP prefetches
    # and reshards them differently), so every probe holds both and the difference is one middle period.
    sizes = (n,) if n <= 3 * k * stages else (2 * k * stages, 3 * k * stages)
    rank = pp_rank * (cfg.mesh.world_size // pp)
    with fake_world(cfg.mesh.world_size, rank), cached_sharding_propagation():
        # One mesh for both probes: DTensor caches redistributions by mesh equality, so a second equal mesh
        # would run on the first one's groups.
        mesh = make_mesh(cfg.mesh, "cpu")
        runs = run_forked(
            [lambda size=size: Run.of(_probe_layers(cfg, rules, provider, mesh, size, forward_only)) for size in sizes]
        )
    return Measurement(runs, n, k, v, stages)
