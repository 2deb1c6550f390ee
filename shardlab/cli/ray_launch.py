"""Launch on a Ray cluster: `python -m shardlab RECIPE --launcher ray` starts the world's ranks as Ray workers
through Ray Train's TorchTrainer, each running the same `train()` as under torchrun.

The first process (the driver) checks ray, the cluster and its resources (`shardlab.cli.ray_cluster`), then runs
TorchTrainer.fit: Ray Train makes the process group (gloo on CPU, nccl on CUDA) and each worker runs `rank_main`,
which enters the CLI as a launched rank (`shardlab.cli.main._run`). One small actor, `RunState`, carries what torchrun's files carry there:
each rank's output (Ray's own is switched off: what the user reads is shardlab's lines, as under torchrun), the first
failure as one line, the attempt number (a restart resumes from the last checkpoint) and a bad value, which ends the
run however many restarts are left. ray is imported only here and in ray_cluster, and only with `--launcher ray`.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from shardlab._errors import ShardlabError, debugging, first_line, one_line
from shardlab.cli._parent_death import LAUNCHER_ENV
from shardlab.cli.flags import RayFlags
from shardlab.cli.ray_cluster import check_resources, cluster_address, connect, import_ray, worker_resources
from shardlab.cli.torchrun import ERROR_FILE_ENV, EXIT_BAD_VALUE, EXIT_STOPPED, PEER_LOST, STOPPED_FILE_ENV
from shardlab.parallel.world import CUDA_INDEX_ENV, env_number

RAY_RANK_ENV = "SHARDLAB_RAY_RANK"
"""Set in a Ray worker while it runs a rank: `_run` then trains, as any launched rank does, without a note."""
FORWARDED = ("SHARDLAB_", "WANDB_", "HF_")
"""Environment variables (by prefix) the driver hands its ranks: on a cluster the workers do not inherit its env."""
PER_PROCESS = (RAY_RANK_ENV, CUDA_INDEX_ENV, ERROR_FILE_ENV, STOPPED_FILE_ENV, LAUNCHER_ENV)
"""Of those, what describes one process (set for the ranks that a launcher starts), never handed on."""
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
"""The workers' Ray environment: Ray Train's print patch would copy every print of a rank to its logger (stderr),
so each of rank 0's lines would come twice."""


def forwarded_env(env: Mapping[str, str]) -> dict[str, str]:
    """What of the driver's environment the ranks get (FORWARDED, less PER_PROCESS)."""
    return {k: v for k, v in env.items() if k.startswith(FORWARDED) and k not in PER_PROCESS}


class RunState:
    """The run's own channel between the ranks and the driver (a Ray actor, one per launch): output, failures,
    attempts. The first failure of an attempt wins (as torchrun's error file does)."""

    def __init__(self) -> None:
        self.output: list[tuple[int, str]] = []
        self.attempts: dict[int, int] = {}
        self.failure: str | None = None
        self.final: str | None = None
        self.started = 0
        self.announced = 0
        self.stopping = False

    def join(self, rank: int) -> tuple[int, str | None]:
        """A rank starts: its attempt number (0 first) and, if a bad value ended the run, its line."""
        attempt = self.attempts.get(rank, -1) + 1
        self.attempts[rank] = attempt
        self.started = max(self.started, attempt)
        return attempt, self.final

    def fail(self, line: str, final: bool) -> None:
        if self.failure is None:
            self.failure = line
        if final and self.final is None:
            self.final = line

    def died(self, lines: dict[int, str]) -> None:
        """Ray Train's own view of a failed attempt (ranks whose worker died say nothing themselves)."""
        if self.failure is None and lines:
            self.failure = lines[min(lines)]

    def write(self, stream: int, text: str) -> None:
        self.output.append((stream, text))

    def drain(self) -> tuple[list[tuple[int, str]], list[str]]:
        """The output since the last drain, and a warning line for each restart begun since."""
        out, self.output = self.output, []
        warnings = []
        if self.final is not None:  # not a restart: the run ends with the bad value's line
            self.announced = self.started
        while self.announced < self.started:
            self.announced += 1
            warnings.append(self.failure or "a rank failed")
            self.failure = None
        return out, warnings

    def last_failure(self) -> tuple[str | None, str | None]:
        return self.failure, self.final

    def stop(self) -> None:
        """The driver got SIGTERM: the ranks are to save and stop, as torchrun's would."""
        self.stopping = True

    def stop_requested(self) -> bool:
        return self.stopping


class _Relay(io.TextIOBase):
    """A rank's stdout or stderr, sent line by line to the driver (Ray's own log forwarding is off)."""

    def __init__(self, state: Any, stream: int) -> None:
        self.state, self.stream, self.buffer = state, stream, []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.buffer.append(text)
        if "\n" in text:
            self.flush()
        return len(text)

    def flush(self) -> None:
        if self.buffer:
            text, self.buffer = "".join(self.buffer), []
            self.state.write.remote(self.stream, text)


def rank_main(config: dict[str, Any]) -> int:
    """One rank, in a Ray Train worker (whose process group Ray Train has made): the CLI as a launched rank. A
    failure is recorded as one line and raised (Ray Train restarts the world, or ends it); a bad value that an
    earlier attempt met ends the run here without training."""
    import ray.train

    state = config["state"]
    rank = ray.train.get_context().get_world_rank()
    attempt, final = ray.get(state.join.remote(rank))
    if final is not None:
        return EXIT_BAD_VALUE
    os.environ.update(config["env"])
    os.environ[RAY_RANK_ENV] = "1"
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)  # where fault points and restarts read the attempt
    if ray.get_gpu_ids():
        from ray.train.torch import get_device

        os.environ[CUDA_INDEX_ENV] = str(get_device().index)  # this worker's GPU, not necessarily cuda:LOCAL_RANK
    if os.path.isdir(config["cwd"]):
        os.chdir(config["cwd"])  # relative paths (run_dir, data) as the user gave them
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Relay(state, 1), _Relay(state, 2)
    done = threading.Event()
    threading.Thread(target=_pass_stop_on, args=(state, done), name="shardlab-stop", daemon=True).start()
    try:
        return config["entry"]("train", config["recipe"], list(config["args"]))
    except Exception as err:
        if debugging():
            import traceback

            traceback.print_exception(err, file=sys.stderr)
        if isinstance(err, RuntimeError) and any(fragment in first_line(err) for fragment in PEER_LOST):
            raise RankFailed(f"rank {rank}: lost its connection to a rank that failed first") from None
        line = f"rank {rank}: {one_line(err)}"
        ray.get(state.fail.remote(line, isinstance(err, ShardlabError)))
        raise RankFailed(line) from None
    finally:
        done.set()
        for relay in (sys.stdout, sys.stderr):
            relay.flush()
        sys.stdout, sys.stderr = saved
        ray.get(state.write.remote(1, ""))  # every line this rank sent is in before it returns


def _pass_stop_on(state: Any, done: threading.Event, every_s: float = 0.5) -> None:
    """A rank's watch for the driver's SIGTERM: Ray Train runs the rank off the worker's main thread, where no
    signal handler can be installed, so the run is asked to stop as SIGTERM asks it (save after the step every rank
    agrees on, exit EXIT_STOPPED); asked again each time until the rank ends, in case its loop had not begun."""
    import ray

    from shardlab.training._preemption import request_stop

    while not done.wait(every_s):
        try:
            if ray.get(state.stop_requested.remote()):
                request_stop()
        except Exception:  # the run state is gone: the launch is over
            return


class RankFailed(Exception):
    """A rank's failure, already recorded as its one line: what Ray Train sees (and restarts on)."""


def _failure_lines(worker_exceptions: dict[int, Exception]) -> dict[int, str]:
    """Ray Train's errors by rank as lines, for ranks that recorded none: a worker that died (killed, os._exit)."""
    lines = {}
    for rank, err in worker_exceptions.items():
        if isinstance(err, RankFailed) or "RankFailed" in type(err).__name__ or "RankFailed" in str(err)[:200]:
            continue
        lines[rank] = f"rank {rank}: its Ray worker died ({first_line(err)[:200]})"
    return lines


def _callback(state: Any) -> Any:
    """A Ray Train callback (it runs in Ray Train's controller) telling `state` which ranks died."""
    from ray.train import UserCallback

    class ReportDeaths(UserCallback):
        def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
            state.died.remote(_failure_lines(worker_exceptions))

    return ReportDeaths()


def launch(world: int, recipe_path: str, args: list[str], cfg: Any, flags: Any, entry: Callable[..., int]) -> int:
    """Train `recipe_path` with `args` on `world` Ray workers; return the exit code (0, EXIT_BAD_VALUE, 1, or
    EXIT_STOPPED). Everything about the cluster is checked before any worker starts. entry: what each rank runs,
    `entry("train", recipe_path, args)` (the CLI's own `_run`, handed here: this module does not import the CLI)."""
    ray = import_ray()
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray_flags: RayFlags = flags.ray
    run_dir = Path(cfg.run_dir).resolve()  # the same directory for every worker, whatever its working directory
    args = [*args, "--train.run-dir", str(run_dir)]
    address, source = cluster_address(ray_flags)
    wanted = ray_flags.resources_per_worker or {}
    owned = connect(ray, address, world * wanted.get("CPU", 1.0), source)
    try:
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        cluster = {k: sum(n.get(k, 0.0) for n in nodes) for n in nodes for k in n}
        per_worker = worker_resources(ray_flags, cfg.train.device, cluster)
        check_resources(world, per_worker, nodes, ray_flags.placement_strategy)
        use_gpu = per_worker.get("GPU", 0) > 0
        backend = ("cpu:gloo,cuda:nccl" if cfg.plan.cpu_offload else "nccl") if use_gpu else "gloo"
        state = ray.remote(num_cpus=0)(RunState).remote()
        env = forwarded_env(os.environ)
        trainer = TorchTrainer(
            rank_main,
            train_loop_config={
                "state": state, "entry": entry, "recipe": os.path.abspath(recipe_path), "args": list(args), "cwd": os.getcwd(),
                "env": env,
            },
            scaling_config=ScalingConfig(
                num_workers=world, use_gpu=use_gpu, resources_per_worker=per_worker,
                placement_strategy=ray_flags.placement_strategy,
            ),
            torch_config=TorchConfig(
                backend=backend, timeout_s=int(env_number(os.environ, "SHARDLAB_PG_TIMEOUT_S", 600.0, float))
            ),
            run_config=RunConfig(
                name=f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}",
                storage_path=str(run_dir / "ray"),
                failure_config=FailureConfig(max_failures=flags.max_restarts),
                callbacks=[_callback(state)],
                worker_runtime_env={"env_vars": WORKER_ENV},
            ),
        )  # fmt: skip
        return _fit(ray, trainer, state, flags.max_restarts)
    finally:
        if owned:
            ray.shutdown()


def _fit(ray: ModuleType, trainer: Any, state: Any, max_restarts: int) -> int:
    """trainer.fit() in a thread while this one prints the ranks' output and a line per restart; then the exit
    code, with the failure's one line."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except Exception as err:  # Ray Train's TrainingFailedError: the last attempt's failure
            outcome["error"] = err

    thread = threading.Thread(target=fit, name="shardlab-ray-fit", daemon=True)
    with _raylet_messages_dropped():
        thread.start()
        return _follow(ray, thread, state, outcome, max_restarts)


@contextlib.contextmanager
def _raylet_messages_dropped() -> Iterator[None]:
    """Ray prints a paragraph to the driver when a worker dies ("(raylet) A worker died or was killed ...") even
    with log_to_driver off; shardlab's line per failure says it once. Ray has no switch for it: its printer
    (ray._private.worker.print_to_stdstream) skips them here unless SHARDLAB_DEBUG is set."""
    from ray._private import worker

    show = getattr(worker, "print_to_stdstream", None)
    if show is None or debugging():
        yield
        return

    def quieter(data: dict, *args: Any, **kwargs: Any) -> None:
        if data.get("pid") != "raylet":
            show(data, *args, **kwargs)

    worker.print_to_stdstream = quieter
    try:
        yield
    finally:
        worker.print_to_stdstream = show


def _follow(ray: ModuleType, thread: threading.Thread, state: Any, outcome: dict[str, Any], max_restarts: int) -> int:
    """Print the ranks' output and a line per restart while `thread` fits; then the exit code and failure line.
    SIGTERM to this process (a cluster's preemption, `kill`) asks the ranks to save and stop, as under torchrun;
    Ctrl-C ends them."""
    forward = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: state.stop.remote()) if forward else None
    try:
        return _print_until_done(ray, thread, state, outcome, max_restarts)
    except KeyboardInterrupt:  # Ctrl-C: the ranks end with this process's Ray job (torchrun's code: 128 + SIGINT)
        return 128 + signal.SIGINT
    finally:
        if forward:
            signal.signal(signal.SIGTERM, previous)


def _print_until_done(
    ray: ModuleType, thread: threading.Thread, state: Any, outcome: dict[str, Any], max_restarts: int
) -> int:
    restarts = 0
    while True:
        done = not thread.is_alive()
        out, warnings = ray.get(state.drain.remote())
        for stream, text in out:
            (sys.stdout if stream == 1 else sys.stderr).write(text)
        sys.stdout.flush()
        for line in warnings:
            restarts += 1
            print(f"warning: {line}; restart {restarts} of {max_restarts}, from the last checkpoint", file=sys.stderr)
        sys.stderr.flush()
        if done:
            break
        thread.join(0.2)
    failure, final = ray.get(state.last_failure.remote())
    if final is not None:
        print(f"error: {final}", file=sys.stderr, flush=True)
        return EXIT_BAD_VALUE
    if "error" in outcome:
        err = outcome["error"]
        line = failure or next(iter(_failure_lines(getattr(err, "worker_failures", {}) or {}).values()), None)
        print(f"error: {line or one_line(err)}", file=sys.stderr, flush=True)
        if debugging():
            raise err
        return 1
    code = outcome["result"].return_value
    return code if isinstance(code, int) and code in (0, EXIT_STOPPED) else 0
