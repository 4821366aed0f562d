"""A byte-level BPE tokenizer trained on local text, so that a model directory needs no download.

The training text is the running interpreter's own standard library (``*.py``, ``*.txt``,
``*.rst``: already on every machine that runs Python), chosen reproducibly from a seed
(:func:`corpus_files`); training with the ``tokenizers`` package is deterministic for the same
texts in the same order (:func:`train_tokenizer`). The same Python version, ``tokenizers``
version and seed give the same tokenizer.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from contextpilot_bench.testbed.chat_template import SPECIAL_TOKENS

__all__ = ["corpus_files", "train_tokenizer"]

# Parts of the standard library left out of the corpus: caches, third-party packages (they
# differ between environments) and test data (odd encodings, generated noise).
_CORPUS_EXCLUDED_PARTS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests"}
)
_CORPUS_SUFFIXES = (".py", ".txt", ".rst")


def corpus_files(seed: int = 0, max_bytes: int = 4_000_000) -> list[Path]:
    """Choose the tokenizer's training files from the running interpreter's standard library.

    The candidate paths (``*.py``, ``*.txt``, ``*.rst`` under ``sysconfig``'s ``stdlib``, without
    site-packages, caches and test directories) are sorted, shuffled with ``random.Random(seed)``
    and taken in that order until ``max_bytes`` is reached; files that are not valid UTF-8 are
    skipped. Same interpreter version and seed → same list.

    Raises:
        ValueError: ``max_bytes`` not positive.
        FileNotFoundError: no candidate file (a Python install without its library sources).
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = sorted(
        path
        for path in stdlib.rglob("*")
        if path.suffix in _CORPUS_SUFFIXES
        and path.is_file()
        and not _CORPUS_EXCLUDED_PARTS.intersection(path.relative_to(stdlib).parts)
    )
    if not candidates:
        raise FileNotFoundError(f"no {_CORPUS_SUFFIXES} files under the standard library {stdlib}")
    random.Random(seed).shuffle(candidates)
    chosen: list[Path] = []
    total = 0
    for path in candidates:
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        chosen.append(path)
        total += len(data)
        if total >= max_bytes:
            break
    return chosen


def train_tokenizer(texts: Sequence[str], vocab: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenization, no prefix space).

    Special tokens :data:`~contextpilot_bench.testbed.chat_template.SPECIAL_TOKENS` get
    ids 0..3; the 256 byte symbols follow, then merges up to ``vocab`` entries (fewer when the
    corpus runs out of pairs seen twice).

    Raises:
        ValueError: ``vocab`` too small to hold the special tokens and the byte alphabet.
    """
    minimum = len(SPECIAL_TOKENS) + 256
    if vocab <= minimum:
        raise ValueError(f"vocab must exceed {minimum} (specials + 256 bytes), got {vocab}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
