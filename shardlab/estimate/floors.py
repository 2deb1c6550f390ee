"""Floors: what a layout's estimated step time and peak memory are at least, from its shape alone (no plan, no probe).

The search (`shardlab.estimate.search`) estimates layouts lowest floor first and stops where the next floor is above
the K-th fastest layout that fits: no layout left can then enter the top K, so the ranking is the exhaustive one.
That holds only if each floor is at most what the estimate gives, term by term:
- compute: the blocks' matmul FLOPs (forward and backward; the forward again under full checkpointing up to the last
  tensor the backward needs, where torch's checkpoint stops, in every ac_every-th block under selective, every other
  matmul of a block under op-level checkpointing), each rank's share being 1 / (tp x cp) of them, at the device's best
  matmul rate (its FP8 peak under plan.fp8, and FSDP's gathers at a byte per weight under tensorwise FP8), and the
  output layer's where the rank runs it. With a pipeline the estimate prices the busiest pp rank and the one holding
  the last stage: where the stages split by blocks (the default), both as the plan splits them (a V-shaped schedule
  puts the output layer on the first rank, beside the first stage), else a rank of at least ceil(L / pp) blocks and
  one computing at least the average. Plus the traffic of the ops without FLOPs (norms, activations, residual adds,
  rotary, copies, the loss), each its own kernel in eager PyTorch and priced by its bytes at the device's best
  bandwidth: counted per row of a micro batch (what grows with the rows; what does not is dropped) on fake CPU tensors
  as the probe runs them (`step.forward_backward`), on one rank with the parameters in param_dtype (as FSDP's mixed
  precision computes), with the blocks checkpointed as the layout's (op or full; a recomputed block under selective as
  under full), and taken at 1 / (tp x cp) on the rank. Each such op of one rank has its counterpart on every layout's
  rank, on its share of the tokens, heads or hidden units; a layout's own ops (casts, redistributions) only add. Two
  of them are counted: what tp, cp and ep add on a rank, counted once at size 2 with 2 and 3 rows for every layout of
  2 rows or more (`Block.tp_memory_bytes`, `Block.cp_memory_bytes`, `Block.ep_memory_bytes`) and with one row for
  those of one (tp's taken to shrink as 1 / tp there), and FSDP's copies of the blocks' weights into and out of the
  gathered buffer at each gather and of their gradients into the reduced one (per step with a pipeline); and the adds
  accumulating the micro batches' gradients, as the estimate counts them (under a pipeline with FSDP each held block's
  unsharded gradients, added in reduce_dtype at every micro batch after the first: for 405B on 4,096 ranks over 256
  micro batches a fifth of a pipeline rank's step). For shardlab's Llama, attention too: the probe counts SDPA's
  causal kernel as half the square and its backward as 2.5 forwards, where the meta model's math kernel computes the
  whole square and 2 (a masked one, as under cp, as the whole square), so the forward at half of the math kernel's
  FLOPs and forward and backward at 7/12 (twice that under CP, whose attention masks by position: the probe counts the
  whole square); other models' attention as the fake runs count the kernels the probe sees (CPU's fused attention;
  a kernel the probe does not count, none), the same under cp (at most the whole square the probe counts there).
- TP's, CP's and EP's collectives, and the pipeline's sends, on the critical path (`comm_floors`).
- FSDP: the rank's block weights gathered in param_dtype and their gradients reduce-scattered in reduce_dtype, over
  dp_shard x cp at that group's bandwidth (experts' split over ep and at most tp, over the expert mesh's
  dp_shard_mod_ep), as often as the estimate runs them (`Floors.fsdp_runs`: with a pipeline and resharding after
  forward, once per micro batch and once more, whatever the schedule).
  On ranks that time-share cores, the compute of the busiest rank and of the one holding the last stage are
  combined as the estimate combines them (`roofline.shared_compute`).
  The step is at least the larger of compute and FSDP (the roofline overlaps them) plus the collectives on the
  critical path, stretched by the pipeline's bubble as `roofline.step_time` stretches it, plus AdamW's step over at
  least the model's parameters split every way the layout shards them.
- memory: parameters, gradients (or activations, if larger, where the forward runs without gradients:
  `peak.beside_state`) and two AdamW moments, split at most dp_shard x cp x tp x pp ways, and under a pipeline with
  FSDP the held blocks' unsharded weights and gradients (`fsdp_buffer_bytes`). Plus the activations (`activations`):
  what a block's forward leaves alive for each row of a micro batch with the layout's checkpointing (none, op or full;
  selective checkpoints every ac_every-th block whole), counted on fake CPU tensors as the probe counts them, in
  param_dtype on one rank, and taken at 1 / (tp x cp) on the rank: each tensor the forward keeps there is its
  counterpart's share of the tokens, heads or hidden units, or whole; under TP with sequence parallelism the blocks
  of a model split as Megatron does (`ModelProvider.tp_reduced_dim`) also keep their attention's (and dense MLP's)
  input gathered whole over tp. The busiest pp rank holds at least ceil(L / pp) blocks, and at its peak the
  activations of the micro batches its schedule keeps in flight (`pipeline.in_flight`, one without a pipeline).
A block's numbers are counted once per search, as the difference of meta models of 2 and 1 blocks. Experts route
every token evenly there, as in the probe (shardlab's MoE: `balanced_routing`), so each rank computes its tokens' share
of their work wherever ep puts them; FSDP's floor counts the experts apart (`Block.expert_params`). A model whose
experts route by data (transformers' MoE layers) cannot run on meta tensors and gets no compute, FSDP or activation
floor. A recipe's own rules may checkpoint other modules than the model's blocks: what op-level and full checkpointing
keep or recompute is then not counted."""

from __future__ import annotations

from functools import cache, partial
from typing import NamedTuple

import msgspec
import torch

from shardlab._base import Frozen
from shardlab.config import Config, MeshSpec
from shardlab.estimate.block_counts import Block, count_block
from shardlab.estimate.comm_floors import exposed_seconds, gathered_bytes, pp_seconds
from shardlab.estimate.device import Device
from shardlab.estimate.layouts import Layout, uses_fsdp
from shardlab.estimate.peak import beside_state
from shardlab.estimate.probe_store import ProbeStore
from shardlab.estimate.roofline import (
    ADAM_BYTES_PER_PARAM,
    DTYPE_BYTES,
    GPUS_PER_NODE,
    axis_bandwidth,
    shared_compute,
    shared_pipeline_factor,
)
from shardlab.models.provider import ModelProvider
from shardlab.sharding.pipeline import bubble_fraction, in_flight, split_stages, stage_ranks


class _Rank(NamedTuple):
    """A pp rank as the floors count it."""

    blocks: int
    recomputed: int
    """Of its blocks, those whose forward runs again (checkpointed whole)."""
    head: bool | None
    """Whether it runs the output layer (None: not known, the split is not by blocks alone)."""


@cache
def _split_ranks(n_layers: int, pp: int, v: int, schedule: str | None, ac: str, k: int) -> tuple[_Rank, ...]:
    """`Floors._ranks` of stages split evenly by blocks, as the plan splits them: the busiest pp rank (the most
    blocks, the lowest such rank) and the one holding the last stage. Cached: a search asks once per layout, and
    a few hundred splits serve its tens of thousands of layouts."""
    starts = (*split_stages([1.0] * n_layers, 0.0, 0.0, pp * v), n_layers)
    owner = stage_ranks(pp, v, schedule)
    blocks = [[i for s, r in enumerate(owner) if r == rank for i in range(starts[s], starts[s + 1])]
              for rank in range(pp)]  # fmt: skip
    recomputed = [len(b) if ac == "full" else sum(i % k == 0 for i in b) if ac == "selective" else 0
                  for b in blocks]  # fmt: skip
    busiest = max(range(pp), key=lambda r: (len(blocks[r]), -r))
    return tuple(_Rank(len(blocks[r]), recomputed[r], r == owner[-1]) for r in dict.fromkeys((busiest, owner[-1])))


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def state_at_least(param_bytes: int, mesh: MeshSpec) -> int:
    """Bytes of a rank's parameters, gradients and AdamW's moments at least: the model's `param_bytes` taken as fp32,
    split at most dp_shard x cp x tp x pp ways (`Floors.memory`'s first term, known before any block is counted)."""
    return 4 * param_bytes // (mesh.dp_shard * mesh.cp * mesh.tp * mesh.pp)


class Floors(Frozen):
    """What every layout of one model, batch and device needs at least (`time`, `memory`)."""

    block: Block | None
    """None: no compute or FSDP floor (a model whose blocks could not be counted on meta tensors)."""
    tp_dim: int
    """The residual stream's width whose reductions tp pays per block and token (0: no TP floor)."""
    param_bytes: int
    """All parameters in their stored dtype (fp32 master weights)."""
    param_numel: int
    n_layers: int
    rate: float
    """The device's best matmul FLOP/s: its peak at the highest efficiency any of its kernels reach."""
    bandwidth: float = 0.0
    """The device's best memory bandwidth (bytes/s) for ops without FLOPs (0: no such floor)."""
    kv_dim: int = 0
    """The width of K (and of V) that cp gathers per block and token (0: no CP floor)."""
    expert_rows: float = 0.0
    """Rows of the residual stream each token sends to its experts and back per block (top_k, fewer under a
    capacity; 0: no EP floor)."""
    stage_dim: int = 0
    """The residual stream's width, which pipeline stages send each other (0: no floor for the sends)."""

    @classmethod
    def of(
        cls,
        cfg: Config,
        provider: ModelProvider,
        model: torch.nn.Module,
        dev: Device,
        own_rules: bool,
        store: ProbeStore | None = None,
        blocks: dict[tuple[int, bytes, bool, tuple[str, ...]], Block | None] | None = None,
        splits: tuple[str, ...] = (),
    ) -> Floors:
        """own_rules: the recipe lays the model out by rules of its own (no TP floor: they may shard otherwise);
        splits: the axes (tp, cp) over which some layout to be floored splits the blocks, whose extra traffic on a
        rank is counted (`Block.tp_memory_bytes`; an axis left out counts 0 there, still a floor);
        store: where the block counts are kept between searches, with the probes (None: counted here); blocks: the
        caller's cache of this provider's block counts, filled here (as `search`'s probes: searches of one model
        share it), so that nothing is kept on the provider, which may be a user's own class."""
        param_bytes = model_bytes(model)
        param_numel = sum(p.numel() for p in model.parameters())
        best, best_memory = dev.matmul_efficiency, dev.hbm_efficiency
        if dev.kernels is not None:
            best = max(e for curve in (dev.kernels.matmul, dev.kernels.attention) for _, e in curve)
            best_memory = max(e for _, e in dev.kernels.memory)
        counted = {} if blocks is None else blocks
        key = (cfg.train.seq_len, msgspec.json.encode(cfg.plan), own_rules, splits)
        if key not in counted:
            count = partial(count_block, provider, cfg.train.seq_len, cfg.plan, own_rules, cfg, splits)
            counted[key] = count() if store is None else store.block(cfg.train.seq_len, cfg.plan, own_rules, splits,
                                                                      count)  # fmt: skip
        block = counted[key]
        own = block is not None and not own_rules  # the provider's rules lay the blocks out, as it says
        moe = provider.moe if own else None  # shardlab's MoE alone: None for every other model
        expert_rows = moe.top_k * min(1.0, moe.capacity_factor or 1.0) if moe is not None else 0.0
        tp_dim, kv_dim = (provider.tp_reduced_dim, provider.kv_dim) if own else (0, 0)
        return cls(block=block, tp_dim=tp_dim, kv_dim=kv_dim, expert_rows=expert_rows,
                   param_bytes=param_bytes, param_numel=param_numel, stage_dim=provider.dim,
                   n_layers=provider.n_layers, rate=_matmul_peak(cfg, dev) * best,
                   bandwidth=dev.hbm_tb_s * 1e12 * best_memory)  # fmt: skip

    def time(self, cfg: Config, layout: Layout, dev: Device, compute: float = 0.0, comm: float = 0.0) -> float:
        """Seconds per step the estimate of `layout` gives at least: `busy` stretched by the pipeline's bubble, then
        the optimizer step (`optimizer_seconds`). compute, comm: what the busiest rank's blocks compute and its tp, cp
        and ep collectives take per step at least, known otherwise (the search's, from an estimated block)."""
        busy, m = self.busy(cfg, layout, dev, compute, comm), layout.mesh
        if m.pp > 1:
            bubble = bubble_fraction(layout.pp_schedule, m.pp, layout.pp_stages_per_rank, layout.micro_batches)
            if dev.busy_speed:
                busy *= shared_pipeline_factor(dev.busy_speed, m.pp, m.world_size // m.pp, bubble)
            else:
                busy /= 1 - bubble
        return busy + self.optimizer_seconds(layout, dev)

    def optimizer_seconds(self, layout: Layout, dev: Device) -> float:
        """Seconds AdamW's step takes at least, as the roofline prices it: over the rank's parameters, at least the
        model's (taken as fp32) split dp_shard x cp x tp x pp ways."""
        m = layout.mesh
        params = self.param_bytes / 4 / (m.dp_shard * m.cp * m.tp * m.pp)
        return params * ADAM_BYTES_PER_PARAM / (dev.hbm_tb_s * 1e12 * dev.hbm_efficiency)

    def busy(self, cfg: Config, layout: Layout, dev: Device, compute: float = 0.0, comm: float = 0.0) -> float:
        """Seconds per step the rank computes and communicates at least, without the pipeline's bubble: the larger of
        its compute and FSDP's collectives (the roofline overlaps them), then its tp, cp and ep collectives (compute,
        comm: at least these, as `time`)."""
        m = layout.mesh
        if self.block is None:
            return compute + comm
        ranks = self._ranks(cfg, layout)
        seconds = [self._compute_seconds(cfg, layout, rank) for rank in ranks]
        if compute:  # beyond what the floor counts of the busiest rank's blocks
            seconds[0] += max(compute - self._compute_seconds(cfg, layout, ranks[0]._replace(head=False)), 0.0)
        compute = max(seconds)
        if dev.busy_speed and len(seconds) == 2:  # as the estimate paces ranks that time-share cores
            compute = shared_compute(*seconds, m.pp, m.world_size // m.pp, dev.busy_speed)
        exposed = max(exposed_seconds(self, cfg, layout, dev), comm) + pp_seconds(self, cfg, layout, dev)
        return max(compute, self.fsdp_seconds(cfg, layout, dev)) + exposed

    def _compute_seconds(self, cfg: Config, layout: Layout, rank: _Rank) -> float:
        """Seconds one pp rank computes per step at least: its FLOPs (`flops`) at the best rate and its ops without
        FLOPs (`memory_seconds`)."""
        return self.flops(cfg, layout, rank) / self.rate + self.memory_seconds(cfg, layout, rank)

    def flops(self, cfg: Config, layout: Layout, rank: _Rank | None = None) -> float:
        """FLOPs a pp rank computes per step at least (default: the busiest, as `_ranks` gives it): its blocks'
        matmuls and attention, what its checkpointing recomputes, and the output layer's where it runs it."""
        m, b = layout.mesh, self.block
        if b is None:
            return 0.0
        rank = rank or self._ranks(cfg, layout)[0]
        masked = 2 if m.cp > 1 and self.kv_dim and b.attention_causal else 1  # CP's masks by position: the square
        flops = rank.blocks * (b.train_flops + masked * b.attention_flops) + rank.recomputed * (
            b.recompute_flops + masked * b.attention_forward_flops
        )
        if layout.activation_checkpoint == "op":
            flops += rank.blocks * b.op_recompute_flops
        if rank.head is None:  # the estimate prices the busiest rank and the one running the output layer: neither
            flops = max(flops, (self.n_layers * (b.train_flops + masked * b.attention_flops) + b.head_flops) / m.pp)
        elif rank.head:
            flops += b.head_flops
        tokens = cfg.train.global_batch // m.size("dp") * cfg.train.seq_len // m.cp
        return tokens * flops / m.tp

    def _ranks(self, cfg: Config, layout: Layout) -> tuple[_Rank, ...]:
        """The pp ranks whose compute the estimate prices: without a pipeline the one rank; with one whose stages split
        evenly by blocks (plan.pp_balance "blocks", no pp_split), exactly as the plan splits them, the busiest rank
        (the most blocks, the lowest such rank) and the one holding the last stage (which also runs the output
        layer); otherwise a rank of ceil(L / pp) blocks, at least the average rank's compute."""
        m = layout.mesh
        if m.pp == 1:
            return (_Rank(self.n_layers, self.recomputed(cfg, layout), True),)
        if cfg.plan.pp_balance != "blocks" or cfg.plan.pp_split:
            return (_Rank(self.held_blocks(m.pp), self.recomputed(cfg, layout), None),)
        return _split_ranks(self.n_layers, m.pp, layout.pp_stages_per_rank, layout.pp_schedule,
                            layout.activation_checkpoint, cfg.plan.ac_every)  # fmt: skip

    def fsdp_seconds(self, cfg: Config, layout: Layout, dev: Device) -> float:
        """Seconds per step FSDP's gathers of the held blocks' weights and reductions of their gradients take at
        least (part of `busy`, overlapped with compute as the roofline does)."""
        m, shards = layout.mesh, layout.mesh.dp_shard * layout.mesh.cp
        if self.block is None or shards == 1:
            return 0.0
        gathers, reductions = self.fsdp_runs(layout)
        per_weight = gathers * gathered_bytes(cfg) + reductions * DTYPE_BYTES[cfg.plan.reduce_dtype]
        weights = self.held_blocks(m.pp) * self.block.params / m.tp
        bandwidth = (dev.nvlink_gb_s if shards * m.tp <= GPUS_PER_NODE else dev.network_gb_s) * 1e9
        dense = weights * per_weight * (shards - 1) / shards / bandwidth
        if not self.block.expert_params:
            return dense
        experts, groups = self.held_blocks(m.pp) * self.block.expert_params / (m.ep * m.tp), m.experts.dp_shard_mod_ep
        moved = experts * per_weight * (groups - 1) / groups  # over the expert mesh's FSDP axis (none where it is 1)
        return dense + moved / axis_bandwidth(m, "dp_shard_mod_ep", dev)

    @staticmethod
    def fsdp_runs(layout: Layout) -> tuple[int, int]:
        """How often per step FSDP all-gathers each block's weights and reduce-scatters its gradients, as the
        estimate counts them. Without a pipeline: in each micro batch's forward, and again in its backward where the
        weights are resharded after forward; its gradients in each. With one, torch's schedule reduces once, at the
        last backward, and a stage's backward leaves its weights gathered; they are gathered before its first
        action and, where resharded after forward, after each of its m forwards (the action after one, a forward or
        a backward, finds them sharded), whatever the schedule: m + 1 times, else once."""
        m, again = layout.micro_batches, layout.reshard_after_forward
        if layout.mesh.pp == 1:
            return m * (2 if again else 1), m
        return m + 1 if again else 1, 1

    def held_blocks(self, pp: int) -> int:
        """Blocks the busiest pp rank holds: at least ceil(L / pp)."""
        return -(-self.n_layers // pp)

    def recomputed(self, cfg: Config, layout: Layout) -> int:
        """Blocks whose forward runs again at least: every held one under full checkpointing; under selective, those
        whose index in the whole model is a multiple of ac_every, of which each of the busiest rank's stages (v
        runs of consecutive blocks, ceil(L / pp) in all) holds at least (its blocks - ac_every + 1) / ac_every;
        none counted otherwise (op-level checkpointing recomputes part of a block: `Block.op_recompute_flops`)."""
        ac, pp, k = layout.activation_checkpoint, layout.mesh.pp, cfg.plan.ac_every
        if ac == "full":
            return self.held_blocks(pp)
        if ac != "selective":
            return 0
        if pp == 1:
            return -(-self.n_layers // k)
        v = layout.pp_stages_per_rank
        return max(0, -(-(self.held_blocks(pp) - v * (k - 1)) // k))

    def memory_seconds(self, cfg: Config, layout: Layout, rank: _Rank | None = None) -> float:
        """Seconds per step the ops without FLOPs take at least on a pp rank (part of `time`; default: the busiest,
        as `_ranks` gives it): its blocks', and those outside them where it runs the output layer."""
        m, b = layout.mesh, self.block
        if b is None or not self.bandwidth:
            return 0.0
        rank = rank or self._ranks(cfg, layout)[0]
        rows = cfg.train.global_batch // m.size("dp")  # over every micro batch
        tokens = rows * cfg.train.seq_len // m.cp
        again = dict(b.recompute_memory_bytes)  # what recomputation adds per block: op-level, or blocks run again whole
        extra = (rank.blocks * again.get("op", 0.0) if layout.activation_checkpoint == "op"
                 else rank.recomputed * again.get("full", b.memory_forward_bytes))  # fmt: skip
        moved = rank.blocks * b.memory_bytes + extra + (b.head_memory_bytes if rank.head else 0.0)
        one = rows // layout.micro_batches == 1  # what tp, cp, ep add on a rank; at one row tp 2's shrinks as 1 / tp
        tp = b.tp_one_row_memory_bytes * 2 if one else b.tp_memory_bytes * m.tp
        cp = b.cp_one_row_memory_bytes if one else b.cp_memory_bytes
        ep = b.ep_one_row_memory_bytes if one else b.ep_memory_bytes
        moved += rank.blocks * (tp * (m.tp > 1) + cp * (m.cp > 1) + ep * (m.ep > 1))
        copies = 0.0
        if m.size("batch") > 1 and uses_fsdp(cfg, m):
            # FSDP copies each block's gradients into the buffer it reduces (read in param_dtype, written in
            # reduce_dtype); where it shards them, at each gather (`fsdp_runs`; per step at least with a pipeline)
            # its shard into a buffer the gathered block's size, then the block out of it (read and written)
            param, reduce = gathered_bytes(cfg), DTYPE_BYTES[cfg.plan.reduce_dtype]
            gathers, reductions = self.fsdp_runs(layout) if m.pp == 1 else (1, 1)
            per_gather = 3 * param  # where tp's one-row count holds the weights' own traffic, the copies out of
            if one and m.tp > 1 and not b.tp_one_row_without_weights:  # the buffer alone, once per micro batch
                gathers, per_gather = reductions, 2 * param
            gathered = gathers * per_gather if m.dp_shard * m.cp > 1 else 0
            copies = rank.blocks * b.params / m.tp * (gathered + reductions * (param + reduce))
        return (tokens * moved / m.tp + copies + self.accumulated_bytes(cfg, layout, rank)) / self.bandwidth

    def accumulated_bytes(self, cfg: Config, layout: Layout, rank: _Rank) -> float:
        """Bytes the adds accumulating the micro batches' gradients move per step on pp rank `rank` at least, as the
        estimate counts them (`estimate._accumulation`): under a pipeline with FSDP, its blocks' gradients unsharded
        (split over tp, the experts' over ep x tp, at most), cast to reduce_dtype at the first micro batch and added
        at each later one; else each later micro batch's gradients added to the last ones, the rank's share of the
        stored parameters' bytes (split at most dp_shard x cp x tp x pp ways, or its blocks' under a pipeline)."""
        m, micro, b = layout.mesh, layout.micro_batches, self.block
        if micro == 1 or b is None:
            return 0.0
        numel = rank.blocks * (b.params / m.tp + b.expert_params / (m.ep * m.tp))
        if m.pp > 1 and uses_fsdp(cfg, m):
            param, reduce = DTYPE_BYTES[cfg.plan.param_dtype], DTYPE_BYTES[cfg.plan.reduce_dtype]
            if param != reduce:
                return numel * (param + reduce) + (micro - 1) * numel * (2 * reduce + param)
            return (micro - 1) * 3 * numel * param
        if m.pp > 1:
            return (micro - 1) * 3 * numel * self.param_bytes / self.param_numel
        return (micro - 1) * 3 * self.param_bytes / (m.dp_shard * m.cp * m.tp)

    def memory(self, cfg: Config, layout: Layout) -> int:
        """Bytes at the peak of `layout` (the estimate's) at least: what its plan fixes (state, a quarter of it
        gradients, and FSDP buffers, `estimate.search`'s `state`) and `activations` (`peak.beside_state`)."""
        m = layout.mesh
        state = state_at_least(self.param_bytes, m)
        if m.pp == 1 or not uses_fsdp(cfg, m) or self.block is None:
            return beside_state((state, state // 4), self.activations(cfg, layout), layout.forward_without_grads)
        held = self.held_blocks(m.pp) * self.block.params // m.tp
        buffers = held * (DTYPE_BYTES[cfg.plan.param_dtype] + DTYPE_BYTES[cfg.plan.reduce_dtype])
        return state + buffers + self.activations(cfg, layout)

    def activations(self, cfg: Config, layout: Layout) -> int:
        """Bytes the blocks' forwards leave alive at the peak of the busiest rank at least: the micro batches in
        flight there, each through at least ceil(L / pp) blocks (`micro_batch_activations`)."""
        m, micro = layout.mesh, layout.micro_batches
        held = in_flight(layout.pp_schedule, m.pp, layout.pp_stages_per_rank, micro) if m.pp > 1 else 1.0
        return int(held * self.micro_batch_activations(cfg, layout))

    def micro_batch_activations(self, cfg: Config, layout: Layout) -> float:
        """Bytes the blocks' forwards of one micro batch leave alive on the busiest rank at least (SP's gathered inputs:
        kept by their linears or op-level's policy; none in op's count on one rank, the norms' outputs in none's)."""
        if self.block is None or not self.block.kept:
            return 0.0
        m, kept = layout.mesh, dict(self.block.kept)
        blocks, ac = self.held_blocks(m.pp), layout.activation_checkpoint
        whole = -(-blocks // cfg.plan.ac_every) if ac == "selective" else blocks * (ac == "full")  # at most so many
        per_token = (blocks - whole) * kept.get("op" if ac == "op" else "none", 0.0) + whole * kept.get("full", 0.0)
        sp = m.tp > 1 and self.tp_dim and cfg.plan.sequence_parallel  # checkpointed whole: one in ac_every, selective
        share = (1.0 if ac == "op" else 1 - 1 / m.tp) if sp else 0.0
        gathered = (1 if self.expert_rows else 2) * self.tp_dim * gathered_bytes(cfg) * share * (blocks - whole)
        tokens = cfg.train.global_batch // m.size("dp") // layout.micro_batches * cfg.train.seq_len // m.cp
        return tokens * (per_token / m.tp + gathered)


def _matmul_peak(cfg: Config, dev: Device) -> float:
    """The device's fastest matmul FLOP/s the layout's linears may run at: its FP8 peak under plan.fp8."""
    if cfg.plan.fp8 != "none" and dev.fp8_tflops is not None:
        return max(dev.bf16_tflops, dev.fp8_tflops) * 1e12
    return dev.bf16_tflops * 1e12
