"""The MultiHop-RAG slice and KV-cache size of the real-engine test bed's vLLM tests.

Those tests need evictions: a KV cache of a few requests of ``max_model_len`` tokens, a fraction
of what the slice's prompts take, makes every few requests evict. ``max_model_len`` comes from
the slice's longest prompt under the model's own tokenizer and chat template, so the sizes
follow the model directory rather than a guess. Needs ``tokenizers`` (the engines extra): the
test modules that import this one skip without it first.
"""

from __future__ import annotations

from pathlib import Path

from contextpilot_bench.kv_cache_size import max_model_len_for
from contextpilot_bench.methods import PreparedWorkload, prepare_workload
from contextpilot_bench.testbed.chat_template import tokenize_prompt
from contextpilot_bench.workloads import load_workload
from tokenizers import Tokenizer

from contextpilot_integrations.core.blocks import TokenizerCounter
from support.data_dir import MULTIHOP_RAG, dataset_dir_or_skip

MAX_POSITIONS = 8192  # the test bed model's max_position_embeddings


def model_tokenizer(model_dir: Path) -> Tokenizer:
    """The tokenizer of a model directory (its ``tokenizer.json``)."""
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def prepare_multihop(model_dir: Path, requests: int, top_k: int) -> PreparedWorkload:
    """The first ``requests`` MultiHop-RAG requests with their BM25 top-``top_k`` blocks, counted
    in the model's tokens. Skips the calling test without the MultiHop-RAG sample."""
    workload = load_workload("multihop-rag", dataset_dir_or_skip(MULTIHOP_RAG)).head(requests)
    counter = TokenizerCounter(model_tokenizer(model_dir))
    return prepare_workload(workload, top_k, counter=counter)


def kv_cache_blocks(
    model_dir: Path, prepared: PreparedWorkload, block_size: int, cache_requests: int
) -> tuple[int, int]:
    """``(max_model_len, usable blocks)``: the slice's ``max_model_len`` in tokens and a KV cache
    of ``cache_requests`` requests of that length, in blocks of ``block_size`` tokens (pass
    ``usable + 1`` as ``num_gpu_blocks``: vLLM reserves one block, its null block).

    Raises:
        ValueError: the slice's longest prompt does not fit the model's positions.
    """
    tokenizer = model_tokenizer(model_dir)
    max_model_len, _ = max_model_len_for(
        prepared, lambda messages: tokenize_prompt(tokenizer, messages), block_size, MAX_POSITIONS
    )
    return max_model_len, cache_requests * max_model_len // block_size
