"""run_world itself: results, values, blame for the failing rank, "not run", hangs and crashes.

Three small worlds of 2 ranks (forked: under a second to start each) plus one that hangs until HANG_TIMEOUT_S.
Run: pytest tests/worlds/test_harness.py
"""

import faulthandler
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ._harness import run_world

HANG_TIMEOUT_S = 15


def check_all_reduce(rank, world_size, **_):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size


def check_returns_value(rank, world_size, scale=1.0):
    return {"rank": rank, "loss": scale * (rank + 1)}


def check_fails_on_rank_1(rank, world_size, **_):
    dist.barrier()
    if rank == 1:
        raise AssertionError("rank one disagrees: 1.5 != 1.25")


def check_never_runs(rank, world_size, **_):
    raise RuntimeError("unreachable: an earlier check failed")


def check_hangs(rank, world_size):
    if rank == 0:
        dist.barrier()  # rank 1 never enters it: it goes on to the pass/fail all-gather, which gloo never matches


def check_crashes(rank, world_size, **_):
    if rank == 1:
        faulthandler._sigsegv()  # a crash below Python, as a broken extension would make one
    dist.barrier()


def check_crashes_twice(rank, world_size, markers):
    """Crashes on rank 1 in the first two worlds only (the files in `markers` count them)."""
    if rank == 1 and len(list(Path(markers).iterdir())) < 2:
        (Path(markers) / str(len(list(Path(markers).iterdir())))).touch()
        faulthandler._sigsegv()
    dist.barrier()
    return rank


MAIN = [check_all_reduce, check_returns_value, check_fails_on_rank_1, check_never_runs]


@pytest.fixture(scope="module")
def main_world():
    return run_world(2, MAIN, timeout_s=120, scale=10.0)


@pytest.mark.world
def test_passing_checks_raise_nothing(main_world):
    assert main_world.raise_for(check_all_reduce) is None
    assert main_world.raise_for("check_returns_value") is None


@pytest.mark.world
def test_values_come_back_per_rank(main_world):
    assert main_world.value(check_returns_value) == {"rank": 0, "loss": 10.0}
    assert main_world.value(check_returns_value, rank=1) == {"rank": 1, "loss": 20.0}


@pytest.mark.world
def test_failure_names_the_failing_rank_with_its_traceback(main_world):
    with pytest.raises(AssertionError, match=r"^check_fails_on_rank_1 failed on rank 1:\nTraceback") as err:
        main_world.raise_for(check_fails_on_rank_1)
    assert "rank one disagrees: 1.5 != 1.25" in str(err.value)
    assert 'raise AssertionError("rank one disagrees' in str(err.value)  # the failing line, from rank 1 itself


@pytest.mark.world
def test_checks_after_a_failure_are_not_run(main_world):
    with pytest.raises(
        AssertionError, match=r"^check_never_runs was not run: an earlier check failed \(check_fails_on_rank_1\)$"
    ):
        main_world.raise_for(check_never_runs)
    with pytest.raises(AssertionError, match="check_never_runs was not run"):
        main_world.value(check_never_runs)


@pytest.mark.world
def test_hang_is_killed_after_timeout():
    start = time.monotonic()
    world = run_world(2, [check_all_reduce, check_hangs, check_never_runs], timeout_s=HANG_TIMEOUT_S)
    assert time.monotonic() - start < HANG_TIMEOUT_S + 10
    world.raise_for(check_all_reduce)
    with pytest.raises(AssertionError, match=r"check_hangs did not finish on ranks \[0\]: the world timed out"):
        world.raise_for(check_hangs)
    with pytest.raises(AssertionError, match="check_never_runs was not run: an earlier check did not finish"):
        world.raise_for(check_never_runs)


@pytest.mark.world
def test_crash_names_the_rank_exit_code_and_python_stack():
    with pytest.warns(RuntimeWarning, match=r"check_crashes: rank 1 was killed by signal 11 inside the check; running"):
        world = run_world(2, [check_crashes, check_never_runs], timeout_s=120)
    message = r"^check_crashes failed on rank 1: the process exited with code -11 inside the check; faulthandler's"
    with pytest.raises(AssertionError, match=message) as err:
        world.raise_for(check_crashes)
    assert re.search(r'File ".*test_harness.py", line \d+ in check_crashes', str(err.value))
    assert re.search(r"\nalso failed on rank 0: RuntimeError: .*Connection", str(err.value))
    with pytest.raises(AssertionError, match="check_never_runs was not run"):
        world.raise_for(check_never_runs)


@pytest.mark.world
def test_a_crash_is_run_again_from_its_check_on(tmp_path):
    checks = [check_returns_value, (check_crashes_twice, {"markers": str(tmp_path)}), check_all_reduce]
    with pytest.warns(
        RuntimeWarning, match=r"(?s)check_crashes_twice: rank 1 was killed by signal 11.*check_crashes_tw"
    ) as w:
        world = run_world(2, checks, timeout_s=120)
    assert len(w) == 2 and len(list(tmp_path.iterdir())) == 2
    assert world.value(check_returns_value, rank=1) == {"rank": 1, "loss": 2.0}  # from the first world
    assert world.value(check_crashes_twice, rank=1) == 1  # from the third
    assert world.raise_for(check_all_reduce) is None


def test_checks_must_be_importable_by_the_spawned_ranks():
    def nested(rank, world_size):
        pass

    with pytest.raises(TypeError, match=r"check test_checks_must_be.*nested must be a module-level function"):
        run_world(2, [nested])


@pytest.mark.world
def test_unknown_check_is_a_key_error(main_world):
    with pytest.raises(KeyError, match="check_hangs is not one of this world's checks: check_all_reduce, "):
        main_world.raise_for(check_hangs)
