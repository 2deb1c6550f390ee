"""The layout search for every recipe in recipes/, as a user runs it: one `python -m shardlab search` each.

    python scripts/search_recipes.py [--recipes NAME ...] [--world NAME=N ...] [--cache DIR] [--budget S] [--out FILE]

docs/search.md is its output for every recipe (`--out docs/search.md` writes the page: its introduction, then the
table).

Each recipe is searched on the world it is written for (WORLDS; --world NAME=N changes one) on H100s, the CLI's
default device, and the script prints a markdown table: layouts enumerated, estimated, probes run and read from
the probe store, the search's own seconds and the wall clock of the whole command, the winner with its tokens/s
per device and peak memory, and how far from the fastest the budget (--budget, the CLI's) left it: 1.00 where the
search was exhaustive or the pick beats every floor it left. Each search starts from an empty probe store (a first search's time) unless --cache
names one to read and keep (SHARDLAB_CACHE: an earlier search's probes are read, not run). The
recipes that take a local transformers model (`model.hf_path`) get one made here by scripts/make_chat_model.py
(nothing is downloaded). A search that fails is a row with its one-line error: the table says what did not run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from shardlab.estimate.search_result import Search

ROOT = Path(__file__).resolve().parents[1]
WORLDS = {
    "llama3_1b": 4, "llama3_8b": 8, "llama3_70b": 256, "llama3_405b": 512, "llama3_405b_pp": 512,
    "qwen2_5_72b": 512, "qwen3_32b": 256, "mixtral_8x7b": 64, "llama_debug": 4, "llama_fsdp": 4, "llama_fsdp_tp": 4,
    "llama_hsdp_tp": 8, "llama_pp": 4, "llama_3d": 8, "llama_cp": 4, "moe_ep": 4, "moe_ep_tp": 4, "moe_fsdp": 4,
    "custom_gpt": 4, "hf_causal_lm": 4, "sft_hf": 4,
}  # fmt: skip
"""The world each recipe is written for: its docstring's, or its mesh's without -1 axes (4 where it fills one)."""
NEEDS_HF_DIR = ("hf_causal_lm", "sft_hf")


def search(name: str, world: int, hf_dir: Path | None, cache: Path, budget: float | None) -> dict:
    """One search, through the CLI with `cache` as SHARDLAB_CACHE: its JSON, wall seconds, and the error line if it
    failed."""
    args = [sys.executable, "-m", "shardlab", "search", f"recipes/{name}.py", "--world", str(world), "--json"]
    if name in NEEDS_HF_DIR:
        args += ["--model.hf-path", str(hf_dir / "model")]
    if budget is not None:
        args += ["--budget", str(budget)]
    start = time.perf_counter()
    env = os.environ | {"SHARDLAB_CACHE": str(cache)}
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        error = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"name": name, "world": world, "wall": wall, "error": error}
    return {"name": name, "world": world, "wall": wall, "found": msgspec.json.decode(done.stdout, type=Search)}


def recipe_layout(name: str, world: int, hf_dir: Path | None, cache: Path) -> dict:
    """The recipe's own layout on `world` ranks, estimated by `python -m shardlab estimate` (its mesh, checkpointing,
    tokens/s per device and peak GiB, read off the table); where the recipe fixes a mesh of another size, that size;
    the error line where it cannot run there."""
    from shardlab.cli.recipe import load_recipe

    fixed = load_recipe(ROOT / "recipes" / f"{name}.py").config.mesh
    if fixed.is_resolved and fixed.world_size != world:
        return {"error": f"written for {fixed.world_size} rank(s)"}
    args = [sys.executable, "-m", "shardlab", "estimate", f"recipes/{name}.py", "--world", str(world)]
    if name in NEEDS_HF_DIR:
        args += ["--model.hf-path", str(hf_dir / "model")]
    env = os.environ | {"SHARDLAB_CACHE": str(cache)}
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
    mesh, ac = re.search(r"Estimate for mesh (.*?) \(", done.stdout), re.search(r"checkpointing (\w+)\)", done.stdout)
    speed, peak = (
        re.search(r"([\d,]+) tokens/s per device", done.stdout),
        re.search(r"peak\s+([\d.]+) GiB", done.stdout),
    )
    if done.returncode != 0 or not (mesh and ac and speed and peak):
        return {"error": "failed: " + (done.stderr.strip().splitlines() or ["(no output)"])[-1]}
    return {"layout": f"{mesh[1]}, AC {ac[1]}", "speed": float(speed[1].replace(",", "")), "peak": float(peak[1])}


def row(r: dict, own: dict) -> str:
    head = f"| {r['name']} | {r['world']} |"
    mine = f"{own['error']} | - | -" if "error" in own else f"{own['layout']} | {own['speed']:,.0f} | {own['peak']:.1f}"
    if "error" in r:
        return f"{head} - | - | - | - | - | {r['wall']:.0f} | failed: {r['error']} | - | - | - | {mine} | - |"
    s: Search = r["found"]
    best = s.best[0]
    gain = f"{best.tokens_per_s_per_device / own['speed']:.2f}" if "error" not in own else "-"
    return (
        f"{head} {s.layouts:,} | {s.estimated:,} | {s.probes:,} | {s.stored:,} | {s.seconds:.0f} | {r['wall']:.0f} | "
        f"{best.layout.describe()} | {best.tokens_per_s_per_device:,.0f} | {best.peak / 2**30:.1f} | "
        f"{s.pick_within:.2f} | {mine} | {gain} |"
    )


DOC = """# The search over every recipe

`python -m shardlab search RECIPE --world N` for each recipe in recipes/, on the world it is written for, on H100s
(the CLI's default device, 80 GB), each from an empty probe store (a first search's time, on this project's 2-core
CI machine), beside the recipe's own layout as `python -m shardlab estimate` gives it on the same world. The
recipes for large models follow torchtitan's published layouts (their docstrings say which); the debug recipes are
laid out for tests, not for speed. Written by

    {command}

Columns: layouts enumerated, estimated, probes run and read from the store, the search's own seconds and the whole
command's, the winner with its estimated tokens/s per device and peak memory, and how far the pick may be from the
fastest (`pick within`: 1.00 where the search was exhaustive or the pick beats every floor it left; above 1.00 where
the budget stopped it), then the recipe's layout, its estimate, and the winner's tokens/s over the recipe's. Every
number is an estimate (docs/estimate.md states the model and how it compares with measured runs); a search that
fails is a row with its one-line error.

"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=sorted(p.stem for p in (ROOT / "recipes").glob("*.py")))
    parser.add_argument("--world", nargs="+", default=[], metavar="NAME=N")
    parser.add_argument("--cache", type=Path, help="the probe store's SHARDLAB_CACHE (default: empty per search)")
    parser.add_argument("--budget", type=float, help="seconds per search (default: the CLI's; 0: no limit)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    worlds = WORLDS | {name: int(n) for name, n in (w.split("=", 1) for w in args.world)}
    if unknown := [n for n in args.recipes if n not in worlds]:
        parser.error(f"no world for {', '.join(unknown)}: give --world NAME=N")
    lines = [
        "| recipe | world | layouts | estimated | probes | read | search s | wall s | winner | tokens/s/dev | peak GiB "
        "| pick within | recipe's layout | tokens/s/dev | peak GiB | winner / recipe |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = None
        if any(n in NEEDS_HF_DIR for n in args.recipes):
            hf_dir = Path(tmp)
            subprocess.run([sys.executable, "scripts/make_chat_model.py", tmp], cwd=ROOT, check=True,
                           capture_output=True)  # fmt: skip
        for name in args.recipes:
            cache = args.cache or Path(tmp) / "cache" / name
            found = search(name, worlds[name], hf_dir, cache, args.budget)
            lines.append(row(found, recipe_layout(name, worlds[name], hf_dir, cache)))
            print(lines[-1], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python scripts/search_recipes.py " + " ".join(sys.argv[1:])
        doc = DOC.format(command=command) if args.out.suffix == ".md" else ""
        args.out.write_text(doc + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
