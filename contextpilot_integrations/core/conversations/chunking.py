"""Content-defined chunking of a context block into sub-blocks, for partial-overlap de-duplication.

Two retrieved blocks often share long stretches without being equal (overlapping windows of one
document, a passage quoted in a longer one). Cut at *content-defined* points, equal stretches
fall into equal sub-blocks, whose stable ids can be looked up in the conversation's history
(ContextPilot, MLSys 2026, multi-turn de-duplication; the technique is LBFS, Muthitacharoen et
al., SOSP 2001). The rule, on the UTF-8 bytes of the text (sizes in UTF-8 bytes, about 4 per
token of English, as :class:`~contextpilot_integrations.core.blocks.ApproxTokenCounter`):

1. The text is read line by line (a line ends after ``"\n"``; ``"\r\n"`` is one line ending).
2. After a line, the open sub-block is cut when it holds at least ``min_bytes`` and
   ``blake2b-64(line content) % modulus == 0`` (the content excludes the ending).
3. A sub-block never exceeds ``max_bytes``: it is cut before a line that would overflow it, and
   a longer line is cut inside, after the last space that leaves a piece of at least
   ``min_bytes``, else at the last character boundary that fits (those pieces depend on where
   the line starts: deterministic, not content-defined).
4. A block shorter than ``min_bytes`` is one sub-block.

A CRLF ending counts as one byte, so the CRLF and LF forms of a text get the same cuts; their
sub-blocks keep their exact bytes, so the two forms never share an id. Lossless:
``"".join(s.text for s in chunker.split(text)) == text`` for every ``str`` UTF-8 can encode.
The defaults (``modulus=4, min_bytes=512, max_bytes=2048``) trade tokens saved against planning
time (``benchmarks/micro/bench_chunking.py`` and ``bench_dedup.py`` measure both); smaller
sub-blocks only pay through runs of consecutive repeats, since a pointer costs about 30 tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["ContentChunker", "SubBlock"]

DEFAULT_MODULUS = 4
DEFAULT_MIN_BYTES = 512
DEFAULT_MAX_BYTES = 2048


@dataclass(frozen=True, slots=True)
class SubBlock:
    """One content-defined piece of a block.

    Attributes:
        text: the exact text of the piece (``block_text[start:end]``).
        sub_block_id: :func:`~contextpilot_integrations.core.blocks.block_id` of ``text``
            (unsigned 64-bit; computed from the bytes already encoded).
        start: offset of the first character in the block text (``str`` index).
        end: offset one past the last character (``str`` index).
    """

    text: str
    sub_block_id: int
    start: int
    end: int


class ContentChunker:
    """Cuts block texts into sub-blocks at content-defined line boundaries (rules in the module
    docstring). Stateless and thread-safe.

    Args:
        modulus: ``M``; a line ends a sub-block when its content hash is ``0 mod M`` (about one
            line in ``M``, once the sub-block holds ``min_bytes``). ``1`` cuts after every line
            past ``min_bytes``.
        min_bytes: smallest sub-block, in UTF-8 bytes (CRLF counted as one), except the last
            sub-block of a block and a piece closed because the next line would overflow
            ``max_bytes``.
        max_bytes: largest sub-block, in UTF-8 bytes (CRLF counted as one).

    Raises:
        TypeError: an argument is not an ``int``.
        ValueError: ``modulus < 1``, ``min_bytes < 1``, ``max_bytes < 16`` or
            ``max_bytes <= min_bytes``.
    """

    def __init__(
        self,
        modulus: int = DEFAULT_MODULUS,
        min_bytes: int = DEFAULT_MIN_BYTES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        for name, value in (
            ("modulus", modulus),
            ("min_bytes", min_bytes),
            ("max_bytes", max_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
        if modulus < 1:
            raise ValueError(f"modulus must be >= 1, got {modulus}")
        if min_bytes < 1:
            raise ValueError(f"min_bytes must be >= 1, got {min_bytes}")
        if max_bytes < 16:
            raise ValueError(f"max_bytes must be >= 16, got {max_bytes}")
        if max_bytes <= min_bytes:
            raise ValueError(
                f"max_bytes ({max_bytes}) must be greater than min_bytes ({min_bytes})"
            )
        self.modulus = modulus
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return (
            f"ContentChunker(modulus={self.modulus}, min_bytes={self.min_bytes}, "
            f"max_bytes={self.max_bytes})"
        )

    def split(self, text: str) -> tuple[SubBlock, ...]:
        """Cut ``text`` into sub-blocks.

        Args:
            text: a block's exact text.

        Returns:
            The sub-blocks in text order; their texts concatenate to ``text``. Empty for
            ``""``; one sub-block (the whole text) for a text under ``min_bytes``.

        Raises:
            TypeError: ``text`` is not a ``str``.
            ValueError: ``text`` cannot be encoded as UTF-8 (a lone surrogate).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}: {text!r:.80}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"text cannot be encoded as UTF-8 ({exc.reason} at index {exc.start}): {text!r:.80}"
            ) from exc
        subs: list[SubBlock] = []
        start_byte = 0
        start_char = 0
        for cut in self._cut_offsets(data):
            raw = data[start_byte:cut]
            piece = raw.decode("utf-8")
            end_char = start_char + len(piece)
            subs.append(SubBlock(piece, _bytes_id(raw), start_char, end_char))
            start_byte, start_char = cut, end_char
        return tuple(subs)

    def _cut_offsets(self, data: bytes) -> list[int]:
        """Byte offsets in ``data`` where sub-blocks end (the last is ``len(data)``); ``[]``
        for ``b""``.

        Works on ``data`` with every CRLF turned into LF (sizes count CRLF as one byte, line
        contents exclude the ending) and maps the cuts back. Only lines that end at least
        ``min_bytes`` into the open sub-block are hashed; the rest is skipped with
        ``bytes.find``.
        """
        has_crlf = b"\r\n" in data
        text = data.replace(b"\r\n", b"\n") if has_crlf else data
        cuts: list[int] = []
        position = 0
        while position < len(text):
            position = self._next_cut(text, position)
            cuts.append(position)
        if has_crlf:
            cuts = _raw_offsets(data, cuts)
        return cuts

    def _next_cut(self, text: bytes, start: int) -> int:
        """End of the sub-block that starts at ``start`` in LF-only ``text`` (rules 2-4)."""
        size = len(text)
        if size - start <= self.min_bytes:
            return size
        limit = start + self.max_bytes
        # first line that ends at least min_bytes in: its "\n" is at or after start + min - 1
        newline = text.find(b"\n", start + self.min_bytes - 1)
        while 0 <= newline < limit:
            line_start = text.rfind(b"\n", 0, newline) + 1
            if _line_hash(text[line_start:newline]) % self.modulus == 0:
                return newline + 1
            newline = text.find(b"\n", newline + 1)
        if size <= limit:
            return size
        newline = text.rfind(b"\n", start, limit)
        if newline >= 0:  # cut before the line that would overflow max_bytes
            return newline + 1
        # one line longer than max_bytes from here: cut inside it
        space = text.rfind(b" ", start + self.min_bytes, limit)
        if space >= 0:
            return space + 1
        cut = limit
        while cut > start + 1 and (text[cut] & 0xC0) == 0x80:  # a UTF-8 continuation byte
            cut -= 1
        return cut


def _line_hash(content: bytes) -> int:
    """Stable 64-bit hash of a line's content (BLAKE2b-64, big-endian), process-independent."""
    return int.from_bytes(hashlib.blake2b(content, digest_size=8).digest(), "big")


def _bytes_id(raw: bytes) -> int:
    """:func:`~contextpilot_integrations.core.blocks.block_id` of ``raw.decode()``, from the
    bytes already encoded (the same BLAKE2b-64 digest; tests check the two agree)."""
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


def _raw_offsets(data: bytes, cuts: list[int]) -> list[int]:
    """Map offsets in ``data`` with CRLF turned into LF back to offsets in ``data``.

    A normalised offset ``p`` is ``p`` plus the number of CRLFs that end before it; a cut is
    never between a CR and its LF (cuts fall after an LF or inside a line).
    """
    raw: list[int] = []
    removed = 0  # CRs dropped before the current normalised position
    search = 0
    for cut in cuts:
        while True:
            crlf = data.find(b"\r\n", search)
            if crlf < 0 or crlf - removed >= cut:
                break
            removed += 1
            search = crlf + 2
        raw.append(cut + removed)
    return raw
