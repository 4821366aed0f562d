"""Content-defined chunking: lossless, bounded, content-defined, CRLF, Unicode, odd inputs."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from contextpilot_integrations.core.blocks import block_id
from contextpilot_integrations.core.conversations.chunking import ContentChunker, SubBlock

SMALL = ContentChunker(modulus=4, min_bytes=32, max_bytes=128)

# Lines of mixed scripts, CR, tabs, control characters and long runs, joined by LF or CRLF.
_line = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"),
    max_size=300,
)
_texts = st.lists(_line, max_size=40).flatmap(
    lambda lines: st.sampled_from(["\n", "\r\n"]).map(lambda nl: nl.join(lines))
)


def _normalized_size(text: str) -> int:
    return len(text.replace("\r\n", "\n").encode("utf-8"))


def _check_pieces(chunker: ContentChunker, text: str) -> tuple[SubBlock, ...]:
    subs = chunker.split(text)
    assert "".join(s.text for s in subs) == text
    position = 0
    for sub in subs:
        assert sub.text, "no empty sub-block"
        assert sub.start == position and text[sub.start : sub.end] == sub.text
        assert sub.sub_block_id == block_id(sub.text)
        assert _normalized_size(sub.text) <= chunker.max_bytes
        position = sub.end
    return subs


@settings(max_examples=300, deadline=None)
@given(_texts)
def test_lossless_and_bounded(text: str) -> None:
    _check_pieces(SMALL, text)


@settings(max_examples=200, deadline=None)
@given(st.lists(_line, max_size=40))
def test_crlf_and_lf_forms_are_cut_after_the_same_lines(lines: list[str]) -> None:
    # a line ending in CR joined by LF would itself be a CRLF line ending: not the same content
    assume(not any(line.endswith("\r") for line in lines[:-1]))
    lf = SMALL.split("\n".join(lines))
    crlf = SMALL.split("\r\n".join(lines))
    assert [s.text.replace("\r\n", "\n") for s in crlf] == [s.text for s in lf]
    if any("\r\n" in s.text for s in crlf):
        assert {s.sub_block_id for s in crlf} != {s.sub_block_id for s in lf}


def test_cut_after_hash_zero_lines_once_min_reached() -> None:
    # modulus 1: every line ends a sub-block once it holds min_bytes.
    chunker = ContentChunker(modulus=1, min_bytes=25, max_bytes=1000)
    text = "".join(f"line {i:04d}\n" for i in range(9))  # 10-byte lines
    assert [s.text.count("\n") for s in chunker.split(text)] == [3, 3, 3]


def test_cut_rule_follows_blake2b_of_line_content() -> None:
    chunker = ContentChunker(modulus=3, min_bytes=1, max_bytes=10_000)
    lines = [f"sentence number {i}" for i in range(60)]
    subs = chunker.split("\n".join(lines))
    ends = [s.text.split("\n")[-2] if s.text.endswith("\n") else None for s in subs[:-1]]
    expected = [
        line
        for line in lines[:-1]
        if int.from_bytes(hashlib.blake2b(line.encode(), digest_size=8).digest(), "big") % 3 == 0
    ]
    assert ends == expected


def test_small_block_is_left_whole() -> None:
    text = "short line\n" * 2
    chunker = ContentChunker(modulus=1, min_bytes=64, max_bytes=256)
    assert [s.text for s in chunker.split(text)] == [text]


def test_cuts_resynchronise_after_an_edit_at_the_start() -> None:
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    lines = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(200)]
    text = "\n".join(lines)
    edited = "A new first paragraph that was not there before.\n" + text
    original_ids = [s.sub_block_id for s in SMALL.split(text)]
    edited_ids = [s.sub_block_id for s in SMALL.split(edited)]
    shared = set(original_ids) & set(edited_ids)
    assert len(shared) >= len(original_ids) - 2  # only the first sub-blocks differ
    assert original_ids[-5:] == edited_ids[-5:]


def test_very_long_line_is_cut_at_max_deterministically() -> None:
    chunker = ContentChunker(modulus=4, min_bytes=100, max_bytes=400)
    text = "x" * 5_000
    subs = _check_pieces(chunker, text)
    assert [len(s.text) for s in subs] == [400] * 12 + [200]
    assert chunker.split(text) == subs


def test_very_long_line_prefers_a_space() -> None:
    chunker = ContentChunker(modulus=4, min_bytes=100, max_bytes=400)
    text = " ".join(f"word{i:03d}" for i in range(600))  # 8-byte words, no newline
    subs = _check_pieces(chunker, text)
    assert all(s.text.endswith(" ") for s in subs[:-1])
    assert all(len(s.text.encode()) > 400 - 9 for s in subs[:-1])


def test_long_line_of_multibyte_characters_is_cut_on_character_boundaries() -> None:
    chunker = ContentChunker(modulus=4, min_bytes=50, max_bytes=100)
    text = "日本語のテキスト" * 100 + "\n" + "🙂" * 200  # 3- and 4-byte characters
    subs = _check_pieces(chunker, text)
    assert len(subs) > 10
    assert all(len(s.text.encode()) >= 97 for s in subs[:-1] if "\n" not in s.text)


def test_line_exactly_at_max_keeps_its_ending_in_a_non_empty_piece() -> None:
    chunker = ContentChunker(modulus=1_000_003, min_bytes=10, max_bytes=64)
    text = "y" * 64 + "\n" + "z" * 10
    subs = _check_pieces(chunker, text)
    assert all(s.text.strip() for s in subs)


def test_one_line_block_and_empty_lines_and_empty_text() -> None:
    assert SMALL.split("") == ()
    assert [s.text for s in SMALL.split("one line, no newline")] == ["one line, no newline"]
    _check_pieces(SMALL, "\n" * 1_000)
    _check_pieces(SMALL, "\r\n" * 1_000)
    _check_pieces(SMALL, "para\n\n\n\n" * 200)


def test_binary_looking_text_is_lossless() -> None:
    rng = random.Random(3)
    raw = bytes(rng.randrange(256) for _ in range(20_000))
    for text in (raw.decode("latin-1"), raw.decode("utf-8", errors="replace")):
        _check_pieces(SMALL, text)
    _check_pieces(SMALL, "\x00\x01\x1b[31m\x7f\r\r\r\n\x0b\x0c\u2028\u2029\ufeff" * 300)


def test_lone_carriage_return_is_an_ordinary_character() -> None:
    chunker = ContentChunker(modulus=1, min_bytes=1, max_bytes=1000)
    assert [s.text for s in chunker.split("a\rb\rc\n")] == ["a\rb\rc\n"]


def test_bad_input_is_rejected_with_the_field_named() -> None:
    with pytest.raises(TypeError, match="text must be a str"):
        SMALL.split(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="UTF-8"):
        SMALL.split("lone \udc80 surrogate")
    with pytest.raises(ValueError, match="modulus"):
        ContentChunker(modulus=0)
    with pytest.raises(ValueError, match="max_bytes"):
        ContentChunker(min_bytes=512, max_bytes=512)
    with pytest.raises(ValueError, match="max_bytes"):
        ContentChunker(min_bytes=1, max_bytes=8)
    with pytest.raises(TypeError, match="min_bytes"):
        ContentChunker(min_bytes=1.5)  # type: ignore[arg-type]


def test_same_cuts_in_another_process_with_another_hash_seed() -> None:
    text = "\n".join(f"row {i} of a table with some content" for i in range(300))
    here = [s.sub_block_id for s in SMALL.split(text)]
    code = (
        "from contextpilot_integrations.core.conversations.chunking import ContentChunker\n"
        "c = ContentChunker(modulus=4, min_bytes=32, max_bytes=128)\n"
        "t = '\\n'.join(f'row {i} of a table with some content' for i in range(300))\n"
        "print([s.sub_block_id for s in c.split(t)])\n"
    )
    for seed in ("1", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out.strip() == str(here)
