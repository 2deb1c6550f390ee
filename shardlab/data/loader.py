"""Data: DataConfig -> documents -> one looping token stream -> this rank's rows of each global batch.

Sequence i is stream[i*S : i*S + S + 1] (inputs = its first S tokens, labels = its last S). Step k's
global batch is sequences [k*G, (k+1)*G), so it does not depend on the layout, and resuming after a change of D
is exact. With M micro batches per step, micro batch j is sequences k*G + [j*G/M, (j+1)*G/M), and data-parallel
rank r of D takes the r-th D-th of each: the ranks' j-th micro batches together are the same sequences in every
layout with M micro batches (an MoE balancing loss over each global micro batch depends on which they are).
Chat data (data.format='chat') is not cut from the stream: sequence i is a row of whole conversations and padding
(`_WholeRows`), so no reply trains without its prompt; the rest holds as for the stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import numpy as np
import torch
from torch import Tensor

from shardlab._errors import ShardlabError
from shardlab.config import Config, DataConfig
from shardlab.data.chat import ChatEncoder
from shardlab.data.documents import (
    BYTE_VOCAB,
    RecordEncoder,
    Split,
    byte_encode,
    ends,
    file_documents,
    hold_out,
    stdlib_texts,
    text_records,
)
from shardlab.data.packing import row_positions, whole_rows

if TYPE_CHECKING:
    from shardlab.data.tokenizer import Tokenizer

IGNORE_INDEX = -100
"""Label value that takes no part in the loss or in the token count (as in F.cross_entropy)."""


class Batch(NamedTuple):
    """One rank's rows of a step's global batch: int64 [rows, seq_len]; labels[:, t] follows inputs[:, t]
    (IGNORE_INDEX where it must not be learnt: across a document boundary of packed rows)."""

    inputs: Tensor
    labels: Tensor
    positions: Tensor | None = None
    """Packed rows (data.document_masks): each input token's position in its document, int64 [rows, seq_len]
    (`shardlab.data.packing`); None: 0..seq_len-1 in every row, attention across documents."""


class Row(NamedTuple):
    """seq_len + 1 tokens of the stream (one sequence's inputs and labels) and where its documents start."""

    tokens: np.ndarray
    starts: np.ndarray | None = None
    """bool: the token begins a document (None: no documents, synthetic tokens)."""
    trainable: np.ndarray | None = None
    """bool: the token is one the loss learns (chat: the assistant's); None: every token."""


class TokenLoader:
    """This rank's rows of every step's global batch, one `Batch` per optimizer step, forever.

    `step` is the next step to yield; `batch(step)` gives any step's rows without moving it.
    """

    def __init__(
        self,
        sequence: Callable[[int], Row],
        *,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        micro_batches: int = 1,
        source: str,
        fingerprint: str,
        document_masks: bool = False,
    ) -> None:
        self._sequence = sequence
        self.document_masks = document_masks
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.rows = global_batch // dp_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        if self.rows % micro_batches:
            raise ShardlabError(
                f"make_loader: micro_batches={micro_batches} does not divide the {self.rows} rows each of {dp_size} "
                "data-parallel ranks gets; pass Config.micro_batches of a resolved config"
            )
        self.micro_batches = micro_batches
        self.source = source
        self.fingerprint = fingerprint
        self.step = 0

    def batch(self, step: int) -> Batch:
        m = self.micro_batches
        per_micro, rows = self.global_batch // m, self.rows // m  # a global micro batch, this rank's part of it
        first = step * self.global_batch + self.dp_rank * rows
        ids = [first + j * per_micro + i for j in range(m) for i in range(rows)]
        rows = [self._sequence(i) for i in ids]
        seqs = torch.from_numpy(np.stack([r.tokens for r in rows]))
        inputs, labels = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
        if rows[0].trainable is not None:  # chat: only the assistant's tokens are targets
            labels[~torch.from_numpy(np.stack([r.trainable[1:] for r in rows]))] = IGNORE_INDEX
        if not self.document_masks:
            return Batch(inputs=inputs, labels=labels)
        starts = torch.from_numpy(np.stack([r.starts for r in rows]))
        labels[starts[:, 1:]] = IGNORE_INDEX  # a document's last token does not see the next one's first
        positions = torch.from_numpy(np.stack([row_positions(r.starts[:-1]) for r in rows]))
        return Batch(inputs=inputs, labels=labels, positions=positions)

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> Batch:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The next step plus what identifies the stream (not dp: resuming on another layout is exact)."""
        return {
            "step": self.step,
            "source": self.source,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "fingerprint": self.fingerprint,
            "document_masks": self.document_masks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, field in (
            ("source", "data.source"),
            ("seq_len", "train.seq_len"),
            ("global_batch", "train.global_batch"),
        ):
            if state.get(key) != getattr(self, key):
                raise ShardlabError(
                    f"data: the checkpoint's loader has {field}={state.get(key)!r} but this run has {getattr(self, key)!r}; "
                    f"resume with {field}={state.get(key)!r}"
                )
        if "document_masks" in state and state["document_masks"] != self.document_masks:  # older states lack it
            flag = "--data.document-masks" if state["document_masks"] else "--data.no-document-masks"
            raise ShardlabError(
                f"data: the checkpoint's loader has data.document_masks={state['document_masks']} but this run has "
                f"{self.document_masks}; resume with {flag}"
            )
        if state.get("fingerprint") != self.fingerprint:
            raise ShardlabError(
                f"data: the checkpoint's token stream (fingerprint {state.get('fingerprint')}) differs from this run's "
                f"({self.fingerprint}); resume with the same data files, data.seed, data.tokenizer and model.vocab_size"
            )
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise ShardlabError(
                f"data: the checkpoint's loader step={step!r} is not an int >= 0; the state_dict is corrupt"
            )
        self.step = step


def make_loader(
    data: DataConfig,
    *,
    seq_len: int,
    global_batch: int,
    vocab_size: int,
    dp_rank: int,
    dp_size: int,
    micro_batches: int = 1,
    tokenizer: Tokenizer | None = None,
    split: Split = "all",
    named_by: str = "data.paths",
) -> TokenLoader:
    """The loader for data-parallel rank `dp_rank` of `dp_size`, positioned at step 0. micro_batches: per step on
    each rank (`Config.micro_batches`); it decides which rows a rank gets, not which rows a step has. tokenizer:
    what turns text into ids (`shardlab.data.tokenizer`; None: byte-level tokens). split: every document ("all"), all
    but the held-out ones ("train"), or only those ("held_out": `hold_out`). named_by: the config field that named
    data.paths, which errors about the files lead with (an evaluation's: eval.paths)."""
    if global_batch % dp_size:
        raise ShardlabError(
            f"train.global_batch={global_batch} is not divisible by the data-parallel size {dp_size}; "
            "pick a global_batch that is a multiple of it"
        )
    if not 0 <= dp_rank < dp_size:
        raise ShardlabError(
            f"make_loader: dp_rank={dp_rank} is outside [0, {dp_size}); pass this rank's index on the dp axes"
        )
    seed = data.seed % 2**64  # numpy seeds must be >= 0
    digest = hashlib.blake2b(f"{data.source} {seed}".encode(), digest_size=8)
    if split != "all":
        digest.update(f" {split}".encode())
    if data.source == "synthetic":
        digest.update(f" {vocab_size}".encode())
        key = [seed, 1] if split == "held_out" else [seed]  # an endless stream: held out by its own seed

        def sequence(i: int) -> Row:
            return Row(np.random.default_rng([*key, i]).integers(0, vocab_size, seq_len + 1, dtype=np.int64))

    else:
        texts = data.source == "stdlib" or any(not p.endswith(".bin") for p in data.paths)
        if tokenizer is None and vocab_size < BYTE_VOCAB and texts:
            raise ShardlabError(
                f"model.vocab_size={vocab_size} is too small for the byte-level tokens of data.source={data.source!r} "
                f"(256 bytes + BOS + EOS); set model.vocab_size >= {BYTE_VOCAB}"
            )
        if tokenizer is not None and tokenizer.vocab_size > vocab_size:
            raise ShardlabError(
                f"data.tokenizer={tokenizer.path!r} has {tokenizer.vocab_size} tokens but model.vocab_size is "
                f"{vocab_size}; use the model's own tokenizer"
            )
        key = f"tokenizer {tokenizer.fingerprint()}" if tokenizer is not None else "bytes"
        if data.format == "chat":
            if tokenizer is None:
                raise ShardlabError(
                    "data.format='chat' needs a tokenizer with a chat template; set data.tokenizer or model.hf_path"
                )
            records: RecordEncoder = ChatEncoder(tokenizer)
            key = f"chat {key} {hashlib.blake2b(tokenizer.backend.chat_template.encode()).hexdigest()}"
        else:
            records = text_records(tokenizer.encode if tokenizer is not None else byte_encode, data.jsonl_field)
        if tokenizer is not None and texts:
            digest.update(f" {key}".encode())
        if data.source == "stdlib":
            docs, masks = records(*stdlib_texts())["ids"], None
        else:
            docs, masks = file_documents(data, vocab_size, records, key, seq_len, named_by)
        corpus = _Corpus(hold_out(docs, split), seed, None if masks is None else hold_out(masks, split))
        digest.update(corpus.lengths.tobytes())
        for doc in corpus.docs:  # text documents are hashed whole, .bin memmaps by their ends
            digest.update(np.ascontiguousarray(ends(doc) if isinstance(doc, np.memmap) else doc).tobytes())
        for mask in corpus.masks or ():
            digest.update(np.packbits(mask).tobytes())

        if data.format == "chat":  # whole conversations per row, padded (`_WholeRows`)
            backend = tokenizer.backend
            pad = next((t for t in (backend.pad_token_id, backend.eos_token_id) if t is not None), 0)
            rows = _WholeRows(corpus, seq_len + 1, pad)
            digest.update(f" whole rows pad {pad}".encode())
            sequence = rows.read
        else:

            def sequence(i: int) -> Row:
                return corpus.read(i * seq_len, seq_len + 1)

        if data.document_masks:
            digest.update(b" document_masks")

    return TokenLoader(
        sequence,
        seq_len=seq_len,
        global_batch=global_batch,
        dp_rank=dp_rank,
        dp_size=dp_size,
        micro_batches=micro_batches,
        source=data.source,
        fingerprint=digest.hexdigest(),
        document_masks=data.document_masks,
    )


def run_data(cfg: Config) -> DataConfig:
    """The run's data settings with the cache directory resolved: data.cache_dir, else the run directory's
    data-cache."""
    if cfg.data.cache_dir is not None:
        return cfg.data
    return msgspec.structs.replace(cfg.data, cache_dir=str(Path(cfg.run_dir) / "data-cache"))


class _Corpus:
    """Documents read back to back in an order reshuffled every epoch (seed (data.seed, epoch)), looping forever.

    Position p of the stream is offset p % total of epoch p // total; only the per-epoch order and its
    cumulative lengths are computed, never the epoch's tokens.
    """

    def __init__(self, docs: list[np.ndarray], seed: int, masks: list[np.ndarray] | None = None) -> None:
        self.docs = docs
        self.masks = masks
        self.lengths = np.array([d.size for d in docs], dtype=np.int64)
        self.total = int(self.lengths.sum())
        self.seed = seed
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch `epoch`'s document order and where each document starts in it (cumulative lengths)."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))
            self._orders[epoch] = (perm, np.concatenate([[0], np.cumsum(self.lengths[perm])]))
        return self._orders[epoch]

    def read(self, pos: int, n: int) -> Row:
        out = np.empty(n, dtype=np.int64)
        begins = np.zeros(n, dtype=bool)
        trainable = None if self.masks is None else np.empty(n, dtype=bool)
        filled = 0
        while filled < n:
            epoch, offset = divmod(pos, self.total)
            perm, starts = self.order(epoch)
            j = int(np.searchsorted(starts, offset, side="right")) - 1
            doc, start = self.docs[perm[j]], offset - int(starts[j])
            take = min(n - filled, doc.size - start)
            out[filled : filled + take] = doc[start : start + take]
            if trainable is not None:
                trainable[filled : filled + take] = self.masks[perm[j]][start : start + take]
            begins[filled] = start == 0
            filled += take
            pos += take
        return Row(out, begins, trainable)


class _WholeRows:
    """Whole documents (chat conversations) per row: each epoch's documents, in `corpus`'s order for it, placed into
    rows of `width` tokens by `whole_rows`, the rest of a row `pad` tokens. The padding is one more document, never a
    target (not trainable) and, with document masks, seen by no other; without them it comes after every real token,
    which a causal mask keeps from seeing it. Row i of the stream is the (i - rows of the earlier epochs)-th of its
    epoch, so the rows are a function of the data and the seed alone, the same in every layout and on resume."""

    def __init__(self, corpus: _Corpus, width: int, pad: int) -> None:
        self.corpus, self.width, self.pad = corpus, width, pad
        self._firsts: list[np.ndarray] = []
        """Per epoch so far: `whole_rows` of its order."""
        self._before = [0]
        """Rows before epoch e (one more entry than _firsts)."""

    def read(self, i: int) -> Row:
        while i >= self._before[-1]:
            perm, _ = self.corpus.order(len(self._firsts))
            self._firsts.append(whole_rows(self.corpus.lengths[perm], self.width))
            self._before.append(self._before[-1] + self._firsts[-1].size - 1)
        epoch = int(np.searchsorted(self._before, i, side="right")) - 1
        perm, _ = self.corpus.order(epoch)
        firsts, r = self._firsts[epoch], i - self._before[epoch]
        tokens = np.full(self.width, self.pad, dtype=np.int64)
        begins = np.zeros(self.width, dtype=bool)
        trainable = np.zeros(self.width, dtype=bool)
        at = 0
        for d in perm[firsts[r] : firsts[r + 1]]:
            doc, n = self.corpus.docs[d], self.corpus.docs[d].size
            tokens[at : at + n] = doc
            if self.corpus.masks is not None:
                trainable[at : at + n] = self.corpus.masks[d]
            begins[at] = True
            at += n
        if at < self.width:
            begins[at] = True  # the padding starts a document of its own
        return Row(tokens, begins, trainable)
