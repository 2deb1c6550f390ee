"""Held-out evaluation on one process: the numbers are the mean token loss of the held-out batches, training never
sees those documents, evaluation never changes the training curve, and bad settings are one line."""

from __future__ import annotations

import math
import warnings

import msgspec
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardlab.config import Config, DataConfig, EvalConfig, LogConfig, MeshSpec, ModelConfig, TrainConfig
from shardlab.data.documents import hold_out
from shardlab.data.loader import make_loader
from shardlab.models import provider_for
from shardlab.training.evaluate import eval_loader, make_eval
from shardlab.training.loop import build_model, train


def tiny(every: int = 0, paths: tuple[str, ...] = (), steps: int = 4) -> Config:
    return Config(
        mesh=MeshSpec(dp_shard=1),
        model=ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=300),
        train=TrainConfig(steps=steps, global_batch=4, seq_len=16, run_dir="/tmp/shardlab-tests/{name}"),
        log=LogConfig(wandb="disabled", progress=False),
        eval=EvalConfig(every=every, steps=2, paths=paths),
    )


def test_the_held_out_documents_are_the_last_and_training_never_reads_them():
    docs = [np.full(10, i) for i in range(250)]
    assert [int(d[0]) for d in hold_out(docs, "held_out")] == [248, 249]  # 1% of 250
    assert len(hold_out(docs, "train")) == 248 and hold_out(docs, "all") is docs
    (one,) = hold_out([np.arange(1000)], "held_out")
    assert one.tolist() == list(range(990, 1000))
    with pytest.raises(ValueError, match=r"too short to hold out an evaluation slice; pass --eval.paths"):
        hold_out([np.arange(50)], "train")


def test_eval_loss_is_the_mean_token_loss_of_the_held_out_batches():
    cfg = tiny(every=1)
    model, plan, mesh = build_model(cfg)
    provider = provider_for(cfg)
    loader = eval_loader(cfg, vocab_size=300, dp_rank=0, dp_size=1, micro_batches=1, tokenizer=None)
    got = make_eval(cfg, plan, mesh, provider)(model, loader)
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(b.inputs).flatten(0, 1), b.labels.flatten(), reduction="sum").item()
            for b in (loader.batch(0), loader.batch(1))
        ]
    want = sum(losses) / (2 * 4 * 16)
    assert got["eval_loss"] == pytest.approx(want, rel=1e-6)
    assert got["eval_ppl"] == pytest.approx(math.exp(want), rel=1e-6)
    train_loader = make_loader(cfg.data, seq_len=16, global_batch=4, vocab_size=300, dp_rank=0, dp_size=1)
    assert not torch.equal(loader.batch(0).inputs, train_loader.batch(0).inputs)


def test_evaluation_never_changes_the_training_curve(tmp_path):
    """With the held-out documents out of training either way, evaluating every step or never gives the same
    training losses; held-out files leave the training data as it is without evaluation."""
    often = train(tiny(every=1), write=False)
    once = train(tiny(every=4), write=False)
    assert [m["loss"] for m in often] == [m["loss"] for m in once]
    assert [("eval_loss" in m) for m in often] == [True] * 4 and [("eval_loss" in m) for m in once] == [0, 0, 0, 1]
    assert often[-1]["eval_loss"] == once[-1]["eval_loss"]
    held = tmp_path / "held.txt"
    held.write_text("def held_out():\n    return 'text training never reads'\n" * 20)
    plain = train(tiny(), write=False)
    with_files = train(tiny(every=2, paths=(str(held),)), write=False)
    assert [m["loss"] for m in plain] == [m["loss"] for m in with_files]
    assert all(math.isfinite(m["eval_loss"]) for m in with_files if "eval_loss" in m)


def test_missing_held_out_files_fail_before_anything_runs(tmp_path):
    cfg = tiny(every=1, paths=(str(tmp_path / "nope.txt"),))
    with pytest.raises(ValueError, match=r"nope.txt does not exist"):
        eval_loader(cfg, vocab_size=300, dp_rank=0, dp_size=1, micro_batches=1, tokenizer=None)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"every": -1}, EvalConfig)


@pytest.mark.parametrize("kind", ["jsonl", "jsonl_dir", "bin"])
def test_a_bad_held_out_file_is_named_by_eval_paths(tmp_path, kind):
    """An error about a file that --eval.paths named leads with eval.paths, not data.paths; the same file given as
    --data.paths leads with data.paths."""
    if kind == "bin":
        bad = tmp_path / "odd.bin"
        bad.write_bytes(b"123")
        why = r"odd\.bin is 3 bytes, not a positive multiple of 2"
    else:
        bad = tmp_path / ("held" if kind == "jsonl_dir" else "") / "held.jsonl"
        bad.parent.mkdir(exist_ok=True)
        bad.write_text('{"text": "fine"}\n{oops\n')
        why = r"held\.jsonl:2 is not valid JSON"
    named = bad.parent if kind == "jsonl_dir" else bad
    cfg = msgspec.structs.replace(tiny(every=1, paths=(str(named),)), train=TrainConfig(run_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=rf"^eval\.paths: .*{why}"):
        eval_loader(cfg, vocab_size=300, dp_rank=0, dp_size=1, micro_batches=1, tokenizer=None)
    data = DataConfig(source="files", paths=(str(named),), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=rf"^data\.paths: .*{why}"):
        make_loader(data, seq_len=16, global_batch=4, vocab_size=300, dp_rank=0, dp_size=1)


def test_synthetic_data_holds_out_by_its_own_stream():
    data = DataConfig(source="synthetic")
    a = make_loader(data, seq_len=8, global_batch=2, vocab_size=50, dp_rank=0, dp_size=1, split="held_out")
    b = make_loader(data, seq_len=8, global_batch=2, vocab_size=50, dp_rank=0, dp_size=1, split="train")
    assert not torch.equal(a.batch(0).inputs, b.batch(0).inputs) and a.fingerprint != b.fingerprint


def test_a_run_leaves_the_process_warnings_filters_as_they_were():
    """The loop silences FSDP's warning about the embedding's view for its own run only: a researcher's process keeps
    its filters."""
    before = list(warnings.filters)
    train(tiny(), write=False)
    assert warnings.filters == before
