"""estimate_table(estimate, cfg, device) -> str: an estimate as `python -m shardlab estimate` prints it: per rank
memory (and whether its peak fits the device), each collective, compute and the roofline's step time."""

from __future__ import annotations

from shardlab.config import Config
from shardlab.estimate import Estimate
from shardlab.estimate.device import Device
from shardlab.estimate.roofline import collective_seconds


def _gib(n: float) -> str:
    return f"{n / 2**30:10.3f} GiB"


def _fits(peak: int, dev: Device) -> str:
    """Whether the peak fits the device's memory: a layout that does not is said so beside its step time, which
    the device could not run."""
    held = dev.memory_gib * 2**30
    if peak <= held:
        return f"  fits {dev.name}'s {dev.memory_gib:g} GiB, {(held - peak) / 2**30:.3f} GiB to spare"
    return (
        f"  does not fit {dev.name}'s {dev.memory_gib:g} GiB: {(peak - held) / 2**30:.3f} GiB over; shard over more "
        "ranks (--world), checkpoint more, or let `python -m shardlab search RECIPE --world N` find a layout that fits"
    )


def estimate_table(e: Estimate, cfg: Config, dev: Device | None = None) -> str:
    """The estimate as text, for `python -m shardlab estimate`."""
    ac = cfg.plan.activation_checkpoint
    lines = [
        f"Estimate for mesh {e.mesh}, {e.n_params:,} parameters, {e.micro_batches} micro batch(es) of "
        f"{cfg.train.global_batch // cfg.mesh.size('dp') // e.micro_batches} x {cfg.train.seq_len} tokens per rank; "
        "worst rank:",
        "memory",
        f"  {'parameters':<34}{_gib(e.memory.params)}",
        f"  {'gradients':<34}{_gib(e.memory.grads)}"
        + (
            ""
            if e.first_grads is None
            else f"  (none in the forward: {e.first_grads / 2**30:.3f} GiB beside every "
            "activation, the rest made as they are freed)"
        ),
        f"  {'optimizer (AdamW)':<34}{_gib(e.memory.optim)}",
        *([f"  {'the three above: host memory':<34}{_gib(e.memory.host)}  (not in peak)"] if e.memory.on_host else []),
        f"  {f'activations (checkpointing {ac})':<34}{_gib(e.activations)}",
        f"  {f'activations (checkpointing {e.other_checkpointing})':<34}{_gib(e.activations_other)}  (not in peak)",
        f"  {'FSDP unsharded params and grads':<34}{_gib(e.fsdp_buffers)}",
        f"  {'peak':<34}{_gib(e.peak)}",
        *([_fits(e.peak, dev)] if dev is not None else []),
        "communication per step (buffer bytes; ring traffic is (n-1)/n of it, all-reduce twice)",
    ]
    for c in sorted(e.collectives, key=lambda c: (c.axis, c.kind, c.phase)):
        seconds = f"  {collective_seconds(c, cfg.mesh, dev) * 1e3:9.2f} ms" if dev is not None else ""
        lines.append(
            f"  {c.axis:<15} {c.kind:<15} {c.phase:<9} {c.count:>6} x  {_gib(c.bytes)}  (group of {c.group_size})"
            + seconds
        )
    lines.append(f"compute: {e.flops_per_token / 1e9:.2f} GFLOP per token (6N + 12 L d S); this rank runs "
                 f"{e.executed_flops / 1e12:.1f} TFLOP per step (causal attention halved, recomputation included)")  # fmt: skip
    t = e.time
    if t is not None and dev is not None:
        lines += [
            f"on {dev.name} (see shardlab/estimate/roofline.py for the model): compute {t.compute_s * 1e3:.1f} ms"
            + (f" ({t.recompute_s * 1e3:.1f} ms of it recomputation), " if t.recompute_s else ", ")
            + f"FSDP comm {t.fsdp_comm_s * 1e3:.1f} ms (overlapped), TP/CP/EP comm {t.tp_comm_s * 1e3:.1f} ms, "
            + (f"PP sends {t.pp_comm_s * 1e3:.1f} ms, bubble {t.bubble_s * 1e3:.1f} ms, " if cfg.mesh.pp > 1 else "")
            + f"optimizer {t.optimizer_s * 1e3:.1f} ms",
            f"  step {t.step_s:.3f} s, {t.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {100 * t.mfu:.1f}%",
        ]
    return "\n".join(lines)
