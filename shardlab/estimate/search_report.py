"""A search's ranking for people and scripts: the table `python -m shardlab search` prints, one line on why the
winner wins, the JSON of `--json`, and the recipe file `--out` writes for the winner."""

from __future__ import annotations

import math
import pprint

import msgspec

from shardlab.config import Config
from shardlab.estimate.device import Device
from shardlab.estimate.layouts import Layout
from shardlab.estimate.search import Candidate, Search, readable_bytes


def why(best: Candidate, runner_up: Candidate | None) -> str:
    """One line on why the winner wins: against the runner-up, the part of the step that differs most."""
    if runner_up is None:
        return f"{best.layout.describe()} is the only layout that fits"
    mine, theirs = dict(best.parts), dict(runner_up.parts)
    part = max(mine, key=lambda k: theirs[k] - mine[k])
    faster = runner_up.step_s / best.step_s - 1
    if faster < 1e-3:
        return f"{best.layout.describe()} ties with {runner_up.layout.describe()} (within 0.1%)"
    return (
        f"{best.layout.describe()} wins, {100 * faster:.1f}% faster than {runner_up.layout.describe()}: "
        f"{part} {mine[part]:.3g} s against {theirs[part]:.3g} s per step"
    )


def search_table(s: Search, dev: Device, memory: int) -> str:
    """The ranking as text, for `python -m shardlab search`."""
    header = ("#", "mesh", "AC", "micro", "schedule", "peak GiB", "comm s/step by axis", "tokens/s/dev", "MFU")
    chose_fp8 = any(c.layout.fp8 is not None for c in s.best)  # `--fp8-choices`: a column for what it chose
    if chose_fp8:
        header = (*header[:4], "fp8", *header[4:])
    rows = [header]
    for i, c in enumerate(s.best, 1):
        lay = c.layout
        schedule = "-" if lay.pp_schedule is None else f"{lay.pp_schedule} x{lay.pp_stages_per_rank}"
        if not lay.reshard_after_forward:
            schedule = "no reshard" if lay.pp_schedule is None else f"{schedule}, no reshard"
        comm = " ".join(f"{axis} {sec:.3g}" for axis, sec in c.comm_s) or "-"
        rows.append((
            str(i), lay.mesh.describe().rsplit(" (", 1)[0], lay.activation_checkpoint, str(lay.micro_batches),
            *([lay.fp8 or "-"] if chose_fp8 else []), schedule, f"{c.peak / 2**30:.2f}", comm, f"{c.tokens_per_s_per_device:,.0f}", f"{100 * c.mfu:.1f}%",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        f"Search on {dev.name}, {readable_bytes(memory)} per rank: {s.layouts} layouts, {s.over_memory} dropped by their state "
        f"and activations before any probe and {s.too_big} as a sibling needing less memory was too big, {s.pruned} slower than "
        f"the top {len(s.best)} by their floor alone, {s.estimated} estimated ({s.probes} probes"
        + (f", {s.stored} read from earlier searches" if s.stored else "")
        + f") in {s.seconds:.1f} s",
        *("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows),
        why(s.best[0], s.best[1] if len(s.best) > 1 else None),
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
