"""Mixture-of-experts feed-forward: a top-k router over SwiGLU experts whose weights are stacked ([E, ...]).

Stacked weights let a PartitionSpec shard the expert dim like any other (`P("ep", None, None)`: expert
parallelism, shardlab.sharding.experts). What the code around the model needs from it is explicit and kept off the
modules: each forward hands its router statistics to whoever records them (`router_stats`: the train step, which adds
the load-balancing loss over each global micro batch, updates the auxiliary-loss-free bias and logs the loads), and
`balanced_routing` routes every token evenly for the estimator, whose fake tensors hold no scores to route by.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardlab._errors import ShardlabError
from shardlab.config import ModelConfig

Compute = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""The experts a rank holds: rows grouped by its local expert, counts per local expert -> their outputs."""
Dispatch = Callable[[Compute, torch.Tensor, "torch.Tensor | list[int]"], torch.Tensor]
"""(compute, rows sorted by global expert, counts [E]) -> the rows' expert outputs, in the same order; expert
parallelism (shardlab.parallel.experts) provides one that runs each expert on the rank holding it."""


class RouterStats(NamedTuple):
    """One forward's routing on this rank."""

    counts: torch.Tensor
    """[E] token slots routed to each expert (before any capacity limit)."""
    score_sum: torch.Tensor
    """[E] summed (normalised) router scores, with their gradient: the balancing loss's differentiable part."""
    tokens: int
    dropped: int
    """Token slots that went over an expert's capacity and skipped it."""


Record = Callable[["MoE", RouterStats], None]
"""record(layer, stats): where a MoE layer's forward sends its routing."""

_RECORD: ContextVar[Record | None] = ContextVar("shardlab_router_stats", default=None)
_BALANCED: ContextVar[bool] = ContextVar("shardlab_balanced_routing", default=False)


@contextmanager
def router_stats(record: Record) -> Iterator[None]:
    """While inside, every MoE forward calls `record(layer, stats)` with its routing; outside, forwards record nothing
    (evaluation, generation). A recomputation in the backward (activation checkpointing) repeats a forward; the
    recorder tells it apart (shardlab.training.routers)."""
    token = _RECORD.set(record)
    try:
        yield
    finally:
        _RECORD.reset(token)


@contextmanager
def balanced_routing() -> Iterator[None]:
    """While inside, token t's k slots go to experts t k, ..., t k + k - 1 (mod E) whatever the scores: every expert
    gets the same load, known without the data. The estimator's probe runs on fake tensors, which have no data to
    route by."""
    token = _BALANCED.set(True)
    try:
        yield
    finally:
        _BALANCED.reset(token)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of `model`, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


class Experts(nn.Module):
    """E SwiGLU experts: gate_proj and up_proj [E, ffn, dim], down_proj [E, dim, ffn].

    Under expert parallelism the weights are DTensors sharded over ep (each rank holds E / ep experts) and the
    forward's keyword `dispatch`, which apply passes with every call (`shardlab.parallel.experts`), sends every row
    to the rank holding its expert and back; the module holds no slot for it."""

    hidden_dims: ClassVar[dict[str, int]] = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}
    """Each weight's hidden dim: the one tensor parallelism may split (the rules' `expert_mlp`)."""

    def __init__(self, n_experts: int, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))

    def forward(
        self, rows: torch.Tensor, counts: torch.Tensor | list[int], dispatch: Dispatch | None = None
    ) -> torch.Tensor:
        """rows [N, dim] sorted by expert, counts[e] of them for expert e -> [N, dim] in the same order. counts as a
        list: known on the host and the same on every rank (balanced routing). dispatch: how rows reach the experts
        (None: this rank holds them all)."""
        if dispatch is None:
            return self.compute(rows, counts if isinstance(counts, list) else counts.tolist())
        return dispatch(self.compute, rows, counts)

    def compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The experts this rank holds (all, or its ep shard: the local blocks of the DTensors) on rows grouped by
        local expert, counts[e] for its e-th."""
        # Unbound, not indexed: the backward of `w[e]` writes a zero gradient the size of all of w for each expert
        # (memory traffic growing as the square of the experts); unbind's backward stacks their gradients once.
        gate, up, down = (_local(w).unbind(0) for w in (self.gate_proj, self.up_proj, self.down_proj))
        # Every expert runs, idle ones on zero rows: their weights get zero gradients, not none (under expert
        # parallelism a rank whose experts got no tokens must still join FSDP's reduce-scatter).
        return torch.cat(
            [(F.silu(x @ gate[e].T) * (x @ up[e].T)) @ down[e].T for e, x in enumerate(rows.split(counts))]
        )


def _local(w: torch.Tensor) -> torch.Tensor:
    """The block of an expert weight this rank holds (a plain tensor is all of it); gradients flow back into the
    DTensor's own shard."""
    return w.to_local() if isinstance(w, DTensor) else w


class MoE(nn.Module):
    """Router (`router`, [E, dim]), experts, an optional dense `shared_expert`; x [b, s, dim] -> [b, s, dim].

    Each token goes to the top_k experts by score (plus `expert_bias` under balance="bias", which only
    steers the choice); their outputs are summed with the chosen scores, renormalised to 1 when top_k > 1.
    """

    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        m = cfg.moe
        if m is None:
            raise ShardlabError("MoE: model.moe is None; build the dense MLP instead")
        self.cfg = m
        self.router = nn.Linear(cfg.dim, m.n_experts, bias=False)
        self.experts = Experts(m.n_experts, cfg.dim, m.expert_ffn_dim)
        self.shared_expert = shared_expert
        if m.balance == "bias":
            self.register_buffer("expert_bias", torch.zeros(m.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        m = self.cfg
        flat = x.reshape(-1, d)
        logits = self.router(flat).float()
        scores = logits.softmax(-1) if m.score == "softmax" else logits.sigmoid()
        choose = scores + self.expert_bias if m.balance == "bias" else scores
        capacity = None
        if m.capacity_factor is not None:
            capacity = math.ceil(m.capacity_factor * flat.shape[0] * m.top_k / m.n_experts)
        if _BALANCED.get():
            chosen, slots, counts, kept = _balanced_routing(flat.shape[0], m.top_k, m.n_experts, capacity, x.device)
        else:
            chosen = choose.topk(m.top_k, dim=-1).indices  # [T, k]
            expert_of = chosen.flatten()  # slots, token-major
            order = torch.argsort(expert_of, stable=True)  # by expert, then token
            counts = torch.bincount(expert_of, minlength=m.n_experts)
            keep = torch.ones_like(order, dtype=torch.bool)
            if capacity is not None:
                starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
                keep = torch.arange(order.numel(), device=order.device) - starts < capacity
            kept = torch.bincount(expert_of[order][keep], minlength=m.n_experts)
            slots = order[keep]
        weights = scores.gather(1, chosen)
        if m.top_k > 1:  # renormalised over the chosen; one expert keeps its raw score (its only gradient path)
            weights = weights / weights.sum(-1, keepdim=True)
        token = slots // m.top_k
        out = self.experts(flat[token], kept) * weights.flatten()[slots].unsqueeze(-1).to(x.dtype)
        y = torch.zeros_like(flat).index_add(0, token, out)
        if self.shared_expert is not None:
            y = y + self.shared_expert(flat)
        record = _RECORD.get()
        if record is not None:
            normalised = scores if m.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            dropped = flat.shape[0] * m.top_k - slots.numel()
            record(self, RouterStats(counts.detach(), normalised.sum(0), flat.shape[0], dropped))
        return y.view(b, s, d)


def _balanced_routing(
    tokens: int, k: int, n_experts: int, capacity: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """`balanced_routing`'s routing: slot s = t k + j goes to expert s mod E. Returns the chosen experts [T, k], the kept
    slots by expert then token, the slots per expert (a tensor) and the kept ones (a host list: no data needed)."""
    slots_of = [len(range(e, tokens * k, n_experts)) for e in range(n_experts)]
    kept = [min(c, capacity) for c in slots_of] if capacity is not None else slots_of
    arange = torch.arange(max(tokens * k, 1), device=device)
    chosen = (arange[: tokens * k] % n_experts).view(tokens, k)
    slots = torch.cat([arange[:c] * n_experts + e for e, c in enumerate(kept)])
    return chosen, slots, torch.tensor(slots_of, device=device), kept
