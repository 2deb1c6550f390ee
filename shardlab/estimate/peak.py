"""Where a rank's memory peaks: beside every gradient, or, where the forward runs without them, at the start or the
end of the backward (`Estimate.peak`, and the search's bounds on it)."""

from __future__ import annotations

from shardlab.sharding.plan import Plan


def forward_without_grads(activation_checkpoint: str, micro_batches: int, pp: int) -> bool:
    """Whether the forward's activations reach their peak with no gradient held. The step sets gradients to None
    after each update, so one micro batch without a pipeline runs its forward without any, and its backward makes
    each block's gradients as it frees that block's activations; without checkpointing no block's backward holds
    more than that block kept. Later micro batches and pipelines run forwards beside earlier ones' gradients, and a
    checkpointed block rebuilds more than it kept."""
    return micro_batches == 1 and pp == 1 and activation_checkpoint == "none"


def beside_state(fixed: tuple[int, int], activations: float, without_grads: bool) -> int:
    """A peak of at least `activations` beside what a plan fixes, `fixed`: (its state and FSDP buffers on the device,
    the gradients among them): beside every gradient, or, where the forward runs without them
    (`forward_without_grads`), beside the rest, or every gradient if they weigh more (`Estimate.peak`)."""
    total, grads = fixed
    return int(total - grads + max(activations, grads) if without_grads else total + activations)


def first_grad_bytes(plan: Plan) -> int:
    """Bytes of the gradients of the parameters outside the plan's blocks (the embedding, the output head, the last
    norm), which the backward makes before any block's or, for the embedding, after: all of them, taken at its
    start. Without blocks, every gradient."""
    blocks = tuple(b + "." for b in plan.blocks)
    return sum(p.bytes_per_rank for p in plan.worst_rank_params if not blocks or not p.fqn.startswith(blocks))
