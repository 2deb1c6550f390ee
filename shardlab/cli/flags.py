"""The verbs' own flags (`--world N`, `--top K`, ...) as structs, and the one tyro call that reads them.

Each verb's flags are a frozen struct; its docstring and its fields' docstrings are what the verb's `--help` prints.
With a recipe, one tyro call reads the flags and the recipe's config together, both without a prefix: the flags
read `--world N`, the config's fields `--section.field VALUE` with the recipe's values as defaults, in any order.
A flag's value it cannot take fails as one line, `--flag 'VALUE': expected ...`, not in tyro's box.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import math
from collections.abc import Callable
from typing import Annotated, Generic, Literal, TypeVar

import tyro
from tyro.constructors import PrimitiveConstructorSpec

from shardlab._base import Frozen, deferred_checks
from shardlab._errors import ShardlabError
from shardlab.config import Config

T = TypeVar("T")
F = TypeVar("F", bound=Frozen)


class FlagError(Exception):
    """A flag given a value it cannot take. Not a ValueError: tyro draws its box around those; `parse` re-raises
    this one as a one-line ShardlabError."""


def _flag(name: str, metavar: str, read: Callable[[str], T | None], expected: str) -> PrimitiveConstructorSpec:
    """How tyro reads flag `name`: `read` returns None for a value the flag cannot take, which fails as one line
    naming the flag and what it expects."""

    def instance_from_str(args: list[str]) -> T:
        value = read(args[0])
        if value is None:
            raise FlagError(f"{name} {args[0]!r}: expected {expected}")
        return value

    return PrimitiveConstructorSpec(
        nargs=1, metavar=metavar, instance_from_str=instance_from_str, is_instance=lambda _: True,
        str_from_instance=lambda value: [str(value)],
    )  # fmt: skip


def _integer(least: int) -> Callable[[str], int | None]:
    """A reader of whole numbers >= least (digits only: `-1` and `2.0` are refused)."""
    return lambda text: int(text) if text.isdigit() and int(text) >= least else None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _gib(text: str) -> float | None:
    value = _number(text)
    return value if value is not None and value > 0 else None


def _seconds(text: str) -> float | None:
    value = _number(text)
    return value if value is not None and 0 <= value < math.inf else None


def _path(text: str) -> str | None:
    return text or None


FP8_RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")
"""plan.fp8's values (`shardlab.sharding.fp8.Fp8Recipe`)."""


def _fp8_choices(text: str) -> tuple[str, ...] | None:
    """A comma-separated list of plan.fp8 values, each once."""
    choices = tuple(text.split(","))
    return choices if choices and len(set(choices)) == len(choices) and set(choices) <= set(FP8_RECIPES) else None


class _Debug(Frozen):
    """The flag every verb has."""

    debug: tyro.conf.FlagCreatePairsOff[bool] = False
    """Show any error with its traceback, on every rank, instead of one line (sets SHARDLAB_DEBUG=1 for this process
    and the ranks it starts)."""


class _World(_Debug):
    """The flag of every verb that lays a recipe out on ranks."""

    world: Annotated[
        int | None,
        _flag("--world", "N", _integer(1), "a positive integer number of ranks"),
        tyro.conf.arg(help_behavior_hint="(default: the launcher's WORLD_SIZE, else the product of the fixed axes)"),
    ] = None
    """World size: the size of the mesh's -1 axis."""


def _resources(text: str) -> dict[str, float] | None:
    """A JSON object of Ray resource names to amounts > 0, e.g. '{"GPU": 1}'."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not value:
        return None
    ok = all(isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf for v in value.values())
    return {str(k): float(v) for k, v in value.items()} if ok else None


class RayFlags(Frozen):
    """Where and how `--launcher ray` starts the ranks (LLaMA-Factory's ray_* arguments, as flags)."""

    address: Annotated[
        str | None,
        _flag("--ray.address", "ADDR", _path, "the address of a Ray cluster's head, e.g. 10.0.0.5:6379"),
        tyro.conf.arg(help_behavior_hint="(default: env RAY_ADDRESS, else a local Ray instance)"),
    ] = None
    """Join the Ray cluster at this address (as `ray start --address` takes it); without one, start a local one."""
    resources_per_worker: Annotated[
        dict[str, float] | None,
        _flag(
            "--ray.resources-per-worker", "JSON", _resources,
            "a JSON object of Ray resources per rank with amounts > 0, e.g. '{\"GPU\": 1}'",
        ),
        tyro.conf.arg(help_behavior_hint='(default: {"GPU": 1} on CUDA, else {"CPU": 1})'),
    ] = None  # fmt: skip
    """What each rank reserves on the cluster."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How Ray places the ranks on nodes: PACK on as few nodes as it can, SPREAD over as many; STRICT_ refuses to
    start otherwise."""


class TrainFlags(_World):
    """Train the recipe's model: check everything before any rank starts, then train on --world ranks (several
    through torch.distributed.run or as Ray workers, one in this process; under torchrun or srun this process is one
    of the ranks)."""

    max_restarts: Annotated[
        int, _flag("--max-restarts", "N", _integer(0), "how many times to restart, an integer >= 0")
    ] = 0
    """Start the ranks again, up to N times, when one dies (torch.distributed.run's restarts); each restart resumes
    from the run's last checkpoint; an error a restart would meet again (a bad value: a ShardlabError) is not retried;
    ignored under an outside launcher (torchrun, srun). With --launcher ray, Ray Train's FailureConfig(max_failures=N)."""
    launcher: Literal["torchrun", "ray"] = "torchrun"
    """What starts the ranks: torch.distributed.run on this node, or Ray Train's TorchTrainer as Ray workers on a Ray
    cluster (`pip install 'shardlab[ray]'`; see --ray.*)."""
    ray: RayFlags = RayFlags()
    """Ray cluster and placement, read with --launcher ray."""


class PlanFlags(_World):
    """Print the layout (per-parameter specs, placements, bytes per rank) and exit; no processes."""


class EstimateFlags(_World):
    """Per-rank memory, communication per mesh axis, FLOPs and a roofline step time (worst rank), from the plan and
    one micro batch run on fake tensors in a fake world of --world ranks; no devices."""

    device: Annotated[str, tyro.conf.arg(metavar="D")] = "h100"
    """The accelerator to predict step time for: a name from shardlab/estimate/devices.toml (h100, h100-96gb-500w,
    h200, a100, b200); a .toml or .json file describing one device in the same fields (docs/estimate.md, Devices);
    cpu: this machine, measured once (matmul, memory and gloo bandwidth with --world ranks sharing its cores) and
    cached."""


class SearchFlags(EstimateFlags):
    """Every layout of the recipe's model and batch on --world ranks (needed here): mesh, checkpointing, micro
    batches, pipeline schedule, resharding; a --mesh.AXIS override pins that axis. Those that fit --memory are ranked
    by estimated step time. Probes are kept in SHARDLAB_CACHE/probes (~/.cache/shardlab/probes) for later searches of
    the model."""

    memory: Annotated[
        float | None,
        _flag("--memory", "GiB", _gib, "GiB per rank, a number > 0"),
        tyro.conf.arg(help_behavior_hint="(default: the device's)"),
    ] = None
    """Memory per rank a layout must fit, in GiB."""
    top: Annotated[int, _flag("--top", "K", _integer(1), "how many layouts to show, an integer >= 1")] = 5
    """How many layouts to show."""
    out: Annotated[
        str | None,
        _flag("--out", "FILE", _path, "the path of the recipe file to write"),
        tyro.conf.arg(help_behavior_hint="(optional)"),
    ] = None
    """Write the fastest layout as a recipe file here (same model and batch), which `python -m shardlab FILE` runs."""
    json: tyro.conf.FlagCreatePairsOff[bool] = False
    """Print the ranking as JSON, for scripts."""
    explain: tyro.conf.FlagCreatePairsOff[bool] = False
    """After the ranking, the winner's and the runner-up's step time term by term (compute, recomputation, exposed
    communication per axis, pp sends, bubble, optimizer), peak memory and headroom, and the terms that decide. With
    --top 1 the runner-up is still searched for (as with --top 2) and shown only there."""
    budget: Annotated[
        float, _flag("--budget", "SECONDS", _seconds, "seconds the search may take, a number >= 0 (0: no limit)")
    ] = 600.0
    """Stop after this many seconds once a layout fits (0: no limit), and say how far from the fastest the pick may
    be."""
    fp8_choices: Annotated[
        tuple[str, ...] | None,
        _flag(
            "--fp8-choices",
            "R,R",
            _fp8_choices,
            f"plan.fp8 values separated by commas, each once: {', '.join(FP8_RECIPES)}",
        ),
        tyro.conf.arg(help_behavior_hint="(default: the recipe's plan.fp8 only)"),
    ] = None
    """Let the search choose FP8 too: every layout with each of these plan.fp8 values (e.g. none,tensorwise)."""


class ExportFlags(_Debug, kw_only=True):
    """Write the newest checkpoint of RUN_DIR (or a step directory) as a Hugging Face directory (config.json and
    safetensors)."""

    run_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR")]
    """The run directory, or one of its step directories."""
    to_hf: Annotated[str, _flag("--to-hf", "OUT", _path, "the directory to write the Hugging Face model to")]
    """The directory to write."""
    recipe: Annotated[
        str | None,
        _flag("--recipe", "RECIPE", _path, "the recipe file of the run"),
        tyro.conf.arg(help_behavior_hint="(optional)"),
    ] = None
    """The run's recipe, needed for a recipe's own model: it names the transformers class (HFExport)."""


class _Command(Frozen, Generic[F]):
    """A verb's flags and a recipe's config, read by one tyro call; `name=""` keeps both free of a prefix."""

    flags: Annotated[F, tyro.conf.arg(name="")]
    config: Annotated[Config, tyro.conf.arg(name="")]


def parse(
    verb: type[F], args: list[str], prog: str, config: Config | None = None, console_outputs: bool = True
) -> tuple[F, Config | None]:
    """Read a verb's flags from `args`, and given a recipe's `config`, the overrides of its fields too; `--help`
    prints them (tyro exits 0). The config is built without its checks (`Config.validated` runs them, as one line).
    """
    description = inspect.cleandoc(verb.__doc__ or "")
    if config is None and issubclass(verb, _World):
        description += (
            f"\n\nThe config's fields (--section.field VALUE) come with a RECIPE: `{prog} --help` lists them with "
            "the recipe's values as defaults."
        )
    drawn = io.StringIO()  # tyro draws a malformed command line's error as a box on stderr: it becomes one line
    try:
        with deferred_checks(), contextlib.redirect_stderr(drawn):
            if config is None:
                return tyro.cli(
                    verb, args=args, prog=prog, description=description, console_outputs=console_outputs
                ), None
            both = tyro.cli(
                _Command[verb],
                default=_Command(flags=verb(), config=config),
                args=args,
                prog=prog,
                description=description,
                console_outputs=console_outputs,
                config=(tyro.conf.AvoidSubcommands,),  # a recipe's model.moe / rope_scaling: plain --flags
            )
    except FlagError as err:
        raise ShardlabError(str(err)) from None
    except SystemExit as done:
        if done.code in (0, None):  # --help
            raise
        raise ShardlabError(box_line(drawn.getvalue(), prog)) from None
    return both.flags, both.config


def box_line(box: str, prog: str) -> str:
    """tyro's error box as one line: its message, the flag it suggests, where the help is."""
    lines = [line.strip().strip("│|╭╮╰╯+").strip() for line in box.splitlines()]  # unicode or ASCII borders
    lines = [line for line in lines if line][1:]  # the title's line (the top border, or above a rule)
    paragraphs: list[list[str]] = [[]]
    for line in lines:  # rules part the box: the message, wrapped over lines, is its first paragraph
        if set(line) - set("─-+ "):
            paragraphs[-1].append(line)
        elif paragraphs[-1]:
            paragraphs.append([])
    first = paragraphs[0]
    body = [line for line in lines if set(line) - set("─-+ ")]
    body = body[: next((i for i, line in enumerate(body) if line.startswith("For full helptext")), len(body))]
    if not body:
        return f"{prog}: a malformed command line; see `{prog} --help`"
    if first and first[0].endswith(":") and len(body) > 1:  # "Missing from PROG:", then the flags
        message = f"{first[0][:-1]}: {body[1]}"
    else:
        message = " ".join(first or body[:1]).rstrip(".")
    if "Perhaps you meant:" in body and body.index("Perhaps you meant:") + 1 < len(body):
        message += f" (did you mean {body[body.index('Perhaps you meant:') + 1]}?)"
    return f"{message}; see `{prog} --help`"
