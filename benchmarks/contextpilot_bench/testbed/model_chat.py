"""A model directory's own tokenizer and chat template: the token ids vLLM prefills for chat
messages, computed here without asking the server.

:class:`ModelChat` reads the template the directory ships (``chat_template.jinja``, else
``tokenizer_config.json``'s ``chat_template``) and renders it as transformers'
``apply_chat_template`` does (a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, ``raise_exception``, ``tojson``, the special tokens by name), then encodes
the text with ``tokenizer.json`` as vLLM's ``/v1/chat/completions`` does (no special tokens
added: the template writes them). It serves the random-weights model
(:mod:`~contextpilot_bench.testbed.model_dir`, whose template is
:data:`~contextpilot_bench.testbed.chat_template.CHAT_TEMPLATE`) and SmolLM2
(:mod:`~contextpilot_bench.testbed.smollm2`) alike; the ``vllm`` test tier checks it
against the server's ``/tokenize``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = ["ModelChat"]

ChatMessages = Sequence[Mapping[str, str]]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class ModelChat:
    """A model's tokenizer and chat template.

    Args:
        tokenizer: the model's ``tokenizers.Tokenizer``.
        template: the Jinja chat template.
        special_tokens: template variables such as ``bos_token`` -> their text.

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
    """

    def __init__(
        self, tokenizer: Tokenizer, template: str, special_tokens: Mapping[str, str]
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.special_tokens = dict(special_tokens)
        self._compiled = _environment().from_string(template)

    @classmethod
    def from_model_dir(cls, directory: str | os.PathLike[str]) -> ModelChat:
        """Load ``tokenizer.json`` and the chat template of a model directory.

        Raises:
            FileNotFoundError: no ``tokenizer.json``, or no chat template in the directory.
        """
        path = Path(directory)
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        else:
            raise FileNotFoundError(f"{path} has no chat template (chat_template.jinja)")
        special = {
            key: text
            for key, value in config.items()
            if key.endswith("_token") and (text := _token_text(value)) is not None
        }
        return cls(tokenizer, template, special)

    def render(self, messages: ChatMessages, *, add_generation_prompt: bool = True) -> str:
        """The prompt text the template makes of ``messages`` (special tokens written out).

        Raises:
            TypeError: a message that is not a mapping with string ``role`` and ``content``.
            jinja2.TemplateError: the template refused the messages (``raise_exception``).
        """
        for position, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise TypeError(f"messages[{position}] must be a mapping")
            if not isinstance(message.get("role"), str) or not isinstance(
                message.get("content"), str
            ):
                raise TypeError(f"messages[{position}] needs str role and content")
        return self._compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )

    def token_ids(
        self, prompt: str | ChatMessages, *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids vLLM prefills for ``prompt``: a message list through the template, encoded
        without added special tokens (``/v1/chat/completions``); a string encoded with them
        (``/v1/completions``)."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)
        text = self.render(prompt, add_generation_prompt=add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        """Tokens of ``text`` alone (no special tokens added)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
