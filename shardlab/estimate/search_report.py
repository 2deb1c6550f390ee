"""A search's ranking for people and scripts: the table `python -m shardlab search` prints, one line on why the
winner wins, the JSON of `--json`, and the recipe file `--out` writes for the winner."""

from __future__ import annotations

import math
import pprint

import msgspec

from shardlab.config import Config
from shardlab.estimate.device import Device
from shardlab.estimate.layouts import Layout
from shardlab.estimate.search_result import Candidate, Search, readable_bytes


def why(s: Search) -> str:
    """Why the winner wins: against the runner-up, the terms of the step that differ most (`deciding`)."""
    best = s.best[0]
    if len(s.best) == 1:
        alone = "no other layout looked at before the budget ran out fits" if s.unsearched else (
            "every other layout is too big, or one it beats by construction (its mesh with more recomputation, micro "
            "batches or FSDP gathers: not estimated)"
        )  # fmt: skip
        return f"{best.layout.describe()} has no runner-up: {alone}"
    runner_up = s.best[1]
    faster = runner_up.step_s / best.step_s - 1
    if faster < 1e-3:
        return f"{best.layout.describe()} ties with {runner_up.layout.describe()} (within 0.1%)"
    return (
        f"{best.layout.describe()} wins, {100 * faster:.1f}% faster than {runner_up.layout.describe()} "
        f"({runner_up.step_s - best.step_s:.3g} s per step): {deciding(best, runner_up)}"
    )


def deciding(best: Candidate, runner_up: Candidate) -> str:
    """The terms that decide between the two: the two largest in the winner's favour, and the largest against it
    where one is (what it pays for the rest)."""
    mine, theirs = dict(best.parts), dict(runner_up.parts)
    gaps = sorted(((theirs.get(k, 0.0) - mine.get(k, 0.0), k) for k in mine | theirs), reverse=True)
    named = [f"{gap:.3g} s less {term}" for gap, term in gaps[:2] if gap > 0]
    if gaps[-1][0] < 0:
        named.append(f"for {-gaps[-1][0]:.3g} s more {gaps[-1][1]}")
    return ", ".join(named)


def explain(s: Search, memory: int) -> str:
    """`search --explain`: the winner's and the runner-up's step, term by term (`Candidate.parts`, adding up to the
    ranking's step time), their peak memory and headroom, and what decides between them (`why`)."""
    shown = s.best[:2]
    parts = [dict(c.parts) for c in shown]
    terms = dict.fromkeys(k for p in parts for k in p)  # the winner's order, then any the runner-up adds
    seconds = [(t, [p.get(t, 0.0) for p in parts]) for t in terms] + [("step", [c.step_s for c in shown])]
    both = len(shown) == 2
    rows = [("seconds per step", *(f"#{i} {c.layout.describe()}" for i, c in enumerate(shown, 1)),
             *(["#2 - #1"] if both else []))]  # fmt: skip
    rows += [(t, *(f"{v:.4g}" for v in vs), *([f"{vs[1] - vs[0]:+.4g}"] if both else [])) for t, vs in seconds]
    rows += [
        ("peak memory", *(readable_bytes(c.peak) for c in shown)),
        (f"headroom of {readable_bytes(memory)}", *(readable_bytes(memory - c.peak) for c in shown)),
    ]
    exposed = "exposed comm: what the estimator's overlap leaves on the critical path; FSDP's hides behind compute"
    return "\n".join([f"Where the step goes ({exposed}):", *_aligned(rows), why(s)])


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells as lines, each column as wide as its widest cell (a row may have fewer cells)."""
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def search_table(s: Search, dev: Device, memory: int, rows: int | None = None, explained: bool = False) -> str:
    """The ranking as text, for `python -m shardlab search`: its first `rows` layouts (None: all), then why the winner
    wins, in a line or (`explained`, `--explain`) term by term."""
    header = ("#", "mesh", "AC", "micro", "schedule", "peak GiB", "comm s/step by axis", "step s", "tokens/s/dev",
              "MFU")  # fmt: skip
    chose_fp8 = any(c.layout.fp8 is not None for c in s.best)  # `--fp8-choices`: a column for what it chose
    if chose_fp8:
        header = (*header[:4], "fp8", *header[4:])
    table = [header]
    for i, c in enumerate(s.best[:rows], 1):
        lay = c.layout
        schedule = "-" if lay.pp_schedule is None else f"{lay.pp_schedule} x{lay.pp_stages_per_rank}"
        if not lay.reshard_after_forward:
            schedule = "no reshard" if lay.pp_schedule is None else f"{schedule}, no reshard"
        comm = " ".join(f"{axis} {sec:.3g}" for axis, sec in c.comm_s) or "-"
        table.append((
            str(i), lay.mesh.describe().rsplit(" (", 1)[0], lay.activation_checkpoint, str(lay.micro_batches),
            *([lay.fp8 or "-"] if chose_fp8 else []), schedule, f"{c.peak / 2**30:.2f}", comm, f"{c.step_s:.4g}",
            f"{c.tokens_per_s_per_device:,.0f}", f"{100 * c.mfu:.1f}%",
        ))  # fmt: skip
    lines = [
        f"Search on {dev.name}, {readable_bytes(memory)} per rank: {s.layouts} layouts, {s.over_memory} dropped by their state "
        f"and activations before any probe and {s.too_big} as a sibling needing less memory was too big, {s.pruned} slower than "
        f"the top {len(s.best)} by their floors, {s.estimated} estimated ({s.probes} probes"
        + (f", {s.stored} read from earlier searches" if s.stored else "")
        + f") in {s.seconds:.1f} s",
        *_aligned(table),
        explain(s, memory) if explained else why(s),
    ]
    if s.unsearched:
        lines.append(stopped(s))
    return "\n".join(lines)


def stopped(s: Search) -> str:
    """Where the budget stopped the search, and how far from the fastest that leaves the pick."""
    left = f"{s.unsearched} layouts not looked at, each at least {s.floor_left:.3g} s per step (their floors)"
    if s.pick_within == 1.0:
        verdict = "the pick is faster than any of them"
    elif math.isinf(s.pick_within):
        verdict = "how much faster the fastest may be is not known (the model's blocks could not be counted)"
    else:
        verdict = f"the fastest may be up to {s.pick_within:.2f}x faster than the pick"
    return (
        f"Stopped at the budget after {s.seconds:.0f} s: {left}; {verdict}. The same command again reads this "
        "search's probes and goes further (--budget 0: no limit)"
    )


def search_json(s: Search) -> bytes:
    """The ranking for scripts: each candidate's layout, peak bytes, step time, tokens/s per device, MFU, comm."""
    return msgspec.json.encode(s)


def layout_recipe(cfg: Config, layout: Layout, world: int, source: str, own: bool, note: str) -> str:
    """A recipe file running `cfg`'s model and batch with `layout`: the whole config as data. `own`: the source recipe
    defines its own model or rules, which the file then takes from it (by its path, `source`)."""
    run = layout.config(cfg).resolve(world)
    data = pprint.pformat(msgspec.to_builtins(run), indent=4, width=116, sort_dicts=False)
    lines = [
        f'"""{cfg.name} laid out by `python -m shardlab search`: {layout.describe()} on {world} ranks.',
        f'{note}"""',
        "",
        "import msgspec",
        "",
        "from shardlab import Config",
    ]
    if own:
        lines += ["from shardlab.cli.recipe import load_recipe", "", f"_source = load_recipe({source!r})"]
    lines += ["", f"config = msgspec.convert(\n{data},\n    Config,\n)"]
    if own:
        lines += ["", "", "def rules(cfg):", "    return _source.rules(cfg)", "", "", "def model(cfg):",
                  "    return _source.model(cfg)"]  # fmt: skip
    return "\n".join(lines) + "\n"
