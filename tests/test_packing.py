"""Packing with document masks: a packed row computes what its documents compute alone (fp32, per token), for
shardlab's Llama and a transformers model; the loader's positions restart at each document and labels never cross
one; models that cannot keep documents apart are refused.

Run: pytest tests/test_packing.py (one process, a few seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardlab.config import Config, DataConfig, ModelConfig
from shardlab.data.loader import IGNORE_INDEX, make_loader
from shardlab.data.packing import document_ids, packed_mask, row_positions, whole_rows
from shardlab.models.custom import CustomModel
from shardlab.models.llama.model import Llama
from shardlab.models.llama.provider import LlamaProvider
from shardlab.models.provider import check_layout

SEQ, G, VOCAB = 48, 4, 300
TOL = 2e-5


@pytest.fixture
def packed(tmp_path: Path) -> DataConfig:
    """Documents of 5 to 40 bytes (7 to 42 tokens): rows of 48 hold several, some cut by the row's ends."""
    texts = ["".join(chr(97 + (i * 7 + j) % 26) for j in range(5 + (i * 11) % 36)) for i in range(24)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return DataConfig(source="files", paths=(str(path),), document_masks=True)


def batch_of(data: DataConfig, step: int = 0):
    return make_loader(data, seq_len=SEQ, global_batch=G, vocab_size=VOCAB, dp_rank=0, dp_size=1).batch(step)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none").view(labels.shape)


def assert_documents_alone(forward, data: DataConfig) -> int:
    """Every document piece of a packed batch, run alone from position 0, gives the packed batch's per-token losses;
    returns how many pieces were compared."""
    batch = batch_of(data)
    packed_losses = token_losses(forward(batch.inputs, batch.positions), batch.labels)
    pieces = 0
    for r in range(G):
        docs = document_ids(batch.positions[r])
        for d in docs.unique():
            cols = (docs == d).nonzero().flatten()
            a, b = int(cols[0]), int(cols[-1]) + 1
            alone = token_losses(forward(batch.inputs[r : r + 1, a:b], None), batch.labels[r : r + 1, a:b])[0]
            keep = batch.labels[r, a:b] != IGNORE_INDEX
            diff = (alone[keep] - packed_losses[r, a:b][keep]).abs().max().item() if keep.any() else 0.0
            assert diff <= TOL, f"row {r} document {int(d)} (columns {a}:{b}): max |loss diff| {diff:.2e}"
            pieces += 1
    assert pieces > 2 * G, "the rows should hold several documents each"
    return pieces


def test_positions_restart_at_each_document():
    starts = np.array([False, False, True, False, False, True, True, False])
    assert row_positions(starts).tolist() == [0, 1, 0, 1, 2, 0, 0, 1]
    assert document_ids(torch.tensor(row_positions(starts))).tolist() == [0, 0, 1, 1, 1, 2, 3, 3]
    mask = packed_mask(torch.tensor([[0, 1, 0, 1]]))[0, 0]
    assert mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_whole_rows_take_the_next_documents_while_they_fit():
    assert whole_rows(np.array([3, 4, 2, 5, 1]), 7).tolist() == [0, 2, 4, 5]  # rows [3, 4], [2, 5], [1]
    assert whole_rows(np.array([7, 7, 6]), 7).tolist() == [0, 1, 2, 3]


def test_loader_positions_and_labels_keep_documents_apart(packed: DataConfig):
    batch = batch_of(packed)
    plain = batch_of(DataConfig(source="files", paths=packed.paths))
    assert torch.equal(batch.inputs, plain.inputs) and plain.positions is None  # the same tokens, off by default
    begins = batch.positions == 0
    assert begins[:, 0].all()
    # a document starts at each BOS (byte-level tokens), and the token before it is not trained to predict it
    bos = batch.inputs == 256
    assert torch.equal(begins[:, 1:], bos[:, 1:])
    assert (batch.labels[:, :-1][bos[:, 1:]] == IGNORE_INDEX).all()
    assert torch.equal(batch.labels[batch.labels != IGNORE_INDEX], plain.labels[batch.labels != IGNORE_INDEX])
    assert not (batch.labels == 256).any() and torch.equal(batch.labels == IGNORE_INDEX, plain.labels == 256)


def test_document_masks_change_the_fingerprint(packed: DataConfig):
    on = make_loader(packed, seq_len=SEQ, global_batch=G, vocab_size=VOCAB, dp_rank=0, dp_size=1)
    off = make_loader(DataConfig(source="files", paths=packed.paths), seq_len=SEQ, global_batch=G,
                      vocab_size=VOCAB, dp_rank=0, dp_size=1)  # fmt: skip
    assert on.fingerprint != off.fingerprint
    with pytest.raises(ValueError, match=r"data\.document_masks=True but this run has False; resume with --data\.doc"):
        off.load_state_dict(on.state_dict())
    with pytest.raises(ValueError, match=r"data\.document_masks=False but this run has True; .* --data\.no-document"):
        on.load_state_dict(off.state_dict())


def test_llama_packed_rows_equal_documents_alone(packed: DataConfig):
    torch.manual_seed(0)
    model = Llama(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=VOCAB))
    model.init_weights(0)
    with torch.no_grad():
        assert_documents_alone(lambda x, p: model(x, positions=p), packed)


def test_transformers_packed_rows_equal_documents_alone(packed: DataConfig):
    transformers = pytest.importorskip("transformers")
    from shardlab.models.transformers.provider import HFCausalLM

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=24)  # fmt: skip
    provider = HFCausalLM(transformers.MistralConfig(**config))
    assert provider.packs_documents
    torch.manual_seed(0)
    model = provider.build()
    provider.init_weights(model, 0)
    with torch.no_grad():
        assert_documents_alone(lambda x, p: provider.forward(model, x, p), packed)


def test_models_that_cannot_keep_documents_apart_are_refused(packed: DataConfig):
    cfg = Config(data=packed, model=ModelConfig(vocab_size=VOCAB))
    check_layout(cfg, LlamaProvider(cfg.model))  # shardlab's Llama packs
    custom = CustomModel(lambda: torch.nn.Linear(2, 2), rules=LlamaProvider(cfg.model).rules(cfg.plan))
    with pytest.raises(ValueError, match=r"data\.document_masks: recipe model .* drop --data\.document-masks"):
        check_layout(cfg, custom)
    with pytest.raises(ValueError, match=r"data\.source=.synthetic. has no documents"):
        DataConfig(source="synthetic", document_masks=True)
