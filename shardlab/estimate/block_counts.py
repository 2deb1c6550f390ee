"""A model's block counted on meta and fake tensors, per token: its matmul FLOPs, the bytes its ops without FLOPs move,
what its forward leaves alive under each checkpointing mode, and the parameters FSDP gathers whole (`Block`).

The floors (`shardlab.estimate.floors`) are arithmetic on these numbers. Each is the difference of models of 2 and
1 blocks (and of 2 and 1 rows where it grows with the rows), so what the rest of the model holds drops out. A model
that cannot run on meta or fake tensors (`CANNOT_RUN`) leaves that number 0: a floor stays a lower bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import msgspec
import torch
from torch.utils.flop_counter import FlopCounterMode

from shardlab._base import Frozen
from shardlab.config import Config, PlanConfig
from shardlab.estimate._fake import fake_tensors
from shardlab.estimate._forked import run_forked
from shardlab.estimate.probe import measure
from shardlab.estimate.recorder import Recorder, param_storages
from shardlab.models.llama.moe import balanced_routing, moe_layers
from shardlab.models.llama.provider import LlamaProvider
from shardlab.models.provider import ModelProvider, check_layout
from shardlab.parallel.apply import apply
from shardlab.sharding.mesh import MeshSpec
from shardlab.sharding.plan import make_plan
from shardlab.training.loss import chunks_counted_by
from shardlab.training.step import forward_backward

MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm)
"""The ops counted: every projection of a block runs as one of them (attention's and experts' batched ones don't)."""
CANNOT_RUN = (RuntimeError, NotImplementedError)
"""What a model raises where it cannot run on meta or fake tensors (an op without a meta kernel, data-dependent
control flow; fake tensors' own errors are RuntimeErrors): that floor term is then 0, still a lower bound. Any other
error is a bug in the model or here, and is raised."""
T = TypeVar("T")


class Block(Frozen):
    """One block of the model, per token of one sequence."""

    train_flops: float
    """Matmul FLOPs of its forward and backward (attention's batched matmuls not included)."""
    attention_flops: float
    """What the probe counts at least for its attention, forward and backward (0: not counted)."""
    attention_forward_flops: float
    params: int
    """Its parameters that FSDP gathers whole (numel): all but experts."""
    attention_causal: bool = False
    """Whether the attention FLOPs count half the square, as the probe counts a causal kernel (shardlab's Llama's):
    under cp, whose attention masks by position, the probe counts the whole square, twice that. Else they count
    what the fake runs' kernels compute, at most the whole square."""
    expert_params: int = 0
    """Its experts' parameters (numel): split over ep (and at most tp), FSDP gathers them over the expert mesh's
    dp_shard_mod_ep."""
    memory_bytes: float = 0.0
    """Bytes its ops without FLOPs read and write per token, forward and backward, in param_dtype on one rank."""
    memory_forward_bytes: float = 0.0
    kept: tuple[tuple[str, float], ...] = ()
    """Bytes its forward leaves alive per token, in param_dtype on one rank, per checkpointing mode counted ("none",
    and "op" and "full" where the model's blocks are the ones checkpointed); a mode not counted keeps 0 at least."""
    recompute_memory_bytes: tuple[tuple[str, float], ...] = ()
    """Bytes per token its ops without FLOPs move beyond memory_bytes when it is checkpointed, per mode counted
    ("op", "full"; as `kept`): what the backward's recomputation reads and writes. A mode not counted adds
    memory_forward_bytes under full checkpointing (the forward's ops, again), 0 otherwise."""
    head_flops: float = 0.0
    """Matmul FLOPs per token outside the blocks (the output layer), forward and backward."""
    op_recompute_flops: float = 0.0
    """Matmul FLOPs per token op-level checkpointing recomputes in its backward (every other of its matmuls)."""
    recompute_flops: float = 0.0
    """Matmul FLOPs per token the backward of the block checkpointed whole recomputes: its forward's up to the last
    tensor the backward needs (torch's checkpoint stops there: not the block's last projection). 0: not counted (the
    recipe's own rules may checkpoint other modules)."""
    head_memory_bytes: float = 0.0
    """Bytes the ops without FLOPs outside the blocks (final norm, output, loss) move per token, forward and
    backward, in param_dtype on one rank."""
    tp_memory_bytes: float = 0.0
    """Bytes per token of a tp rank's tokens its ops without FLOPs move beyond memory_bytes / tp, counted at tp 2
    with 2 and 3 rows per micro batch (0: not counted): what tensor parallelism adds on each rank with 2 rows or
    more, at least as much at any larger tp (ops left whole outside the sharded regions grow as 1 - 1 / tp of the
    block's; sequence parallelism's gathers and scatters rearrange the rank's whole tokens, which one row gathers
    as a view)."""
    tp_one_row_memory_bytes: float = 0.0
    """The same at one row per micro batch (its gathers take other paths), counted at tp 2 with one row; where the
    model has experts, less what does not grow with the rows there (the weights' own traffic, every expert whole)."""
    tp_one_row_without_weights: bool = False
    """Whether tp_one_row_memory_bytes leaves the weights' own traffic out (where the model has experts). Where it
    holds it (dense weights, split as tp splits them, on a rank without FSDP), the floor counts FSDP's copies at one
    row under tp as the copies out of its buffer alone, so as not to count that traffic twice."""
    cp_memory_bytes: float = 0.0
    """The same for context parallelism, per token of a cp rank's tokens, counted at cp 2 (0: not counted): what
    it moves on each rank beyond its share (K and V gathered whole, among others), at least as much at any larger cp
    per token of the rank (whole-sequence work over fewer tokens)."""
    cp_one_row_memory_bytes: float = 0.0
    """The same at one row per micro batch, counted at cp 2 with one row, less what does not grow with the rows there
    (the weights' own traffic, FSDP's over cp's two ranks)."""
    ep_memory_bytes: float = 0.0
    """Bytes per token of a rank's tokens its ops without FLOPs move beyond memory_bytes under expert parallelism,
    counted at ep 2 of dp_shard 2 with 2 and 3 rows (0: not counted): dispatching its tokens to the experts' ranks
    and back (sorting them by expert, packing and unpacking the all-to-alls' buffers), work over the rank's own
    tokens, as much at any larger ep (the same at ep 4 for Mixtral 8x7B)."""
    ep_one_row_memory_bytes: float = 0.0
    """The same at one row per micro batch: ep_memory_bytes where ep 2's block moves at one row what the line through
    2 and 3 rows gives, and no less than its slope (what the rank's experts' weights add does not grow with the
    rows, and shrinks at a larger ep); else 0."""


def count_block(
    provider: ModelProvider,
    seq_len: int,
    options: PlanConfig,
    own_rules: bool,
    cfg: Config | None = None,
    splits: tuple[str, ...] = (),
) -> Block | None:
    """One block's numbers: models of 2 and 1 blocks, one sequence each, counted by torch's FlopCounterMode;
    its memory-bound ops and what its forward keeps alive, per row (`_per_row`). own_rules: the recipe's rules may
    checkpoint other modules than the model's blocks (only what no checkpointing keeps is counted). splits: the
    axes (tp, cp, ep) some layout searched splits the blocks over, whose rank 0 at size 2 in `cfg` (a config of the
    model under its plan `options`) is probed for what each adds to the traffic (none under own rules; tp not where
    the model cannot split in 2, ep not without an even number of experts): 6 runs each (1 and 2 blocks at 1, 2 and
    3 rows), left out where no layout needs them. The counts are independent runs, side by side on the cores
    (`run_forked`) in one batch, so no core waits for another's last run before the next; a count's two runs (1 and
    2 blocks) go to one core, in turn (`_in_turn`)."""
    modes = () if own_rules else ("op", "full")
    calls: dict[tuple, partial] = {}
    for ac in (None, *modes):  # the FLOPs, and what op-level and full checkpointing recompute
        calls |= {("flops", n, ac): partial(_count, provider.with_layers(n), seq_len, options, ac) for n in (1, 2)}
    even = all(size % 2 == 0 for size in provider.tp_divisors().values())
    moe = provider.moe is not None and provider.moe.n_experts % 2 == 0
    splits = () if own_rules else tuple(a for a in splits if a == "cp" or (a == "tp" and even) or (a == "ep" and moe))
    if splits and cfg is None:
        raise ValueError("count_block: the traffic tp, cp and ep add needs the config they split (cfg)")
    for n, rows in PER_ROW:
        calls["memory", n, rows] = partial(_memory_bytes, provider.with_layers(n), seq_len, rows, options)
        for axis in splits:  # at 2 and 3 rows: one row takes other paths (SP's gather of one sequence is a view)
            calls[axis, n, rows + 1] = partial(_split_traffic, provider.with_layers(n), cfg, rows + 1, axis)
        calls |= {(ac, n, rows): partial(_memory_bytes, provider.with_layers(n), seq_len, rows, options, ac)
                  for ac in modes}  # fmt: skip
    for axis in splits:  # and at one row
        calls |= {(axis, n, 1): partial(_split_traffic, provider.with_layers(n), cfg, 1, axis) for n in (1, 2)}
    pairs: dict[tuple, list[tuple]] = {}  # each key is (what, blocks, ...): the runs of 1 and 2 blocks of one count
    for key in calls:
        pairs.setdefault((key[0], *key[2:]), []).append(key)
    ran = run_forked([partial(_in_turn, [calls[key] for key in keys]) for keys in pairs.values()])
    counted = {key: found for keys, results in zip(pairs.values(), ran, strict=True)
               for key, found in zip(keys, results, strict=True)}  # fmt: skip
    one, two = counted["flops", 1, None], counted["flops", 2, None]
    if one is None or two is None:  # no compute floor
        return None
    per_token = [(b - a) / seq_len for a, b in zip(one, two, strict=True)]
    experts = per_token[4] > per_token[3]  # parameters beyond those FSDP gathers whole
    head_flops = one[0] / seq_len - per_token[0]
    recompute = {}
    for ac in modes:  # else none counted
        one_ac, two_ac = counted["flops", 1, ac], counted["flops", 2, ac]
        if one_ac is not None and two_ac is not None:
            recompute[ac] = max((two_ac[0] - one_ac[0]) / seq_len - per_token[0], 0.0)
    # attention as the probe counts it: shardlab's Llama's from its meta model's math kernel (see floors' docstring),
    # any other model's as the fake runs below count its kernels (0 where the probe does not count them either)
    llama = isinstance(provider, LlamaProvider)
    attention = (7 / 12 * per_token[1], 1 / 2 * per_token[2]) if llama else (0.0, 0.0)
    memory, head, kept, again = (0.0, 0.0), 0.0, [], []
    for mode in ("memory", *modes):  # no memory floor, or none for the modes not counted from the first missing on
        found = _per_row({(n, rows): counted[mode, n, rows] for n, rows in PER_ROW})
        if found is None:
            break
        (moved, _, alive, *attended), (rest, *_) = found
        if mode == "memory":
            memory, head = found[0][:2], rest
            kept.append(("none", alive / seq_len))
            if not llama:
                attention = (attended[0] / seq_len, attended[1] / seq_len)
        else:
            kept.append((mode, alive / seq_len))
            again.append((mode, max(moved - memory[0], 0.0) / seq_len))
    excess = {}  # one block per row of a rank's sequences at size 2, beyond its share of what one rank does (as the
    for axis in splits:  # probe at size 1 counts memory_bytes: half under tp and cp, all of its own rows under ep),
        c = {key[1:]: value for key, value in counted.items() if key[0] == axis}  # per token of the rank's
        if memory[0] and None not in c.values():
            tokens, share = seq_len // (2 if axis == "cp" else 1), 1.0 if axis == "ep" else 0.5
            block = {rows: c[2, rows][0] - c[1, rows][0] for rows in (1, 2, 3)}
            two = block[3] - block[2]
            excess[axis] = max(two - memory[0] * share, 0.0) / tokens
            if axis != "ep":  # what the line through 2 and 3 rows moves at none is the weights' own traffic, at the
                # count's size 2 alone: FSDP's over its group (cp's), the experts' whole (no ep); tp's (of the dense
                # weights, split as tp splits them) is left in where there are no experts
                fixed = max(block[2] - 2 * two, 0) if axis == "cp" or experts else 0
                excess[axis, 1] = max(block[1] - fixed - memory[0] * share, 0.0) / tokens
            elif block[2] - block[1] == two and block[1] >= two:  # the same ops at one row: a block's experts' weights
                excess[axis, 1] = excess[axis]  # (fewer per rank at a larger ep) only add to it; else none counted
    return Block(train_flops=per_token[0], attention_flops=attention[0], attention_forward_flops=attention[1],
                 attention_causal=llama, params=round(per_token[3] * seq_len),
                 expert_params=round((per_token[4] - per_token[3]) * seq_len),
                 memory_bytes=memory[0] / seq_len, memory_forward_bytes=memory[1] / seq_len,
                 kept=tuple(kept), recompute_memory_bytes=tuple(again), head_flops=max(head_flops, 0.0),
                 head_memory_bytes=head / seq_len, tp_memory_bytes=excess.get("tp", 0.0),
                 cp_memory_bytes=excess.get("cp", 0.0), tp_one_row_memory_bytes=excess.get(("tp", 1), 0.0),
                 tp_one_row_without_weights=experts,
                 cp_one_row_memory_bytes=excess.get(("cp", 1), 0.0), ep_memory_bytes=excess.get("ep", 0.0),
                 ep_one_row_memory_bytes=excess.get(("ep", 1), 0.0),
                 op_recompute_flops=recompute.get("op", 0.0), recompute_flops=recompute.get("full", 0.0))  # fmt: skip


def _in_turn(calls: list[Callable[[], T]]) -> list[T | None]:
    """Each call's result (`_or_none`), one after another in one process: a count's models of 1 and 2 blocks run
    the same shapes, so the second finds those outside its blocks in fake tensors' caches, which the first filled
    (8B's block counts in its search: 7.5-8.4 s against 8.2-8.9 s dealt apart)."""
    return [_or_none(call) for call in calls]


def _or_none(call: Callable[..., T], *args: Any) -> T | None:
    """`call(*args)`, or None where the model cannot run on meta or fake tensors (`CANNOT_RUN`)."""
    try:
        return call(*args)
    except CANNOT_RUN:
        return None


def _model(provider: ModelProvider, options: PlanConfig, ac: str | None = None) -> torch.nn.Module:
    """A new model of `provider` on meta in options.param_dtype (as FSDP's mixed precision computes), its blocks
    checkpointed as `ac` says (`apply` on one process: checkpointing alone; None: not). It runs under
    `balanced_routing`, as the probe's do: meta and fake tensors hold no scores to route by."""
    with torch.device("meta"):
        model = provider.build().to(getattr(torch, options.param_dtype))
    if ac is not None:
        one = _single(options, ac)
        apply(model, make_plan(model, MeshSpec(dp_shard=1), provider.rules(one), one))
    return model


def _dense_params(model: torch.nn.Module) -> int:
    """Parameters FSDP shards over dp_shard x cp and gathers whole: all but experts (sharded over ep too, and
    gathered over dp_shard_mod_ep alone)."""
    experts = {id(p) for layer in moe_layers(model) for p in layer.experts.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in experts)


def _count(
    provider: ModelProvider, seq_len: int, options: PlanConfig, ac: str | None = None
) -> tuple[int, int, int, int, int]:
    """Matmul FLOPs forward + backward, batched (attention's) ones forward + backward and forward, the parameters
    FSDP gathers whole (`_dense_params`) and all parameters, of `provider`'s model on one sequence (ac: its blocks
    checkpointed so): on meta tensors, or where the model cannot run there (transformers' masks read a value), on
    fake CPU tensors, whose matmuls are the same (CPU's fused attention is not a batched matmul: none counted
    there)."""
    try:
        return _flops(provider, seq_len, options, ac, fake=False)
    except CANNOT_RUN:
        return _flops(provider, seq_len, options, ac, fake=True)


def _flops(
    provider: ModelProvider, seq_len: int, options: PlanConfig, ac: str | None, fake: bool
) -> tuple[int, int, int, int, int]:
    model = _model(provider, options, ac)
    counter = FlopCounterMode(display=False)
    with balanced_routing(), fake_tensors() if fake else contextlib.nullcontext():
        if fake:
            model.to_empty(device="cpu")
        sample = torch.zeros(1, seq_len, dtype=torch.long, device="cpu" if fake else "meta")
        with counter:  # one pass: the forward's counts, then the forward's and the backward's
            out = provider.forward(model, sample)
            forward = counter.get_flop_counts()["Global"]
            out.float().sum().backward()
    counts = [counter.get_flop_counts()["Global"], forward]
    batched = [c.get(torch.ops.aten.bmm, 0) for c in counts]
    matmuls = sum(counts[0].get(op, 0) for op in MATMULS)
    return matmuls, batched[0], batched[1], _dense_params(model), sum(p.numel() for p in model.parameters())


PER_ROW = ((1, 1), (1, 2), (2, 1), (2, 2))
"""(blocks, rows) of the fake CPU models `_per_row` takes the difference of."""


def _per_row(
    c: dict[tuple[int, int], tuple[int, ...] | None],
) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """What one block adds to a count's numbers for each row of a micro batch, and what the rest of the model adds,
    from the count on fake CPU models of 1 and 2 blocks on 1 and 2 rows (`PER_ROW`), so what does not grow with the
    rows (rotary tables, masks, the embedding's gradient) drops out; negative parts (none expected) count as 0.
    None where one of them could not run."""
    if any(counts is None for counts in c.values()):
        return None
    block = [c[2, 2][i] - c[1, 2][i] - c[2, 1][i] + c[1, 1][i] for i in range(len(c[1, 1]))]
    rest = [c[1, 2][i] - c[1, 1][i] - block[i] for i in range(len(c[1, 1]))]
    return tuple(max(x, 0.0) for x in block), tuple(max(x, 0.0) for x in rest)


def _memory_bytes(
    provider: ModelProvider, seq_len: int, rows: int, options: PlanConfig, ac: str | None = None
) -> tuple[int, int, int, int, int]:
    """Bytes read and written by the ops without FLOPs of one training micro batch of `provider`'s model on `rows`
    sequences (`step.forward_backward`), and by its forward, on fake CPU tensors (the kernels the probe sees: CPU's
    fused attention) with the parameters in param_dtype, its blocks checkpointed as `ac` says (None: not); the
    bytes its forward leaves alive; and the FLOPs of its attention kernels, forward and backward and forward."""
    model = _model(provider, options, ac)
    recorder, forward = Recorder({}, fused_casts=options.compile and options.fp8 != "none"), {}

    def after_forward() -> None:
        forward.update(moved=_moved(recorder), alive=recorder.live_bytes(param_storages(model)),
                       attended=_attended(recorder))  # fmt: skip

    with balanced_routing(), fake_tensors():
        model.to_empty(device="cpu")
        tokens = torch.zeros(rows, seq_len, dtype=torch.long)
        with recorder, chunks_counted_by(recorder):
            forward_backward(model, tokens, tokens, 1.0, False, after_forward, forward=provider.forward)
    return _moved(recorder), forward["moved"], forward["alive"], _attended(recorder), forward["attended"]


def _split_traffic(provider: ModelProvider, cfg: Config, rows: int, axis: str) -> tuple[int] | None:
    """Bytes the ops without FLOPs of one micro batch of `rows` sequences move on rank 0 of 2 ranks of `axis` (tp or
    cp alone; ep of dp_shard 2, from which it borrows its ranks), laid out by the provider's rules as the probe lays
    them out (FSDP's own copies aside); None where the model refuses that layout."""
    mesh = MeshSpec(dp_shard=2, ep=2) if axis == "ep" else MeshSpec(dp_shard=1, **{axis: 2})
    train = msgspec.structs.replace(cfg.train, global_batch=rows * mesh.size("dp"), micro_batch=None)
    run = msgspec.structs.replace(cfg, mesh=mesh, train=train)
    try:
        run = run.resolve(2)
        check_layout(run, provider)
    except ValueError:  # the model's own limits (a transformers model's heads vs tp)
        return None
    measured = measure(run, provider=provider)
    (only,) = measured.runs  # a model this small is probed whole
    return (sum(moved for flops, moved, kind, role, _ in only.sequence if kind == "memory" and not role),)


def _moved(recorder: Recorder) -> int:
    return sum(moved * count for (flops, moved, _), count in recorder.ops.items() if not flops)


def _attended(recorder: Recorder) -> int:
    return sum(flops * count for (flops, _, kind), count in recorder.ops.items() if kind == "attention")


def _single(options: PlanConfig, ac: str) -> PlanConfig:
    """`options` for one process in fp32 checkpointing as `ac` says: what `apply` then does is checkpointing alone."""
    return msgspec.structs.replace(options, activation_checkpoint=ac, param_dtype="float32", reduce_dtype="float32",
                                   compile=False, cpu_offload=False)  # fmt: skip
