"""Checkpoints on one process: a kill at any moment loses nothing, partial saves are cleaned up, the newest
K are kept, and a checkpoint of another model or a bad path is a clear error before anything is loaded; every
checkpoint carries a manifest, and a resume falls back past (auto) or refuses (a path) one that does not match it."""

import json
import os
import re
import traceback
import warnings
import zlib
from pathlib import Path

import msgspec
import pytest

from shardlab._faults import EXIT_FAULT, FAULT_ENV
from shardlab.cli.main import main
from shardlab.config import CheckpointConfig, Config, DataConfig, LogConfig, MeshSpec, ModelConfig, TrainConfig
from shardlab.config import MoEConfig as MoE
from shardlab.training._manifest import MANIFEST_FILE
from shardlab.training.checkpoint import complete, resolve_resume, step_dir
from shardlab.training.loop import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.dim", "32", "--model.n-layers", "1", "--model.n-heads", "2", "--model.n-kv-heads", "1",
        "--model.ffn-dim", "64", "--model.vocab-size", "300", "--train.seq-len", "32", "--train.steps", "6",
        "--log.wandb", "disabled", "--log.no-progress", "--checkpoint.every", "2"]  # fmt: skip


def killed(run_dir: Path, fault: str) -> int:
    """The exit status of the command line's main on the tiny run, checkpointing every step, in a forked child of
    this process with the fault point `fault` armed (`FAULT_ENV`): it ends the child as kill -9 would."""
    pid = os.fork()
    if pid == 0:  # the child: the run, then its exit status, without the parent's exit handlers
        try:
            os.environ[FAULT_ENV] = fault
            os._exit(
                main(["recipes/llama_debug.py", *TINY, "--train.run-dir", str(run_dir), "--checkpoint.every", "1"])
            )
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_kills_at_any_moment_lose_nothing(tmp_path, monkeypatch):
    """A run saving every step is killed between steps, during a save and during a log write, and started again
    after each kill: its metrics.jsonl ends with the losses of an uninterrupted run, bitwise, one line per step.
    The kills are forked children of this process (a fault point ends one as kill -9 would); the uninterrupted run
    and the last start run in this process."""
    monkeypatch.chdir(ROOT)
    args = ["recipes/llama_debug.py", *TINY, "--checkpoint.every", "1"]
    assert main([*args, "--train.run-dir", str(tmp_path / "straight")]) == 0
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"

    assert killed(run, "step:2") == EXIT_FAULT  # step 2 done: not saved, not logged
    assert [p.name for p in complete(checkpoints)] == ["step-00000001"] and list(losses(run)) == [1]

    assert killed(run, "save:3") == EXIT_FAULT  # step 3's files, not committed
    assert [p.name for p in complete(checkpoints)][-1] == "step-00000002" and (
        checkpoints / "step-00000003.tmp"
    ).is_dir()

    assert killed(run, "log:5") == EXIT_FAULT  # step 5 committed, half its line written
    assert [p.name for p in complete(checkpoints)][-1] == "step-00000005"
    torn = (run / "metrics.jsonl").read_text().splitlines()[-1]
    assert torn.startswith('{"step": 5, "loss": ') and not torn.endswith("}")

    assert main([*args, "--train.run-dir", str(run)]) == 0
    assert not (checkpoints / "step-00000003.tmp").exists(), "the partial save is cleaned up on the next start"
    assert losses(run) == losses(tmp_path / "straight")  # bitwise, every step, one line per step


def test_a_resume_restores_the_line_of_its_step_when_a_kill_cut_it(tmp_path):
    """The checkpoint of step 4 committed, then its metrics line was lost: resuming writes it from the checkpoint
    (train_state.json keeps the step's values), unless the line was never due (log.every)."""
    cfg = tiny(tmp_path, every=2)
    straight = train(cfg, until=4)
    path = tmp_path / "metrics.jsonl"
    rows = path.read_text().splitlines()
    path.write_text("\n".join(rows[:3]) + "\n" + rows[3][:20])
    train(cfg, until=4)
    assert losses(tmp_path) == {m: straight[m - 1]["loss"] for m in range(1, 5)}
    sparse = msgspec.structs.replace(cfg, log=msgspec.structs.replace(cfg.log, every=3))
    path.write_text("\n".join(rows[:3]) + "\n")
    train(sparse, until=4)
    assert list(losses(tmp_path)) == [1, 2, 3]


def tiny(run_dir: Path, **checkpoint) -> Config:
    return Config(
        mesh=MeshSpec(dp_shard=1),
        model=ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=300),
        train=TrainConfig(steps=6, seq_len=32, global_batch=4, run_dir=str(run_dir)),
        log=LogConfig(wandb="disabled", progress=False),
        data=DataConfig(source="synthetic"),
        checkpoint=CheckpointConfig(**{"every": 1, **checkpoint}),
    )


def test_one_process_saves_and_loads_without_torchs_single_process_warning(tmp_path):
    """Saving, resuming and exporting in one process, as shardlab means to, do not show torch's "assuming the intent
    is to save/load in a single process" warning; only that warning is dropped, and the process's warning filters
    are as they were."""
    from shardlab.training.export import export_to_hf

    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(tiny(tmp_path, every=2), write=False, until=2)  # saves
        train(tiny(tmp_path, every=2), write=False, until=4)  # loads, saves
        export_to_hf(tmp_path, tmp_path / "hf")  # loads
    messages = [str(w.message) for w in seen]
    assert not [m for m in messages if "assuming the intent is to" in m], messages
    assert warnings.filters == before

    from shardlab.training.checkpoint import one_process

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with one_process(True):
            warnings.warn("torch.distributed is disabled: another warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["torch.distributed is disabled: another warning"]


def test_one_process_async_save_is_quiet_and_resumes_bitwise(tmp_path):
    """An async save in one process writes on a thread without torch's one-process warning (which DCP's own async
    save prints from its thread, where no filter scoped to the call reaches); a run resumed from it continues the
    uninterrupted curve bitwise."""
    whole = [m["loss"] for m in train(tiny(tmp_path / "whole", every=2), write=False)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = train(tiny(tmp_path / "async", every=2, async_save=True), write=False, until=4)
        second = train(tiny(tmp_path / "async", every=2, async_save=True), write=False)
    assert not [w for w in seen if "assuming the intent is to" in str(w.message)], [str(w.message) for w in seen]
    assert [p.name for p in complete(tmp_path / "async" / "checkpoints")][-1] == "step-00000006"
    assert [m["loss"] for m in first + second] == whole


def test_keeps_the_newest_k(tmp_path):
    train(tiny(tmp_path, keep=2), write=False)
    assert [p.name for p in complete(tmp_path / "checkpoints")] == ["step-00000005", "step-00000006"]


def test_resume_none_starts_fresh_and_auto_finds_nothing_to_do(tmp_path, capsys):
    train(tiny(tmp_path), write=False)
    assert "resum" not in capsys.readouterr().out
    assert train(tiny(tmp_path), write=False) == []  # auto: step 6 of 6 is already done, and it says so
    assert capsys.readouterr().out == (
        f"shardlab: {tmp_path / 'checkpoints' / 'step-00000006'} is at step 6, at or past train.steps=6: nothing to "
        "train (raise --train.steps to train on)\n"
    )
    assert len(train(tiny(tmp_path, resume="none"), write=False)) == 6


def test_a_resumed_run_says_from_where_and_how_far(tmp_path, capsys):
    train(tiny(tmp_path), write=False, until=2)
    capsys.readouterr()
    assert len(train(tiny(tmp_path), write=False, until=5)) == 3
    assert capsys.readouterr().out.splitlines()[0] == (
        f"shardlab: resuming from {tmp_path / 'checkpoints' / 'step-00000002'} at step 2; 3 steps to go, to step 5"
    )


def test_a_run_started_over_replaces_the_later_checkpoints_of_the_one_before(tmp_path):
    """A fresh run of 3 steps where a run of 6 left its checkpoints keeps its own (keep=2 prunes the oldest, not
    the step it just committed), and the next start resumes it, not the earlier run's step 6."""
    train(tiny(tmp_path, keep=2), write=False)
    fresh = msgspec.structs.replace(tiny(tmp_path, keep=2, resume="none"), train=TrainConfig(
        steps=3, seq_len=32, global_batch=4, run_dir=str(tmp_path)))  # fmt: skip
    assert len(train(fresh, write=False)) == 3
    assert [p.name for p in complete(tmp_path / "checkpoints")] == ["step-00000002", "step-00000003"]
    assert resolve_resume("auto", tmp_path / "checkpoints") == step_dir(tmp_path / "checkpoints", 3)


@pytest.mark.parametrize("name", [".metadata", "train_state.json"])
def test_a_checkpoint_missing_its_index_or_state_is_damage_not_absence(tmp_path, capsys, name):
    """Skipped with a warning like any damage, and with every checkpoint so, the run stops instead of starting
    over from step 0 on top of them."""
    oldest, newest = two_checkpoints(tmp_path)
    (newest / name).unlink()
    assert resolve_resume("auto", tmp_path / "checkpoints") == oldest
    assert f"skips step-00000004: {name} is missing; resuming from step-00000002" in capsys.readouterr().err
    (oldest / name).unlink()
    with pytest.raises(ValueError, match=rf"no intact checkpoint .* \(newest step-00000004: {name} is missing\)"):
        resolve_resume("auto", tmp_path / "checkpoints")


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    train(tiny(tmp_path), write=False, until=2)
    other = tiny(tmp_path)
    other = msgspec.structs.replace(other, model=msgspec.structs.replace(other.model, ffn_dim=96))
    with pytest.raises(ValueError, match=r"saved for another model \(model.ffn_dim=64, now 96\)"):
        train(other, write=False)


def test_a_bad_resume_path_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint.resume='.*nowhere': not a complete shardlab checkpoint"):
        resolve_resume(str(tmp_path / "nowhere"), tmp_path)
    assert resolve_resume("auto", tmp_path / "none-yet") is None
    assert step_dir(tmp_path, 12).name == "step-00000012"


@pytest.mark.parametrize("moe", [None, MoE(n_experts=4, top_k=2, expert_ffn_dim=32)], ids=["llama", "mixtral"])
def test_export_writes_what_transformers_loads(tmp_path, moe):
    """A checkpoint's weights come out as safetensors + config.json with the trained model's logits (an MoE
    model's as a Mixtral)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from shardlab.data.loader import make_loader
    from shardlab.training.checkpoint import save
    from shardlab.training.export import export_to_hf
    from shardlab.training.loop import build_model
    from shardlab.training.step import init_state, make_step

    cfg = tiny(tmp_path)
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, moe=moe))
    model, plan, mesh = build_model(cfg)
    state, step = init_state(model, cfg.optim), make_step(cfg, plan, mesh)
    loader = make_loader(cfg.data, seq_len=32, global_batch=4, vocab_size=300, dp_rank=0, dp_size=1)
    for _ in range(2):
        state, _ = step(state, next(loader))
    save(state, loader, cfg, tmp_path / "checkpoints")
    export_to_hf(tmp_path, tmp_path / "hf")
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == ("MixtralForCausalLM" if moe else "LlamaForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-5, rtol=0)


def test_init_from_hf_starts_from_those_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch
    import torch.nn.functional as F

    from shardlab.data.loader import make_loader
    from shardlab.hf import read_hf_config
    from shardlab.models.llama.model import to_hf_config

    cfg = tiny(tmp_path / "run", every=None)
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_config(cfg.model))).eval()
    hf.save_pretrained(tmp_path / "hf")
    cfg = msgspec.structs.replace(cfg, model=read_hf_config(tmp_path / "hf"))
    cfg = msgspec.structs.replace(cfg, checkpoint=CheckpointConfig(init_from_hf=str(tmp_path / "hf")))
    first = train(cfg, write=False, until=1)[0]["loss"]
    batch = next(make_loader(cfg.data, seq_len=32, global_batch=4, vocab_size=300, dp_rank=0, dp_size=1))
    with torch.no_grad():
        want = F.cross_entropy(hf(batch.inputs).logits.flatten(0, 1), batch.labels.flatten()).item()
    assert first == pytest.approx(want, abs=1e-5)
    other = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, ffn_dim=96))
    with pytest.raises(ValueError, match=r"init_from_hf: the checkpoint has model.ffn_dim=64 but the config says 96"):
        train(other, write=False, until=1)


def test_export_of_a_directory_without_checkpoints_is_an_error(tmp_path):
    from shardlab.training.export import export_to_hf

    with pytest.raises(ValueError, match="holds no committed checkpoint"):
        export_to_hf(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("damage", ["truncate", "delete", "metadata"])
def test_a_damaged_checkpoint_is_refused_before_anything_loads(tmp_path, damage):
    import torch

    from shardlab.data.loader import make_loader
    from shardlab.training.checkpoint import load
    from shardlab.training.loop import build_model
    from shardlab.training.step import init_state

    cfg = tiny(tmp_path)
    train(cfg, write=False, until=2)
    step = step_dir(tmp_path / "checkpoints", 2)
    data = step / "__0_0.distcp"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif damage == "delete":
        data.unlink()
    else:
        (step / ".metadata").write_bytes(b"not a pickle")
    model, _, _ = build_model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loader = make_loader(cfg.data, seq_len=32, global_batch=4, vocab_size=300, dp_rank=0, dp_size=1)
    message = {
        "truncate": r"__0_0.distcp is truncated",
        "delete": r"__0_0.distcp is missing",
        "metadata": r"unreadable .metadata",
    }
    with pytest.raises(ValueError, match=message[damage]):
        load(init_state(model, cfg.optim), loader, step, cfg)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a failed load"


def test_resuming_with_another_global_batch_says_what_differs(tmp_path):
    train(tiny(tmp_path), write=False, until=2)
    other = tiny(tmp_path)
    other = msgspec.structs.replace(other, train=msgspec.structs.replace(other.train, global_batch=8))
    with pytest.raises(ValueError, match="global_batch"):
        train(other, write=False)


def damage(file: Path, how: str) -> None:
    """Damage a file as a disk, a copy or a kill might: shorter, one byte changed (same size), or gone."""
    data = file.read_bytes()
    if how == "truncate":
        file.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        middle = len(data) // 2
        file.write_bytes(data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :])
    else:
        file.unlink()


def two_checkpoints(run_dir: Path) -> tuple[Path, Path]:
    """Steps 2 and 4 of the 6-step run, saved."""
    train(tiny(run_dir, every=2), write=False, until=4)
    return step_dir(run_dir / "checkpoints", 2), step_dir(run_dir / "checkpoints", 4)


def test_every_checkpoint_carries_a_manifest_of_its_files(tmp_path):
    _, step = two_checkpoints(tmp_path)
    files = json.loads((step / MANIFEST_FILE).read_text())["files"]
    on_disk = sorted(p.name for p in step.iterdir() if p.name != MANIFEST_FILE)
    assert sorted(files) == on_disk and {".metadata", "__0_0.distcp", "train_state.json"} <= set(files)
    for name, entry in files.items():
        data = (step / name).read_bytes()
        assert entry == {"size": len(data), "crc32": zlib.crc32(data)}, name


MESSAGE = {
    "truncate": r"data file __0_0\.distcp is truncated \(\d+ of \d+ bytes\)",
    "flip": r"data file __0_0\.distcp is corrupt \(CRC-32 [0-9a-f]{8}, the manifest says [0-9a-f]{8}\)",
    "delete": r"data file __0_0\.distcp is missing",
}


@pytest.mark.parametrize("how", ["truncate", "flip", "delete"])
def test_resume_auto_falls_back_past_a_damaged_checkpoint(tmp_path, capsys, how):
    """The newest checkpoint's data file is damaged: auto says so, resumes from the one before, and the run's
    losses are those of an uninterrupted run, bitwise."""
    straight = [m["loss"] for m in train(tiny(tmp_path / "straight", every=None), write=False)]
    _, newest = two_checkpoints(tmp_path / "run")
    capsys.readouterr()
    damage(newest / "__0_0.distcp", how)
    resumed = [m["loss"] for m in train(tiny(tmp_path / "run", every=2), write=False)]
    assert resumed == straight[2:]
    warning = capsys.readouterr().err.strip()
    assert "\n" not in warning, warning
    assert re.fullmatch(
        rf"warning: checkpoint\.resume=auto skips step-00000004: {MESSAGE[how]}; resuming from step-00000002", warning
    ), warning


def test_an_unreadable_manifest_is_damage_too(tmp_path, capsys):
    _, newest = two_checkpoints(tmp_path)
    (newest / MANIFEST_FILE).write_text('{"files": {"__0_0.distcp": ')
    assert resolve_resume("auto", tmp_path / "checkpoints") == step_dir(tmp_path / "checkpoints", 2)
    assert "skips step-00000004: manifest.json is unreadable (JSONDecodeError: " in capsys.readouterr().err


def test_a_checkpoint_without_a_manifest_is_trusted(tmp_path, capsys):
    """Checkpoints written before manifests existed load as they always did."""
    _, newest = two_checkpoints(tmp_path)
    (newest / MANIFEST_FILE).unlink()
    assert len(train(tiny(tmp_path, every=2), write=False)) == 2  # steps 5 and 6, from step 4
    assert capsys.readouterr().err == ""


def test_a_garbage_train_state_without_a_manifest_is_damage_named_in_one_line(tmp_path, capsys):
    """In checkpoints without a manifest, a train_state.json that is not JSON (or not shardlab's object) is damage
    like any other: auto skips it naming the file, an explicit path and a read of it refuse it in one line naming
    the file and what to do, and with every checkpoint so the run stops; never a bare JSON error."""
    from shardlab.training.checkpoint import saved_metrics

    older, newest = two_checkpoints(tmp_path)
    for step in (older, newest):
        (step / MANIFEST_FILE).unlink()
    (newest / "train_state.json").write_text("garbage{")
    why = r"train_state\.json is unreadable \(JSONDecodeError: Expecting value: line 1 column 1 \(char 0\)\)"
    assert resolve_resume("auto", tmp_path / "checkpoints") == older
    warning = capsys.readouterr().err
    assert re.fullmatch(
        rf"warning: checkpoint\.resume=auto skips step-00000004: {why}; resuming from step-00000002\n", warning
    )
    with pytest.raises(ValueError, match=rf"^checkpoint\.resume='.*step-00000004': {why}; resume from another step$"):
        resolve_resume(str(newest), tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=rf"^checkpoint '.*step-00000004': {why}; resume from another step$"):
        saved_metrics(newest)
    (older / "train_state.json").write_text("[]")
    with pytest.raises(
        ValueError,
        match=r"^checkpoint\.resume=auto: no intact checkpoint in '.*checkpoints' \(newest step-00000004: train_state"
        r"\.json is unreadable .*\); set checkpoint\.resume=none to start fresh$",
    ):
        train(tiny(tmp_path, every=2), write=False)
    with pytest.raises(ValueError, match=r"step-00000002': train_state\.json is unreadable \(not the object shardlab"):
        resolve_resume(str(older), tmp_path / "checkpoints")


def test_export_speaks_of_exporting_not_resuming(tmp_path, capsys):
    """An export past a damaged newest checkpoint says it exports the one before; with none intact it says there is
    nothing to export; a damaged step without a manifest says to export another step: never a word of resuming."""
    from shardlab.training.export import export_to_hf

    older, newest = two_checkpoints(tmp_path)
    damage(newest / "__0_0.distcp", "truncate")
    capsys.readouterr()
    assert export_to_hf(tmp_path, tmp_path / "hf") == older
    warning = capsys.readouterr().err
    assert re.fullmatch(
        rf"warning: export skips step-00000004: {MESSAGE['truncate']}; exporting step-00000002\n", warning
    ), warning
    damage(older / "__0_0.distcp", "truncate")
    with pytest.raises(ValueError) as err:
        export_to_hf(tmp_path, tmp_path / "hf2")
    assert re.fullmatch(
        r"export: no intact checkpoint in '.*checkpoints' \(newest step-00000004: data file __0_0\.distcp is "
        r"truncated \(\d+ of \d+ bytes\)\); nothing to export until a checkpoint is restored or trained again",
        str(err.value),
    ), err.value
    (older / MANIFEST_FILE).unlink()  # trusted: the size check before loading finds the damage
    with pytest.raises(
        ValueError, match=r"data file __0_0\.distcp is truncated \(\d+ of \d+ bytes\); export another step$"
    ):
        export_to_hf(older, tmp_path / "hf3")
    assert "resum" not in capsys.readouterr().err


def test_no_intact_checkpoint_is_an_error(tmp_path):
    older, newest = two_checkpoints(tmp_path)
    damage(older / "train_state.json", "flip")
    damage(newest / "__0_0.distcp", "truncate")
    with pytest.raises(
        ValueError,
        match=r"^checkpoint\.resume=auto: no intact checkpoint in '.*checkpoints' \(newest step-00000004: data file "
        r"__0_0\.distcp is truncated \(\d+ of \d+ bytes\)\); set checkpoint\.resume=none to start fresh$",
    ):
        train(tiny(tmp_path, every=2), write=False)


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_an_explicit_damaged_checkpoint_is_a_one_line_error(tmp_path, capsys, monkeypatch, how):
    """A truncated file is found before launch (a stat); a changed byte by the ranks, before anything loads."""
    _, newest = two_checkpoints(tmp_path / "run")
    damage(newest / "__0_0.distcp", how)
    monkeypatch.chdir(ROOT)
    args = ["recipes/llama_debug.py", *TINY, "--train.run-dir", str(tmp_path / "again"), "--data.source", "synthetic",
            "--train.global-batch", "4", "--checkpoint.resume", str(newest)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(
        rf"error: checkpoint\.resume='.*step-00000004': {MESSAGE[how]}; resume from another step", err
    ), err
