"""python -m shardlab [VERB] RECIPE [flags]: recipe + the verb's flags and the config's overrides (one tyro call,
`shardlab.cli.flags`) -> Config -> checks -> launch -> train, or plan, estimate, search; export converts a run.

Every check (config, mesh vs world size, rules vs model, unsupported axes) runs here, in the first
process, before torchrun starts anything; what fails later, on the ranks, comes back as one line too.
"""

from __future__ import annotations

import gc
import math
import os
import sys

from shardlab._errors import DEBUG_ENV, ShardlabError, debugging, one_line
from shardlab._version import version
from shardlab.cli._parent_death import LAUNCHER_ENV, die_with_parent
from shardlab.cli.flags import EstimateFlags, ExportFlags, PlanFlags, SearchFlags, TrainFlags, parse
from shardlab.cli.ray_launch import RAY_RANK_ENV
from shardlab.cli.torchrun import ERROR_FILE_ENV, EXIT_STOPPED, STOPPED_FILE_ENV

USAGE = """usage: python -m shardlab RECIPE [--section.field VALUE ...] [--world N] [--max-restarts N]
                                [--launcher torchrun|ray] [--ray.address ADDR] [--ray.resources-per-worker JSON]
                                [--ray.placement-strategy PACK|SPREAD|STRICT_PACK|STRICT_SPREAD]
       python -m shardlab plan RECIPE [--section.field VALUE ...] [--world N]
       python -m shardlab estimate RECIPE [--section.field VALUE ...] [--world N] [--device D]
       python -m shardlab search RECIPE --world N [--device D] [--memory GiB] [--top K] [--out FILE] [--json]
                                [--explain] [--budget SECONDS] [--section.field VALUE ...]
       python -m shardlab export RUN_DIR --to-hf OUT [--recipe RECIPE]
       python -m shardlab --version

  RECIPE      a Python file defining `config = shardlab.Config(...)` (see recipes/); with no verb, train it
  plan        print the layout (per-parameter specs, placements, bytes per rank) and exit; no processes
  estimate    per-rank memory, communication per mesh axis, FLOPs and a roofline step time, on fake tensors
  search      every layout of the recipe's model on N ranks, those that fit ranked by estimated step time
  export      write a run's newest checkpoint as a Hugging Face directory

`python -m shardlab VERB --help` lists a verb's flags; `python -m shardlab [VERB] RECIPE --help` adds every config
field (--section.field VALUE) with the recipe's values as defaults."""

VERBS = {"plan": PlanFlags, "estimate": EstimateFlags, "search": SearchFlags, "export": ExportFlags}
"""The verbs a command line may start with, and their flags; without one it trains a recipe (TrainFlags)."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if args[0] == "--version":
        print(f"shardlab {version()}")
        return 0
    command = args.pop(0) if args[0] in VERBS else "train"
    if "--debug" in args:  # tyro reads it with the verb's flags; seen here too, for an error before they are read
        os.environ[DEBUG_ENV] = "1"
    try:
        if command == "export":
            return _export(parse(ExportFlags, args, "python -m shardlab export")[0])
        recipe_path = args.pop(0) if args and not args[0].startswith("-") else None
        return _run(command, recipe_path, args)
    except Exception as err:
        return _fail(err)


def _fail(err: Exception) -> int:
    """A rank that `relaunch` started leaves one line for the first process to print and exits quietly; any other
    process prints one line: a ShardlabError's message (a bad value: exit 2), or any other error's type, message and
    place (exit 1). SHARDLAB_DEBUG=1 (or --debug) raises the error instead, with its traceback."""
    from shardlab.cli.torchrun import report

    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file and "LOCAL_RANK" in os.environ:
        return report(err, error_file, int(os.environ.get("RANK", "0")))
    if isinstance(err, ShardlabError):
        print(f"error: {err}", file=sys.stderr)
        return 2
    if debugging():
        raise err
    print(f"error: {one_line(err)}", file=sys.stderr)
    return 1


def _run(command: str, recipe_path: str | None, args: list[str]) -> int:
    from shardlab.cli.launch import nproc_for, relaunch
    from shardlab.cli.recipe import load_recipe
    from shardlab.parallel.world import init_distributed, under_launcher

    verb = VERBS.get(command, TrainFlags)
    prog = f"python -m shardlab{'' if command == 'train' else ' ' + command}"
    if recipe_path is None:
        parse(verb, args, f"{prog} RECIPE")  # --help lists the verb's flags here; a bad value fails as one line
        raise ShardlabError(f"{command}: expected a RECIPE first, e.g. `{prog} recipes/llama_fsdp_tp.py`")
    recipe = load_recipe(recipe_path)
    launched = under_launcher()
    rank = int(os.environ.get("RANK", "0"))
    flags, cfg = parse(verb, args, f"{prog} {recipe_path}", recipe.config, console_outputs=rank == 0)
    cfg = cfg.validated()
    on_ray = command == "train" and flags.launcher == "ray" and not launched
    if on_ray:
        from shardlab.cli.ray_cluster import import_ray

        import_ray()  # a missing ray is one line before anything else runs
    if command == "search":
        return _search(cfg, recipe, flags, _pinned_axes(args, cfg))
    if launched:
        world = int(os.environ["WORLD_SIZE"])
    elif (world := flags.world) is None:
        world = math.prod(s for s in cfg.mesh.axis_sizes if s != -1)  # a -1 axis gets size 1 unless --world says more
        if command in ("plan", "estimate") and -1 in cfg.mesh.axis_sizes:
            axis = cfg.mesh.axis_names[cfg.mesh.axis_sizes.index(-1)]
            print(f"note: no --world: {axis} (-1 in the recipe) takes size 1, a world of {world}; "
                  f"--world N {command}s N ranks", file=sys.stderr)  # fmt: skip
    cfg = cfg.resolve(world)
    from shardlab.models import provider_for
    from shardlab.models.provider import check_layout
    from shardlab.training.loop import eager_fp8_note, plan_model

    provider = provider_for(cfg, recipe.model(cfg))
    check_layout(cfg, provider)
    _, plan = plan_model(cfg, recipe.rules(cfg), provider)
    if command == "plan":
        from shardlab.training.step import group_names

        print(plan.table(groups=group_names([p.fqn for p in plan.params], cfg.optim)))
        return 0
    if command == "estimate":
        from shardlab.estimate import estimate
        from shardlab.estimate.devices import device
        from shardlab.estimate.estimate_table import estimate_table

        dev = device(flags.device, cfg.mesh.world_size)  # cpu: this machine as the layout's ranks share it
        print(estimate_table(estimate(cfg, plan, recipe.rules(cfg), dev, provider), cfg, dev))
        return 0
    cfg = _resume_on_restart(cfg)
    _check_data(cfg, provider.vocab_size)
    _check_run(cfg)
    max_restarts = flags.max_restarts
    started_here = ERROR_FILE_ENV in os.environ or RAY_RANK_ENV in os.environ  # a rank `relaunch` or Ray started
    if rank == 0 and not started_here and (note := eager_fp8_note(cfg)):
        print(note, file=sys.stderr, flush=True)
    if flags.launcher == "ray" and launched and rank == 0 and not started_here:
        print(
            "shardlab: --launcher ray is ignored: an outside launcher (torchrun, srun) started this process",
            flush=True,
        )
    if max_restarts and launched and rank == 0 and not started_here:
        print(
            f"shardlab: --max-restarts {max_restarts} is ignored: an outside launcher (torchrun, srun) started this "
            "process; ask it for restarts (torchrun --max-restarts)",
            flush=True,
        )
    if on_ray:
        from shardlab.cli.ray_launch import launch

        many = world > 1
        restarts = f", restarting {'them' if many else 'it'} up to {max_restarts} time{'s' * (max_restarts > 1)}"
        print(
            f"shardlab: launching {world} rank{'s' * many} ({cfg.mesh.describe()}) as {'' if many else 'a '}Ray "
            f"worker{'s' * many} through Ray Train's TorchTrainer{restarts if max_restarts else ''}",
            flush=True,
        )
        return launch(world, recipe_path, args, cfg, flags, entry=_run)
    if (world > 1 or max_restarts) and not launched:  # one rank too, when it is to be restarted
        many = world > 1
        restarts = f", restarting {'them' if many else 'it'} up to {max_restarts} time{'s' * (max_restarts > 1)}"
        print(
            f"shardlab: launching {world} rank{'s' * many} ({cfg.mesh.describe()}) through torch.distributed.run"
            f"{restarts if max_restarts else ''}",
            flush=True,
        )
        return relaunch(nproc_for(world), [recipe_path, *args], max_restarts=max_restarts)
    from shardlab.training._preemption import Preempted
    from shardlab.training.loop import train

    dist_info = init_distributed(cfg.train.device, host_collectives=cfg.plan.cpu_offload)
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


def _pinned_axes(args: list[str], cfg) -> dict[str, int]:
    """Mesh axes an override names (`--mesh.tp 8`): the search keeps them at the config's value."""
    from shardlab.sharding.mesh import AXES

    named = {a.split("=", 1)[0].removeprefix("--mesh.").replace("-", "_") for a in args if a.startswith("--mesh.")}
    pinned = {a: getattr(cfg.mesh, a) for a in (*AXES, "ep") if a in named}
    if any(size == -1 for size in pinned.values()):
        raise ShardlabError("search: a pinned mesh axis is -1; pin axes to sizes, the search fills the rest")
    return pinned


def _search(cfg, recipe, flags: SearchFlags, pinned: dict[str, int]) -> int:
    from pathlib import Path

    from shardlab.estimate.devices import device
    from shardlab.estimate.probe_store import ProbeStore
    from shardlab.estimate.search import search
    from shardlab.estimate.search_report import layout_recipe, search_json, search_table
    from shardlab.models import provider_for

    world = flags.world
    if world is None:
        raise ShardlabError("search: --world N is required (the number of ranks to lay the model out on)")
    if flags.explain and flags.json:
        raise ShardlabError("search: --explain is for the table; --json already holds each layout's parts and peak")
    dev = device(flags.device, world)
    memory = round((flags.memory or dev.memory_gib) * 2**30)
    provider = provider_for(cfg, recipe.model(cfg))
    store = ProbeStore(provider)  # probes an earlier search of this model measured are read, not run again
    top = max(flags.top, 2) if flags.explain else flags.top  # a runner-up to explain the winner against
    found = search(cfg, world, provider, recipe.rules, dev, memory, fixed=pinned, top=top, store=store,
                   budget=flags.budget or None, fp8=flags.fp8_choices or ())  # fmt: skip
    print(search_json(found).decode() if flags.json else search_table(found, dev, memory, flags.top, flags.explain))
    if flags.out:
        best = found.best[0]
        note = (
            f"Estimated {best.step_s:.3f} s per step, {best.tokens_per_s_per_device:,.0f} tokens/s per device and "
            f"{best.peak / 2**30:.1f} GiB peak on {dev.name} (shardlab/estimate/roofline.py states the model)."
        )
        own = recipe.model(cfg) is not None or recipe.rules(cfg) is not None
        Path(flags.out).write_text(layout_recipe(cfg, best.layout, world, str(recipe.path), own, note))
        if not flags.json:
            print(f"shardlab: wrote {flags.out}")
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


def _export(flags: ExportFlags) -> int:
    from pathlib import Path

    from shardlab.training.export import export_to_hf

    model = None
    if flags.recipe is not None:
        from shardlab.cli.recipe import load_recipe

        recipe = load_recipe(flags.recipe)
        model = recipe.model(recipe.config)
    step = export_to_hf(Path(flags.run_dir), Path(flags.to_hf), model)
    print(f"shardlab: wrote {step} as a Hugging Face directory {flags.to_hf}")
    return 0


def _resume_on_restart(cfg):
    """A restarted attempt (torchelastic's TORCHELASTIC_RESTART_COUNT > 0) resumes from the newest checkpoint in the
    run directory, whatever checkpoint.resume says (`none` or a path were for the first attempt); with none there
    yet it starts as the first attempt did."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" or cfg.checkpoint.resume == "auto":
        return cfg
    from pathlib import Path

    from msgspec.structs import replace

    from shardlab.training.checkpoint import complete

    if not complete(Path(cfg.run_dir) / "checkpoints"):
        return cfg
    return replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto"))


def _check_run(cfg) -> None:
    """What a training run needs beyond the layout, checked before any rank starts (plan and estimate skip it):
    the checkpoint to resume or start from (its files' presence and sizes; the ranks read the bytes), and the limits
    of sharded initialisation."""
    from pathlib import Path

    from shardlab.hf import read_hf_config
    from shardlab.training.checkpoint import resolve_resume
    from shardlab.training.loop import check_init

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
    from shardlab.training.evaluate import eval_loader, train_split

    tokenizer = run_tokenizer(cfg)
    make_loader(
        run_data(cfg), seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch, vocab_size=vocab_size,
        dp_rank=0, dp_size=1, tokenizer=tokenizer, split=train_split(cfg),
    )  # fmt: skip
    if cfg.eval.every:
        eval_loader(cfg, vocab_size=vocab_size, dp_rank=0, dp_size=1, micro_batches=1, tokenizer=tokenizer)


def run() -> None:
    """`python -m shardlab`: main, then the exit; a failed rank of a world that `relaunch` started leaves its
    one line for the launching process instead of exiting with a traceback. A rank `relaunch` started dies with its
    agent (which dies with the process the user started), and leaves without the interpreter's teardown whatever its
    code (`leave`): its run is saved and its files closed by then, and the teardown's C++ destructors of the process
    groups could still turn a finished run into a SIGABRT (seen under load after the last step)."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is not None and "LOCAL_RANK" in os.environ:
        die_with_parent(int(launcher))
    code = main()
    from shardlab.cli.torchrun import leave

    if os.environ.get(ERROR_FILE_ENV):
        leave(code)
    if sys.argv[1:2] in (["plan"], ["estimate"], ["search"]):
        # They have written all they write, and the exit's last collection would walk what they built (a search's
        # fake tensors and caches: about 1 s of 8B on 8 ranks' 10 s) to free nothing the exit does not.
        gc.freeze()
    sys.exit(code)
