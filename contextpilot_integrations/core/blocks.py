"""Context block identity and token counting.

A context block is one retrieved document, chunk or memory. Its identity is a stable 64-bit
hash of the exact text that will be rendered, so that the same text gets the same id in every
process and after a restart (docs/DESIGN.md, "Block identity"); framework ids (LangChain
``Document.id``, LlamaIndex ``node_id``, Mem0 memory ids) are kept for reporting only.

Token lengths come from a pluggable :class:`TokenCounter`. The default,
:class:`ApproxTokenCounter`, costs one ``len(text.encode())`` per call; give
:class:`TokenizerCounter` the model's tokenizer when figures must be exact.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ApproxTokenCounter",
    "ContextBlock",
    "TokenCounter",
    "TokenizerCounter",
    "block_id",
    "validate_block_text",
]


def block_id(text: str) -> int:
    """Return the stable id of a block's exact text.

    Args:
        text: the block text exactly as it will be rendered (no normalisation: a changed byte
            is a different block).

    Returns:
        An unsigned 64-bit integer (``0 <= id < 2**64``): the BLAKE2b-64 digest of the UTF-8
        bytes, read big-endian. Independent of ``PYTHONHASHSEED`` and of the process.

    Raises:
        TypeError: ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(f"block text must be str, got {type(text).__name__}: {text!r:.80}")
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def validate_block_text(text: object, *, field: str) -> str:
    """Check one block text and return it unchanged.

    Raises:
        TypeError: ``text`` is not a ``str`` (the message names ``field`` and the value).
        ValueError: ``text`` is empty or whitespace only.
    """
    if not isinstance(text, str):
        raise TypeError(f"{field} must be a str, got {type(text).__name__}: {text!r:.80}")
    if not text or text.isspace():
        raise ValueError(f"{field} is empty or whitespace only: {text!r:.80}")
    return text


@runtime_checkable
class TokenCounter(Protocol):
    """Counts the tokens of a text (text -> number of tokens, an ``int >= 0``)."""

    def count(self, text: str) -> int: ...


class ApproxTokenCounter:
    """Fast default token counter: ``ceil(len(text.encode("utf-8")) / bytes_per_token)``.

    Four bytes per token is the usual rule of thumb for English text with BPE vocabularies of
    32k-200k entries (OpenAI's tokenizer documentation states ~4 characters per token). It is
    an estimate: it is used only to weigh blocks against each other and to size budgets. Pass
    :class:`TokenizerCounter` for exact counts.
    """

    def __init__(self, bytes_per_token: float = 4.0) -> None:
        if not bytes_per_token > 0:
            raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token!r}")
        self.bytes_per_token = float(bytes_per_token)

    def count(self, text: str) -> int:
        return math.ceil(len(text.encode("utf-8")) / self.bytes_per_token)

    def __repr__(self) -> str:
        return f"ApproxTokenCounter(bytes_per_token={self.bytes_per_token})"


class TokenizerCounter:
    """Exact token counts from a real tokenizer.

    Accepts a HuggingFace ``tokenizers.Tokenizer`` (``encode(text).ids``), a ``transformers``
    tokenizer or anything whose ``encode(text)`` returns a sequence of token ids, or a plain
    callable ``text -> sequence of ids``. Special tokens are not added.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._encode = self._make_encoder(tokenizer)
        self.tokenizer = tokenizer

    @staticmethod
    def _make_encoder(tokenizer: Any) -> Callable[[str], Sequence[int]]:
        encode = getattr(tokenizer, "encode", None)
        if encode is None:
            if callable(tokenizer):
                return tokenizer  # type: ignore[no-any-return]
            raise TypeError(
                f"tokenizer must have an encode(text) method or be callable, got "
                f"{type(tokenizer).__name__}"
            )

        def _encode(text: str) -> Sequence[int]:
            try:
                out = encode(text, add_special_tokens=False)
            except TypeError:
                out = encode(text)
            ids = getattr(out, "ids", out)  # tokenizers.Encoding has .ids
            return ids  # type: ignore[no-any-return]

        return _encode

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens)."""
        return list(self._encode(text))

    def count(self, text: str) -> int:
        return len(self._encode(text))


@dataclass(frozen=True, slots=True)
class ContextBlock:
    """One context block as the index sees it.

    Attributes:
        text: the exact text rendered into the prompt.
        block_id: :func:`block_id` of ``text``.
        tokens: token length of ``text`` by the pilot's token counter.
        original_rank: 0-based position in the retriever's (relevance) order.
    """

    text: str
    block_id: int
    tokens: int
    original_rank: int
