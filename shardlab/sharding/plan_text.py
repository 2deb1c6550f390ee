"""How a Plan reads: the per-parameter table (repeated blocks collapsed) and `explain`.

Separate from plan.py so the data and its resolution stay short; everything here only formats.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from shardlab.sharding.mesh import FLAT_VIEWS, ExpertMeshSpec, MeshSpec
from shardlab.sharding.spec import Entry, P, Spec

if TYPE_CHECKING:
    from shardlab.sharding.plan import Plan
    from shardlab.sharding.rules import Rules


def explain(plan: Plan, fqn: str) -> str:
    """Why a parameter is laid out as it is: the winning rule, the shadowed ones, the fallbacks."""
    p = plan.param(fqn)
    lines = [f"{p.fqn}  shape {p.shape}  spec {P(*p.spec)!r}"]
    if p.rule is None:
        lines.append("  no rule matched: replicated because plan.allow_uncovered=True")
    else:
        lines.append(f"  rule {p.rule}: {_rule_text(plan.rules, p.rule)}  (first match wins)")
    lines += [f"  shadowed rule {i}: {_rule_text(plan.rules, i)}" for i in p.shadowed]
    lines += [f"  logical fallback: {f}" for f in p.fallbacks]
    if p.fsdp_unit is not None and plan.fsdp is not None:
        axes = plan.experts.fsdp_axes if p.expert and plan.experts is not None else plan.fsdp.axes
        lines.append(
            f"  FSDP unit {p.fsdp_unit or '<root>'} over {' x '.join(axes)}: dim {p.fsdp_dim} gets them as its minor "
            "axes" + (" (padded)" if p.padded else "")
        )
    lines.append(
        f"  placements {_placements_text(p.placements, plan.mesh.experts if p.expert else plan.mesh)}  local {p.local_shape}  {p.bytes_per_rank:,} bytes/rank"
    )
    lines += [f"  alias {a}" for a in p.aliases]
    return "\n".join(lines)


def table(plan: Plan, collapse: bool = True, groups: Mapping[str, str] | None = None) -> str:
    """Readable table; with `collapse`, parameters of repeated blocks are shown once (`layers.*`); `groups`:
    each parameter's optimizer group, shown as a column."""
    head = (
        f"Plan for mesh {plan.mesh.describe()}  "
        f"params {sum(math.prod(p.shape) for p in plan.params):,}  "
        f"{plan.bytes_per_rank / 2**20:,.1f} MiB/rank (params)"
    )
    staged = plan.pipeline is not None
    rows = [
        (
            "parameter", "shape", "spec", "placements", "local", "MiB/rank", "rule", *(("stage",) if staged else ()),
            *(("optimizer",) if groups else ()), *(("fp8",) if plan.fp8 else ()),
        )
    ]  # fmt: skip
    fp8 = set(plan.fp8.linears) if plan.fp8 else set()
    for fqn, p, count in _collapsed(plan.params, collapse):
        rows.append(
            (
                fqn + (f" (x{count})" if count > 1 else ""),
                "x".join(map(str, p.shape)),
                _spec_text(p.spec),
                _placements_text(p.placements, plan.mesh.experts if p.expert else plan.mesh),
                "x".join(map(str, p.local_shape)),
                f"{p.bytes_per_rank / 2**20:.2f}",
                "-" if p.rule is None else str(p.rule),
                *((str(p.stage),) if staged else ()),
                *((groups[p.fqn],) if groups else ()),
                *((("float8" if p.fqn.removesuffix(".weight") in fp8 else "-"),) if plan.fp8 else ()),
            )
        )
    out = [head, _columns(rows)]
    if plan.modules:
        mrows = [("module", "style", "inputs", "output")]
        for fqn, m, count in _collapsed(plan.modules, collapse):
            ins = m.desired_inputs or m.inputs
            src = " -> ".join(_spec_text(s[0]) for s in (m.inputs, m.desired_inputs) if s) if ins else "-"
            if m.kwarg_inputs:
                name = m.kwarg_inputs[0][0]
                pair = (m.kwarg_inputs, m.desired_kwarg_inputs or ())
                src = f"{name}=" + " -> ".join(_spec_text(dict(k)[name]) for k in pair if name in dict(k))
            mrows.append(
                (
                    fqn + (f" (x{count})" if count > 1 else ""),
                    m.style,
                    src,
                    _spec_text(m.output) if m.output else "-",
                )
            )
        out += ["", _columns(mrows)]
    if plan.fsdp:
        f = plan.fsdp
        units = sorted({_layer_glob(" + ".join(u)) for u in f.units})
        notes = [f.resharding] if f.resharding != "as set" else []
        if f.last_kept and f.reshard_after_forward:
            notes.append(f"not {' + '.join(f.units[-1])}")
        notes_text = f" ({'; '.join(notes)})" if notes else ""
        out += [
            "",
            f"FSDP over {' x '.join(f.axes)}: {len(f.units)} units + root ({', '.join(units)}); "
            f"reshard_after_forward={f.reshard_after_forward}{notes_text} param={f.param_dtype} reduce={f.reduce_dtype} "
            f"cpu_offload={f.cpu_offload}"
            + ("; micro batches all-reduced over dp_replicate once per step" if f.all_reduce_once else ""),
        ]
    if plan.pipeline is not None:
        out += ["", *_pipeline_text(plan)]
    if plan.context is not None:
        c = plan.context
        out += [
            "",
            f"Context parallel over cp={plan.mesh.cp}: {c.attention} attention in {len(c.modules)} modules "
            f"({', '.join(sorted({_layer_glob(m) for m in c.modules}))}); each rank holds sequence chunks r and 2cp-1-r",
        ]
    if plan.experts is not None:
        e = plan.experts
        where = f"{len(e.modules)} modules ({', '.join(sorted({_layer_glob(m) for m in e.modules}))})"
        tp = f"; their hidden dims split over tp={plan.mesh.tp}" if e.tensor_parallel else ""
        text = (
            f"Expert parallel over ep={e.ep} (of dp_shard x cp): all-to-all dispatch in {where}{tp}; FSDP over "
            f"{' x '.join(e.fsdp_axes)}, gradients divided by {e.gradient_divide_factor}"
            if e.ep > 1
            else f"Tensor parallel inside experts over tp={plan.mesh.tp}: {where}, partial outputs summed over tp"
        )
        out += ["", text]
    if plan.fp8 is not None:
        out += ["", *_fp8_text(plan)]
    extras = [
        f"loss_parallel={plan.loss_parallel}",
        f"activation_checkpoint={plan.activation_checkpoint}",
        f"compile={plan.compile}",
    ]
    out.append("  ".join(extras))
    return "\n".join(out)


def _fp8_text(plan: Plan) -> list[str]:
    """The FP8 linears as globs, and why each other linear of the blocks is not one."""
    f = plan.fp8
    gather = f"; FSDP all-gathers their weights in float8 over {' x '.join(plan.fsdp.axes)}" if f.all_gather else ""
    lines = [
        f"FP8 {f.recipe} (torchao Float8Linear): {len(f.linears)} linears "
        f"({', '.join(dict.fromkeys(_layer_glob(m) for m in f.linears))}){gather}"
    ]
    kept = dict.fromkeys((_layer_glob(m), why) for m, why in f.kept)
    lines += [f"  kept in the compute dtype: {m} ({why})" for m, why in kept]
    return lines


def _pipeline_text(plan: Plan) -> list[str]:
    pl = plan.pipeline
    lines = [
        f"Pipeline over pp={plan.mesh.pp}: {pl.schedule}, {len(pl.stages)} stages ({pl.stages_per_rank} per rank), "
        f"{pl.microbatches} micro batches, bubble {100 * pl.bubble:.1f}% (analytic)"
    ]
    rows = [("stage", "pp rank", "blocks", "other modules", "params", "MiB/rank")]
    for s in pl.stages:
        held = sum(p.bytes_per_rank for p in plan.params if p.stage == s.index)
        rows.append((
            str(s.index), str(s.pp_rank), _block_range(s.blocks), ", ".join(s.others) or "-", f"{s.params:,}",
            f"{held / 2**20:,.1f}",
        ))  # fmt: skip
    return [*lines, _columns(rows)]


def _block_range(blocks: tuple[str, ...]) -> str:
    """model.layers.0 .. model.layers.7 -> 'model.layers.0-7 (8)'."""
    first, last = blocks[0], blocks[-1]
    head, _, start = first.rpartition(".")
    end = last.rpartition(".")[2]
    return f"{head}.{start}-{end} ({len(blocks)})" if len(blocks) > 1 else first


def _spec_text(spec: Spec | None) -> str:
    if spec is None:
        return "-"
    views = {axes: name for name, axes in FLAT_VIEWS.items()}

    def entry(e: Entry) -> str:
        if e is None or isinstance(e, str):
            return str(e)
        return views.get(tuple(e)) or "(" + ",".join(e) + ")"

    return "P(" + ", ".join(entry(e) for e in spec) + ")"


def _placements_text(pl: tuple[str, ...], mesh: MeshSpec | ExpertMeshSpec) -> str:
    shown = [f"{a}:{p}" for a, p, s in zip(mesh.axis_names, pl, mesh.axis_sizes) if s > 1]
    return " ".join(shown) or "R"


def _rule_text(rules: Rules, i: int) -> str:
    r = rules.params[i]
    return f"{r.pattern!r} -> " + (_spec_text(r.spec) if r.spec is not None else f"axes {r.axes}")


def _layer_glob(fqn: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def _collapsed(items, collapse: bool):
    """Yield (name, item, count): items equal up to their layer index are merged under a `*` name."""
    if not collapse:
        for it in items:
            yield it.fqn, it, 1
        return
    groups: dict[tuple, list] = {}
    for it in items:
        body = re.sub(rb"\.\d+(?=[.\"])", b".*", msgspec.json.encode(msgspec.structs.replace(it, fqn="")))
        groups.setdefault((_layer_glob(it.fqn), body), []).append(it)
    for (glob, _), members in groups.items():
        yield (glob if len(members) > 1 else members[0].fqn), members[0], len(members)


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
