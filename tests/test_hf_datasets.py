"""Parquet, Arrow and directories of JSONL through Hugging Face datasets: the same documents, so the same global
batches, as the same texts read from JSONL; tokenized once into data.cache_dir; bad datasets fail in one line.

Run: pytest tests/test_hf_datasets.py (one process, a few seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardlab._faults import EXIT_FAULT, FAULT_ENV
from shardlab.config import Config, DataConfig, TrainConfig
from shardlab.data import loader as data_module
from shardlab.data.datasets import PARTIAL
from shardlab.data.loader import make_loader, run_data

datasets = pytest.importorskip("datasets")

SEQ, G = 16, 8
TEXTS = [f"row {i}: " + "ab" * (i % 7) for i in range(40)]


def batches(data: DataConfig, steps: int = 8, dp_size: int = 1, dp_rank: int = 0) -> list[torch.Tensor]:
    loader = make_loader(data, seq_len=SEQ, global_batch=G, vocab_size=300, dp_rank=dp_rank, dp_size=dp_size)
    return [loader.batch(k).inputs for k in range(steps)]


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def files(path: Path, cache: Path) -> DataConfig:
    return DataConfig(source="files", paths=(str(path),), cache_dir=str(cache))


@pytest.mark.parametrize("kind", ["parquet", "arrow", "jsonl_dir"])
def test_datasets_give_the_jsonl_batches(tmp_path: Path, jsonl: Path, kind: str):
    rows = datasets.Dataset.from_dict({"id": list(range(len(TEXTS))), "text": TEXTS})
    if kind == "parquet":
        path = tmp_path / "texts.parquet"
        rows.to_parquet(path)
    elif kind == "arrow":
        path = tmp_path / "saved"
        rows.save_to_disk(path)  # data-00000-of-00001.arrow beside its json descriptions
    else:
        path = tmp_path / "shards"
        path.mkdir()
        for i, part in enumerate((TEXTS[:25], TEXTS[25:])):
            (path / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    want = batches(DataConfig(source="files", paths=(str(jsonl),)))
    got = batches(files(path, tmp_path / "cache"))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_tokenized_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "texts.parquet"
    datasets.Dataset.from_dict({"text": TEXTS}).to_parquet(path)
    data = files(path, tmp_path / "cache")
    first = batches(data, steps=2)
    assert list((tmp_path / "cache").glob("tokens-*.arrow"))

    def refuse(texts: list[str]) -> list:
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data_module, "byte_encode", refuse)
    assert all(torch.equal(a, b) for a, b in zip(batches(data, steps=2), first, strict=True))


def test_a_tokenization_killed_midway_leaves_nothing_the_next_start_keeps(tmp_path: Path):
    """A process killed while it tokenizes (as kill -9 would, at the `tokenize` fault point) leaves its partial cache
    in its own folder; the next start removes it, tokenizes whole, and the cache holds the finished file alone."""
    path = tmp_path / "texts.parquet"
    datasets.Dataset.from_dict({"text": TEXTS * 30}).to_parquet(path)  # two batches of rows: it dies in the second
    cache = tmp_path / "cache"
    script = (
        "from shardlab.config import DataConfig\n"
        "from shardlab.data.loader import make_loader\n"
        f"data = DataConfig(source='files', paths=({str(path)!r},), cache_dir={str(cache)!r})\n"
        f"make_loader(data, seq_len={SEQ}, global_batch={G}, vocab_size=300, dp_rank=0, dp_size=1)\n"
    )
    env = {**os.environ, FAULT_ENV: "tokenize", "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert killed.returncode == EXIT_FAULT, killed.stderr[-2000:]
    left = [p for p in cache.glob(f"{PARTIAL}*/*")]
    assert left and not list(cache.glob("tokens-*.arrow"))  # what the kill left: a partial file, no cache file
    want = batches(files(path, tmp_path / "never-killed"))
    assert all(torch.equal(a, b) for a, b in zip(batches(files(path, cache)), want, strict=True))
    assert not list(cache.glob(f"{PARTIAL}*")) and len(list(cache.glob("tokens-*.arrow"))) == 1
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith("tokens-")) == ["datasets"]


def test_layout_and_resume(tmp_path: Path):
    path = tmp_path / "texts.parquet"
    datasets.Dataset.from_dict({"text": TEXTS}).to_parquet(path)
    data = files(path, tmp_path / "cache")
    one = batches(data, steps=6)
    two = [torch.cat(b) for b in zip(*(batches(data, steps=6, dp_size=2, dp_rank=r) for r in range(2)))]
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    loader = make_loader(data, seq_len=SEQ, global_batch=G, vocab_size=300, dp_rank=0, dp_size=1)
    loader.step = 3
    resumed = make_loader(data, seq_len=SEQ, global_batch=G, vocab_size=300, dp_rank=0, dp_size=1)
    resumed.load_state_dict(loader.state_dict())
    assert torch.equal(next(resumed).inputs, one[3])


def test_the_cache_defaults_to_the_run_directory(tmp_path: Path):
    cfg = Config(data=DataConfig(source="files", paths=("x.parquet",)), train=TrainConfig(run_dir=str(tmp_path / "r")))
    assert run_data(cfg).cache_dir == str(tmp_path / "r" / "data-cache")


def test_a_jsonl_with_a_byte_order_mark_reads_alone_and_in_a_directory(tmp_path: Path, jsonl: Path):
    """A .jsonl that starts with a UTF-8 byte-order mark is accepted by shardlab's own reader (a file alone) as by
    datasets (a directory): the same documents either way, those of the file without the mark."""
    marked = tmp_path / "marked" / "texts.jsonl"
    marked.parent.mkdir()
    marked.write_bytes(b"\xef\xbb\xbf" + jsonl.read_bytes())
    want = batches(DataConfig(source="files", paths=(str(jsonl),)))
    alone = batches(DataConfig(source="files", paths=(str(marked),)))
    directory = batches(files(marked.parent, tmp_path / "cache"))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(want, alone, directory, strict=True))


def test_a_directory_of_empty_jsonl_files_says_it_holds_no_documents(tmp_path: Path):
    """Empty or blank .jsonl files in a directory are one line naming the directory and saying it holds no
    documents, not datasets' StopIteration (empty) or its "corresponds to no data" (blank lines)."""
    for name, text in (("empty", ""), ("blank", "\n  \n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.jsonl").write_text(text)
        (tmp_path / name / "b.jsonl").write_text("")
        with pytest.raises(ValueError) as err:
            batches(files(tmp_path / name, tmp_path / "cache"))
        assert str(err.value) == (
            f"data.paths: {tmp_path / name} holds no documents: its .jsonl files are empty or blank; add one JSON "
            "record per line"
        )


def test_a_bad_json_line_prints_only_shardlabs_line(tmp_path: Path, capfd: pytest.CaptureFixture, caplog):
    """On a bad JSON line in a directory, datasets' logger says nothing (it logged its reader's failure on a line of
    its own before shardlab's error); the error names the file and line, and the logger's level is as it was."""
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl").write_text('{"text": "fine"}\n{oops\n')
    level = datasets.logging.get_logger().level
    with pytest.raises(ValueError, match=r"^data\.paths: .*bad/x\.jsonl:2 is not valid JSON"):
        batches(files(tmp_path / "bad", tmp_path / "cache"))
    out, err = capfd.readouterr()
    assert (out, err) == ("", "") and not [r for r in caplog.records if r.name.startswith("datasets")]
    assert datasets.logging.get_logger().level == level


def test_bad_datasets_are_one_line(tmp_path: Path):
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict({"body": TEXTS}).to_parquet(path)
    with pytest.raises(
        ValueError, match=r"rows\.parquet has no field 'text' \(its fields: body\); set data\.jsonl_field"
    ):
        batches(files(path, tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty holds no \.parquet, \.arrow, \.jsonl files"):
        batches(files(tmp_path / "empty", tmp_path / "cache"))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"broken\.parquet is not a readable dataset"):
        batches(files(broken, tmp_path / "cache"))
    (tmp_path / "latin1").mkdir()  # a directory: read by datasets, whose JSON reader lets the bytes through
    (tmp_path / "latin1" / "texts.jsonl").write_bytes(b'{"text": "fine"}\n\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1/texts\.jsonl:3 is not valid JSON \('utf-8' codec can't decode"):
        batches(files(tmp_path / "latin1", tmp_path / "cache"))
    nulls = tmp_path / "nulls.parquet"
    datasets.Dataset.from_dict({"text": ["fine", None]}).to_parquet(nulls)
    with pytest.raises(ValueError, match=r"nulls\.parquet row 1 has no string field 'text'"):
        batches(files(nulls, tmp_path / "cache"))
