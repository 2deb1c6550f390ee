"""`--launcher ray`: the ranks as Ray workers through Ray Train's TorchTrainer, with torchrun's promises.

Bad input is one line before anything trains (ray absent, an address nobody answers at, resources the cluster
lacks); those checks and the run state's bookkeeping need no cluster. The rest (marked world) shares one local Ray
instance of 4 CPUs started in this process, which the CLI, called here as the driver, joins: a launch costs the
workers' start (~20-40 s on 2 busy cores), so one run of FSDP 2 x TP 2 that loses rank 1 after step 3 and resumes
from step 2 checks the curve against one process, the restart and the output at once.
"""

import io
import json
import re
import sys
import textwrap
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from worlds.layouts import STEPS, assert_matches, curves, tiny  # tests/ is on the path

from shardlab._errors import ShardlabError
from shardlab._faults import FAULT_ENV
from shardlab.cli.flags import RayFlags
from shardlab.cli.main import main
from shardlab.cli.ray_cluster import LOCAL_RAY_ENV, check_reachable, check_resources, cluster_address, worker_resources
from shardlab.cli.ray_launch import RunState, forwarded_env

ROOT = Path(__file__).resolve().parents[1]
RECIPE = """
import sys

sys.path.insert(0, {tests!r})
from shardlab import MeshSpec
from worlds.layouts import tiny

config = tiny(MeshSpec(dp_shard={dp}, tp={tp}))
"""


def recipe(tmp: Path, dp: int = 2, tp: int = 2) -> str:
    """tests/worlds/layouts.py's tiny config as a recipe file: what `curves(tiny())` runs in one process."""
    path = tmp / f"tiny_{dp}x{tp}.py"
    path.write_text(textwrap.dedent(RECIPE.format(tests=str(ROOT / "tests"), dp=dp, tp=tp)))
    return str(path)


def one_line_error(args: list[str], capsys) -> str:
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "\n" not in err, f"not one line: {err}"
    return err


def test_without_ray_it_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    run_dir = tmp_path / "run"
    err = one_line_error([recipe(tmp_path), "--launcher", "ray", "--train.run-dir", str(run_dir)], capsys)
    assert err.startswith("error: --launcher ray needs ray with Ray Train (")
    assert err.endswith("install it: pip install 'shardlab[ray]', or use --launcher torchrun")
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1:1", r"^--ray\.address '127\.0\.0\.1:1': no Ray cluster answers there \(.*\); start one with"),
        ("ray://127.0.0.1:1", r"^--ray\.address 'ray://127\.0\.0\.1:1': no Ray cluster answers there"),
        ("headnode", r"^--ray\.address 'headnode' is not HOST:PORT \(e\.g\. 10\.0\.0\.5:6379"),
    ],
)
def test_an_address_nobody_answers_at_is_one_line(address, message):
    with pytest.raises(ShardlabError, match=message):
        check_reachable(address, timeout_s=2)


def test_the_address_comes_from_the_flag_else_ray_address():
    assert cluster_address(RayFlags(address="h:1"), {"RAY_ADDRESS": "e:2"}) == ("h:1", "--ray.address")
    assert cluster_address(RayFlags(), {"RAY_ADDRESS": "e:2"}) == ("e:2", "env RAY_ADDRESS")
    assert cluster_address(RayFlags(), {}) == (None, "env RAY_ADDRESS")
    with pytest.raises(ShardlabError, match=r"^env RAY_ADDRESS '127\.0\.0\.1:1': no Ray cluster answers there"):
        check_reachable("127.0.0.1:1", "env RAY_ADDRESS", timeout_s=2)


def test_a_bad_address_fails_the_cli_before_training(tmp_path, capsys, monkeypatch):
    pytest.importorskip("ray.train.torch")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run_dir = tmp_path / "run"
    args = [recipe(tmp_path), "--launcher", "ray", "--ray.address", "127.0.0.1:1", "--train.run-dir", str(run_dir)]
    assert one_line_error(args, capsys).startswith("error: --ray.address '127.0.0.1:1': no Ray cluster answers there")
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"GPU": 0}', r"--ray\.resources-per-worker '\{\"GPU\": 0\}': expected a JSON object of Ray resources"),
        ("GPU=1", r"--ray\.resources-per-worker 'GPU=1': expected a JSON object"),
        ("{}", r"--ray\.resources-per-worker '\{\}': expected a JSON object"),
    ],
)
def test_resources_that_are_not_a_json_object_of_amounts(value, message, capsys):
    err = one_line_error(["recipes/llama_debug.py", "--launcher", "ray", "--ray.resources-per-worker", value], capsys)
    assert err.startswith("error: ")
    assert re.search(message, err), err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--launcher", "slurm"],
            r"^error: invalid choice 'slurm' for argument '--launcher'\. Expected one of \('torchrun', 'ray'\); see",
        ),
        (
            ["--launcher", "ray", "--ray.placement-strategy", "PACKED"],
            r"^error: invalid choice 'PACKED' for argument '--ray\.placement-strategy'\. Expected one of \('PACK', ",
        ),
    ],
)
def test_a_launcher_or_strategy_that_does_not_exist(args, message, capsys):
    err = one_line_error(["recipes/llama_debug.py", *args], capsys)
    assert err.startswith("error: ")
    assert re.search(message, err), err


NODE = {"CPU": 4.0, "memory": 1e10}
GPU_NODE = {"CPU": 16.0, "GPU": 8.0}


@pytest.mark.parametrize(
    ("world", "per_worker", "nodes", "strategy", "message"),
    [
        (
            4, {"GPU": 1.0}, [NODE], "PACK",
            r"^--ray\.resources-per-worker '\{\"GPU\": 1\}': 4 workers need 4 GPU but the Ray cluster has 0; ask for "
            r"less per worker, fewer ranks \(--world, the mesh\), or a bigger cluster$",
        ),
        (
            16, {"GPU": 1.0}, [GPU_NODE], "PACK",
            r"^--ray\.resources-per-worker '\{\"GPU\": 1\}': 16 workers need 16 GPU but the Ray cluster has 8;",
        ),
        (
            1, {"GPU": 4.0}, [{"GPU": 2.0}, {"GPU": 2.0}], "PACK",
            r"^--ray\.resources-per-worker '\{\"GPU\": 4\}': no node of the Ray cluster has that much for one worker",
        ),
        (
            4, {"GPU": 1.0}, [GPU_NODE], "STRICT_SPREAD",
            r"^--ray\.placement-strategy STRICT_SPREAD puts each of 4 workers on its own node but the Ray cluster has 1",
        ),
    ],
)  # fmt: skip
def test_resources_the_cluster_cannot_give(world, per_worker, nodes, strategy, message):
    with pytest.raises(ShardlabError, match=message):
        check_resources(world, per_worker, nodes, strategy)


def test_resources_the_cluster_can_give():
    check_resources(16, {"GPU": 1.0, "CPU": 2.0}, [GPU_NODE, GPU_NODE], "STRICT_PACK")  # no error
    check_resources(2, {"GPU": 4.0}, [GPU_NODE, GPU_NODE], "STRICT_SPREAD")


def test_each_rank_reserves_a_gpu_where_the_run_uses_cuda():
    assert worker_resources(RayFlags(), "auto", {"CPU": 2.0}) == {"CPU": 1.0}
    assert worker_resources(RayFlags(), "auto", {"CPU": 2.0, "GPU": 8.0}) == {"GPU": 1.0}
    assert worker_resources(RayFlags(), "cpu", {"GPU": 8.0}) == {"CPU": 1.0}
    assert worker_resources(RayFlags(), "cuda", {}) == {"GPU": 1.0}
    assert worker_resources(RayFlags(resources_per_worker={"GPU": 2.0, "CPU": 8.0}), "cpu", {}) == {
        "GPU": 2.0,
        "CPU": 8.0,
    }


def test_the_ranks_get_the_drivers_shardlab_wandb_and_hf_variables_but_not_its_own():
    env = {"SHARDLAB_FAULT_AT": "step:3@1", "WANDB_MODE": "offline", "HF_HOME": "/h", "PATH": "/bin",
           "SHARDLAB_RAY_RANK": "1", "SHARDLAB_ERROR_FILE": "/e", "SHARDLAB_CUDA_INDEX": "2"}  # fmt: skip
    assert forwarded_env(env) == {"SHARDLAB_FAULT_AT": "step:3@1", "WANDB_MODE": "offline", "HF_HOME": "/h"}


def test_a_restart_is_announced_once_with_the_failure_of_the_attempt_before():
    state = RunState()
    assert [state.join(rank) for rank in range(2)] == [(0, None), (0, None)]
    state.fail("rank 1: RuntimeError: boom", final=False)
    state.died({1: "rank 1: its Ray worker died (x)"})  # Ray's view comes later: the rank's own line wins
    assert state.drain() == ([], [])  # no restart yet
    assert [state.join(rank) for rank in range(2)] == [(1, None), (1, None)]
    assert state.drain() == ([], ["rank 1: RuntimeError: boom"])
    state.died({0: "rank 0: its Ray worker died (y)", 1: "rank 1: its Ray worker died (z)"})
    assert state.last_failure() == ("rank 0: its Ray worker died (y)", None)


def test_a_bad_value_on_a_rank_ends_the_run_however_many_restarts_are_left():
    """A ShardlabError is recorded as final: the next attempt's ranks return without training, and no restart is
    announced (the driver prints the error line)."""
    state = RunState()
    state.join(0)
    state.fail("rank 0: train.steps: bad", final=True)
    assert state.join(0) == (1, "rank 0: train.steps: bad")
    assert state.drain() == ([], [])
    assert state.last_failure() == ("rank 0: train.steps: bad", "rank 0: train.steps: bad")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance with 4 CPUs for the module's launches (the CLI joins a Ray this process started)."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.train.torch")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in LOCAL_RAY_ENV.items():  # what the CLI's own local instance gets
            patch.setenv(name, value)
        ray.init(num_cpus=4, log_to_driver=False, logging_level="ERROR", include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def reference() -> dict[str, list[float]]:
    return curves(tiny())


@pytest.fixture(scope="module")
def restarted(local_ray, tmp_path_factory):
    """FSDP 2 x TP 2 on 4 Ray workers, saving every 2 steps; rank 1 dies after step 3 (first attempt only) and
    Ray Train restarts the world once: (exit code, stdout, stderr, metrics lines, run dir)."""
    tmp = tmp_path_factory.mktemp("ray")
    run_dir = tmp / "run"
    args = [recipe(tmp), "--launcher", "ray", "--max-restarts", "1", "--train.run-dir", str(run_dir),
            "--checkpoint.every", "2", "--checkpoint.resume", "none", "--log.every", "1"]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAULT_ENV, "step:3@1")  # handed to the workers, with every SHARDLAB_ variable
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = main(args)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return code, out.getvalue(), err.getvalue(), lines, run_dir


@pytest.mark.world
def test_fsdp_tp_on_ray_workers_matches_one_process(restarted, reference):
    """Every step rank 0 logged, steps 1-2 by the first attempt and 3-4 after the restart (which drops the lines
    past its checkpoint), is the one-process step within 1e-5 (loss) and 1e-4 (gradient norm)."""
    code, out, err, lines, _ = restarted
    assert code == 0, out[-2000:] + err[-2000:]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    got = {"loss": [x["loss"] for x in lines], "grad_norm": [x["grad_norm"] for x in lines]}
    assert_matches(got, reference, "fsdp 2 x tp 2 on 4 Ray workers, restarted after step 3")


@pytest.mark.world
def test_a_killed_worker_is_restarted_and_resumes_from_the_last_checkpoint(restarted):
    """One warning line naming rank 1, the resume from step 2, and nothing of Ray's in the output: shardlab's
    launch line, then rank 0's own lines, as under torchrun."""
    code, out, err, _, run_dir = restarted
    assert code == 0, out[-2000:] + err[-2000:]
    assert re.fullmatch(
        r"warning: rank 1: its Ray worker died \(.+\); restart 1 of 1, from the last checkpoint\n", err
    ), f"stdout:\n{out}\nstderr:\n{err}"
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    assert [line.split(" | ")[0] for line in out.splitlines()] == [
        "shardlab: launching 4 ranks (dp_shard=2 x tp=2 (4 ranks)) as Ray workers through Ray Train's TorchTrainer, "
        "restarting them up to 1 time",
        "step 1/4", "step 2/4", "step 3/4",
        f"shardlab: resuming from {checkpoint} at step 2; 2 steps to go, to step 4",
        "step 3/4", "step 4/4",
    ], out  # fmt: skip


@pytest.mark.world
def test_resources_a_local_ray_cannot_give_are_one_line_before_any_worker(local_ray, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = [recipe(tmp_path), "--launcher", "ray", "--ray.resources-per-worker", '{"GPU": 1}',
            "--train.run-dir", str(run_dir)]  # fmt: skip
    err = one_line_error(args, capsys)
    assert err == (
        "error: --ray.resources-per-worker '{\"GPU\": 1}': 4 workers need 4 GPU but the Ray cluster has 0; ask for "
        "less per worker, fewer ranks (--world, the mesh), or a bigger cluster"
    )
    assert not (run_dir / "metrics.jsonl").exists()
