"""MoE routers in the train step: the load-balancing loss over every data-parallel rank's tokens, the
auxiliary-loss-free bias update, and the routing metrics (`Routers`), for the MoE layers of `shardlab.models.llama.moe`.

The layers hold no process group and keep nothing: inside `router_stats(routers.record)` each forward hands its
statistics to the step's `Routers`, which reduces them over the ranks holding other tokens (and, inside pipeline
stages, in forward hooks as the schedule runs them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from shardlab._errors import ShardlabError
from shardlab.config import MoEConfig
from shardlab.models.llama.moe import MoE, RouterStats
from shardlab.parallel._activation_checkpoint import in_backward


class RouterTotals(NamedTuple):
    """The router statistics of one global micro batch (this micro batch of every rank holding other tokens)."""

    aux_loss: torch.Tensor
    """Summed over layers: E x sum_e(share of slots_e x mean score_e); differentiable, the same on every rank."""
    counts: torch.Tensor
    """[layers, E] token slots per expert."""
    dropped: torch.Tensor
    """Token slots dropped over capacity, summed over layers (a float64 scalar)."""
    tokens: torch.Tensor
    """Tokens of the global micro batch (a float64 scalar). Statistics stay on the device: nothing is read back to
    the host until the step reads its metrics."""


def balance(stats: list[RouterStats], cfg: MoEConfig, group: dist.ProcessGroup | None) -> RouterTotals:
    """Reduce the layers' router statistics of one forward over `group` (None: one process) into the Switch
    balancing loss.

    The score sums go through an autograd-aware all-reduce: each rank's router gets the gradient of the global
    loss, as one process holding the whole batch would (FSDP then averages what the ranks computed)."""
    counts = torch.stack([s.counts for s in stats]).to(torch.float64)
    score_sum = torch.stack([s.score_sum for s in stats])
    tokens = torch.tensor(
        [float(stats[0].tokens), float(sum(s.dropped for s in stats))], dtype=torch.float64, device=counts.device
    )
    if group is not None:
        dist.all_reduce(counts, group=group)
        dist.all_reduce(tokens, group=group)
        score_sum = funcol.all_reduce(score_sum, "sum", group)  # differentiable: backward sums the gradients
    n_tokens, dropped = tokens.unbind()
    share = counts / (n_tokens * cfg.top_k)
    mean_score = score_sum / n_tokens.to(score_sum.dtype)
    aux = (cfg.n_experts * (share.to(mean_score.dtype) * mean_score).sum(-1)).sum()
    return RouterTotals(aux_loss=aux, counts=counts.round().to(torch.long), dropped=dropped, tokens=n_tokens)


@torch.no_grad()
def update_bias(layers: list[MoE], counts: torch.Tensor) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): raise the bias of experts below the mean load, lower it above.

    counts [layers, E]: the step's token slots per expert, over the global batch (the same on every rank)."""
    for layer, load in zip(layers, counts.to(torch.float32), strict=True):
        if layer.cfg.balance == "bias":
            layer.expert_bias += layer.cfg.bias_rate * torch.sign(load.mean() - load).to(layer.expert_bias.device)


class Routers:
    """One step's router bookkeeping for the step: the balancing loss of each global micro batch,
    the step's loads for the bias update and the metrics.

    Without pipelines the step calls `loss` after each micro batch's forward and backpropagates it with the
    objective. A pipeline schedule backpropagates each stage from its output, so there (`stage_group`, the pp
    group) a forward hook on each MoE layer reduces its statistics as it runs and ties the balancing loss's
    gradient to the layer's output (`_with_balancing_grad`); `after_pipeline` reads them. The metrics sum over
    stages. The layers' forwards reach `record` inside `router_stats(routers.record)`."""

    def __init__(
        self,
        layers: list[MoE],
        group: dist.ProcessGroup | None,
        micro_batches: int,
        stage_group: dist.ProcessGroup | None = None,
        *,
        n_experts: int,
        device: torch.device,
    ) -> None:
        self.layers, self.group, self.micro_batches, self.stage_group = layers, group, micro_batches, stage_group
        self.counts = torch.zeros(len(layers), n_experts, dtype=torch.long, device=device)
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)  # the balancing loss, dropped slots
        self._stats: list[RouterStats | None] = [None] * len(layers)
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        self._history: list[list[RouterTotals]] = [[] for _ in layers]
        self._hooks = [
            layer.register_forward_hook(self._reduce_in_forward(history), prepend=True)
            for layer, history in zip(layers, self._history)
            if stage_group is not None
        ]

    def record(self, layer: MoE, stats: RouterStats) -> None:
        """A layer's routing of the forward it just ran (`shardlab.models.llama.moe.router_stats`). A recomputation
        in the backward (activation checkpointing) repeats a forward that was counted, and is left out."""
        if not in_backward():
            self._stats[self._index[id(layer)]] = stats

    def _take(self, i: int) -> RouterStats:
        stats, self._stats[i] = self._stats[i], None
        if stats is None:
            raise ShardlabError(
                "moe: a MoE layer ran no forward inside router_stats since its statistics were read; run the "
                "model's forward inside `with router_stats(routers.record):`"
            )
        return stats

    def loss(self) -> torch.Tensor | None:
        """After a micro batch's forward: what to add to its objective (aux_loss balance), else None."""
        if not self.layers:  # a pipeline stage without MoE layers (so are the other ranks of its `group`)
            return None
        b = balance([self._take(i) for i in range(len(self.layers))], self.layers[0].cfg, self.group)
        self._count(b)
        if self.layers[0].cfg.balance != "aux_loss":
            return None
        return b.aux_loss * (self.layers[0].cfg.aux_loss_coef / self.micro_batches)

    def _count(self, b: RouterTotals) -> None:
        self.counts = self.counts + b.counts.to(self.counts.device)
        aux = b.aux_loss.detach().to(torch.float64) / self.micro_batches
        self.sums = self.sums + torch.stack([aux, b.dropped]).to(self.sums.device)

    def _reduce_in_forward(self, history: list[RouterTotals]):
        """A forward hook for one MoE layer inside a pipeline stage: reduce its statistics over `group` now (every
        rank of the group runs the same schedule) and keep them; under aux_loss, give its output the loss's
        gradient. A recomputation in the backward (activation checkpointing) is skipped: its forward was counted."""
        cfg = self.layers[0].cfg
        holders = dist.get_world_size(self.group) if self.group is not None else 1

        def reduce(layer: MoE, args: object, output: torch.Tensor) -> torch.Tensor | None:
            if in_backward():
                return None
            stats = self._take(self._index[id(layer)])
            score_sum = stats.score_sum
            with torch.no_grad():
                b = balance([stats], cfg, self.group)
            history.append(b)
            if cfg.balance != "aux_loss":
                return None
            # d aux / d (global score sum) = E x share_e / tokens; the loss is the global micro batch's, so each of
            # the `holders` ranks backpropagates all of it into its own score sum (FSDP then averages them).
            tokens = b.tokens.to(score_sum.dtype)
            share = b.counts[0].to(score_sum.dtype) / (tokens * cfg.top_k)
            weight = share * (cfg.n_experts / tokens * holders * cfg.aux_loss_coef / self.micro_batches)
            return _with_balancing_grad(output, score_sum, weight)

        return reduce

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def after_pipeline(self) -> None:
        """After a pipeline schedule ran every micro batch: count their statistics (the last `micro_batches`
        forwards of each layer: torch's first step also runs one to infer the stages' shapes)."""
        self.remove_hooks()
        m = self.micro_batches
        if any(len(h) < m for h in self._history):
            raise ShardlabError(f"moe: a MoE layer ran fewer than the pipeline's {m} micro batches this step")
        for history in self._history:
            for b in history[-m:]:
                self._count(b)

    def update_bias(self) -> None:
        update_bias(self.layers, self.counts)

    def summary(self) -> torch.Tensor:
        """The step's router metrics on the device, one float64 vector (`metrics` names them): the balancing
        loss, dropped slots, max load, then tokens per expert; reduced over stages. The step reads it from the
        host together with its loss, in one read."""
        counts = self.counts.to(torch.float64)
        tokens = counts.sum(0)
        sums = self.sums.clone()
        load = counts.max(-1).values / counts.mean(-1)
        max_load = (load.max() if len(load) else torch.zeros((), dtype=torch.float64, device=counts.device)).reshape(1)
        if self.stage_group is not None:
            dist.all_reduce(tokens, group=self.stage_group)
            dist.all_reduce(sums, group=self.stage_group)
            dist.all_reduce(max_load, op=dist.ReduceOp.MAX, group=self.stage_group)
        return torch.cat([sums, max_load, tokens])

    @staticmethod
    def metrics(summary: list[float]) -> dict[str, float | list[int]]:
        """`summary`, read: moe_aux_loss (summed over layers, whether or not it is trained on), dropped token slots,
        the busiest expert's load over the mean (worst layer), and tokens per expert summed over layers (and
        stages)."""
        aux, dropped, max_load, *tokens = summary
        return {
            "moe_aux_loss": aux,
            "moe_dropped": dropped,
            "moe_max_load": max_load,
            "moe_tokens_per_expert": [round(t) for t in tokens],
        }


class _WithBalancingGrad(torch.autograd.Function):
    """Identity on a layer's output whose backward also sends `weight` (a constant) into `score_sum`: a linear loss
    term, weight . score_sum, backpropagated with the output. It keeps nothing for the backward but `weight`, so a
    checkpointed block's recomputation, which skips it, still lines up."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, score_sum: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, ctx.weight, None


def _with_balancing_grad(output: torch.Tensor, score_sum: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _WithBalancingGrad.apply(output, score_sum, weight)
