"""The chat template of the random-weights model, and the token ids vLLM prefills with it.

The template (:data:`CHAT_TEMPLATE`, ChatML style) is written into the model directory's
``tokenizer_config.json`` (:mod:`~contextpilot_bench.testbed.model_dir`), where vLLM
reads it; :func:`render_chat` is the same function in Python, so the benchmark knows the exact
prompt tokens without asking the server. The ``vllm`` test tier checks both against the
server's ``/tokenize``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "BOS_TOKEN",
    "CHAT_ROLES",
    "CHAT_TEMPLATE",
    "MESSAGE_END",
    "MESSAGE_START",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "render_chat",
    "tokenize_prompt",
]

BOS_TOKEN = "<|bos|>"
PAD_TOKEN = "<|pad|>"
MESSAGE_START = "<|im_start|>"
MESSAGE_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, PAD_TOKEN, MESSAGE_START, MESSAGE_END)
"""The tokenizer's special tokens, ids 0..3 in this order."""
CHAT_ROLES = ("system", "user", "assistant")

# Written on one line because transformers renders chat templates with trim_blocks/lstrip_blocks.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def render_chat(
    messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
) -> str:
    """Render chat messages exactly as :data:`CHAT_TEMPLATE` does on the server.

    Args:
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
        add_generation_prompt: append the opening of the assistant turn (what chat completions do).

    Returns:
        The prompt text, special tokens written out (``<|bos|><|im_start|>user\\n...``).

    Raises:
        ValueError: a role outside system/user/assistant.
        TypeError: a message that is not a mapping, or content that is not a string.
    """
    parts = [BOS_TOKEN]
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{position}] must be a mapping, got {type(message).__name__}")
        role = message.get("role")
        content = message.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{position}].role must be one of {CHAT_ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise TypeError(
                f"messages[{position}].content must be a str, got {type(content).__name__}"
            )
        parts.append(f"{MESSAGE_START}{role}\n{content}{MESSAGE_END}\n")
    if add_generation_prompt:
        parts.append(f"{MESSAGE_START}assistant\n")
    return "".join(parts)


def tokenize_prompt(
    tokenizer: Tokenizer,
    prompt: str | Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids vLLM prefills for ``prompt`` with a model from
    :func:`~contextpilot_bench.testbed.model_dir.prepare_model_dir`.

    A string is encoded as ``/v1/completions`` does (``add_special_tokens=True``; the tokenizer
    has no post-processor, so nothing is added). A message list is rendered with
    :func:`render_chat` and encoded as ``/v1/chat/completions`` does (``add_special_tokens=False``;
    the template writes ``<|bos|>``).

    Raises:
        TypeError, ValueError: see :func:`render_chat`.
    """
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True).ids)
    text = render_chat(prompt, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False).ids)
