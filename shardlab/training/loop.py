"""train(config): data, logging and run-directory output around `step`; the loop a CLI run executes.

Builds the model on the meta device, plans it, materialises it with the config's seed (each weight a
function of the seed and its name, so every layout starts from the same model; a pipeline rank allocates
only its own stages), applies the plan, then steps. Returns the per-step metrics, so tests and researchers can compare layouts directly.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardlab._base import to_json
from shardlab._errors import ShardlabError
from shardlab._faults import fault_point
from shardlab.config import Config
from shardlab.config.run import CPU_OFFLOAD_ON_CPU
from shardlab.data.loader import make_loader, run_data
from shardlab.data.tokenizer import run_tokenizer
from shardlab.hf import initial_weights, load_hf_weights
from shardlab.models import provider_for
from shardlab.models.flops import module_flops
from shardlab.models.provider import ModelProvider, check_layout
from shardlab.parallel.apply import Parallelized, parallelize
from shardlab.parallel.device_mesh import make_mesh
from shardlab.parallel.stages import keep_own_stages
from shardlab.parallel.world import resolve_device
from shardlab.sharding.plan import Plan, make_plan
from shardlab.sharding.rules import Rules
from shardlab.training import checkpoint
from shardlab.training._malloc import keep_freed_memory
from shardlab.training._preemption import Preempted, Preemption
from shardlab.training.evaluate import eval_loader, make_eval, train_split
from shardlab.training.metrics import MetricsWriter, device_peak_flops, mfu, peak_memory_bytes
from shardlab.training.step import Metrics, TrainState, init_state, make_step, model_device


def plan_model(
    cfg: Config, rules: Rules | None = None, provider: ModelProvider | None = None
) -> tuple[nn.Module, Plan]:
    """The model on the meta device and its plan for cfg.mesh (resolved): no process group, no memory.

    provider: the model (default: the one the config names, `provider_for`); rules: its layout (default: the
    provider's rules)."""
    provider = provider or provider_for(cfg)
    with torch.device("meta"):
        model = provider.build()
    flops = None
    if cfg.mesh.pp > 1 and cfg.plan.pp_balance == "flops":
        sample = torch.zeros(1, cfg.train.seq_len, dtype=torch.long, device="meta")
        flops = module_flops(model, sample, provider.forward)
    return model, make_plan(model, cfg.mesh, rules or provider.rules(cfg.plan), cfg.plan, flops)


FP8_CAPABILITY = (8, 9)
"""The CUDA compute capability from which devices have float8 tensor cores."""


def eager_fp8_note(cfg: Config, device: torch.device | None = None) -> str | None:
    """A line for a GPU run of plan.fp8 without plan.compile, which is slower than bf16 (None for any other run):
    eager, each of torchao's casts is several kernels over the whole tensor; compiled, they fuse. device: where the
    model goes (None: cfg.train.device)."""
    if cfg.plan.fp8 == "none" or cfg.plan.compile or (device or resolve_device(cfg.train.device)).type != "cuda":
        return None
    return (
        f"note: plan.fp8={cfg.plan.fp8!r} without plan.compile runs torchao's float8 casts as separate kernels, "
        "slower than bf16 (Llama 3.2 1B on an H200: 2.2x slower eager, 5.6% faster than bf16 compiled); add "
        "--plan.compile"
    )


def check_init(cfg: Config, device: torch.device | None = None) -> None:
    """The limits that depend on the run's device: train.init='sharded', plan.cpu_offload, plan.fp8 (checked by the
    CLI before launch, and again here for library use); device: where the model goes (None: cfg.train.device)."""
    if cfg.plan.cpu_offload and (device or resolve_device(cfg.train.device)).type == "cpu":
        raise ShardlabError(CPU_OFFLOAD_ON_CPU)
    if cfg.plan.fp8 != "none" and (at := device or resolve_device(cfg.train.device)).type == "cuda":
        major, minor = torch.cuda.get_device_capability(at)
        if (major, minor) < FP8_CAPABILITY:
            raise ShardlabError(
                f"plan.fp8={cfg.plan.fp8!r} needs float8 matmuls, which CUDA devices of compute capability "
                f"{'.'.join(map(str, FP8_CAPABILITY))} or more have (Ada, Hopper, Blackwell); this "
                f"{torch.cuda.get_device_name(at)} is {major}.{minor}: set plan.fp8='none'"
            )
    if cfg.train.init == "sharded" and cfg.mesh.pp > 1:
        raise ShardlabError(
            "train.init='sharded' with mesh.pp > 1 is not supported yet; use train.init='full', which with pp "
            "allocates and draws only this rank's stages"
        )
    if cfg.train.init == "sharded" and (device or resolve_device(cfg.train.device)).type != "cuda":
        raise ShardlabError(
            "train.init='sharded' needs CUDA: torch coordinates DTensor random init across ranks only on CUDA "
            "meshes (on CPU every shard would draw the same numbers); use train.init='full'"
        )


def build_model(
    cfg: Config,
    rules: Rules | None = None,
    device: torch.device | str | None = None,
    provider: ModelProvider | None = None,
) -> tuple[nn.Module, Plan, DeviceMesh | None]:
    """Model + plan + mesh for the current process group (or a single process), parallelized and ready to train.

    device: None reads cfg.train.device (cuda:LOCAL_RANK when CUDA is used). provider: the model (default: the
    one the config names). A rank that runs several pipeline stages, or a transformers model's stage, runs modules
    built beside the model: `build` returns them.
    """
    built, plan, mesh = build(cfg, rules, device, provider)
    return built.model, plan, mesh


def build(
    cfg: Config,
    rules: Rules | None = None,
    device: torch.device | str | None = None,
    provider: ModelProvider | None = None,
) -> tuple[Parallelized, Plan, DeviceMesh | None]:
    """`build_model`, with what was built to run the model (`Parallelized`: its pipeline stages, the expert mesh)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = cfg.validated().resolve(world)
    provider = provider or provider_for(cfg)
    check_layout(cfg, provider)
    device = resolve_device(cfg.train.device) if device is None else torch.device(device)
    check_init(cfg, device)
    model, plan = plan_model(cfg, rules, provider)
    mesh = None
    if plan.fsdp is not None or plan.mesh.tp > 1 or plan.pipeline is not None:
        if not dist.is_initialized():
            # FSDP mixed precision on one process still needs a (one-rank) process group; on a GPU its
            # collectives run on CUDA tensors, which gloo cannot reduce.
            backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        mesh = make_mesh(cfg.mesh, device.type)
    built = None
    if cfg.train.init == "sharded":
        built = parallelize(model, plan, mesh)  # on the meta device: no rank ever holds more than its shards
    elif plan.pipeline is not None:
        keep_own_stages(model, plan, mesh["pp"].get_local_rank())  # on the meta device: only this rank's stages
    provider.materialize(model, device, cfg.train.seed)  # each weight a function of (seed, name): same in every layout
    if built is None:
        built = parallelize(model, plan, mesh)
    return built, plan, mesh


def train(
    cfg: Config,
    rules: Rules | None = None,
    *,
    device: torch.device | str | None = None,
    write: bool = True,
    until: int | None = None,
    provider: ModelProvider | None = None,
) -> list[Metrics]:
    """Run (or resume, per checkpoint.resume) up to cfg.train.steps steps, or stop after step `until`.

    Rank 0 writes config.json, plan.json and metrics.jsonl into the run directory (unless `write` is
    False); checkpoints go to run_dir/checkpoints every checkpoint.every steps and after the last.
    provider: the model (default: the one the config names; a recipe's own model is passed here).
    SIGTERM (preemption) on any rank: every rank finishes its step, the run saves it (whatever checkpoint.every
    says) and raises `Preempted` (see `shardlab.training._preemption`).
    """
    with warnings.catch_warnings():  # for this run only, not for the rest of the process
        # nn.Embedding returns a view; FSDP warns in case an in-place op follows. Llama only adds out of place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor")
        return _train(cfg, rules, device, write, until, provider)


def _train(
    cfg: Config,
    rules: Rules | None,
    device: torch.device | str | None,
    write: bool,
    until: int | None,
    provider: ModelProvider | None,
) -> list[Metrics]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    provider = provider or provider_for(cfg)
    built, plan, mesh = build(cfg, rules, device, provider)
    model = built.model
    cfg = cfg.resolve(plan.mesh.world_size)
    device = model_device(model)
    if device.type == "cpu" and cfg.train.keep_freed_memory:
        keep_freed_memory()
    dp = cfg.mesh.size("dp")
    dp_rank = cfg.mesh.group_index(rank, ("dp",))
    step = make_step(cfg, plan, mesh, provider, built.stages)
    state: TrainState = init_state(model, cfg.optim)
    tokenizer = run_tokenizer(cfg)
    loader = make_loader(
        run_data(cfg), seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch, vocab_size=provider.vocab_size,
        dp_rank=dp_rank, dp_size=dp, micro_batches=cfg.micro_batches, tokenizer=tokenizer, split=train_split(cfg),
    )  # fmt: skip
    evaluate, held_out = None, None
    if cfg.eval.every:
        evaluate = make_eval(cfg, plan, mesh, provider, built.stages)
        held_out = eval_loader(
            cfg, vocab_size=provider.vocab_size, dp_rank=dp_rank, dp_size=dp, micro_batches=cfg.micro_batches,
            tokenizer=tokenizer,
        )  # fmt: skip
    run_dir = Path(cfg.run_dir)
    checkpoints = run_dir / "checkpoints"
    if rank == 0:
        checkpoint.remove_partial(checkpoints)
    if dist.is_initialized():
        dist.barrier()
    resume_from = checkpoint.resolve_resume(cfg.checkpoint.resume, checkpoints)
    if resume_from is not None:
        state = checkpoint.load(state, loader, resume_from, cfg, provider)
    elif (weights := initial_weights(cfg, provider)) is not None:
        load_hf_weights(model, weights, provider.hf_names, _elsewhere(plan, mesh))
    is_writer = write and rank == 0
    if is_writer:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_bytes(to_json(cfg))
        (run_dir / "plan.json").write_bytes(plan.to_json())
        (run_dir / "model.json").write_text(json.dumps(provider.identity(), indent=2) + "\n")
    fpt = provider.flops_per_token(cfg.train.seq_len)
    peak = device_peak_flops(device, cfg.log.peak_tflops)
    world = plan.mesh.world_size
    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    history: list[Metrics] = []
    last = cfg.train.steps if until is None else min(until, cfg.train.steps)
    if resume_from is not None and rank == 0:
        print(_resuming(resume_from, state.step, last, cfg.train.steps), flush=True)
    every = cfg.checkpoint.every
    pending: checkpoint.PendingSave | None = None
    save_group = checkpoint.checkpoint_group() if every is not None and cfg.checkpoint.async_save else None
    with (
        MetricsWriter(
            run_dir,
            cfg.log,
            cfg.train.steps,
            enabled=is_writer,
            config_dict=json.loads(to_json(cfg)),
            name=cfg.name,
            start_step=state.step,
            start_row=None if resume_from is None else checkpoint.saved_metrics(resume_from),
        ) as writer,
        Preemption() as preemption,
    ):
        while state.step < last:
            start = time.perf_counter()  # the step time includes loading the batch, as torchtitan's does
            with profiled(state.step + 1 == cfg.log.profile_step, run_dir / "profile", rank):
                state, metrics = step(state, next(loader))
            stop = state.step < last and preemption.requested()  # after the last step there is nothing to stop
            elapsed = time.perf_counter() - start
            fault_point(f"step:{state.step}")
            rates = {
                "tokens_per_s": tokens_per_step / elapsed,
                "mfu": mfu(tokens_per_step / elapsed / world, fpt, peak),
                "peak_memory_bytes": peak_memory_bytes(device),
                "step_s": elapsed,
            }
            if evaluate is not None and (state.step % cfg.eval.every == 0 or state.step == cfg.train.steps):
                metrics |= evaluate(state.model, held_out)
            if stop or (every is not None and (state.step % every == 0 or state.step == cfg.train.steps)):
                saving = time.perf_counter()
                if pending is not None:
                    pending.commit()  # the previous async save must be committed before the next one starts
                pending = checkpoint.save(
                    state, loader, cfg, checkpoints, async_save=cfg.checkpoint.async_save and not stop,
                    group=None if stop else save_group, provider=provider, metrics={**metrics, **rates},
                )  # fmt: skip
                metrics["checkpoint_block_s"] = time.perf_counter() - saving
            # wall clock at the end of the step: benchmarks time steps as torchtitan does
            metrics = {**metrics, **rates, "time": time.time()}
            history.append(metrics)
            writer.record(state.step, metrics)
            if stop:
                raise Preempted("SIGTERM", state.step, checkpoint.step_dir(checkpoints, state.step))
        if pending is not None:
            pending.commit()
    return history


def _resuming(source: Path, step: int, last: int, steps: int) -> str:
    """The line a resumed run starts with: where from, and how many steps it will run (or that it has none to)."""
    if step >= steps:
        return (
            f"shardlab: {source} is at step {step}, at or past train.steps={steps}: nothing to train (raise "
            "--train.steps to train on)"
        )
    return f"shardlab: resuming from {source} at step {step}; {last - step} steps to go, to step {last}"


def _elsewhere(plan: Plan, mesh: DeviceMesh | None) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the parameters other pipeline stages hold (none without a pipeline)."""
    if plan.pipeline is None:
        return []
    own = {s.index for s in plan.pipeline.stages_of(mesh["pp"].get_local_rank())}
    return [(n, p.shape) for p in plan.params if p.stage not in own for n in (p.fqn, *p.aliases)]


@contextlib.contextmanager
def profiled(enabled: bool, folder: Path, rank: int) -> Iterator[None]:
    """torch.profiler around what runs inside (log.profile_step): this rank's Chrome trace in `folder`, and on rank 0
    the ops that took the most time, so a slow step can be read op by op and compared with another trainer's."""
    if not enabled:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    folder.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(folder / f"rank{rank}.json"))
    if rank == 0:
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=10), flush=True)
