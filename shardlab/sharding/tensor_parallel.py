"""Tensor-parallel styles derived from data: which torch ParallelStyle each module gets, from its parameters'
tp dims (colwise or rowwise Linear, vocab- or dim-split Embedding) and the activation layouts the rules declare
(sequence parallel norms, redistributed inputs, loss parallel's vocab-split logits)."""

from __future__ import annotations

from typing import Literal

from torch import nn

from shardlab._base import Frozen
from shardlab._errors import ShardlabError
from shardlab._kept import kept
from shardlab.sharding.rules import Activation, Rules, logical_to_spec, matches
from shardlab.sharding.spec import Spec, dim_of

Style = Literal[
    "colwise", "rowwise", "embedding_rowwise", "embedding_colwise", "sequence_parallel", "prepare_input",
    "prepare_input_output",
]  # fmt: skip


class ModulePlan(Frozen):
    """A TP style derived from a module's parameter specs and declared activation layouts."""

    fqn: str
    style: Style
    inputs: tuple[Spec | None, ...] | None = None
    """Layout of positional inputs as they arrive (None = the style's default)."""
    desired_inputs: tuple[Spec | None, ...] | None = None
    output: Spec | None = None
    """Layout of the output (None = the style's default)."""
    desired_output: Spec | None = None
    """Layout the output is redistributed to (prepare_input_output)."""
    kwarg_inputs: tuple[tuple[str, Spec], ...] | None = None
    """Layout of keyword inputs as they arrive, by name (prepare_input)."""
    desired_kwarg_inputs: tuple[tuple[str, Spec], ...] | None = None
    local_output: bool = True
    """Hand the next module a plain local tensor (False keeps a DTensor, e.g. vocab-sharded logits)."""


@kept  # a search plans one model under the same rules on hundreds of meshes
def _activation(fqn: str, rules: Rules) -> Activation | None:
    return next((a for a in rules.activations if matches(a.pattern, fqn)), None)


def _lower(axes: tuple[str | None, ...] | None, rules: Rules, fqn: str) -> Spec | None:
    return None if axes is None else tuple(logical_to_spec(axes, rules.logical, name=fqn)[0])


def _tp_dim(spec: Spec | None) -> int | None:
    return None if spec is None else dim_of(spec, "tp")


def module_plans(modules: dict[str, nn.Module], tp_dims: dict[str, int | None], rules: Rules) -> tuple[ModulePlan, ...]:
    """The TP style of every module (fqn -> module) from its parameters' tp dims (fqn -> dim, None when not
    sharded over tp) and the activation layouts the rules declare."""
    out: list[ModulePlan] = []
    held: dict[str, dict[str, int | None]] = {}  # module -> its own parameters' tp dims, by their names in it
    for name, dim in tp_dims.items():
        owner, _, leaf = name.rpartition(".")
        held.setdefault(owner, {})[leaf] = dim
    for fqn, module in modules.items():
        act = _activation(fqn, rules)
        inputs = None if act is None or act.inputs is None else tuple(_lower(x, rules, fqn) for x in act.inputs)
        desired = (
            None
            if act is None or act.desired_inputs is None
            else tuple(_lower(x, rules, fqn) for x in act.desired_inputs)
        )
        output = None if act is None else _lower(act.output, rules, fqn)
        desired_output = None if act is None else _lower(act.desired_output, rules, fqn)
        kwargs = None if act is None else _lower_kwargs(act.kwarg_inputs, rules, fqn)
        desired_kwargs = None if act is None else _lower_kwargs(act.desired_kwarg_inputs, rules, fqn)
        local = None if act is None else act.local_output
        own = held.get(fqn, {})
        if desired_output is not None and (output is None or not inputs or any(d is not None for d in own.values())):
            raise ShardlabError(
                f"rules.activations: {fqn} declares desired_output, which needs its inputs and output declared too "
                "and a module without tp-sharded weights of its own (its code runs on local tensors)"
            )
        if desired_output is not None and (  # a module computing on plain local tensors: redistribute around it
            [_tp_dim(x) for x in inputs or ()] != [_tp_dim(x) for x in desired or inputs or ()]
            or _tp_dim(output) != _tp_dim(desired_output)
        ):
            out.append(
                ModulePlan(
                    fqn=fqn, style="prepare_input_output", inputs=inputs, desired_inputs=desired or inputs,
                    output=output, desired_output=desired_output,
                )
            )  # fmt: skip
        elif any(d is not None for d in own.values()):
            out.append(_parallel_style(fqn, module, own, inputs, output))
        elif inputs and output and _tp_dim(inputs[0]) is not None and _tp_dim(inputs[0]) == _tp_dim(output):
            out.append(
                ModulePlan(fqn=fqn, style="sequence_parallel", inputs=inputs, output=output, local_output=bool(local))
            )
        elif (inputs and desired and [_tp_dim(x) for x in inputs] != [_tp_dim(x) for x in desired]) or (
            kwargs and desired_kwargs and _kwarg_dims(kwargs) != _kwarg_dims(desired_kwargs)
        ):
            out.append(
                ModulePlan(
                    fqn=fqn, style="prepare_input", inputs=inputs if desired else None, desired_inputs=desired,
                    kwarg_inputs=kwargs, desired_kwarg_inputs=desired_kwargs, local_output=bool(local),
                )
            )  # fmt: skip
    return tuple(out)


def _lower_kwargs(
    layouts: tuple[tuple[str, tuple[str | None, ...]], ...] | None, rules: Rules, fqn: str
) -> tuple[tuple[str, Spec], ...] | None:
    return None if layouts is None else tuple((name, _lower(x, rules, fqn)) for name, x in layouts)


def _kwarg_dims(layouts: tuple[tuple[str, Spec], ...]) -> dict[str, int | None]:
    return {name: _tp_dim(x) for name, x in layouts}


def _parallel_style(fqn: str, module: nn.Module, own: dict[str, int | None], inputs, output) -> ModulePlan:
    weight = own.get("weight")
    kinds = {nn.Linear: ("colwise", "rowwise"), nn.Embedding: ("embedding_colwise", "embedding_rowwise")}
    kind = next((v for k, v in kinds.items() if isinstance(module, k)), None)
    if kind is None or weight is None:
        where = ", ".join(f"{fqn}.{n}" if fqn else n for n, d in own.items() if d is not None)
        raise ShardlabError(
            f"{where}: tp-sharded parameters of a {type(module).__name__}; shardlab derives TP styles "
            "for nn.Linear and nn.Embedding weights only: replicate these parameters over tp"
        )
    # nn.Linear weight is [out, in]: tp on dim 0 is colwise. nn.Embedding weight is [num, dim]: dim 1 is colwise.
    colwise = (weight == 0) == isinstance(module, nn.Linear)
    style = kind[0] if colwise else kind[1]
    bias = own.get("bias")
    if "bias" in own and (bias == 0) != (style == "colwise"):
        raise ShardlabError(
            f"{fqn}.bias: a {style} Linear needs its bias {'sharded' if style == 'colwise' else 'replicated'} over tp; fix its rule"
        )
    # Only a colwise output declared split over tp stays a DTensor (vocab-split logits for loss parallel).
    local_output = style != "colwise" or _tp_dim(output) is None
    return ModulePlan(fqn=fqn, style=style, inputs=inputs, output=output, local_output=local_output)
