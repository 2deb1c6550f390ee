"""Rules: ordered glob patterns over fully qualified names -> PartitionSpecs (directly or via logical axes).

The first matching rule wins (as in EasyDeL/fjformer partition rules). A rule states either a
PartitionSpec over mesh axes or logical dim names (`("vocab", "embed")`) that the logical table maps
to mesh axes with Flax linen semantics. Every resolution says which rule matched and which were shadowed.
"""

from __future__ import annotations

import functools
import inspect

from shardlab._base import Frozen
from shardlab._errors import ShardlabError
from shardlab._glob import glob_regex as glob_regex
from shardlab._glob import matches as matches
from shardlab._kept import kept
from shardlab.sharding.pipeline import StageCall
from shardlab.sharding.spec import Entry, P

LogicalTable = tuple[tuple[str, Entry], ...]
"""Ordered (logical name, mesh axes) pairs; a later pair for the same name is a fallback."""


class Rule(Frozen):
    """One row of the rule table: parameters whose fqn matches `pattern` get `spec` (or logical `axes`)."""

    pattern: str
    """Glob over fully qualified names: `*` matches within one dotted component, `**` across components."""
    spec: tuple[Entry, ...] | None = None
    """PartitionSpec entries over mesh axes, one per tensor dim (shorter = trailing dims replicated)."""
    axes: tuple[str | None, ...] | None = None
    """Logical dim names, mapped to mesh axes by the logical table."""

    def check(self) -> None:
        if (self.spec is None) == (self.axes is None):
            raise ShardlabError(
                f"rule {self.pattern!r}: give exactly one of spec= (mesh axes) or axes= (logical names)"
            )
        glob_regex(self.pattern)


class Activation(Frozen):
    """Declared layouts of a module's activations, in logical names (how SP and loss parallel are stated)."""

    pattern: str
    """Glob over module fqns."""
    inputs: tuple[tuple[str | None, ...], ...] | None = None
    """Layout of each positional input as it arrives."""
    desired_inputs: tuple[tuple[str | None, ...], ...] | None = None
    """Layout the module needs its inputs in (a redistribution is inserted when it differs)."""
    output: tuple[str | None, ...] | None = None
    """Layout of the output."""
    desired_output: tuple[str | None, ...] | None = None
    """Layout the next module needs the output in; with it, the module takes and returns plain local tensors
    (torch's PrepareModuleInputOutput), for modules that compute on local shards (an MoE layer under TP)."""
    kwarg_inputs: tuple[tuple[str, tuple[str | None, ...]], ...] | None = None
    """Layout of keyword inputs as they arrive, by name (a transformers decoder layer calls its attention with
    `hidden_states=`)."""
    desired_kwarg_inputs: tuple[tuple[str, tuple[str | None, ...]], ...] | None = None
    """Layout the module needs its keyword inputs in."""
    local_output: bool | None = None
    """Hand the next module a plain local tensor (True) or a DTensor (False); None: the style's default (a
    sequence-parallel norm keeps a DTensor). Code that adds the output to a local tensor needs True."""


class Rules(Frozen, cache_hash=True):
    """Everything that states a model's layout as data: parameter rules, the logical table, activations,
    FSDP units and the blocks that activation checkpointing and compile wrap.

    Its hash is computed once: planning asks many kept questions of the same rules (`shardlab._kept`)."""

    params: tuple[Rule, ...]
    """Parameter rules, first match wins."""
    logical: LogicalTable = ()
    """Logical name -> mesh axes (Flax semantics: ordered; a pair applies only if its axes are still free)."""
    activations: tuple[Activation, ...] = ()
    """Activation layouts per module (sequence parallel, loss parallel)."""
    fsdp_units: tuple[tuple[str, ...], ...] = ()
    """FSDP units, each a group of module globs sharded together; the root takes the rest."""
    fsdp_last_kept: bool = False
    """The last of fsdp_units is the one whose forward ends the model (the final norm and output layer): its
    backward follows at once, so it stays gathered in between instead of being gathered again."""
    blocks: tuple[str, ...] = ()
    """Globs of the repeated blocks (activation checkpointing and torch.compile wrap these)."""
    attention: tuple[str, ...] = ()
    """Globs of the attention modules, whose forward takes the keyword `attend(q, k, v, positions)` that context
    parallelism passes (`shardlab.models.provider.Attend`)."""
    stage_call: StageCall = "tensor"
    """How a pipeline stage calls the model: "tensor" (its forward is its parts in sequence, tensors in and out) or
    "transformers" (a transformers causal LM; shardlab.sharding.pipeline.StageCall)."""
    fp8_modules: tuple[str, ...] = ()
    """With plan.fp8: globs of linears outside the blocks that run in float8 too (the output head stays in the
    compute dtype unless named here)."""
    fp8_exclude: tuple[str, ...] = ()
    """With plan.fp8: globs of linears inside the blocks kept in the compute dtype (an MoE router)."""


class Match(Frozen):
    """How one parameter's spec was decided."""

    spec: tuple[Entry, ...]
    rule: int | None
    """Index of the winning rule; None when no rule covers it."""
    shadowed: tuple[int, ...] = ()
    """Later rules that also matched."""
    fallbacks: tuple[str, ...] = ()
    """Logical names whose preferred mesh axes were taken, so a fallback (or replication) applied."""


@kept  # a search plans one model under the same rules on hundreds of meshes
def resolve(fqn: str, ndim: int, rules: Rules) -> Match | None:
    """Spec of parameter `fqn` from the first matching rule; None when no rule matches."""
    hits = [i for i, r in enumerate(rules.params) if matches(r.pattern, fqn)]
    if not hits:
        return None
    rule = rules.params[hits[0]]
    if rule.spec is not None:
        spec, fallbacks = tuple(P(*rule.spec)), ()
    else:
        spec, fallbacks = logical_to_spec(rule.axes or (), rules.logical, name=fqn)
    if len(spec) > ndim:
        raise ShardlabError(
            f"{fqn}: rule {hits[0]} {rule.pattern!r} gives {len(spec)} entries for a {ndim}-dim parameter; fix the rule"
        )
    return Match(
        spec=tuple(spec) + (None,) * (ndim - len(spec)), rule=hits[0], shadowed=tuple(hits[1:]), fallbacks=fallbacks
    )


@kept  # a search plans one model on hundreds of meshes, each plan matching the same globs over the same modules
def matching(pattern: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The `names` that `pattern` matches, in order."""
    regex = glob_regex(pattern)
    return tuple(n for n in names if regex.fullmatch(n) is not None)


def matching_any(patterns: tuple[str, ...], names: tuple[str, ...]) -> tuple[str, ...]:
    """The `names` that one of `patterns` matches, in order."""
    hits = {n for p in patterns for n in matching(p, names)}
    return tuple(n for n in names if n in hits)


def logical_to_spec(
    axes: tuple[str | None, ...], table: LogicalTable, *, name: str = "tensor"
) -> tuple[P, tuple[str, ...]]:
    """Map logical dim names to a PartitionSpec (Flax linen `_logical_to_mesh_axes` semantics).

    Pairs are tried in order; a pair applies only if all its mesh axes are still free for this
    tensor (tuples are all-or-nothing). With table (("heads", "tp"), ("embed", "tp"), ("embed", None)):

    >>> logical_to_spec(("heads", "embed"), (("heads", "tp"), ("embed", "tp"), ("embed", None)))
    (P('tp', None), ('embed->None',))

    ("embed" wanted tp, which "heads" took, so its fallback None applied and is reported.) A name with no
    pair at all is an error; a name whose every pair is blocked is replicated and reported.
    """
    key = tuple(axes), tuple(table)
    try:
        hash(key)
    except TypeError:  # a table with lists in it: not remembered
        spec_of = _logical_to_spec.__wrapped__
    else:
        spec_of = _logical_to_spec
    try:
        return spec_of(*key)
    except _NoEntry as missing:
        raise ShardlabError(
            f"{name}: logical axis {missing.args[0]!r} has no entry in the logical table; add "
            f"({missing.args[0]!r}, None) to replicate it"
        ) from None


class _NoEntry(Exception):
    pass


@functools.lru_cache(maxsize=4096)
def _logical_to_spec(axes: tuple[str | None, ...], table: LogicalTable) -> tuple[P, tuple[str, ...]]:
    """`logical_to_spec`, once per tensor's logical axes and table: a model's blocks repeat the same few (make_plan
    of a 126-block model asks 2,400 times)."""
    known = {n for n, _ in table}
    used: set[str] = set()
    entries: list[Entry] = [None] * len(axes)
    fallbacks: list[str] = []
    # Flax resolves dims in order of the rules, not of the tensor: a higher-priority name claims axes first.
    pending = {i: n for i, n in enumerate(axes) if n is not None}
    for n in pending.values():
        if n not in known:
            raise _NoEntry(n)
    done: set[int] = set()
    tried: dict[int, int] = {}
    for logical, mesh_axes in table:
        for i, n in pending.items():
            if n != logical or i in done:
                continue
            tried[i] = tried.get(i, 0) + 1
            want = P(mesh_axes).axes(0) if mesh_axes is not None else ()
            if any(a in used for a in want):
                continue
            used.update(want)
            entries[i] = mesh_axes
            done.add(i)
            if tried[i] > 1:
                fallbacks.append(f"{n}->{'None' if mesh_axes is None else mesh_axes}")
    for i, n in pending.items():
        if i not in done:
            fallbacks.append(f"{n}->None")
    return P(*entries), tuple(fallbacks)


def takes_keyword(module: object, name: str) -> bool:
    """Whether `module`'s forward declares the keyword `name`, or hands on any (`**kwargs`): how a model says which
    inputs parallel code may pass it with each call (context parallelism's `attend`, expert parallelism's
    `dispatch`), rather than slots set on its modules."""
    forward = getattr(module, "forward", None)
    if forward is None:
        return False
    params = inspect.signature(forward).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
