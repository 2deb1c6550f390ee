"""run_world: one gloo world, many checks in it (one module's, or several modules' in the shared worlds of
conftest.py), each reported on its own.

Every rank runs the checks in order; after each one the ranks all-gather pass/fail, so one failure stops
the world cleanly and later checks read "not run". Each rank writes its results to files as it goes, so a
killed world still reports what finished, and a failure names the rank that failed first with its own
traceback (torch's mp.spawn can blame a bystander: the first rank to exit, not the first to fail).

A rank killed by a signal inside a check (a crash below Python) has its checks from that one on run again in a new
world, at most CRASH_RETRIES times, each with a warning that carries its stack: gloo's CPU collectives have crashed
that way (SIGSEGV, SIGABRT from a gloo thread) in 2 of 6 whole suites, always in the experts' collectives of
tests/worlds/test_models.py's 4-rank world late in its run, never in about 20 runs of that world alone. A check that
crashes every time still fails, with the last crash's stack.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ._gloo import share_one_device

Check = Callable[..., Any] | tuple[Callable[..., Any], dict[str, Any]]
"""A check, or (check, keyword arguments of its own) when checks of several modules share one world."""
PG_TIMEOUT_S = 120
"""Collectives of 4 ranks sharing 2 cores can stall for a while; this is not the hang detector (timeout_s is)."""
TIMES_ENV = "SHARDLAB_WORLD_TIMES"
"""A file to which each world appends its checks' seconds on rank 0 (`SHARDLAB_WORLD_TIMES=f pytest tests/worlds`)."""
CRASH_RETRIES = 2
"""How many more worlds run the checks from one where a rank was killed by a signal (see the module docstring)."""
GRACE_S = 10
"""After a rank fails or dies, how long the others get to finish the pass/fail all-gather before they are killed."""
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "shardlab.training.loop",
    "transformers",
]
"""What the forkserver imports once: every rank is forked from it with these loaded (a 4-rank world starts in
under a second, where spawning, each rank importing them anew, took about 10 s on 2 cores)."""


@dataclass(frozen=True)
class Outcome:
    """One check on one rank: status is "passed" or "failed"; `at` orders failures across ranks; `seconds` is how
    long the check ran."""

    status: str
    value: Any = None
    error: str = ""
    at: float = 0.0
    seconds: float = 0.0


def _write(out: Path, key: str, outcome: Outcome) -> None:
    tmp = out / f".{key}.tmp"
    tmp.write_bytes(pickle.dumps(outcome))
    os.replace(tmp, out / f"{key}.{outcome.status}")  # atomic; the status is in the name


def _split(check: Check, kwargs: dict[str, Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
    return (check[0], kwargs | check[1]) if isinstance(check, tuple) else (check, kwargs)


def _name(check: Check) -> str:
    """module.name: checks of several modules that share a world may have the same name."""
    fn = check[0] if isinstance(check, tuple) else check
    return f"{fn.__module__}.{fn.__qualname__}"


def _short(check: Check) -> str:
    return _name(check).rsplit(".", 1)[1]


def _rank_main(rank: int, world_size: int, port: int, checks: list[Check], kwargs: dict, out: Path) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size}
    os.environ.update({k: str(v) for k, v in env.items()})  # for code under test that reads the launcher's env
    torch.set_num_threads(1)
    fault = open(out / f".fault.{rank}", "w")  # noqa: SIM115 (open for the process's life: a crash writes here)
    faulthandler.enable(fault)  # a rank killed by a signal leaves its Python stack for the parent to report
    share_one_device()  # the world's many meshes would otherwise each start gloo threads that wake every 10 ms
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT_S))
    except BaseException:
        _write(out, f"setup.{rank}", Outcome("failed", error=traceback.format_exc(), at=time.time()))
        raise
    for i, check in enumerate(checks):
        start = time.monotonic()
        try:
            fn, own = _split(check, kwargs)
            value = fn(rank, world_size, **own)
            pickle.dumps(value)  # an unpicklable value fails here, with the check's name on it
            outcome = Outcome("passed", value=value, seconds=time.monotonic() - start)
        except BaseException:
            outcome = Outcome("failed", error=traceback.format_exc(), at=time.time(), seconds=time.monotonic() - start)
        _write(out, f"{i}.{rank}", outcome)
        passed: list[Any] = [None] * world_size
        dist.all_gather_object(passed, outcome.status == "passed")
        if not all(passed):
            break  # every rank stops here; the parent reports the later checks as "not run"
    dist.destroy_process_group()


@dataclass(frozen=True)
class WorldResult:
    """What one world did: ask it with `raise_for(check)` and `value(check, rank)`."""

    checks: list[Check]
    world_size: int
    outcomes: dict[str, Outcome]
    """Keyed "<check index>.<rank>" (and "setup.<rank>" if joining the process group failed)."""
    died: dict[int, int]
    """Exit codes of the ranks that died on their own, before the parent killed the rest."""
    faults: dict[int, str]
    """The Python stacks faulthandler wrote for ranks killed by a signal (a segfault, an abort)."""
    cut: str
    """Why the parent killed the world ("" if it did not)."""

    def _index(self, check: Callable | str) -> int:
        """A check by function or by name (its own name, or module.name where checks of several modules share a
        world)."""
        names = [_name(c) for c in self.checks]
        if not isinstance(check, str):
            check = _name(check)
        hits = [i for i, c in enumerate(self.checks) if check in (names[i], _short(c))]
        if len(hits) != 1:
            short = check.rsplit(".", 1)[-1]
            raise KeyError(f"{short} is not one of this world's checks: {', '.join(map(_short, self.checks))}")
        return hits[0]

    def _verdict(self, i: int) -> tuple[str, str]:
        """("passed" | "failed" | "did not finish", message) of check i on its own, assuming the world reached it."""
        name, ranks = _short(self.checks[i]), range(self.world_size)
        got = {r: o for r in ranks if (o := self.outcomes.get(f"{i}.{r}"))}
        failed = [r for _, r in sorted((o.at, r) for r, o in got.items() if o.status == "failed")]
        crashed = [r for r in ranks if r not in got and r in self.died]
        if crashed:  # it died inside the check: its peers' errors ("Connection reset by peer") are only echoes
            rank, others = crashed[0], crashed[1:] + failed
            head = f"{name} failed on rank {rank}: the process exited with code {self.died[rank]} inside the check"
            stack = self.faults.get(rank)
            head += f"; faulthandler's stack:\n{stack}" if stack else " (no Python traceback; see its stderr)"
        elif failed:
            rank, others = failed[0], failed[1:]
            head = f"{name} failed on rank {rank}:\n{got[rank].error}"
        elif len(got) == self.world_size:
            return "passed", ""
        else:
            return (
                "did not finish",
                f"{name} did not finish on ranks {[r for r in ranks if r not in got]}: {self._ending()}",
            )
        also = [
            f"rank {r}: " + (got[r].error.strip().splitlines()[-1] if r in got else f"exited with code {self.died[r]}")
            for r in others
        ]
        return "failed", head + "".join(f"\nalso failed on {line}" for line in also)

    def _error(self, i: int) -> str | None:
        name = _short(self.checks[i])
        setup = sorted((o.at, r, o.error) for r in range(self.world_size) if (o := self.outcomes.get(f"setup.{r}")))
        if setup:
            return f"{name} was not run: rank {setup[0][1]} failed to join the world:\n{setup[0][2]}"
        for j in range(i):  # the world stops at the first check that does not pass everywhere
            kind, _ = self._verdict(j)
            if kind == "failed":
                return f"{name} was not run: an earlier check failed ({_short(self.checks[j])})"
            if kind == "did not finish":
                return f"{name} was not run: an earlier check did not finish ({_short(self.checks[j])})"
        kind, message = self._verdict(i)
        return None if kind == "passed" else message

    def _ending(self) -> str:
        died = [f"rank {r} exited with code {code}" for r, code in sorted(self.died.items())]
        return ", ".join([*died, self.cut] if self.cut else died) or "the ranks exited without a result"

    def crashed(self) -> tuple[int, int] | None:
        """(check index, rank) of the first rank killed by a signal inside a check, if one was."""
        for i in range(len(self.checks)):
            for r in range(self.world_size):
                if f"{i}.{r}" not in self.outcomes and self.died.get(r, 0) < 0:
                    return i, r
            if any(f"{i}.{r}" not in self.outcomes for r in range(self.world_size)):
                return None  # the world stopped here otherwise
        return None

    def raise_for(self, check: Callable | str) -> None:
        """Raise AssertionError("<check> failed on rank 2:\\n<traceback>") or ("<check> was not run: ..."), unless
        the check passed on every rank."""
        __tracebackhide__ = True
        error = self._error(self._index(check))
        if error is not None:
            raise AssertionError(error)

    def value(self, check: Callable | str, rank: int = 0) -> Any:
        """What `check` returned on `rank` (raises like raise_for if it did not pass)."""
        __tracebackhide__ = True
        self.raise_for(check)
        return self.outcomes[f"{self._index(check)}.{rank}"].value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(
    world_size: int, checks: list[Check], timeout_s: float = 300, environ: dict[str, str] | None = None, **kwargs: Any
) -> WorldResult:
    """Run `check(rank, world_size, **kwargs)` for each check on `world_size` gloo ranks; a check given as
    (check, own) also gets its own keyword arguments.

    Checks must be module-level functions (the ranks import them by name) and may return a picklable value. The
    parent kills the world after `timeout_s`, or GRACE_S after a rank fails or dies. The ranks are forked from a
    server that has PRELOAD imported; with `environ` they are spawned, new processes that start with these
    environment variables set (for what a process reads once, at its start, as malloc reads its options). A rank
    killed by a signal inside a check runs that check and the later ones again, in a new world (a warning each time,
    at most CRASH_RETRIES times).
    """
    for check in checks:
        qualname = (check[0] if isinstance(check, tuple) else check).__qualname__
        if "<" in qualname:
            raise TypeError(f"check {qualname} must be a module-level function: the ranks import checks by name")
    result, start, outcomes = _run(world_size, checks, timeout_s, environ, kwargs), 0, {}
    for _ in range(CRASH_RETRIES):
        crashed = result.crashed()
        if crashed is None:
            break
        i, rank = crashed
        warnings.warn(
            f"{_short(checks[start + i])}: rank {rank} was killed by signal {-result.died[rank]} inside the check; "
            f"running the checks from it again in a new world. Its stack:\n{result.faults.get(rank, '(none)')}",
            RuntimeWarning,
            stacklevel=2,
        )
        outcomes |= _shifted(result.outcomes, start, before=i)  # each passed on every rank
        start += i
        result = _run(world_size, checks[start:], timeout_s, environ, kwargs)
    outcomes |= _shifted(result.outcomes, start)
    return WorldResult(checks, world_size, outcomes, result.died, result.faults, result.cut)


def _shifted(outcomes: dict[str, Outcome], start: int, before: int | None = None) -> dict[str, Outcome]:
    """A world's outcomes of `checks[start:]` keyed by their index in `checks` (only those before `before`)."""
    out = {}
    for key, outcome in outcomes.items():
        n, r = key.split(".")
        if not n.isdigit():
            out[key] = outcome  # setup
        elif before is None or int(n) < before:
            out[f"{int(n) + start}.{r}"] = outcome
    return out


def _run(
    world_size: int, checks: list[Check], timeout_s: float, environ: dict[str, str] | None, kwargs: dict[str, Any]
) -> WorldResult:
    """One world running `checks` (run_world's arguments)."""
    ctx = mp.get_context("spawn" if environ else "forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="world-") as tmp, mock.patch.dict(os.environ, environ or {}):
        out, port = Path(tmp), _free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, world_size, port, checks, kwargs, out)) for r in range(world_size)
        ]
        start, trouble_at, cut = time.monotonic(), None, ""
        try:
            for p in procs:
                p.start()
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if trouble_at is None and (any(p.exitcode for p in procs) or any(out.glob("*.failed"))):
                    trouble_at = now
                if now - start > timeout_s:
                    cut = f"the world timed out after {timeout_s:g} s and was killed"
                    break
                if trouble_at is not None and now - trouble_at > GRACE_S:
                    cut = f"the rest were killed {GRACE_S} s after a rank failed or died"
                    break
                time.sleep(0.2)
            died = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode}
        finally:
            for p in procs:
                if p.pid is not None:
                    p.kill()
                    p.join()
        outcomes = {f.name.rsplit(".", 1)[0]: pickle.loads(f.read_bytes()) for f in out.glob("[!.]*")}
        faults = {r: text for r in died if (f := out / f".fault.{r}").exists() and (text := f.read_text().strip())}
    if times := os.environ.get(TIMES_ENV):
        with open(times, "a") as f:  # rank 0's seconds per check: where a world's time goes
            for i, check in enumerate(checks):
                if (o := outcomes.get(f"{i}.0")) is not None:
                    f.write(f"{world_size} {_name(check)} {o.seconds:.1f}\n")
    return WorldResult(checks, world_size, outcomes, died, faults, cut)
