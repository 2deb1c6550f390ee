"""shardlab.data.loader: the global batch is the same for every data-parallel layout, resume is exact, sources load.

Run: pytest tests/test_data.py (pure, one process, ~1 s).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shardlab.config import DataConfig
from shardlab.data.documents import BOS, EOS, decode, encode
from shardlab.data.loader import Batch, TokenLoader, make_loader

SEQ, G = 16, 8
TXT = "héllo wörld\n" * 3
JSONL_TEXTS = [f"doc {i} " * (i + 1) for i in range(12)]


@pytest.fixture
def corpus(tmp_path: Path) -> DataConfig:
    """Short documents of uneven length: sequences cross document and epoch boundaries within a few steps."""
    txt = tmp_path / "a.txt"
    txt.write_text(TXT)
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(JSONL_TEXTS)) + "\n\n")
    return DataConfig(source="files", paths=(str(txt), str(jsonl)))


def loader(data: DataConfig, dp_rank: int = 0, dp_size: int = 1, vocab_size: int = 300) -> TokenLoader:
    return make_loader(data, seq_len=SEQ, global_batch=G, vocab_size=vocab_size, dp_rank=dp_rank, dp_size=dp_size)


def global_batches(data: DataConfig, dp_size: int, steps: int, first_step: int = 0) -> list[torch.Tensor]:
    """Each step's rows from every rank, concatenated in rank order."""
    ranks = [loader(data, r, dp_size) for r in range(dp_size)]
    return [torch.cat([rank.batch(k).inputs for rank in ranks]) for k in range(first_step, first_step + steps)]


def test_encode_decode_round_trip():
    tokens = encode("hé")
    assert tokens.tolist() == [BOS, *"hé".encode(), EOS]
    assert decode(tokens) == "hé"


@pytest.mark.parametrize("source", ["corpus", "synthetic"])
def test_global_batch_is_independent_of_dp(corpus: DataConfig, source: str):
    data = corpus if source == "corpus" else DataConfig(source="synthetic")
    single = global_batches(data, 1, steps=12)  # 12 * 8 * 16 tokens: more than two epochs of the corpus
    for dp_size in (2, 4, 8):
        for k, (a, b) in enumerate(zip(single, global_batches(data, dp_size, steps=12), strict=True)):
            assert torch.equal(a, b), f"step {k} differs at dp_size={dp_size}"


@pytest.mark.parametrize(("dp_size", "micro_batches"), [(1, 4), (2, 2), (2, 4), (4, 2), (8, 1)])
def test_micro_batch_j_is_the_same_sequences_in_every_layout(dp_size: int, micro_batches: int):
    """The ranks' j-th micro batches together are sequences [j G/M, (j+1) G/M) of the step, whatever dp is."""
    data = DataConfig(source="synthetic")
    step = global_batches(data, 1, steps=1, first_step=3)[0]
    ranks = [
        make_loader(data, seq_len=SEQ, global_batch=G, vocab_size=300, dp_rank=r, dp_size=dp_size,
                    micro_batches=micro_batches).batch(3).inputs
        for r in range(dp_size)
    ]  # fmt: skip
    for j, want in enumerate(step.chunk(micro_batches)):
        assert torch.equal(torch.cat([rows.chunk(micro_batches)[j] for rows in ranks]), want), j
    with pytest.raises(ValueError, match=r"^make_loader: micro_batches=3 does not divide the 4 rows each of 2"):
        make_loader(data, seq_len=SEQ, global_batch=G, vocab_size=300, dp_rank=0, dp_size=2, micro_batches=3)


def test_batches_are_deterministic_and_distinct(corpus: DataConfig):
    a, b = loader(corpus), loader(corpus)
    first = [next(a).inputs for _ in range(6)]
    assert all(torch.equal(x, next(b).inputs) for x in first)
    assert not torch.equal(first[0], first[1])


def test_labels_are_inputs_shifted_by_one(corpus: DataConfig):
    batch = loader(corpus, dp_rank=1, dp_size=2).batch(3)
    assert isinstance(batch, Batch)
    assert batch.inputs.shape == batch.labels.shape == (G // 2, SEQ)
    assert batch.inputs.dtype == batch.labels.dtype == torch.int64
    assert torch.equal(batch.inputs[:, 1:], batch.labels[:, :-1])


def test_sequences_tile_the_stream(corpus: DataConfig):
    """Sequence i is stream[i*S : i*S + S + 1]: the label ending one sequence is the input starting the next."""
    batch = loader(corpus).batch(0)
    assert torch.equal(batch.labels[:-1, -1], batch.inputs[1:, 0])


def test_epochs_loop_every_document_in_a_new_order(corpus: DataConfig):
    n_tokens = sum(len(encode(t)) for t in [TXT, *JSONL_TEXTS])
    stream = torch.cat([loader(corpus).batch(k).inputs.flatten() for k in range(12)])
    assert stream.numel() > 2 * n_tokens
    epoch0, epoch1 = stream[:n_tokens], stream[n_tokens : 2 * n_tokens]
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist())
    assert not torch.equal(epoch0, epoch1)
    assert (epoch0 == BOS).sum() == 13


@pytest.mark.parametrize("new_dp", [1, 2, 4])
def test_resume_is_exact_even_after_changing_dp(corpus: DataConfig, new_dp: int):
    run = loader(corpus, dp_rank=1, dp_size=2)
    for _ in range(5):
        next(run)
    state = run.state_dict()
    assert state["step"] == 5
    resumed = [loader(corpus, r, new_dp) for r in range(new_dp)]
    for rank in resumed:
        rank.load_state_dict(state)
    after = [torch.cat([next(rank).inputs for rank in resumed]) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(after, global_batches(corpus, 1, steps=3, first_step=5), strict=True))


def test_resume_rejects_another_stream(corpus: DataConfig):
    state = loader(corpus).state_dict()
    other = DataConfig(source="files", paths=corpus.paths, seed=7)
    with pytest.raises(ValueError, match=r"token stream \(fingerprint .*\) differs"):
        loader(other).load_state_dict(state)
    with pytest.raises(ValueError, match=r"train.global_batch=8 but this run has 4"):
        make_loader(corpus, seq_len=SEQ, global_batch=4, vocab_size=300, dp_rank=0, dp_size=1).load_state_dict(state)


def test_stdlib_is_fast_and_byte_level():
    start = time.perf_counter()
    data = make_loader(DataConfig(source="stdlib"), seq_len=512, global_batch=8, vocab_size=258, dp_rank=0, dp_size=1)
    batch = next(data)
    assert time.perf_counter() - start < 1.0
    assert batch.inputs.shape == (8, 512)
    assert int(batch.inputs.min()) >= 0 and int(batch.inputs.max()) < 258
    assert "def " in decode(batch.inputs.flatten().tolist())


def test_synthetic_ids_are_below_vocab():
    batch = loader(DataConfig(source="synthetic"), vocab_size=50).batch(0)
    assert int(batch.inputs.max()) < 50 and int(batch.labels.min()) >= 0
    assert len(torch.unique(batch.inputs)) > 25


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_is_the_token_stream(tmp_path: Path, dtype: str):
    tokens = np.arange(100, dtype=dtype) + (70_000 if dtype == "uint32" else 0)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    data = DataConfig(source="files", paths=(str(path),), bin_dtype=dtype)
    batch = loader(data, vocab_size=70_100).batch(0)
    expected = torch.from_numpy(tokens.astype(np.int64))
    assert torch.equal(batch.inputs[0], expected[:SEQ])
    assert torch.equal(batch.labels[0], expected[1 : SEQ + 1])
    assert torch.equal(batch.inputs[6, :4], expected[96:100])
    assert torch.equal(batch.inputs[6, 4:], expected[: SEQ - 4])  # loops after the last token


def test_bin_token_beyond_vocab(tmp_path: Path):
    path = tmp_path / "tokens.bin"
    np.array([1, 2, 999], dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match=r"tokens.bin holds token id 999 but model.vocab_size=500"):
        loader(DataConfig(source="files", paths=(str(path),)), vocab_size=500)


def test_missing_file(tmp_path: Path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match=rf"data.paths: {missing} does not exist"):
        loader(DataConfig(source="files", paths=(missing,)))


def test_empty_texts_are_no_documents(tmp_path: Path, corpus: DataConfig):
    """An empty .txt or a .jsonl of empty texts holds no documents (it would train on its markers alone); beside
    other files they add nothing."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    for name in ("empty.txt", "empty.jsonl"):
        with pytest.raises(ValueError, match=rf"data.paths: .*{name} hold no documents"):
            loader(DataConfig(source="files", paths=(str(tmp_path / name),)))
    padded = DataConfig(source="files", paths=(*corpus.paths, str(tmp_path / "empty.txt")))
    assert torch.equal(loader(padded).batch(0).inputs, loader(corpus).batch(0).inputs)


def test_jsonl_without_the_field(tmp_path: Path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2 has no string field 'text'; set data.jsonl_field"):
        loader(DataConfig(source="files", paths=(str(path),)))


def test_vocab_too_small_for_bytes():
    with pytest.raises(ValueError, match=r"model.vocab_size=256 is too small .* set model.vocab_size >= 258"):
        loader(DataConfig(source="stdlib"), vocab_size=256)


def test_global_batch_not_divisible_by_dp():
    with pytest.raises(ValueError, match=r"train.global_batch=8 is not divisible by the data-parallel size 3"):
        loader(DataConfig(source="synthetic"), dp_size=3)
