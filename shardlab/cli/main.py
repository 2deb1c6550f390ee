"""python -m shardlab [plan] RECIPE [overrides]: recipe + tyro overrides -> Config -> checks -> launch -> train.

Every check (config, mesh vs world size, rules vs model, unsupported axes) runs here, in the first
process, before torchrun starts anything; what fails later, on the ranks, comes back as one line too.
"""

from __future__ import annotations

import math
import os
import sys

from shardlab.cli.torchrun import EXIT_STOPPED, STOPPED_FILE_ENV

USAGE = """usage: python -m shardlab RECIPE [--section.field VALUE ...] [--world N] [--max-restarts N]
       python -m shardlab plan RECIPE [--section.field VALUE ...] [--world N]
       python -m shardlab estimate RECIPE [--section.field VALUE ...] [--world N] [--device h100|h200|a100|b200]
       python -m shardlab search RECIPE --world N [--device D] [--memory GiB] [--top K] [--out FILE] [--json]
                                [--budget SECONDS] [--section.field VALUE ...]
       python -m shardlab export RUN_DIR --to-hf OUT [--recipe RECIPE]

  RECIPE      a Python file defining `config = shardlab.Config(...)` (see recipes/)
  plan        print the layout (per-parameter specs, placements, bytes per rank) and exit; no processes
  estimate    per-rank memory, communication per mesh axis, FLOPs and a roofline step time (worst rank), from
              the plan and one micro batch run on fake tensors in a fake world of that size; no devices
  search      every layout of the recipe's model and batch on N ranks (mesh, checkpointing, micro batches, pipeline
              schedule, resharding; a --mesh.AXIS override pins that axis), those that fit --memory (default: the
              device's) ranked by estimated step time; --top K rows (5), --json for scripts, --out FILE writes the
              winner as a recipe; probes are kept in SHARDLAB_CACHE/probes (~/.cache/shardlab/probes) for later
              searches of the model; --budget S stops it after S seconds once a layout fits (600; 0: no limit)
              and says how far from the fastest the pick may be
  export      write the newest checkpoint of RUN_DIR (or a step directory) as Hugging Face safetensors; a
              recipe's own model needs its recipe (--recipe), which names the transformers class (HFExport)
  --world N   world size for the mesh's -1 axis (default: the launcher's WORLD_SIZE, else the fixed axes' product)
  --device D  the accelerator `estimate` and `search` predict step time for (default h100); cpu: this machine,
              measured once (matmul, memory and gloo bandwidth with --world ranks sharing its cores) and cached
  --max-restarts N  start the ranks again, up to N times, when one dies (torch.distributed.run's restarts); each
              restart resumes from the run's last checkpoint; an error a restart would meet again (a ValueError:
              a bad value) is not retried; ignored under an outside launcher (torchrun, srun)
  RECIPE --help shows every field with the recipe's values as defaults."""


def _pop_flag(args: list[str], flag: str) -> str | None:
    """Remove `--flag VALUE` or `--flag=VALUE` from args (the rest goes to tyro) and return VALUE."""
    for i, a in enumerate(args):
        if a == flag or a.startswith(f"{flag}="):
            value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            del args[i : i + (1 if "=" in a else 2)]
            return value
    return None


def _pop_world(args: list[str]) -> int | None:
    value = _pop_flag(args, "--world")
    if value is not None and (not value.isdigit() or int(value) < 1):
        raise ValueError(f"--world {value!r}: expected a positive integer number of ranks")
    return None if value is None else int(value)


def _pop_max_restarts(args: list[str]) -> int:
    value = _pop_flag(args, "--max-restarts")
    if value is not None and not value.isdigit():
        raise ValueError(f"--max-restarts {value!r}: expected how many times to restart, an integer >= 0")
    return 0 if value is None else int(value)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command = args.pop(0) if args[0] in ("plan", "estimate", "search", "export") else "train"
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    recipe_path, overrides = args[0], args[1:]
    try:
        if command == "export":
            return _export(recipe_path, overrides)
        return _run(command, recipe_path, overrides)
    except Exception as err:
        return _fail(err)


def _fail(err: Exception) -> int:
    """A rank that `relaunch` started leaves one line for the first process to print and exits quietly; any
    other process prints a ValueError as one line (a bad value) and lets anything else raise."""
    from shardlab.cli.torchrun import ERROR_FILE_ENV, report

    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file and "LOCAL_RANK" in os.environ:
        return report(err, error_file, int(os.environ.get("RANK", "0")))
    if isinstance(err, ValueError):
        print(f"error: {err}", file=sys.stderr)
        return 2
    raise err


def _run(command: str, recipe_path: str, overrides: list[str]) -> int:
    import tyro

    from shardlab._base import deferred_checks
    from shardlab.cli.launch import nproc_for, relaunch
    from shardlab.cli.recipe import load_recipe
    from shardlab.config import Config
    from shardlab.parallel.world import init_distributed, under_launcher

    world = _pop_world(overrides)
    max_restarts = _pop_max_restarts(overrides)
    device_name = _pop_flag(overrides, "--device") if command in ("estimate", "search") else None
    search_flags = _pop_search_flags(overrides) if command == "search" else None
    recipe = load_recipe(recipe_path)
    launched = under_launcher()
    rank = int(os.environ.get("RANK", "0"))
    with deferred_checks():  # checks run in validated(): one line, not tyro's box
        cfg = tyro.cli(
            Config,
            default=recipe.config,
            args=overrides,
            prog=f"python -m shardlab {recipe_path}",
            console_outputs=rank == 0,
            config=(tyro.conf.AvoidSubcommands,),  # a recipe's model.moe / rope_scaling: plain --flags, no subcommand
        )
    cfg = cfg.validated()
    if command == "search":
        return _search(cfg, recipe, world, device_name, search_flags, _pinned_axes(overrides, cfg))
    if launched:
        world = int(os.environ["WORLD_SIZE"])
    elif world is None:
        world = math.prod(s for s in cfg.mesh.axis_sizes if s != -1)  # a -1 axis gets size 1 unless --world says more
    cfg = cfg.resolve(world)
    from shardlab.models import provider_for
    from shardlab.models.provider import check_layout
    from shardlab.train.loop import plan_model

    provider = provider_for(cfg, recipe.model(cfg))
    check_layout(cfg, provider)
    _, plan = plan_model(cfg, recipe.rules(cfg), provider)
    if command == "plan":
        from shardlab.train.step import group_names

        print(plan.table(groups=group_names([p.fqn for p in plan.params], cfg.optim)))
        return 0
    if command == "estimate":
        from shardlab.estimate import estimate, estimate_table
        from shardlab.estimate.devices import device

        dev = device(device_name or "h100")
        print(estimate_table(estimate(cfg, plan, recipe.rules(cfg), dev, provider), cfg, dev))
        return 0
    cfg = _resume_on_restart(cfg)
    _check_data(cfg, provider.vocab_size)
    _check_run(cfg)
    if max_restarts and launched and rank == 0:
        print(
            f"shardlab: --max-restarts {max_restarts} is ignored: an outside launcher (torchrun, srun) started this "
            "process; ask it for restarts (torchrun --max-restarts)",
            flush=True,
        )
    if (world > 1 or max_restarts) and not launched:  # one rank too, when it is to be restarted
        many = world > 1
        restarts = f", restarting {'them' if many else 'it'} up to {max_restarts} time{'s' * (max_restarts > 1)}"
        print(
            f"shardlab: launching {world} rank{'s' * many} ({cfg.mesh.describe()}) through torch.distributed.run"
            f"{restarts if max_restarts else ''}",
            flush=True,
        )
        return relaunch(nproc_for(world), [recipe_path, *overrides], max_restarts=max_restarts)
    from shardlab.train._preemption import Preempted
    from shardlab.train.loop import train

    dist_info = init_distributed(cfg.train.device)
    code = 0
    try:
        train(cfg, recipe.rules(cfg), device=dist_info.device, provider=provider)
    except Preempted as stopped:
        _announce(str(stopped), dist_info.rank, dist_info.local_rank)
        code = EXIT_STOPPED
    if dist_info.backend is not None:
        import torch.distributed as dist

        if code == EXIT_STOPPED:
            dist.barrier()  # no rank leaves before rank 0 has announced: a launcher stops the rest at the first exit
        dist.destroy_process_group()
    return code


SEARCH_BUDGET = 600.0
"""Seconds a search takes at most by default, once a layout fits (`--budget`)."""


def _pop_search_flags(args: list[str]) -> dict:
    """search's own flags: --memory GiB, --top K, --out FILE, --json, --budget SECONDS."""
    memory, top, out, budget = (_pop_flag(args, f) for f in ("--memory", "--top", "--out", "--budget"))
    as_json = "--json" in args
    if as_json:
        args.remove("--json")
    try:
        gib = None if memory is None else float(memory)
    except ValueError:
        gib = -1.0
    if gib is not None and not gib > 0:
        raise ValueError(f"--memory {memory!r}: expected GiB per rank, a number > 0")
    if top is not None and (not top.isdigit() or int(top) < 1):
        raise ValueError(f"--top {top!r}: expected how many layouts to show, an integer >= 1")
    if out == "":
        raise ValueError("--out: expected the path of the recipe file to write")
    try:
        seconds = SEARCH_BUDGET if budget is None else float(budget)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or math.isinf(seconds):
        raise ValueError(f"--budget {budget!r}: expected seconds the search may take, a number >= 0 (0: no limit)")
    return {"memory": gib, "top": 5 if top is None else int(top), "out": out, "json": as_json,
            "budget": seconds or None}  # fmt: skip


def _pinned_axes(overrides: list[str], cfg) -> dict[str, int]:
    """Mesh axes an override names (`--mesh.tp 8`): the search keeps them at the config's value."""
    from shardlab.sharding.mesh import AXES

    named = {a.split("=", 1)[0].removeprefix("--mesh.").replace("-", "_") for a in overrides if a.startswith("--mesh.")}
    pinned = {a: getattr(cfg.mesh, a) for a in (*AXES, "ep") if a in named}
    if any(size == -1 for size in pinned.values()):
        raise ValueError("search: a pinned mesh axis is -1; pin axes to sizes, the search fills the rest")
    return pinned


def _search(cfg, recipe, world: int | None, device_name: str | None, flags: dict, pinned: dict[str, int]) -> int:
    from pathlib import Path

    from shardlab.estimate.devices import device
    from shardlab.estimate.probe_store import ProbeStore
    from shardlab.estimate.search import search
    from shardlab.estimate.search_report import layout_recipe, search_json, search_table
    from shardlab.models import provider_for

    if world is None:
        raise ValueError("search: --world N is required (the number of ranks to lay the model out on)")
    dev = device(device_name or "h100", world)
    memory = round((flags["memory"] or dev.memory_gib) * 2**30)
    provider = provider_for(cfg, recipe.model(cfg))
    store = ProbeStore(provider)  # probes an earlier search of this model measured are read, not run again
    found = search(cfg, world, provider, recipe.rules, dev, memory, fixed=pinned, top=flags["top"], store=store,
                   budget=flags["budget"])  # fmt: skip
    print(search_json(found).decode() if flags["json"] else search_table(found, dev, memory))
    if flags["out"]:
        best = found.best[0]
        note = (
            f"Estimated {best.step_s:.3f} s per step, {best.tokens_per_s_per_device:,.0f} tokens/s per device and "
            f"{best.peak / 2**30:.1f} GiB peak on {dev.name} (shardlab/estimate/roofline.py states the model)."
        )
        own = recipe.model(cfg) is not None or recipe.rules(cfg) is not None
        Path(flags["out"]).write_text(layout_recipe(cfg, best.layout, world, str(recipe.path), own, note))
        if not flags["json"]:
            print(f"shardlab: wrote {flags['out']}")
    return 0


def _announce(line: str, rank: int, local_rank: int) -> None:
    """Say how the run stopped, once: where `relaunch` started the ranks, local rank 0 leaves the line for the first
    process of its node (which prints it once the launcher is done); elsewhere rank 0 prints it."""
    stopped_file = os.environ.get(STOPPED_FILE_ENV)
    if stopped_file and "LOCAL_RANK" in os.environ:
        if local_rank == 0:
            with open(stopped_file, "w") as f:
                f.write(line + "\n")
    elif rank == 0:
        print(f"shardlab: {line}", flush=True)


def _export(source: str, args: list[str]) -> int:
    from pathlib import Path

    from shardlab.train.checkpoint import export_to_hf

    given = " ".join(["export", source, *args])
    recipe_path = _pop_flag(args, "--recipe")
    out = _pop_flag(args, "--to-hf")
    if not out or args or recipe_path == "":
        raise ValueError(f"export: expected `export RUN_DIR --to-hf OUT [--recipe RECIPE]`, got {given!r}")
    model = None
    if recipe_path is not None:
        from shardlab.cli.recipe import load_recipe

        recipe = load_recipe(recipe_path)
        model = recipe.model(recipe.config)
    step = export_to_hf(Path(source), Path(out), model)
    print(f"shardlab: wrote {step} as a Hugging Face directory {out}")
    return 0


def _resume_on_restart(cfg):
    """A restarted attempt (torchelastic's TORCHELASTIC_RESTART_COUNT > 0) resumes from the newest checkpoint in the
    run directory, whatever checkpoint.resume says (`none` or a path were for the first attempt); with none there
    yet it starts as the first attempt did."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" or cfg.checkpoint.resume == "auto":
        return cfg
    from pathlib import Path

    from msgspec.structs import replace

    from shardlab.train.checkpoint import complete

    if not complete(Path(cfg.run_dir) / "checkpoints"):
        return cfg
    return replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto"))


def _check_run(cfg) -> None:
    """What a training run needs beyond the layout, checked before any rank starts (plan and estimate skip it):
    the checkpoint to resume or start from (its files' presence and sizes; the ranks read the bytes), and the limits
    of sharded initialisation."""
    from pathlib import Path

    from shardlab.hf import read_hf_config
    from shardlab.train.checkpoint import resolve_resume
    from shardlab.train.loop import check_init

    if cfg.checkpoint.resume not in ("auto", "none"):
        resolve_resume(cfg.checkpoint.resume, Path(cfg.run_dir) / "checkpoints", checksums=False)
    if cfg.checkpoint.init_from_hf is not None:
        read_hf_config(cfg.checkpoint.init_from_hf)
    check_init(cfg)


def _check_data(cfg, vocab_size: int) -> None:
    """Open the data once here, so a missing file or a too-small vocabulary fails before any rank starts (and datasets
    are tokenized into their cache once, not by every rank)."""
    from shardlab.data.loader import make_loader, run_data
    from shardlab.data.tokenizer import run_tokenizer
    from shardlab.train.evaluate import eval_loader, train_split

    tokenizer = run_tokenizer(cfg)
    make_loader(
        run_data(cfg), seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch, vocab_size=vocab_size,
        dp_rank=0, dp_size=1, tokenizer=tokenizer, split=train_split(cfg),
    )  # fmt: skip
    if cfg.eval.every:
        eval_loader(cfg, vocab_size=vocab_size, dp_rank=0, dp_size=1, micro_batches=1, tokenizer=tokenizer)


def run() -> None:
    """`python -m shardlab`: main, then the exit; a failed rank of a world that `relaunch` started leaves its
    one line for the launching process instead of exiting with a traceback."""
    code = main()
    from shardlab.cli.torchrun import ERROR_FILE_ENV, leave

    if code != 0 and os.environ.get(ERROR_FILE_ENV):
        leave(code)
    sys.exit(code)
