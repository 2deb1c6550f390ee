"""estimate_memory(plan) -> MemoryEstimate: what the worst rank holds in parameters, gradients and AdamW state.

Read off the Plan, not a separate formula, so it cannot drift from what `apply` builds: every sharded
axis gives its first coordinates the largest torch.chunk piece (FSDP pads every rank to it), so the
worst rank holds the largest shard of every parameter. Activations, communication volume, FLOPs and
step time are not estimated yet (issue 6).
"""

from __future__ import annotations

import math

from shardlab._base import Frozen
from shardlab.plan import Plan

ADAM_STATES = 2
"""AdamW keeps exp_avg and exp_avg_sq per parameter, in the parameter's dtype, plus a 0-dim fp32 step."""
NOT_YET = "activations, FSDP all-gather buffers, communication volume, FLOPs per token, step time and MFU"


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
    params = sum(p.bytes_per_rank for p in plan.params)
    return MemoryEstimate(params=params, grads=params, optim=ADAM_STATES * params + 4 * len(plan.params))


def memory_table(plan: Plan) -> str:
    """The estimate as text, for `python -m shardlab estimate`."""
    m = estimate_memory(plan)
    n = sum(math.prod(p.shape) for p in plan.params)
    rows = [("parameters", m.params), ("gradients", m.grads), ("optimizer (AdamW)", m.optim), ("total", m.total)]
    lines = [f"Estimate for mesh {plan.mesh.describe()}, {n:,} parameters; per rank, worst rank:"]
    lines += [f"  {name:<18} {value / 2**30:10.3f} GiB  ({value:,} bytes)" for name, value in rows]
    lines.append(f"not estimated yet (issue 6): {NOT_YET}")
    return "\n".join(lines)
