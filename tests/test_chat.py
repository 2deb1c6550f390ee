"""Chat data for fine-tuning: the loss learns the assistant's tokens only, found the same way whether the template
marks them ({% generation %}) or not (rendered prefix by prefix); each row holds whole conversations and padding that
changes no real token's loss, the same rows in every layout; bad chat files fail in one line naming the file and the
field.

Run: pytest tests/test_chat.py (one process, a few seconds).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shardlab.config import DataConfig, ModelConfig
from shardlab.data.chat import ChatEncoder
from shardlab.data.loader import IGNORE_INDEX, make_loader
from shardlab.data.tokenizer import Tokenizer
from shardlab.models.llama.model import Llama

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
PLAIN = (  # Llama 3's shape: a BOS, a header per turn, an end-of-turn token; no generation marks
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MARKED = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "five"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the dog"},
        {"role": "assistant", "content": "barks loud"},
        {"role": "user", "content": "and the fox"},
        {"role": "assistant", "content": "jumps over the lazy dog"},
    ],
]


def make_tokenizer(path: Path, template: str) -> Tokenizer:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, add two and three: five. " * 20], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = template
    fast.save_pretrained(path)
    return Tokenizer(str(path))


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Tokenizer:
    return make_tokenizer(tmp_path_factory.mktemp("plain"), PLAIN)


@pytest.fixture(scope="module")
def marked(tmp_path_factory) -> Tokenizer:
    return make_tokenizer(tmp_path_factory.mktemp("marked"), MARKED)


def write_chat(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat_data(path: Path, tokenizer: Tokenizer, **kw) -> DataConfig:
    kw.setdefault("cache_dir", str(path.parent / "cache"))
    return DataConfig(source="files", paths=(str(path),), format="chat", tokenizer=tokenizer.path, **kw)


def loader(data: DataConfig, tokenizer: Tokenizer, seq_len: int = 64, dp_size: int = 1, dp_rank: int = 0):
    return make_loader(
        data, seq_len=seq_len, global_batch=4, vocab_size=320, dp_rank=dp_rank, dp_size=dp_size, tokenizer=tokenizer
    )


def sums(n: int) -> list[list[dict[str, str]]]:
    """n conversations of different lengths (one or two exchanges), each with its own replies."""
    out = []
    for i in range(n):
        turns = [
            {"role": "user", "content": f"add {i} and {2 * i}"},
            {"role": "assistant", "content": f"it is {3 * i}"},
        ]
        if i % 3 == 0:
            turns += [{"role": "user", "content": "and twice that"}, {"role": "assistant", "content": f"{6 * i}"}]
        out.append(turns)
    return out


def segments(batch, pad: int) -> list[tuple[list[int], str]]:
    """Each row's documents in order (a document starts where its position is 0), trailing padding dropped: its
    tokens (the row's inputs and, for its last column, the last label) and the text of its learnt labels."""
    out = []
    for inputs, labels, positions in zip(batch.inputs, batch.labels, batch.positions, strict=True):
        last = labels[-1:] if labels[-1] != IGNORE_INDEX else torch.tensor([pad])
        tokens = torch.cat([inputs, last]).tolist()
        cuts = [*(positions == 0).nonzero().flatten().tolist(), len(tokens)]
        for a, b in itertools.pairwise(cuts):
            doc, learnt = tokens[a:b], labels[a:b]
            while doc and doc[-1] == pad:
                doc.pop()
            if doc:
                out.append((doc, learnt[learnt != IGNORE_INDEX].tolist()))
    return out


def test_assistant_tokens_are_the_replies_and_their_end(plain: Tokenizer, marked: Tokenizer):
    assert not ChatEncoder(plain).marked and ChatEncoder(marked).marked
    for messages in CONVERSATIONS:
        ids, mask = ChatEncoder(plain).encode(messages)
        marked_ids, marked_mask = ChatEncoder(marked).encode(messages)
        assert np.array_equal(ids, marked_ids)
        assert np.array_equal(mask, marked_mask), "prefix rendering and {% generation %} marks disagree"
        replies = "".join(m["content"] + "<|end|>" for m in messages if m["role"] == "assistant")
        assert plain.decode(ids[mask]) == replies


def test_prefix_inconsistent_templates_are_refused(tmp_path: Path):
    drops_history = "{% for m in messages %}{% if loop.last %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    tok = make_tokenizer(tmp_path, drops_history)
    with pytest.raises(ValueError, match=r"f\.jsonl:1: the chat template renders the conversation differently"):
        ChatEncoder(tok)([CONVERSATIONS[1]], lambda j: f"f.jsonl:{j + 1}")


def test_loss_is_on_the_assistant_tokens_only(tmp_path: Path, plain: Tokenizer):
    path = write_chat(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS * 3])
    batch = loader(chat_data(path, plain, document_masks=True), plain).batch(0)
    learnt = batch.labels[batch.labels != IGNORE_INDEX]
    replies = plain.backend(["five<|end|>barks loud<|end|>jumps over the lazy dog<|end|>"])["input_ids"][0]
    assert set(learnt.tolist()) <= set(replies) and learnt.numel() > 8
    end = plain.backend.convert_tokens_to_ids("<|end|>")
    user = plain.backend.convert_tokens_to_ids("<|user|>")
    assert (batch.labels == end).any() and not (batch.labels == user).any()
    assert (batch.positions == 0).sum() > 4  # more than one conversation per row, each from position 0


def test_a_chat_file_a_directory_and_parquet_give_the_same_batches(tmp_path: Path, plain: Tokenizer):
    datasets = pytest.importorskip("datasets")
    records = [{"messages": m} for m in sums(12)]
    path = write_chat(tmp_path / "chat.jsonl", records)
    (tmp_path / "shards").mkdir()
    write_chat(tmp_path / "shards" / "a.jsonl", records[:5])
    write_chat(tmp_path / "shards" / "b.jsonl", records[5:])
    datasets.Dataset.from_list(records).to_parquet(tmp_path / "chat.parquet")
    want = [loader(chat_data(path, plain, document_masks=True), plain).batch(k) for k in range(3)]
    for other in (tmp_path / "shards", tmp_path / "chat.parquet"):
        data = chat_data(other, plain, document_masks=True, cache_dir=str(tmp_path / f"cache-{other.name}"))
        for k, batch in enumerate(want):
            got = loader(data, plain).batch(k)
            assert all(torch.equal(a, b) for a, b in zip(got, batch, strict=True))
    # an error names the file and line in a directory too, and a line that is not JSON
    alone = {"messages": [{"role": "user", "content": "hi"}]}
    (tmp_path / "shards" / "b.jsonl").write_text(json.dumps(records[0]) + "\n\n" + json.dumps(alone) + "\n")
    with pytest.raises(ValueError, match=r"shards/b\.jsonl:3: messages has no 'assistant' message"):
        loader(chat_data(tmp_path / "shards", plain), plain)
    write_chat(path, records[:2]).write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"chat\.jsonl:3 is not valid JSON \(Expecting property name"):
        loader(chat_data(path, plain), plain)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"text": "hi"}, r"chat\.jsonl:2: no 'messages' list"),
        ({"messages": [{"content": "hi"}]}, r"chat\.jsonl:2: messages\[0\] needs a string 'role'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, r"chat\.jsonl:2: messages has no 'assistant' message"),
    ],
)
def test_bad_chat_records_are_one_line(tmp_path: Path, plain: Tokenizer, record: dict, message: str):
    path = write_chat(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}, record])
    with pytest.raises(ValueError, match=message):
        loader(chat_data(path, plain), plain)


def test_conversations_longer_than_seq_len(tmp_path: Path, plain: Tokenizer):
    path = write_chat(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    with pytest.raises(
        ValueError, match=r"chat\.jsonl:2: the conversation is \d+ tokens, longer than train\.seq_len=16"
    ):
        loader(chat_data(path, plain), plain, seq_len=16)
    batch = loader(chat_data(path, plain, truncate=True), plain, seq_len=16).batch(0)
    assert batch.inputs.shape == (4, 16)


def test_chat_needs_a_template_and_chat_files(tmp_path: Path, plain: Tokenizer):
    path = write_chat(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    data = DataConfig(source="files", paths=(str(path),), format="chat")
    with pytest.raises(ValueError, match=r"data\.format='chat' needs a tokenizer with a chat template"):
        loader(data, None)
    text = tmp_path / "a.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"a\.txt is not chat data"):
        loader(chat_data(text, plain), plain)
    with pytest.raises(ValueError, match=r"data\.format='chat' reads chat files"):
        DataConfig(format="chat")


def test_rows_hold_whole_conversations_and_padding_changes_no_loss(tmp_path: Path, plain: Tokenizer):
    chats = sums(24)
    path = write_chat(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    data = chat_data(path, plain, document_masks=True)
    encoded = {tuple(ChatEncoder(plain).encode(m)[0].tolist()): m for m in chats}
    pad = plain.backend.eos_token_id
    batches = [loader(data, plain, seq_len=48).batch(k) for k in range(8)]
    found = [s for b in batches for s in segments(b, pad)]
    assert len(found) > len(chats)  # more than one epoch
    firsts = sorted(tuple(doc) for doc, _ in found[: len(chats)])
    assert firsts == sorted(encoded), "the first epoch's rows should hold every conversation once, each whole"
    for doc, learnt in found:
        replies = "".join(m["content"] + "<|end|>" for m in encoded[tuple(doc)] if m["role"] == "assistant")
        assert plain.decode(learnt) == replies
    for positions in (True, False):
        batch = batches[0] if positions else loader(chat_data(path, plain), plain, seq_len=48).batch(0)
        padding = torch.flip(torch.cumprod(torch.flip(batch.inputs == pad, [1]), 1), [1]).bool()  # trailing pads
        assert padding.any() and (batch.labels[padding] == IGNORE_INDEX).all()
        torch.manual_seed(0)
        model = Llama(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=320))
        model.init_weights(0)
        other = batch.inputs.masked_fill(padding, 7)
        with torch.no_grad():
            a, b = (model(x, positions=batch.positions) for x in (batch.inputs, other))
        real = batch.labels != IGNORE_INDEX
        assert torch.equal(a[real], b[real]), "a pad token changed a real token's logits"


def test_chat_rows_are_the_same_in_every_layout_and_on_resume(tmp_path: Path, plain: Tokenizer):
    path = write_chat(tmp_path / "chat.jsonl", [{"messages": m} for m in sums(24)])
    data = chat_data(path, plain, document_masks=True)
    one = loader(data, plain, seq_len=48)
    halves = [loader(data, plain, seq_len=48, dp_size=2, dp_rank=r) for r in range(2)]
    for k in range(6):
        want = one.batch(k)
        got = [h.batch(k) for h in halves]
        for field in ("inputs", "labels", "positions"):
            assert torch.equal(torch.cat([getattr(g, field) for g in got]), getattr(want, field))
    one.step = 5
    resumed = loader(data, plain, seq_len=48)
    resumed.load_state_dict(one.state_dict())
    assert torch.equal(next(resumed).labels, one.batch(5).labels)
