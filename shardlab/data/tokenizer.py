"""Text -> token ids with a local tokenizer: a transformers tokenizer directory or a `tokenizer.json` file.

Never downloads. Without a tokenizer shardlab's tokens are bytes (`shardlab.data.documents.encode`); with one, each document
is the tokenizer's ids between its BOS and EOS tokens (where it has them), so packed documents stay apart. A
transformers model directory that holds a tokenizer is the default for that model (`tokenizer_path`). The files
that describe it (chat template included) go into every checkpoint and every export (`Tokenizer.files`).
"""

from __future__ import annotations

import functools
import hashlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shardlab._errors import ShardlabError

if TYPE_CHECKING:
    from shardlab.config import Config

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""The files a transformers tokenizer directory describes itself with (the first is the one that must be there)."""


def tokenizer_path(cfg: Config) -> str | None:
    """The tokenizer a run uses: data.tokenizer, else the model directory's own (model.hf_path with a
    tokenizer.json), else None (byte-level tokens)."""
    if cfg.data.tokenizer is not None:
        return cfg.data.tokenizer
    hf_path = cfg.model.hf_path
    if hf_path is not None and (Path(hf_path) / FILES[0]).is_file():
        return hf_path
    return None


class Tokenizer:
    """A loaded local tokenizer (transformers' fast tokenizer over the `tokenizers` library)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tok = _load(path)
        self.bos_id: int | None = self._tok.bos_token_id
        self.eos_id: int | None = self._tok.eos_token_id

    @property
    def backend(self) -> Any:
        """The transformers tokenizer itself (its chat template, `apply_chat_template`)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Every id it can produce, added tokens included."""
        return len(self._tok)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids, between BOS and EOS where the tokenizer has them (uint32)."""
        ids = self._tok(texts, add_special_tokens=False)["input_ids"] if texts else []
        head = [self.bos_id] if self.bos_id is not None else []
        tail = [self.eos_id] if self.eos_id is not None else []
        return [np.asarray(head + list(x) + tail, dtype=np.uint32) for x in ids]

    def decode(self, ids: Any) -> str:
        return self._tok.decode([int(i) for i in ids])

    @functools.cached_property
    def _files(self) -> dict[str, bytes]:
        with tempfile.TemporaryDirectory() as tmp:
            self._tok.save_pretrained(tmp)
            return {f.name: f.read_bytes() for f in sorted(Path(tmp).iterdir()) if f.name in FILES}

    def files(self) -> dict[str, bytes]:
        """The files transformers' `save_pretrained` writes for it (tokenizer.json, its config, chat template)."""
        return dict(self._files)

    def fingerprint(self) -> str:
        """What identifies its ids (a different tokenizer gives a different token stream)."""
        digest = hashlib.blake2b(digest_size=8)
        digest.update(self._tok.backend_tokenizer.to_str().encode())
        digest.update(f"{self.bos_id} {self.eos_id}".encode())
        return digest.hexdigest()


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at `path`, loaded once per process."""
    return Tokenizer(path)


def run_tokenizer(cfg: Config) -> Tokenizer | None:
    """The tokenizer a run's text goes through (`tokenizer_path`), loaded; None: byte-level tokens."""
    path = tokenizer_path(cfg)
    return None if path is None else load_tokenizer(path)


def _load(path: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ShardlabError(
            f"data.tokenizer={path!r} needs the transformers package: pip install 'shardlab[hf]'"
        ) from None
    p = Path(path)
    if not p.exists():
        raise ShardlabError(
            f"data.tokenizer={path!r}: no such file or directory; pass a local tokenizer directory or tokenizer.json"
        )
    if p.is_dir() and not (p / FILES[0]).is_file():
        raise ShardlabError(
            f"data.tokenizer={path!r}: no {FILES[0]} in the directory; pass a transformers tokenizer directory "
            "(save_pretrained) or a tokenizer.json file"
        )
    try:
        if p.is_dir():
            return transformers.AutoTokenizer.from_pretrained(p, local_files_only=True)
        return transformers.PreTrainedTokenizerFast(tokenizer_file=str(p))
    except Exception as e:  # whatever transformers or tokenizers raise on a user's file
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ShardlabError(f"data.tokenizer={path!r}: not a readable tokenizer ({first})") from None
