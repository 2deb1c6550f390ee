"""One problem, one line: how a failure on the ranks that `relaunch` started comes back to the user.

rank raises -> `report` writes "rank R: <message>" to the error file (the first rank wins: O_EXCL) -> the rank
`leave`s quietly -> the elastic agent, run by `main` here with its logging off, stops the other ranks -> if no
rank wrote a line (a rank killed by a signal, or one that called os._exit), `main` writes one from the agent's
failures -> the first process prints the file as `error: ...`. A rank that fails only because a peer died writes
nothing: its "Connection closed by peer" is the echo of the first failure, not the cause. SHARDLAB_TRACEBACK=1
keeps every rank's traceback and the agent's log. A run that SIGTERM stopped after a save is no failure: local
rank 0 leaves its line in the stopped file instead, and the first process prints it and exits EXIT_STOPPED.
With `--max-restarts N` the agent (`restarting_agent`) starts the ranks again after a failure, with a warning line
each time, unless a rank's exit code says a restart cannot help (EXIT_FINAL).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

ERROR_FILE_ENV = "SHARDLAB_ERROR_FILE"
"""Where the ranks of one node write their first failure; set by `relaunch` for the ranks it starts."""
DEBUG_ENV = "SHARDLAB_DEBUG"
"""Set to 1 to see every failing rank's full traceback and torch.distributed.run's own report (as in
shardlab._errors, which this file, run by path in the agent, does not import)."""
TRACEBACK_ENV = "SHARDLAB_TRACEBACK"
"""The older name of DEBUG_ENV, still read."""
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
)
"""Message fragments of the RuntimeErrors gloo and NCCL raise on a rank whose peer died: echoes, never the cause."""
EXIT_BAD_VALUE = 2
"""A rank's exit code for a ShardlabError: a bad value (as before launch), which a restart would meet again."""
EXIT_PEER_LOST = 3
"""A rank's exit code when it failed only because a peer died."""
STOPPED_FILE_ENV = "SHARDLAB_STOPPED_FILE"
"""Where rank 0 writes how a run stopped early and cleanly (`stopped by SIGTERM after step N; ...`); set by `relaunch`."""
EXIT_STOPPED = 75
"""The exit code of a run stopped by SIGTERM after saving (every rank's, and the first process's): sysexits' EX_TEMPFAIL,
"try again later", since starting it again resumes where it stopped."""
EXIT_FINAL = (EXIT_BAD_VALUE, EXIT_STOPPED)
"""Rank exit codes that end a run however many restarts are left: a restart would fail the same way, or stop again."""


def tracebacks_wanted(env: Mapping[str, str] | None = None) -> bool:
    """shardlab._errors.debugging, for the agent, which runs this file without shardlab."""
    env = os.environ if env is None else env
    return any(env.get(name, "") not in ("", "0") for name in (DEBUG_ENV, TRACEBACK_ENV))


def write_first(path: str, line: str) -> bool:
    """Write `line` to `path` unless a line is already there (O_EXCL: of several failing ranks the first wins)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(line + "\n")
    return True


def report(err: Exception, path: str, rank: int) -> int:
    """On a launched rank: record `err` as this node's one line (unless a rank was first); return the exit code:
    EXIT_BAD_VALUE for a ShardlabError (a bad value, as before launch: never retried), 1 for anything else (named,
    with the place it was raised; retried under --max-restarts), EXIT_PEER_LOST for an echo."""
    from shardlab._errors import ShardlabError, debugging, first_line, one_line

    if debugging():
        traceback.print_exception(err, file=sys.stderr)
    if isinstance(err, RuntimeError) and any(fragment in first_line(err) for fragment in PEER_LOST):
        return EXIT_PEER_LOST
    write_first(path, f"rank {rank}: {one_line(err)}")
    return EXIT_BAD_VALUE if isinstance(err, ShardlabError) else 1


def leave(code: int) -> None:
    """Exit a launched rank now, output flushed, without the interpreter's teardown: there the process groups' C++
    destructors can abort the process (gloo: "terminate called without an active exception", then SIGABRT) or hang,
    with a peer gone and, rarely, even after a clean destroy_process_group at the end of a run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def describe(failures: Mapping[int, ProcessFailure]) -> str:
    """One line for the rank whose death caused the others': an exit code of its own first, then a signal other
    than the SIGTERM the agent sends the survivors, then any."""

    def cause(item: tuple[int, ProcessFailure]) -> tuple[int, int]:
        rank, failure = item
        code = failure.exitcode
        if code > 0 and code != EXIT_PEER_LOST:
            return (0, rank)
        if code < 0 and failure.signal_name() != "SIGTERM":
            return (1, rank)
        return (2, rank)

    rank, failure = min(failures.items(), key=cause)
    if failure.exitcode == EXIT_PEER_LOST:
        return f"rank {rank}: lost its connection to a rank that failed first (on another node: see its output)"
    if failure.exitcode < 0:
        name = failure.signal_name()
        return f"rank {rank}: killed by {name}" + (" (often the out-of-memory killer)" if name == "SIGKILL" else "")
    return f"rank {rank}: exited with code {failure.exitcode} and reported no error"


def restarting_agent(error_file: str | None) -> type:
    """torch's LocalElasticAgent with two changes to its restarts (`--max-restarts`, which restart on any failure):
    a failure where a rank exited with a code of EXIT_FINAL is not retried (torch does the same, setting
    `_remaining_restarts` to 0, for a rank stuck in uninterruptible sleep), and each restart says why in one line,
    `warning: rank 1: killed by SIGKILL ...; restart 1 of 3, from the last checkpoint`, and clears the error file,
    so that what the first process prints in the end is the last attempt's own failure."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        _failures: Mapping[int, ProcessFailure] | None = None

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                self._failures = result.failures
                if any(failure.exitcode in EXIT_FINAL for failure in result.failures.values()):
                    self._remaining_restarts = 0
            return result

        def _initialize_workers(self, worker_group):
            if self._failures is not None:  # a restart after a failure; every rank of that attempt is stopped
                spec = worker_group.spec
                line = describe(self._failures)
                if error_file is not None and os.path.isfile(error_file):
                    with open(error_file) as f:
                        line = f.read().strip() or line
                    os.remove(error_file)
                restart = f"restart {spec.max_restarts - self._remaining_restarts} of {spec.max_restarts}"
                print(f"warning: {line}; {restart}, from the last checkpoint", file=sys.stderr, flush=True)
                self._failures = None
            super()._initialize_workers(worker_group)

    return Agent


def main(argv: list[str]) -> int:
    """torch.distributed.run with `argv`, quiet: exit 0, or 1 with this node's one line in the error file."""
    import logging

    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    path = os.environ.get(ERROR_FILE_ENV)
    if not tracebacks_wanted():
        logging.disable(logging.CRITICAL)  # this process runs only the agent; the ranks are other processes
    launcher.LocalElasticAgent = restarting_agent(path)  # the class launch_agent builds its agent from
    try:
        run(parse_args(argv))
    except ChildFailedError as err:
        if path is not None:
            write_first(path, describe(err.failures))
        return 1
    except SignalException as err:  # SIGINT/SIGTERM: the agent has stopped the ranks
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    # Run by path (see `relaunch_command`), so the agent imports torch's launcher without all of shardlab (~2 s).
    # Python puts this file's directory first on sys.path, where config.py, data.py, ... would shadow other modules.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    sys.exit(main(sys.argv[1:]))
