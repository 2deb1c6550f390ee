"""estimate(cfg) -> Estimate: per-rank memory, communication, FLOPs and step time of a layout, without devices.

Parameters, gradients and AdamW state are read off the Plan (every sharded axis gives its first
coordinates the largest torch.chunk piece, so rank 0 holds the largest shard of every parameter). The rest
is measured by `probe`: one micro batch of the real layout on fake tensors in a fake world of the config's
size. Step time, tokens/s and MFU come from `roofline` for a named device.
"""

from __future__ import annotations

import math
from collections import Counter

import msgspec

from shardlab._base import Frozen
from shardlab.config import Config
from shardlab.metrics import model_flops_per_token
from shardlab.plan import Plan
from shardlab.probe import Collective, probe
from shardlab.roofline import Device, StepTime, collective_seconds, step_time
from shardlab.rules import Rules

ADAM_STATES = 2
"""AdamW keeps exp_avg and exp_avg_sq per parameter, in the parameter's dtype, plus a 0-dim fp32 step."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class MemoryEstimate(Frozen):
    """Bytes on the worst rank (the one holding the first chunk of every sharded axis)."""

    params: int
    """Sharded parameters (FSDP's padded shard size)."""
    grads: int
    """Sharded gradients: the parameters' dtype and layout (reduce_dtype only changes the reduction)."""
    optim: int
    """AdamW state: two moments per parameter plus one fp32 step counter per tensor."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim


def estimate_memory(plan: Plan) -> MemoryEstimate:
    params = plan.bytes_per_rank
    return MemoryEstimate(params=params, grads=params, optim=ADAM_STATES * params + 4 * len(plan.worst_rank_params))


def fsdp_buffer_bytes(plan: Plan) -> int:
    """FSDP's transient buffers at their largest: two units' unsharded parameters (the one computing and the
    one prefetched) in param_dtype, plus one unit's unsharded gradients in reduce_dtype before reduce-scatter."""
    f = plan.fsdp
    if f is None:
        return 0
    shards = plan.mesh.size("dp_shard")
    numel: Counter[str | None] = Counter()
    for p in plan.params:
        numel[p.fsdp_unit] += math.prod(p.local_shape) * shards
    largest = sorted(numel.values(), reverse=True)
    gathered = sum(largest[:2]) * DTYPE_BYTES[f.param_dtype]
    return gathered + largest[0] * DTYPE_BYTES[f.reduce_dtype]


class Estimate(Frozen):
    """What one rank (the worst) holds, sends and computes per optimizer step."""

    mesh: str
    n_params: int
    memory: MemoryEstimate
    activations: int
    """Bytes the forward of one micro batch leaves alive, with the config's activation checkpointing."""
    activations_other: int
    """The same with the other choice: `full` when the config checkpoints nothing, else `none`."""
    other_checkpointing: str
    fsdp_buffers: int
    collectives: tuple[Collective, ...]
    """Per optimizer step (every micro batch)."""
    micro_batches: int
    flops_per_token: float
    """Model FLOPs per token as MFU counts them (6N + 12 L d S)."""
    executed_flops: int
    """FLOPs this rank runs per step, recomputation included."""
    time: StepTime | None

    @property
    def peak(self) -> int:
        return self.memory.total + self.activations + self.fsdp_buffers


def estimate(cfg: Config, plan: Plan, rules: Rules | None = None, dev: Device | None = None) -> Estimate:
    """The estimate for `cfg` (resolved) laid out by `plan`, with step time on `dev` when given."""
    p = probe(cfg, rules)
    other = "full" if cfg.plan.activation_checkpoint == "none" else "none"
    other_cfg = msgspec.structs.replace(cfg, plan=msgspec.structs.replace(cfg.plan, activation_checkpoint=other))
    activations_other = probe(other_cfg, rules, forward_only=True).activation_bytes
    memory = estimate_memory(plan)
    micro = cfg.train.grad_accum(cfg.mesh.size("dp"))
    fpt = model_flops_per_token(cfg.model, cfg.train.seq_len)
    time = None
    if dev is not None:
        time = step_time(
            p, plan.mesh, dev, micro_batches=micro, params_per_rank=sum(math.prod(q.local_shape) for q in plan.params),
            global_tokens=cfg.train.global_batch * cfg.train.seq_len, model_flops_per_token=fpt,
        )  # fmt: skip
    return Estimate(
        mesh=plan.mesh.describe(),
        n_params=sum(math.prod(q.shape) for q in plan.params),
        memory=memory,
        activations=p.activation_bytes,
        activations_other=activations_other,
        other_checkpointing=other,
        fsdp_buffers=fsdp_buffer_bytes(plan),
        collectives=tuple(_per_step(c, micro) for c in p.collectives),
        micro_batches=micro,
        flops_per_token=fpt,
        executed_flops=micro * p.flops,
        time=time,
    )


def _per_step(c: Collective, micro: int) -> Collective:
    return msgspec.structs.replace(c, count=c.count * micro, bytes=c.bytes * micro)


def _gib(n: float) -> str:
    return f"{n / 2**30:10.3f} GiB"


def estimate_table(e: Estimate, cfg: Config, dev: Device | None = None) -> str:
    """The estimate as text, for `python -m shardlab estimate`."""
    ac = cfg.plan.activation_checkpoint
    lines = [
        f"Estimate for mesh {e.mesh}, {e.n_params:,} parameters, {e.micro_batches} micro batch(es) of "
        f"{cfg.train.global_batch // cfg.mesh.size('dp') // e.micro_batches} x {cfg.train.seq_len} tokens per rank; "
        "worst rank:",
        "memory",
        f"  {'parameters':<34}{_gib(e.memory.params)}",
        f"  {'gradients':<34}{_gib(e.memory.grads)}",
        f"  {'optimizer (AdamW)':<34}{_gib(e.memory.optim)}",
        f"  {f'activations (checkpointing {ac})':<34}{_gib(e.activations)}",
        f"  {f'activations (checkpointing {e.other_checkpointing})':<34}{_gib(e.activations_other)}  (not in peak)",
        f"  {'FSDP all-gather/reduce buffers':<34}{_gib(e.fsdp_buffers)}",
        f"  {'peak':<34}{_gib(e.peak)}",
        "communication per step (buffer bytes; ring traffic is (n-1)/n of it, all-reduce twice)",
    ]
    for c in sorted(e.collectives, key=lambda c: (c.axis, c.kind, c.phase)):
        seconds = f"  {collective_seconds(c, cfg.mesh, dev) * 1e3:9.2f} ms" if dev is not None else ""
        lines.append(
            f"  {c.axis:<12} {c.kind:<15} {c.phase:<9} {c.count:>6} x  {_gib(c.bytes)}  (group of {c.group_size})"
            + seconds
        )
    lines.append(f"compute: {e.flops_per_token / 1e9:.2f} GFLOP per token (6N + 12 L d S); this rank runs "
                 f"{e.executed_flops / 1e12:.1f} TFLOP per step (causal attention halved, recomputation included)")  # fmt: skip
    t = e.time
    if t is not None and dev is not None:
        lines += [
            f"on {dev.name} (see shardlab/roofline.py for the model): compute {t.compute_s * 1e3:.1f} ms, "
            f"FSDP comm {t.fsdp_comm_s * 1e3:.1f} ms (overlapped), TP comm {t.tp_comm_s * 1e3:.1f} ms, "
            f"optimizer {t.optimizer_s * 1e3:.1f} ms",
            f"  step {t.step_s:.3f} s, {t.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {100 * t.mfu:.1f}%",
        ]
    return "\n".join(lines)
