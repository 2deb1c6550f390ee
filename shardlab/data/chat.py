"""Chat data for supervised fine-tuning: each record's `messages` ([{"role", "content"}, ...]) rendered with the
tokenizer's chat template, and which of its tokens the loss learns: the assistant's, nothing else.

A template that marks the assistant's text with `{% generation %}` says so itself (transformers'
`return_assistant_tokens_mask`). Most do not (Llama 3's, Qwen's): there an assistant turn is the text that rendering
the conversation up to and including it adds to rendering the conversation before it with the generation prompt
(its header), so the span holds the reply and the template's end-of-turn marker. Both map character spans to tokens
as transformers does (`char_to_token`). A template that renders a conversation differently from its prefixes (one
that drops earlier turns' reasoning) is refused in one line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from shardlab._errors import ShardlabError
from shardlab.data.tokenizer import Tokenizer

FIELD = "messages"
"""The field of a chat record that holds its conversation."""
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatEncoder:
    """Records' conversations -> token ids and trainable masks (bool: the assistant's tokens), with `tokenizer`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        template = tokenizer.backend.chat_template
        if not isinstance(template, str) or not template:
            raise ShardlabError(
                f"data.format='chat': the tokenizer {tokenizer.path!r} has no chat template; use a tokenizer whose "
                "tokenizer_config.json or chat_template.jinja holds one"
            )
        self.tokenizer = tokenizer
        self.marked = bool(_GENERATION.search(template))
        """The template marks the assistant's text itself ({% generation %})."""

    def __call__(self, values: list[Any], where: Callable[[int], str]) -> dict[str, list[np.ndarray]]:
        """values: each record's `messages`; where(j): how an error names record j (`file:line`), asked only for
        an error."""
        ids, trainable = [], []
        for j, messages in enumerate(values):
            try:
                tokens, mask = self.encode(check_messages(messages))
            except ValueError as err:
                raise ShardlabError(f"{where(j)}: {err}") from None
            ids.append(tokens)
            trainable.append(mask)
        return {"ids": ids, "trainable": trainable}

    def encode(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """One conversation's ids (uint32) and its mask (True on the assistant's tokens)."""
        tok = self.tokenizer.backend
        out = tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=self.marked
        )
        ids = np.asarray(out["input_ids"], dtype=np.uint32)
        if self.marked:
            return ids, np.asarray(out["assistant_masks"], dtype=bool)
        mask = np.zeros(ids.size, dtype=bool)
        whole = tok.apply_chat_template(messages, tokenize=False)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)) if i else 0
            upto = tok.apply_chat_template(messages[: i + 1], tokenize=False)
            if not whole.startswith(upto) or start > len(upto):
                raise ShardlabError(
                    f"the chat template renders the conversation differently from its first {i + 1} messages, "
                    "so the assistant's turns cannot be found; use a template with {% generation %} marks"
                )
            first, last = out.char_to_token(0, start), out.char_to_token(0, len(upto) - 1)
            if first is not None and last is not None:
                mask[first : last + 1] = True
        return ids, mask


def check_messages(messages: Any) -> list[dict[str, str]]:
    """`messages` as a list of {"role": str, "content": str} with an assistant turn, else a one-line error (which
    the caller prefixes with the record's name)."""
    if not isinstance(messages, list) or not messages:
        raise ShardlabError(f"no {FIELD!r} list; a chat record is {{{FIELD!r}: [{{role, content}}, ...]}}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ShardlabError(f"{FIELD}[{j}] needs a string 'role' and a string 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise ShardlabError(f"{FIELD} has no 'assistant' message, so nothing to learn; drop the record")
    return [{"role": m["role"], "content": m["content"]} for m in messages]
