"""Packing with document masks: documents share `seq_len` rows, but no token attends across a document boundary and
each document's positions start at 0, so a packed row computes what its documents would alone.

The one thing that travels with a packed batch is each token's position in its document ([rows, seq_len]); a
document starts wherever the position does not follow the previous token's by one (transformers' rule for
`position_ids`, `masking_utils.find_packed_sequence_indices`), and every row starts one (a document cut by a row
boundary continues as a new one). From the positions come the RoPE angles and the mask: a query sees the keys of its
own document at or before its position. Unpacked rows have positions 0..seq_len-1: one document, the causal mask.

Chat rows (`whole_rows`) hold whole conversations and end in padding: a conversation cut at a row's edge would train
its replies without their prompt.
"""

from __future__ import annotations

import numpy as np
import torch


def row_positions(starts: np.ndarray) -> np.ndarray:
    """Each token's position in its document, for one row: `starts` [n] marks the tokens that begin a document;
    the row's first token begins one whatever it says."""
    index = np.arange(starts.size)
    begin = np.where(starts, index, 0)
    begin[0] = 0
    return index - np.maximum.accumulate(begin)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[..., s] positions -> [..., s] document numbers (0, 1, ...) within each row."""
    first = positions[..., :1] - 1
    return (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)


def document_mask(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    q_docs: torch.Tensor,
    k_docs: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Boolean SDPA mask [b, 1, queries, keys]: a query sees the keys of its document at or before its position
    (and, with a sliding `window`, fewer than `window` positions back). Inputs are [b, queries] and [b, keys]."""
    behind = q_positions[:, :, None] - k_positions[:, None, :]
    mask = (q_docs[:, :, None] == k_docs[:, None, :]) & (behind >= 0)
    if window is not None:
        mask &= behind < window
    return mask[:, None]


def packed_mask(positions: torch.Tensor) -> torch.Tensor:
    """The mask of whole packed rows: positions [b, s] -> [b, 1, s, s]."""
    docs = document_ids(positions)
    return document_mask(positions, positions, docs, docs)


def whole_rows(lengths: np.ndarray, width: int) -> np.ndarray:
    """Whole documents into rows of `width` tokens, in order (next fit: a row takes the next documents while they
    fit, so a document is never cut and the rows depend on the documents' order and lengths alone). Returns the
    index of each row's first document and, last, len(lengths). Every length must be at most `width`."""
    firsts, used = [0], 0
    for k, n in enumerate(lengths.tolist()):
        if used + n > width:
            firsts.append(k)
            used = 0
        used += n
    return np.array([*firsts, lengths.size], dtype=np.int64)
