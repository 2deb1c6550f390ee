"""The CLI: bad input is a one-line error before any process starts; a real run trains and writes its run dir.

Run: pytest tests/test_cli.py (the end-to-end runs are marked slow: ~10 s, ~15 s and ~25 s on 2 cores).
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.cli.flags import ExportFlags, SearchFlags, TrainFlags, parse
from shardlab.cli.main import main
from shardlab.sharding.plan import PLAN_VERSION

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.dim", "64", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
        "--model.ffn-dim", "128", "--model.vocab-size", "512", "--train.seq-len", "64", "--log.wandb", "disabled",
        "--log.no-progress"]  # fmt: skip


def error_of(args, capsys) -> str:
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "\n" not in err, f"not one line: {err}"
    return err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["recipes/nope.py"], r"recipe: no file 'recipes/nope.py'"),
        (["recipes/llama_fsdp_tp.py", "--world", "8"], r"mesh: dp_shard=2 x tp=2 = 4 ranks but world_size is 8"),
        (["recipes/llama_fsdp_tp.py", "--world=8"], r"mesh: dp_shard=2 x tp=2 = 4 ranks but world_size is 8"),
        (["recipes/llama_fsdp_tp.py", "--world", "x"], r"--world 'x': expected a positive integer"),
        (["plan", "recipes/llama_fsdp_tp.py", "--world=0"], r"^error: --world '0': expected a positive integer"),
        (["plan", "--world", "4"], r"plan: expected a RECIPE first, e.g. `python -m shardlab plan recipes/"),
        (["recipes/llama_fsdp_tp.py", "--max-restarts", "-1"], r"--max-restarts '-1': expected how many times"),
        (
            ["recipes/llama_pp.py", "--plan.pp-schedule", "gpipe", "--plan.pp-stages-per-rank", "2"],
            r"plan.pp_schedule='gpipe' runs one stage per rank but plan.pp_stages_per_rank=2",
        ),
        (
            ["recipes/llama_cp.py", "--train.seq-len", "102"],
            r"train.seq_len=102 is not divisible by 2 x mesh.cp = 4: context parallelism gives each cp rank two",
        ),
        (["recipes/llama_fsdp_tp.py", "--data.source", "files", "--data.paths", "/nope/x.bin"], r"/nope/x.bin"),
        (["recipes/llama_fsdp_tp.py", "--model.vocab-size", "256", "--model.n-heads", "16"], r"model.vocab_size"),
        (["recipes/llama_fsdp_tp.py", "--checkpoint.resume", "/no/such/dir"], r"checkpoint.resume='/no/such/dir'"),
        (["recipes/llama_fsdp_tp.py", "--checkpoint.init-from-hf", "/no/hf"], r"/no/hf: no such directory"),
        (["recipes/llama3_405b_pp.py", "--world", "512"], r"train.init='sharded' with mesh.pp > 1"),
        (["recipes/llama_fsdp_tp.py", "--train.init", "sharded", "--train.device", "cpu"], r"needs CUDA"),
        (["README.md"], r"recipe 'README.md' is not a Python file"),
        (["search", "recipes/llama_debug.py"], r"search: --world N is required"),
        (
            ["search", "recipes/llama_debug.py", "--world", "5", "--mesh.tp", "2"],
            r"mesh.tp=2 = 2 ranks does not divide",
        ),
        (
            ["search", "recipes/llama_debug.py", "--world", "7"],
            r"^error: search: no valid layout of 7 ranks: 5 mesh\(es\) tried, none fits the model and batch; the first: ",
        ),
        (["search", "recipes/llama_debug.py", "--world", "4", "--mesh.tp", "3"], r"model.n_heads=16 is not divisible"),
        (
            ["search", "recipes/llama_debug.py", "--world", "4", "--memory", "0.0001"],
            r"none of the 616 layouts of 4 ranks fits 0.1 MiB per rank \(616 exceed it by their state and the "
            r"activations they keep at least, 0 estimated\); the closest, .*, needs .* MiB or more",
        ),
        (["search", "recipes/llama_debug.py", "--world", "4", "--top", "0"], r"--top '0': expected how many"),
        (["search", "recipes/llama_debug.py", "--world", "4", "--memory", "x"], r"--memory 'x': expected GiB per rank"),
        (["search", "recipes/llama_debug.py", "--world", "4", "--budget", "-1"], r"--budget '-1': expected seconds"),
        (["search", "recipes/llama_debug.py", "--budget=inf", "--world", "4"], r"--budget 'inf': expected seconds"),
        (["search", "recipes/llama_debug.py", "--world", "4", "--out="], r"--out '': expected the path of the recipe"),
        (["search", "recipes/llama_debug.py", "--world", "4", "--device", "tpu"], r"--device 'tpu' is unknown"),
        (["search", "recipes/llama_debug.py", "--world", "4", "--explain", "--json"], r"--explain is for the table"),
    ],
)
def test_bad_input_is_one_line_before_launch(args, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert re.search(message, error_of(args, capsys))


SEARCH_FLAGS = ["--world N", "--device D", "--memory GiB", "--top K", "--out FILE", "--json", "--explain",
                "--budget SECONDS"]  # fmt: skip


def help_of(args: list[str], capsys) -> str:
    """What `--help` prints: tyro prints it and exits 0."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "usage", "named"),
    [
        (["plan", "--help"], "python -m shardlab plan RECIPE [-h] [--debug] [--world N]", ["come with a RECIPE"]),
        (["estimate", "--help"], "python -m shardlab estimate RECIPE [-h] [--debug] [--world N] [--device D]", ["cpu"]),
        (["search", "-h"], "python -m shardlab search RECIPE [-h] [OPTIONS]", SEARCH_FLAGS),
        (
            ["export", "--help"],
            "python -m shardlab export [-h] RUN_DIR [--debug] --to-hf OUT [--recipe RECIPE]",
            ["HFExport"],
        ),
        (
            ["recipes/llama_fsdp_tp.py", "--help"],
            "python -m shardlab recipes/llama_fsdp_tp.py [-h] [OPTIONS]",
            ["--world N", "--max-restarts N", "--mesh.tp INT", "(default: llama_fsdp_tp)"],
        ),
        (
            ["plan", "recipes/llama_fsdp_tp.py", "--mesh.tp", "4", "--help"],
            "python -m shardlab plan recipes/llama_fsdp_tp.py [-h] [OPTIONS]",
            ["--world N", "--mesh.dp-shard INT", "(default: llama_fsdp_tp)"],
        ),
        (
            ["search", "recipes/llama_debug.py", "--help"],
            "python -m shardlab search recipes/llama_debug.py [-h] [OPTIONS]",
            [*SEARCH_FLAGS, "--model.dim INT", "(default: llama_debug)"],
        ),
    ],
)
def test_every_verb_answers_help_with_its_own_flags(args, usage, named, capsys, monkeypatch):
    """Without a recipe a verb's --help lists its flags; with one, the config's fields too, the recipe's values as
    their defaults."""
    monkeypatch.chdir(ROOT)
    out = help_of(args, capsys)
    assert out.splitlines()[0] == f"usage: {usage}"
    text = " ".join(out.replace("│", " ").split())
    assert all(name in text for name in named), out
    assert ("--mesh.tp INT" in text) == ("recipes/" in args[1 if args[0] in ("plan", "search") else 0])


def test_the_overview_and_the_version(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m shardlab RECIPE") and "python -m shardlab VERB --help" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"shardlab {importlib.metadata.version('shardlab')}\n"


def test_the_version_of_a_source_tree_is_pyproject_s(monkeypatch):
    """Not installed (a checkout on PYTHONPATH): the version pyproject.toml states."""
    import shardlab._version

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(shardlab._version, "installed_version", not_installed)
    stated = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert shardlab._version.version() == stated


@pytest.mark.parametrize("form", ["--flag=VALUE", "--flag VALUE"])
def test_flags_and_overrides_mix_in_either_form(form):
    """The verbs' flags read `--flag VALUE` and `--flag=VALUE`, among the config's overrides in any order."""
    from shardlab.cli.recipe import load_recipe

    def given(*pairs: tuple[str, str]) -> list[str]:
        return [x for flag, value in pairs for x in ([f"{flag}={value}"] if "=" in form else [flag, value])]

    config = load_recipe(ROOT / "recipes" / "llama_debug.py").config
    args = given(("--mesh.tp", "2"), ("--world", "4"), ("--memory", "1.5"), ("--model.hf-path", "dir"), ("--top", "3"),
                 ("--out", "best.py"), ("--device", "cpu"), ("--budget", "0"))  # fmt: skip
    flags, cfg = parse(SearchFlags, [*args, "--json"], "prog", config)
    assert flags == SearchFlags(world=4, device="cpu", memory=1.5, top=3, out="best.py", json=True, budget=0.0)
    assert (cfg.mesh.tp, cfg.model.hf_path, cfg.name) == (2, "dir", "llama_debug")
    args = given(("--train.steps", "3"), ("--max-restarts", "2"), ("--world", "8"))
    assert parse(TrainFlags, args, "prog", config)[0] == TrainFlags(world=8, max_restarts=2)
    args = [*given(("--to-hf", "out")), "runs/x", *given(("--recipe", "r.py"))]
    assert parse(ExportFlags, args, "prog")[0] == ExportFlags(run_dir="runs/x", to_hf="out", recipe="r.py")


def test_resharding_after_forward_is_a_flag_pair_that_defaults_to_the_plans_choice():
    from shardlab.cli.recipe import load_recipe

    config = load_recipe(ROOT / "recipes" / "llama_debug.py").config
    read = {args: parse(TrainFlags, list(args), "prog", config)[1].plan.reshard_after_forward
            for args in [(), ("--plan.reshard-after-forward",), ("--plan.no-reshard-after-forward",)]}  # fmt: skip
    assert list(read.values()) == [None, True, False]
    with pytest.raises(ValueError, match="Unrecognized options: None"):  # a flag pair takes no value
        parse(TrainFlags, ["--plan.reshard-after-forward", "None"], "prog", config)


CHAT = {"messages": [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "five"}]}
LONG = {"messages": [{"role": "user", "content": "add 2 and 3 " * 20}, {"role": "assistant", "content": "five"}]}


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer with a chat template, saved as transformers saves one."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"], initial_alphabet=alphabet)
    tok.train_from_iterator(["add two and three: five"], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    path = tmp_path_factory.mktemp("chat-tokenizer")
    fast.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([CHAT, {"text": "hi"}], r"chat\.jsonl:2: no 'messages' list; a chat record is"),
        (None, r"data\.paths: \S*nope\.jsonl does not exist; check the path"),
        (
            [CHAT, LONG],
            r"chat\.jsonl:2: the conversation is \d+ tokens, longer than train\.seq_len=64; .*data\.truncate",
        ),
    ],
)
def test_bad_chat_data_is_one_line_before_launch(records, message, chat_tokenizer, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / ("nope.jsonl" if records is None else "chat.jsonl")
    if records is not None:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ["recipes/llama_fsdp_tp.py", *TINY, "--data.source", "files", "--data.format", "chat", "--data.paths",
            str(path), "--data.tokenizer", str(chat_tokenizer), "--train.run-dir", str(tmp_path / "run")]  # fmt: skip
    assert re.search(message, error_of(args, capsys))


def test_a_launched_rank_leaves_its_error_for_the_first_process(tmp_path, capsys, monkeypatch):
    """On a rank that `relaunch` started, an error is one line in the error file and nothing on the terminal."""
    from shardlab.cli.torchrun import ERROR_FILE_ENV

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path / "error"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "3")
    assert main(["recipes/nope.py"]) == 2
    assert capsys.readouterr().err == ""
    assert (tmp_path / "error").read_text().startswith("rank 3: recipe: no file 'recipes/nope.py'; pass the path")


FAILS_ON_RANK_1 = """
import os
from pathlib import Path

import torch.distributed as dist
from shardlab import Config, DataConfig, LogConfig, MeshSpec, ModelConfig, ShardlabError, TrainConfig

config = Config(
    mesh=MeshSpec(dp_shard=2),
    model=ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=300),
    train=TrainConfig(steps=2, seq_len=32, global_batch=4),
    log=LogConfig(wandb="disabled", progress=False),
    data=DataConfig(source="synthetic"),
)


def rules(cfg):
    if dist.is_initialized() and dist.get_rank() == 1:  # after launch, on one rank: rank 0 waits in a barrier
        with open(Path(__file__).with_name("attempts"), "a") as f:
            f.write("rank 1\\n")
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise {error}("rules: rank 1 cannot lay out this model")
    return None
"""


@pytest.mark.slow
@pytest.mark.world  # launches gloo ranks
@pytest.mark.parametrize("error", ["ShardlabError", "RuntimeError"])
def test_an_error_after_launch_is_one_line_and_retried_unless_a_bad_value(tmp_path, error):
    """An error one rank raises after launch: one line from that rank, no traceback, no torchrun report, and no
    "Connection closed by peer" from the rank that waited for it. A ShardlabError (a bad value) is not retried though
    restarts are allowed: the rank ran once. Any other error is a fault, named with its type and place: the ranks
    start again, and the run finishes (~15 s each)."""
    recipe = tmp_path / "fails.py"
    source = FAILS_ON_RANK_1.replace("{error}", error)
    recipe.write_text(source)
    raised = next(n for n, line in enumerate(source.splitlines(), 1) if "raise " in line)
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDLAB_TRACEBACK", "SHARDLAB_DEBUG")}
    run = subprocess.run(
        [sys.executable, "-m", "shardlab", str(recipe), "--train.run-dir", str(tmp_path / "run"), "--max-restarts", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.stdout.splitlines()[0] == (
        "shardlab: launching 2 ranks (dp_shard=2 (2 ranks)) through torch.distributed.run, restarting them up to 2 times"
    )
    if error == "ShardlabError":
        assert run.returncode == 1
        assert run.stderr.splitlines() == ["error: rank 1: rules: rank 1 cannot lay out this model"]
        assert (tmp_path / "attempts").read_text() == "rank 1\n"
    else:
        assert run.returncode == 0, run.stderr
        assert run.stderr.splitlines() == [
            f"warning: rank 1: RuntimeError: rules: rank 1 cannot lay out this model (at {recipe}:{raised} in rules); rerun "
            "with SHARDLAB_DEBUG=1 for the traceback; restart 1 of 2, from the last checkpoint"
        ]
        assert (tmp_path / "attempts").read_text() == "rank 1\nrank 1\n"


def test_max_restarts_under_an_outside_launcher_is_ignored_with_a_note(tmp_path, capsys, monkeypatch):
    """Under torchrun or srun, restarts are that launcher's: the flag is ignored, in one line, and the run goes on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port))):  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    args = ["recipes/llama_debug.py", *TINY, "--train.steps", "1", "--data.source", "synthetic",
            "--train.global-batch", "4", "--train.run-dir", str(tmp_path), "--max-restarts", "3"]  # fmt: skip
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "shardlab: --max-restarts 3 is ignored: an outside launcher (torchrun, srun) started this process; ask it "
        "for restarts (torchrun --max-restarts)"
    )


@pytest.mark.parametrize("saved", [True, False], ids=["checkpoint", "none-yet"])
def test_a_restart_resumes_from_the_run_s_newest_checkpoint(tmp_path, monkeypatch, saved):
    """On a restarted attempt, checkpoint.resume=none (or a path) was for the first attempt: once the run directory
    holds a checkpoint the restart resumes auto; before, it starts as the first attempt did."""
    from msgspec.structs import replace

    from shardlab.cli.main import _resume_on_restart
    from shardlab.config import CheckpointConfig, Config, TrainConfig

    cfg = Config(train=TrainConfig(run_dir=str(tmp_path)), checkpoint=CheckpointConfig(resume="none"))
    if saved:
        for name in (".metadata", "train_state.json"):
            (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True, exist_ok=True)
            (tmp_path / "checkpoints" / "step-00000004" / name).write_text("{}")
    assert _resume_on_restart(cfg) is cfg  # the first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _resume_on_restart(cfg).checkpoint.resume == ("auto" if saved else "none")
    other = replace(cfg, checkpoint=CheckpointConfig(resume="/elsewhere/step-00000008"))
    assert _resume_on_restart(other).checkpoint.resume == ("auto" if saved else "/elsewhere/step-00000008")


def test_plan_prints_a_pipelined_layout(capsys, monkeypatch):
    """A layout with pp is planned and printed without any process group."""
    monkeypatch.chdir(ROOT)
    assert main(["plan", "recipes/llama_fsdp_tp.py", "--mesh.pp", "2"]) == 0
    assert "pp=2 x dp_shard=2 x tp=2 (8 ranks)" in capsys.readouterr().out


def test_plan_says_what_size_a_minus_one_axis_took_without_world(capsys, monkeypatch):
    """`plan` of a recipe written for many ranks (dp_shard=-1) without --world plans one rank, and says so."""
    monkeypatch.chdir(ROOT)
    assert main(["plan", "recipes/llama3_8b.py"]) == 0
    out, err = capsys.readouterr()
    assert err == "note: no --world: dp_shard (-1 in the recipe) takes size 1, a world of 1; --world N plans N ranks\n"
    assert out.startswith("Plan for mesh 1 rank")
    assert main(["plan", "recipes/llama3_8b.py", "--world", "8"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("Plan for mesh dp_shard=8 (8 ranks)"), out[:200]


def test_recipe_with_a_python_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("from shardlab import Config, MeshSpec\nconfig = Config(mesh=MeshSpec(tpp=2))\n")
    assert re.search(r"recipe '.*bad.py': TypeError: .*tpp", error_of([str(bad)], capsys))


def test_recipe_without_config(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    assert "`config` must be a shardlab.Config, found nothing; add `config = Config(...)`" in error_of(
        [str(bad)], capsys
    )


def test_rule_matching_nothing_is_an_error_before_launch(tmp_path, capsys):
    recipe = tmp_path / "r.py"
    recipe.write_text(
        "from shardlab import Config, MeshSpec, Rule, Rules\n"
        "config = Config(mesh=MeshSpec(dp_shard=2))\n"
        "rules = Rules(params=(Rule(pattern='**', spec=()), Rule(pattern='model.layers.*.attn.wqkv.weight', spec=('tp',))))\n"
    )
    err = error_of([str(recipe)], capsys)
    assert (
        "rules[1] 'model.layers.*.attn.wqkv.weight' matched no parameter; fix the glob or set plan.allow_unused_rules=True"
        in err
    )


def test_unknown_axis_in_a_rule(tmp_path, capsys):
    recipe = tmp_path / "r.py"
    recipe.write_text(
        "from shardlab import Config, MeshSpec, Rule, Rules\n"
        "config = Config(mesh=MeshSpec(dp_shard=2))\n"
        "rules = Rules(params=(Rule(pattern='**', spec=('model',)),))\n"
    )
    assert "unknown mesh axis 'model'" in error_of([str(recipe)], capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mesh.tp", "3"], "model.n_heads=16 is not divisible by mesh.tp=3"),
        (["--mesh.tq", "3"], "Unrecognized"),
        (["--train.steps", "zero"], "train.steps"),
        (["--train.steps", "0"], "error: train.steps=0: Expected `int` >= 1"),
        (["--optim.lr", "-1"], "error: optim.lr=-1.0: must be > 0"),
        (["--plan.param-dtype", "float16"], "float16"),
        (["--train.global-batch", "5"], "train.global_batch=5 is not divisible by the data-parallel size"),
        (
            ["--mesh.pp", "2", "--mesh.dp-shard", "1", "--plan.pp-microbatches", "3"],
            "plan.pp_microbatches=3 does not divide the 8 sequences each data-parallel rank gets",
        ),
        (["--plan.pp-schedule", "dualpipev"], "plan.pp_schedule='dualpipev' is V-shaped"),
        (["--plan.activation-checkpoint", "ops"], "invalid choice 'ops' for argument '--plan.activation-checkpoint'"),
    ],
)
def test_bad_override(args, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        code = main(["recipes/llama_fsdp_tp.py", *args])
        raise SystemExit(code)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message in " ".join((captured.err + captured.out).split())


def test_plan_prints_the_table(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["plan", "recipes/llama3_405b.py", "--world", "4096"]) == 0
    out = capsys.readouterr().out
    assert "Plan for mesh dp_shard=512 x tp=8 (4096 ranks)" in out
    assert "model.layers.*.self_attn.q_proj.weight (x126)" in out
    assert out.splitlines()[-1] == "loss_parallel=True  activation_checkpoint=full  compile=False"
    assert main(["plan", "recipes/llama3_405b.py", "--world", "4096", "--plan.activation-checkpoint", "op"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "loss_parallel=True  activation_checkpoint=op  compile=False"


@pytest.mark.slow
def test_one_rank_run_writes_its_run_dir(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "shardlab", "recipes/llama_debug.py", *TINY, "--train.steps", "3",
         "--train.run-dir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["steps"] == 3
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["version"] == PLAN_VERSION


@pytest.mark.slow
@pytest.mark.world  # launches gloo ranks
def test_four_rank_run_relaunches_and_matches_one_rank(tmp_path):
    """python -m shardlab RECIPE re-launches itself through torchrun with 4 gloo ranks."""

    def losses(name: str) -> list[float]:
        return [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    args = [*TINY, "--train.steps", "3", "--train.run-dir"]
    run = subprocess.run(
        [sys.executable, "-m", "shardlab", "recipes/llama_fsdp_tp.py", *args, str(tmp_path / "four")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert main([str(ROOT / "recipes" / "llama_debug.py"), *args, str(tmp_path / "one")]) == 0  # in this process
    four, one = losses("four"), losses("one")
    assert len(four) == 3 and max(abs(a - b) for a, b in zip(four, one)) <= 1e-5, (four, one)


def test_estimate_says_whether_the_peak_fits_the_device_and_what_size_a_minus_one_axis_took(capsys, monkeypatch):
    """A newcomer's first estimate of a recipe written for many ranks: without --world its -1 axis is 1 rank, which
    is said in a note, and a peak beyond the device's memory is said beside the step time it could not run."""
    monkeypatch.chdir(ROOT)
    small = ["estimate", "recipes/llama_debug.py", *TINY, "--mesh.dp-shard", "-1"]
    assert main([*small, "--device", "h100"]) == 0
    out, err = capsys.readouterr()
    assert (
        err == "note: no --world: dp_shard (-1 in the recipe) takes size 1, a world of 1; --world N estimates N ranks\n"
    )
    assert re.search(r"^  fits H100 SXM's 79\.6 GiB, 79\.\d{3} GiB to spare$", out, re.M), out
    assert main([*small, "--world", "2", "--model.dim", "8192", "--model.n-heads", "64", "--model.n-kv-heads",
                 "8", "--model.ffn-dim", "28672", "--model.n-layers", "16"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert err == "" and "Estimate for mesh dp_shard=2" in out, out
    over = re.search(r"^  does not fit H100 SXM's 79\.6 GiB: ([\d.]+) GiB over; shard over more ranks", out, re.M)
    peak = float(re.search(r"^  peak +([\d.]+) GiB$", out, re.M)[1])
    assert over is not None and float(over[1]) == pytest.approx(peak - 79.6, abs=0.1), out


def test_plan_shows_each_parameters_optimizer_group(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = ["plan", "recipes/llama_fsdp_tp.py", "--optim.no-decay", "**norm.weight"]
    assert main([*args, "--optim.lr-scales", "model.embed_tokens.weight", "0.1"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("model.")}
    assert rows["model.norm.weight"].endswith("wd 0 lr x1")
    assert rows["model.embed_tokens.weight"].endswith("wd 0.1 lr x0.1")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--to-hf="], "--to-hf '': expected the directory to write the Hugging Face model to"),
        (["--to-hf", "out", "--recipe", "notes.txt"], "recipe: no file 'notes.txt'"),
        (["--to-hf", "out", "--recipe", "recipes/custom_gpt.py"], "holds no committed checkpoint"),
    ],
)
def test_export_errors_are_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    assert main(["export", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "args,message",
    [
        (["export", "run", "--to-hf"], "error: Missing value for argument '--to-hf'. Expected 1 values; see "
                                       "`python -m shardlab export --help`"),
        (["export", "run"], "error: Missing from python -m shardlab export: --to-hf OUT; see"),
        (["export", "run", "--to-hf", "out", "--recipes", "r.py"], "error: Unrecognized options: --recipes"),
        (["plan", "recipes/llama_fsdp_tp.py", "--wrld", "4"], "error: Unrecognized options: --wrld, 4 (did you mean "
                                                              "--world N?); see"),
        (["plan", "recipes/llama_fsdp_tp.py", "--mesh.tpp", "4"], "(did you mean --mesh.pp INT?)"),
        (["plan", "recipes/llama_fsdp_tp.py", "--plan.fp8", "bogus"], "invalid choice 'bogus' for argument "
         "'--plan.fp8'. Expected one of ('none', 'tensorwise', 'rowwise', 'rowwise_with_gw_hp'); see"),  # wrapped
    ],
)  # fmt: skip
def test_a_malformed_command_line_is_one_line(args, message, capsys, monkeypatch):
    """A flag without its value, a missing or unknown flag: one line saying which, with the nearest flag and where the
    help is, and exit 2 (tyro's own box is drawn into that line)."""
    monkeypatch.chdir(ROOT)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "│" not in err, err


@pytest.mark.world  # a whole search, its probes forked side by side: the full suite's tier
def test_search_ranks_the_layouts_that_fit_and_writes_the_winner(tmp_path, capsys, monkeypatch):
    """Dense FSDP or TP on 2 ranks (the other axes pinned): the table, the same ranking as JSON, and a recipe that
    runs the winner with the same model and batch."""
    monkeypatch.chdir(ROOT)
    args = ["search", "recipes/llama_debug.py", *TINY, "--world", "2", "--mesh.pp", "1", "--mesh.cp", "1",
            "--mesh.dp-replicate", "1", "--top", "3"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "best.py")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        "Search on H100 SXM, 79.6 GiB per rank: 40 layouts, 0 dropped by their state and activations"
    )
    assert lines[1].split() == ["#", "mesh", "AC", "micro", "schedule", "peak", "GiB", "comm", "s/step", "by", "axis",
                                "step", "s", "tokens/s/dev", "MFU"]  # fmt: skip
    assert re.match(r"^dp_shard=2, AC none, 1 micro(, no reshard)? (wins|ties)", lines[-2])
    assert main([*args, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    steps = [c["step_s"] for c in found["best"]]
    assert steps == sorted(steps) and len(steps) == 2  # FSDP keeping its weights gathered, TP: the siblings they
    assert {c["layout"]["mesh"]["tp"] for c in found["best"]} == {1, 2}  # beat (resharding, ...) are skipped
    assert not found["best"][0]["layout"]["reshard_after_forward"]
    best = found["best"][0]["layout"]
    from shardlab.cli.recipe import load_recipe

    written = load_recipe(tmp_path / "best.py").config
    assert written.mesh.dp_shard == best["mesh"]["dp_shard"] and written.mesh.tp == best["mesh"]["tp"]
    assert written.plan.activation_checkpoint == best["activation_checkpoint"]
    assert (written.model.dim, written.train.global_batch) == (64, 8)
    assert main([*args, "--budget", "1e-9"]) == 0  # stopped once a layout fits: the table says how far that leaves
    stopped = capsys.readouterr().out.splitlines()[-1]
    assert re.match(
        r"Stopped at the budget after \d+ s: \d+ layouts not looked at, each at least .* s per step", stopped
    )


@pytest.mark.parametrize(
    "model,world",
    [
        pytest.param(TINY, 2, marks=pytest.mark.world),  # whole searches of two ranks: the full suite's tier
        pytest.param(["--model.hf-path", "HF_DIR", "--train.seq-len", "64"], 2, marks=pytest.mark.world),
        (TINY, 1),
    ],
    ids=["recipe", "transformers_dir", "no_runner_up"],
)
def test_search_explains_the_winner_term_by_term(model, world, hf_dir, capsys, monkeypatch):
    """--top 1 --explain: one row in the ranking, then the winner and the runner-up (still searched for) side by
    side, whose terms add up to the step time the ranking shows, and the terms that decide. On one rank the winner
    (no checkpointing, one micro batch) beats every other layout by construction: it is explained alone."""
    monkeypatch.chdir(ROOT)
    recipe = "recipes/hf_causal_lm.py" if "HF_DIR" in model else "recipes/llama_debug.py"
    model = [str(hf_dir) if a == "HF_DIR" else a for a in model]
    assert main(["search", recipe, *model, "--world", str(world), "--mesh.pp", "1", "--mesh.cp", "1",
                 "--top", "1", "--explain"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("1 ") and lines[3].startswith("Where the step goes (exposed comm: ")
    cells = [re.split(r"\s{2,}", line) for line in lines[4:-1]]
    columns = 2 if world > 1 else 1
    assert [c.split(" ", 1)[0] for c in cells[0][1:]] == ["#1", "#2", "#2"][: columns + columns - 1]
    rows = {row[0]: row[1:] for row in cells[1:]}
    assert list(rows)[:5] == ["compute", "recomputation", "pp sends", "bubble", "optimizer"]
    assert rows["step"][0] == lines[2].split()[-3]  # the ranking's step time
    terms = [name for name in rows if name not in ("step", "peak memory", "headroom of 79.6 GiB")]
    for i in range(columns):
        assert sum(float(rows[t][i]) for t in terms) == pytest.approx(float(rows["step"][i]), rel=1e-3)
    assert len(rows["headroom of 79.6 GiB"]) == columns
    if world > 1:
        assert float(rows["step"][2]) >= 0 and float(rows["step"][2]) == pytest.approx(
            float(rows["step"][1]) - float(rows["step"][0]), abs=1e-3 * float(rows["step"][1])
        )
        assert re.search(
            r" (wins, [\d.]+% faster than .* \([\d.e-]+ s per step\): [\d.e-]+ s less |ties with )", lines[-1]
        )
    else:
        assert lines[-1] == (
            "1 rank, AC none, 1 micro, no reshard has no runner-up: every other layout is too big, or one it beats by "
            "construction (its mesh with more recomputation, micro batches or FSDP gathers: not estimated)"
        )


@pytest.mark.parametrize("verb", ["plan", "estimate", "search", "export"])
def test_any_error_is_one_line_unless_debugging(verb, tmp_path, capsys, monkeypatch):
    """An error that is not a bad value (here a RuntimeError from deep inside) is one line too: its type, message and
    place, and how to see the traceback; --debug or SHARDLAB_DEBUG=1 raises it with its traceback instead."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("SHARDLAB_DEBUG", "0")  # off; and restored after the test, which --debug sets
    monkeypatch.delenv("SHARDLAB_TRACEBACK", raising=False)

    def broken(*args, **kwargs):
        raise RuntimeError("something broke\nwith details")

    from shardlab.cli import recipe
    from shardlab.training import export

    monkeypatch.setattr(recipe, "load_recipe", broken)
    monkeypatch.setattr(export, "export_to_hf", broken)
    args = [verb, str(tmp_path)] if verb == "export" else [verb, "recipes/llama_debug.py", "--world", "1"]
    if verb == "export":
        args += ["--to-hf", str(tmp_path / "out")]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"error: RuntimeError: something broke \(at tests/test_cli\.py:\d+ in broken\); rerun with SHARDLAB_DEBUG=1 "
        r"for the traceback\n",
        err,
    ), err
    with pytest.raises(RuntimeError, match="something broke"):
        main([*args, "--debug"])
    monkeypatch.setenv("SHARDLAB_DEBUG", "1")
    with pytest.raises(RuntimeError, match="something broke"):
        main(args)
