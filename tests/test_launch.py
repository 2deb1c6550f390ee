"""shardlab.cli.launch: launcher detection, nproc per node, the torchrun command line, one line per failure on the
ranks, and real 2-process runs.

The pure tests pass an env dict; the real runs start torchrun with 2 CPU ranks (~5 s each, ~10 s with a kill).
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from shardlab._errors import DEBUG_ENV, ShardlabError
from shardlab.cli.launch import TORCHRUN, nproc_for, relaunch, relaunch_command, relaunch_env
from shardlab.cli.torchrun import EXIT_PEER_LOST, TRACEBACK_ENV, describe, report
from shardlab.parallel.world import CUDA_INDEX_ENV, init_distributed, resolve_device, under_launcher

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.mark.parametrize(
    ("env", "launched", "added"),
    [
        ({}, False, {}),
        ({"LOCAL_RANK": "1"}, False, {}),
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "4"}, True, {}),
        ({"SLURM_PROCID": "0"}, False, {}),
        (
            {
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "8",
                "SLURM_LOCALID": "1",
                "SLURM_NNODES": "2",
                "SLURM_JOB_ID": "4242",
            },
            True,
            {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_PORT": "24242"},
        ),
        (
            {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "1"},
            True,
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "20000", "MASTER_ADDR": "127.0.0.1"},
        ),
        (  # torchrun inside a slurm job: torchrun's variables win and nothing is mapped
            {"LOCAL_RANK": "0", "WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
            True,
            {},
        ),
        (  # values the user exported are kept
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "node7", "MASTER_PORT": "1234"},
            True,
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
        ),
    ],
)
def test_under_launcher(env, launched, added):
    before = dict(env)
    assert under_launcher(env) is launched
    assert env == {**before, **added}


@pytest.mark.parametrize(("world_size", "env", "nproc"), [(8, {}, 8), (8, {"NNODES": "1"}, 8), (8, {"NNODES": "2"}, 4)])
def test_nproc_for(world_size, env, nproc):
    assert nproc_for(world_size, env) == nproc


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"NNODES": "4"},
            r"^world_size=6 is not divisible by NNODES=4; make the mesh a multiple of NNODES ranks$",
        ),
        ({"NNODES": "two"}, r"^NNODES='two' in the environment is not an integer$"),
        ({"NNODES": "0"}, r"^NNODES='0' in the environment must be >= 1$"),
    ],
)
def test_nproc_for_errors(env, message):
    with pytest.raises(ValueError, match=message):
        nproc_for(6, env)


def test_relaunch_command_single_node():
    cmd = relaunch_command(4, ["recipes/llama_debug.py", "--train.steps", "3"], {"MASTER_ADDR": "ignored"})
    assert cmd == [
        sys.executable, TORCHRUN, "--nproc-per-node=4", "--standalone",
        "-m", "shardlab", "recipes/llama_debug.py", "--train.steps", "3",
    ]  # fmt: skip


def test_relaunch_command_passes_restarts_to_torchrun():
    cmd = relaunch_command(2, ["r.py"], {}, max_restarts=3)
    assert cmd[:5] == [sys.executable, TORCHRUN, "--nproc-per-node=2", "--max-restarts=3", "--standalone"]
    assert "--max-restarts=0" not in relaunch_command(2, ["r.py"], {}, max_restarts=0)


def test_relaunch_command_multi_node():
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400"}
    assert relaunch_command(8, ["r.py"], env, module="mytool") == [
        sys.executable, TORCHRUN, "--nproc-per-node=8", "--nnodes=2", "--node-rank=1",
        "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.5:29400", "-m", "mytool", "r.py",
    ]  # fmt: skip
    assert "--rdzv-endpoint=10.0.0.5:29500" in relaunch_command(8, [], {**env, "MASTER_PORT": "29500"})


@pytest.mark.parametrize(
    ("nproc", "env", "message"),
    [
        (0, {}, r"^nproc=0 must be at least 1$"),
        (
            2,
            {"NNODES": "2"},
            r"^NNODES=2 needs NODE_RANK and MASTER_ADDR in the environment; export NODE_RANK=<0\.\.1> and ",
        ),
        (2, {"NNODES": "2", "NODE_RANK": "0"}, r"^NNODES=2 needs MASTER_ADDR in the environment"),
        (
            2,
            {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"},
            r"^NODE_RANK=2 but NNODES=2; NODE_RANK counts nodes from 0$",
        ),
    ],
)
def test_relaunch_command_errors(nproc, env, message):
    with pytest.raises(ValueError, match=message):
        relaunch_command(nproc, [], env)


def test_relaunch_env_splits_the_cores_unless_omp_is_set():
    cores = len(os.sched_getaffinity(0))
    assert relaunch_env(1, {"A": "b"}) == {"A": "b", "OMP_NUM_THREADS": str(cores)}
    assert relaunch_env(cores * 2, {})["OMP_NUM_THREADS"] == "1"
    assert relaunch_env(2, {"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"


@pytest.fixture
def no_launcher(monkeypatch):
    for name in (*LAUNCHER_VARS, "SHARDLAB_PG_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)


def test_one_process_without_launcher_needs_no_process_group(no_launcher):
    d = init_distributed("cpu")
    assert (d.rank, d.world_size, d.local_rank, d.device, d.backend, d.is_main) == (
        0,
        1,
        0,
        torch.device("cpu"),
        None,
        True,
    )
    assert not dist.is_initialized()


def test_init_distributed_errors(no_launcher, monkeypatch):
    with pytest.raises(ValueError, match=r"^train\.device='tpu' is not one of 'auto', 'cuda', 'cpu'$"):
        init_distributed("tpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ValueError, match=r"^init_distributed: WORLD_SIZE=2 needs MASTER_ADDR and MASTER_PORT in the environment; start"
    ):
        init_distributed("cpu")
    monkeypatch.setenv("SHARDLAB_PG_TIMEOUT_S", "ten")
    with pytest.raises(ValueError, match=r"^SHARDLAB_PG_TIMEOUT_S='ten' in the environment is not a number$"):
        init_distributed("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_a_device_is_an_error(no_launcher):
    with pytest.raises(ValueError, match=r"^train\.device='cuda' needs cuda:0 \(LOCAL_RANK\) but 0 CUDA"):
        init_distributed("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_the_device_a_launcher_names_wins_over_local_rank(no_launcher, monkeypatch):
    """Ray Train names each worker's GPU (SHARDLAB_CUDA_INDEX), which need not be cuda:LOCAL_RANK."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(CUDA_INDEX_ENV, "3")
    with pytest.raises(ValueError, match=r"^train\.device='cuda' needs cuda:3 \(SHARDLAB_CUDA_INDEX\) but 0 CUDA"):
        resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.gpu
def test_auto_picks_cuda(no_launcher):
    d = init_distributed("auto")
    assert (d.device, d.backend) == (torch.device("cuda", 0), None)


def test_the_first_failing_rank_writes_the_line(tmp_path, monkeypatch):
    """A ShardlabError is its first line (exit 2, as before launch: never retried); anything else, a ValueError of
    torch's or numpy's too, is named with the place it was raised and the traceback hint (exit 1: a restart may help);
    a later rank's failure does not overwrite the first."""
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    first, other, third = tmp_path / "first", tmp_path / "other", tmp_path / "third"
    assert report(ShardlabError("train.steps: bad\nwhy it is bad"), str(first), 3) == 2
    assert report(RuntimeError("later"), str(first), 0) == 1
    assert first.read_text() == "rank 3: train.steps: bad\n"
    assert report(KeyError("w1"), str(other), 1) == 1
    assert other.read_text() == "rank 1: KeyError: 'w1'; rerun with SHARDLAB_DEBUG=1 for the traceback\n"
    try:
        torch.zeros(2).view(3)
    except RuntimeError as err:
        assert report(err, str(third), 0) == 1
    assert re.fullmatch(
        r"rank 0: RuntimeError: shape '\[3\]' is invalid for input of size 2 \(at tests/test_launch\.py:\d+ in "
        r"test_the_first_failing_rank_writes_the_line\); rerun with SHARDLAB_DEBUG=1 for the traceback\n",
        third.read_text(),
    )
    assert report(ValueError("numpy's"), str(tmp_path / "fourth"), 0) == 1


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13708. This is"),
        RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection reset by peer"),
    ],
)
def test_a_rank_that_lost_its_peer_writes_nothing(tmp_path, err):
    assert report(err, str(tmp_path / "error"), 0) == EXIT_PEER_LOST
    assert not (tmp_path / "error").exists()


def test_a_broken_pipe_of_its_own_is_a_failure(tmp_path):
    assert report(BrokenPipeError(32, "Broken pipe"), str(tmp_path / "error"), 0) == 1
    assert (tmp_path / "error").read_text().startswith("rank 0: BrokenPipeError: [Errno 32] Broken pipe; rerun")


def failures(*codes: int) -> dict[int, ProcessFailure]:
    return {rank: ProcessFailure(rank, 100 + rank, code, "/no/error/file") for rank, code in enumerate(codes)}


@pytest.mark.parametrize(
    ("codes", "line"),
    [
        ((-signal.SIGTERM, -signal.SIGKILL), "rank 1: killed by SIGKILL (often the out-of-memory killer)"),
        ((EXIT_PEER_LOST, -signal.SIGSEGV), "rank 1: killed by SIGSEGV"),
        ((EXIT_PEER_LOST, -signal.SIGTERM, 17), "rank 2: exited with code 17 and reported no error"),
        ((-signal.SIGKILL, 1), "rank 1: exited with code 1 and reported no error"),
        ((EXIT_PEER_LOST, -signal.SIGTERM), "rank 0: lost its connection to a rank that failed first (on another"),
        ((-signal.SIGTERM, -signal.SIGTERM), "rank 0: killed by SIGTERM"),
    ],
)
def test_describe_names_the_rank_that_failed_first(codes, line):
    """Without a rank's own line: its own exit code, then a signal other than the agent's SIGTERM to the rest."""
    assert describe(failures(*codes)).startswith(line)


TINY = r"""
import os
import signal

import torch
import torch.distributed as dist
from shardlab.parallel.world import init_distributed

d = init_distributed("cpu")
t = torch.tensor([float(d.rank + 1)])
if "{fail}" == "kill":  # before any collective: one after it could race rank 0's reads of rank 1's last bytes
    from shardlab.cli.torchrun import ERROR_FILE_ENV, leave, report

    try:
        if d.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)  # rank 0: gloo's "Connection closed by peer", the echo of rank 1's death
    except Exception as err:
        leave(report(err, os.environ[ERROR_FILE_ENV], d.rank))
dist.all_reduce(t)
line = f"rank {d.rank}/{d.world_size} backend={d.backend} threads={torch.get_num_threads()} sum={t.item()}\n"
os.write(1, line.encode())  # one write: print() can split the text and the newline, and the ranks interleave
if d.rank == 1 and "{fail}" == "yes":
    raise SystemExit("rank 1 gives up")
dist.destroy_process_group()
"""


@pytest.fixture
def tiny_module(tmp_path, monkeypatch, no_launcher):
    for fail in ("no", "yes", "kill"):
        (tmp_path / f"tiny_{fail}.py").write_text(textwrap.dedent(TINY.replace("{fail}", fail)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)


@pytest.mark.world
def test_relaunch_runs_two_ranks(tiny_module, capfd):
    assert relaunch(2, [], module="tiny_no") == 0
    out = capfd.readouterr()
    lines = sorted(line for line in out.out.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0/2 backend=gloo threads=1 sum=3.0", "rank 1/2 backend=gloo threads=1 sum=3.0"]
    assert out.err == ""


@pytest.mark.world
def test_relaunch_returns_the_failure_exit_code(tiny_module, capfd):
    """The rank's own output stays; torchrun adds nothing but one line naming the rank."""
    assert relaunch(2, [], module="tiny_yes") == 1
    assert capfd.readouterr().err.splitlines() == [
        "rank 1 gives up",
        "error: rank 1: exited with code 1 and reported no error",
    ]


@pytest.mark.world
def test_a_killed_rank_is_one_line_and_its_peers_echo_is_not(tiny_module, capfd):
    assert relaunch(2, [], module="tiny_kill") == 1
    assert capfd.readouterr().err.splitlines() == ["error: rank 1: killed by SIGKILL (often the out-of-memory killer)"]


def _processes_naming(token: str) -> list[int]:
    """The live processes whose command line holds `token` (zombies have none)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(entry))
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError, ValueError):
            continue
    return found


@pytest.mark.world
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize(
    "restarts,training", [([], True), (["--max-restarts", "1"], False)], ids=["training", "starting-restartable"]
)
def test_kill_9_of_the_users_process_leaves_no_rank(tmp_path, no_launcher, restarts, training):
    """`kill -9` of `python -m shardlab RECIPE` ends torchrun's agent and every rank within seconds: once they train
    (the agent dies with the user's process, each rank with its agent), and while the ranks are still starting (a
    rank checks at start that the user's process lives)."""
    run_dir = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "shardlab", "recipes/llama_debug.py", "--mesh.dp-shard", "2", "--train.steps",
           "100000", "--train.run-dir", run_dir, *restarts]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    user = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.monotonic()
    try:
        while time.monotonic() - started < 120:
            others = [p for p in _processes_naming(run_dir) if p != user.pid]
            metrics = os.path.join(run_dir, "metrics.jsonl")
            if len(others) >= 3 and (not training or (os.path.isfile(metrics) and os.path.getsize(metrics))):
                break  # torchrun's agent and both ranks (training, when asked)
            assert user.poll() is None, f"the run ended early with code {user.returncode}"
            time.sleep(0.2)
        else:
            pytest.fail("the ranks did not start within 120 s")
    finally:
        user.kill()
        user.wait()
    deadline = time.monotonic() + 15
    while (left := _processes_naming(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} processes outlived the user's: {left}"
