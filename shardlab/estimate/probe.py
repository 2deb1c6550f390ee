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
from collections.abc import Callable

import msgspec
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel

from shardlab.config import Config
from shardlab.estimate._fake import cached_sharding_propagation, fake_tensors, fake_world
from shardlab.estimate._forked import run_forked
from shardlab.estimate.measurement import Measurement, Probe, Run
from shardlab.estimate.recorder import Recorder, axis_names, param_storages
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
from shardlab.training.loss import chunks_counted_by, summed_loss
from shardlab.training.step import forward_backward


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
        fused_casts=plan.compile and plan.fp8 is not None,
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
        with (
            recorder,
            chunks_counted_by(recorder),  # fake tensors: the loss's middle chunks run once
            contextlib.suppress(_ForwardDone),
            warnings.catch_warnings(),
            balanced_routing(),
        ):
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
