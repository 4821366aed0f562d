"""A random-weights Llama model directory for vLLM, written with no download, and its reuse.

:func:`prepare_model_dir` writes a small ``LlamaForCausalLM`` config, a byte-level BPE tokenizer
trained on local text (:mod:`~contextpilot_bench.testbed.tokenizer_training`) and the
chat template (:mod:`~contextpilot_bench.testbed.chat_template`). vLLM serves it with
``--load-format dummy`` (random weights): prefill cost and prefix caching do not depend on the
weights' values. :func:`ensure_model_dir` prepares such a directory once and reuses it while its
manifest matches. The recipe and its traps: docs/DESIGN.md, "vLLM on a CPU".
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import sysconfig
from pathlib import Path
from typing import Any

import tokenizers

from contextpilot_bench.testbed.chat_template import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    MESSAGE_END,
    MESSAGE_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
)
from contextpilot_bench.testbed.locations import default_model_dir
from contextpilot_bench.testbed.tokenizer_training import corpus_files, train_tokenizer

__all__ = ["MODEL_MANIFEST", "ensure_model_dir", "prepare_model_dir"]

logger = logging.getLogger(__name__)

MODEL_MANIFEST = "contextpilot_model.json"
"""The manifest file of a prepared directory, written last (its presence means complete)."""


def _llama_config(
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    max_positions: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "bfloat16",
    }


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8", newline="\n")


def prepare_model_dir(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    hidden: int = 512,
    layers: int = 8,
    heads: int = 8,
    kv_heads: int = 2,
    intermediate: int = 1024,
    vocab: int = 8192,
    max_positions: int = 8192,
    corpus_bytes: int = 4_000_000,
) -> Path:
    """Write a random-weights Llama model directory for vLLM, with no download.

    Files: ``config.json`` (``LlamaForCausalLM``, bf16), ``tokenizer.json`` (byte-level BPE
    trained on :func:`~contextpilot_bench.testbed.tokenizer_training.corpus_files`),
    ``tokenizer_config.json`` (special tokens and the chat template) and
    ``contextpilot_model.json`` (the arguments and a SHA-256 of the training corpus, to tell two
    machines' tokenizers apart). Serve it with ``--load-format dummy``. The same arguments on
    the same Python and ``tokenizers`` versions give byte-identical files. Existing files of
    those names are overwritten.

    Args:
        path: the directory (created if missing).
        seed: chooses the corpus files (and so the merges).
        hidden, layers, heads, kv_heads, intermediate: transformer shape; head size is
            ``hidden // heads``.
        vocab: the config's vocabulary size and the tokenizer's target size (the trained
            tokenizer may be smaller, never larger).
        max_positions: ``max_position_embeddings`` (the longest ``--max-model-len`` allowed).
        corpus_bytes: cap on the training text, in bytes.

    Returns:
        The directory, as a :class:`Path`.

    Raises:
        ValueError: a non-positive size, ``hidden`` not divisible by ``heads``, ``heads`` not
            divisible by ``kv_heads``, or ``vocab`` too small.
    """
    sizes = {
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate,
        "vocab": vocab,
        "max_positions": max_positions,
        "corpus_bytes": corpus_bytes,
    }
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    files = corpus_files(seed, corpus_bytes)
    texts = [file.read_text(encoding="utf-8") for file in files]
    corpus_digest = hashlib.sha256()
    for text in texts:
        corpus_digest.update(hashlib.sha256(text.encode("utf-8")).digest())
    tokenizer = train_tokenizer(texts, vocab)
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:  # the trainer adds them first; a different tokenizers would not
            raise RuntimeError(f"trained tokenizer lacks the special token {token!r}")
        ids[token] = token_id

    config = _llama_config(
        **{k: v for k, v in sizes.items() if k != "corpus_bytes"},
        bos_id=ids[BOS_TOKEN],
        eos_id=ids[MESSAGE_END],
        pad_id=ids[PAD_TOKEN],
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": MESSAGE_END,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [MESSAGE_START],
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    manifest = {
        "generator": f"{__name__}.prepare_model_dir",
        "arguments": {"seed": seed, **sizes},
        "corpus": {
            "root": "stdlib",
            "python": sysconfig.get_python_version(),
            "files": len(files),
            "bytes": sum(len(text.encode("utf-8")) for text in texts),
            "sha256": corpus_digest.hexdigest(),
        },
        "tokenizers_version": tokenizers.__version__,
        "trained_vocab": tokenizer.get_vocab_size(),
    }
    _write_text(directory / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_text(directory / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    _write_text(
        directory / "tokenizer_config.json",
        json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n",
    )
    _write_text(directory / MODEL_MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    logger.info(
        "wrote model dir %s: %d-layer/%d llama, tokenizer of %d tokens from %d stdlib files",
        directory,
        layers,
        hidden,
        tokenizer.get_vocab_size(),
        len(files),
    )
    return directory


def _default_arguments(seed: int) -> dict[str, Any]:
    """The manifest ``arguments`` of :func:`prepare_model_dir` with its defaults and ``seed``."""
    arguments = {
        name: parameter.default
        for name, parameter in inspect.signature(prepare_model_dir).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    arguments["seed"] = seed
    return arguments


def ensure_model_dir(path: str | os.PathLike[str] | None = None, *, seed: int = 0) -> Path:
    """The default-shape model directory, prepared once and reused.

    Reused when its manifest (written last by :func:`prepare_model_dir`) records the default
    shape with this ``seed``, this Python version (the tokenizer's training text is the standard
    library) and this ``tokenizers`` version; otherwise rewritten.

    Args:
        path: the directory (default
            :func:`~contextpilot_bench.testbed.locations.default_model_dir`).
        seed: the model directory's seed.

    Returns:
        The directory.
    """
    directory = Path(path) if path is not None else default_model_dir()
    manifest_path = directory / MODEL_MANIFEST
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            manifest = {}
        if (
            manifest.get("arguments") == _default_arguments(seed)
            and manifest.get("tokenizers_version") == tokenizers.__version__
            and manifest.get("corpus", {}).get("python") == sysconfig.get_python_version()
            and all((directory / name).is_file() for name in ("config.json", "tokenizer.json"))
        ):
            logger.info("reusing the model directory %s", directory)
            return directory
        logger.info("model directory %s is stale; rewriting it", directory)
        manifest_path.unlink()  # an interrupted rewrite must not look complete
    return prepare_model_dir(directory, seed=seed)
