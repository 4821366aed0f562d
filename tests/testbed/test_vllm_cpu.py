"""vLLM CPU engine preparation: model directory, server lifecycle, prefix cache, KV events.

The model-directory tests run anywhere `tokenizers` is installed. The tests marked `vllm` start a
real vLLM server from `.venv-vllm` (made by `scripts/setup-vllm-env.sh`) and are skipped when that
environment is absent. Only one server runs at a time: the lifecycle tests each start and stop
their own, then `TestRunningServer` shares one (class scope) that is stopped at the class's end.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from support.engine_marks import NEEDS_VLLM

pytest.importorskip("tokenizers", reason="the engines extra needs `tokenizers`")

from contextpilot_bench.testbed.chat_template import (  # noqa: E402
    BOS_TOKEN,
    CHAT_TEMPLATE,
    MESSAGE_END,
    MESSAGE_START,
    render_chat,
    tokenize_prompt,
)
from contextpilot_bench.testbed.locations import (  # noqa: E402
    VLLM_PYTHON_ENV,
    find_vllm_python,
    require_vllm_python,
    source_checkout,
)
from contextpilot_bench.testbed.model_dir import prepare_model_dir  # noqa: E402
from contextpilot_bench.testbed.process_group import process_group_members  # noqa: E402
from contextpilot_bench.testbed.tokenizer_training import corpus_files  # noqa: E402
from contextpilot_bench.testbed.vllm_server import VllmCpuServer  # noqa: E402
from support.data_dir import find_data_dir  # noqa: E402

from contextpilot_integrations.core.rendering import PromptLayout  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32

needs_vllm = NEEDS_VLLM

WORDS = [
    "the",
    "cache",
    "engine",
    "prefix",
    "block",
    "token",
    "request",
    "model",
    "index",
    "shared",
    "context",
    "retrieval",
    "document",
    "answer",
    "question",
    "evidence",
    "article",
    "report",
    "market",
    "season",
    "company",
    "court",
    "city",
    "river",
    "energy",
    "policy",
    "research",
    "data",
    "system",
    "network",
    "science",
    "history",
    "music",
    "film",
]


def _digests(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


def _prose(seed: int, tokens: int, server: VllmCpuServer) -> str:
    """Deterministic word salad of about `tokens` tokens (measured with the model's tokenizer)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    while len(server.tokenizer.encode(" ".join(sentences)).ids) < tokens:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


# ---------------------------------------------------------------------------------------------
# Model directory (no vLLM needed)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_model_dir(tmp_path_factory.mktemp("model"), seed=0)


def test_model_dir_is_byte_identical_for_the_same_seed(model_dir: Path, tmp_path: Path) -> None:
    again = prepare_model_dir(tmp_path / "again", seed=0)
    assert _digests(model_dir) == _digests(again)
    assert set(_digests(again)) == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "contextpilot_model.json",
    }


def test_model_dir_in_a_fresh_process_is_byte_identical(model_dir: Path, tmp_path: Path) -> None:
    # Hash seeds and thread scheduling differ between processes; the files must not.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "contextpilot_bench.testbed",
            "prepare",
            "--dir",
            str(tmp_path / "cli"),
        ],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert _digests(model_dir) == _digests(tmp_path / "cli")


def test_another_seed_gives_another_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    other = prepare_model_dir(tmp_path / "seed1", seed=1)
    assert corpus_files(0) != corpus_files(1)
    assert (other / "tokenizer.json").read_bytes() != (model_dir / "tokenizer.json").read_bytes()
    assert (other / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()


def test_model_dir_config_and_tokenizer(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (512, 8, 64)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (8192, 8192)
    assert config["dtype"] == "bfloat16"

    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert tokenizer_config["bos_token"] == "<|bos|>"

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= config["vocab_size"]
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert tokenizer.id_to_token(config[name]) is not None
    # Byte-level: any text round-trips, special tokens are single ids.
    text = "Zürich → 東京, naïve café ☕\n\n[Doc 1] tabs\tand  spaces"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    rendered = render_chat([{"role": "user", "content": "hi"}])
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == config["bos_token_id"]
    assert tokenizer.id_to_token(ids[1]) == "<|im_start|>"


def test_render_chat_rejects_bad_messages() -> None:
    with pytest.raises(ValueError, match=r"messages\[1\]\.role.*'tool'"):
        render_chat([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(TypeError, match=r"messages\[0\]\.content must be a str, got list"):
        render_chat([{"role": "user", "content": [{"type": "text", "text": "a"}]}])  # type: ignore[dict-item]


def test_prepare_model_dir_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"hidden \(500\) must be divisible by heads \(8\)"):
        prepare_model_dir(tmp_path, hidden=500)
    with pytest.raises(ValueError, match=r"heads \(8\) must be divisible by kv_heads \(3\)"):
        prepare_model_dir(tmp_path, kv_heads=3)
    with pytest.raises(ValueError, match="layers must be a positive int, got 0"):
        prepare_model_dir(tmp_path, layers=0)
    with pytest.raises(ValueError, match="vocab must exceed 260"):
        prepare_model_dir(tmp_path, vocab=200)


def test_server_rejects_bad_arguments_before_starting(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 32.*16"):
        VllmCpuServer(model_dir, block_size=16)
    with pytest.raises(ValueError, match=r"num_gpu_blocks \(10\) x block_size \(32\)"):
        VllmCpuServer(model_dir, block_size=32, num_gpu_blocks=10, max_model_len=4096)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        VllmCpuServer(tmp_path)
    with pytest.raises(ValueError, match="work_dir too long"):
        VllmCpuServer(model_dir, work_dir=tmp_path / ("x" * 120))
    with pytest.raises(FileNotFoundError, match=r"no vLLM environment \(/nowhere/python\)"):
        VllmCpuServer(model_dir, vllm_python="/nowhere/python")


# ---------------------------------------------------------------------------------------------
# The Python that runs vLLM (no vLLM needed)
# ---------------------------------------------------------------------------------------------


def test_the_vllm_python_is_configurable_and_never_second_guessed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    other = tmp_path / "other-python"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(other))
    # An argument wins over the environment, which wins over the checkout's .venv-vllm.
    assert find_vllm_python(python) == python
    assert find_vllm_python() == other
    assert require_vllm_python() == other
    # A configured path that is no interpreter is not replaced by another one behind the back.
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "missing"))
    assert find_vllm_python() is None
    with pytest.raises(FileNotFoundError, match=r"no vLLM environment \(.*missing\)"):
        require_vllm_python()
    with pytest.raises(FileNotFoundError, match="run scripts/setup-vllm-env.sh"):
        require_vllm_python(tmp_path / "missing")
    # Unset: the source checkout's .venv-vllm when there is one (this repository).
    monkeypatch.delenv(VLLM_PYTHON_ENV)
    checkout = source_checkout()
    assert checkout == REPO_ROOT
    venv_python = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if venv_python.is_file():
        assert find_vllm_python() == venv_python


# ---------------------------------------------------------------------------------------------
# Token-level prefix stability of the core's PromptLayout (model tokenizer, no vLLM needed)
# ---------------------------------------------------------------------------------------------

# Block endings that stress a byte-level BPE join: whitespace runs, newlines, digits, quotes,
# non-ASCII, markup, and text that itself looks like a label or a separator.
EDGE_TEXTS = [
    "Ends with a full stop.",
    "ends with spaces   ",
    "ends with a newline\n",
    "ends with two newlines\n\n",
    "ends with a number 1990",
    'ends with a quote "',
    "Zürich naïve café — 東京",
    "trailing tab\t",
    "  leading spaces and a list:\n- a\n- b",
    "[Doc 7] looks like a label",
    "-----",
    "closing markup </doc>",
]


def _paragraphs() -> list[str]:
    """Real paragraphs (MuSiQue corpus) when the data dir is there, plus the edge cases."""
    texts = list(EDGE_TEXTS)
    data_dir = find_data_dir()
    if data_dir is None:
        return texts
    corpus = data_dir / "hipporag_train_subsets" / "musique_train_corpus.json"
    if corpus.is_file():
        texts += [entry["text"] for entry in json.loads(corpus.read_text())[:400]]
    return texts


def _prefix_breaks(layout: PromptLayout, tokenizer, trials: int = 300) -> list[str]:  # type: ignore[no-untyped-def]
    """Cases where a prompt's tokens do not start with the tokens of its shared block prefix.

    For each trial: a long request with n blocks and a short one with its first k blocks
    (different questions). The shared part is the rendered text up to the end of block k, in
    the plain-text form and in the chat form (template applied). Returns a description of each
    case where tokenize(prompt)[: len(tokenize(shared))] != tokenize(shared).
    """
    rng = random.Random(0)
    texts = _paragraphs()
    breaks = []
    for trial in range(trials):
        n = rng.randint(2, 6)
        blocks = [rng.choice(texts) for _ in range(n)]
        k = rng.randint(0, n - 1)
        requests = [(blocks, "What links them?"), (blocks[:k], "When?")]
        for form in ("plain", "chat"):
            shared_text = "".join(layout.render_segments(blocks, "q")[: k + 1])
            if form == "chat":
                # Chat form: the system prompt is its own message; the blocks open the user turn.
                shared_text = (
                    f"{BOS_TOKEN}{MESSAGE_START}system\n{layout.system_prompt}{MESSAGE_END}\n"
                    f"{MESSAGE_START}user\n" + shared_text[len(layout.system_segment()) :]
                )
            shared = tokenizer.encode(shared_text, add_special_tokens=False).ids
            for request_blocks, question in requests:
                if form == "plain":
                    prompt_text = layout.render(request_blocks, question)
                    tokens = tokenize_prompt(tokenizer, prompt_text)
                else:
                    messages = layout.render_messages(request_blocks, question)
                    prompt_text = render_chat(messages)
                    tokens = tokenize_prompt(tokenizer, messages)
                assert prompt_text.startswith(shared_text)  # byte-identical prefix first
                if tokens[: len(shared)] != shared:
                    ending = blocks[k - 1][-30:] if k else layout.system_prompt[-30:]
                    breaks.append(f"trial {trial}, {form} form, {k} shared blocks: {ending!r}")
    return breaks


@pytest.fixture(scope="module")
def model_tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_layout_block_boundary_is_token_stable(model_tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert _prefix_breaks(PromptLayout(), model_tokenizer) == []


def test_whitespace_only_block_boundary_is_not_token_stable(model_tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The control: the same check catches a separator a BPE tokenizer merges across.
    layout = PromptLayout(block_template="{label}\n{text}\n\n", block_separator="\n\n")
    assert len(_prefix_breaks(layout, model_tokenizer)) > 0


# ---------------------------------------------------------------------------------------------
# Server lifecycle (real vLLM)
# ---------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    children = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children.append(int(entry.name))
            except OSError:
                continue
    return children


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    alive.append(pid)
        except OSError:
            continue
    return alive


@pytest.mark.vllm
@needs_vllm
def test_ctrl_c_on_the_serve_cli_stops_every_server_process(
    model_dir: Path, tmp_path: Path
) -> None:
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "contextpilot_bench.testbed",
            "serve",
            "--dir",
            str(model_dir),
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            "2048",
            "--work-dir",
            str(tmp_path / "work"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output = []
        assert cli.stdout is not None
        for line in cli.stdout:
            output.append(line)
            if line.startswith("ready in"):
                break
        else:
            pytest.fail("serve exited before ready:\n" + "".join(output))
        base_url = next(line.split()[1] for line in output if line.startswith("base_url"))
        assert httpx.get(f"{base_url}/health").status_code == 200
        (server_pid,) = _children(cli.pid)
        group = process_group_members(server_pid)
        assert server_pid in group and len(group) >= 2  # API server + engine core at least

        cli.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends to the foreground job
        assert cli.wait(timeout=60) == 0
        assert _alive(group) == []
        assert process_group_members(server_pid) == []
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()


@pytest.mark.vllm
@needs_vllm
def test_startup_failure_raises_with_the_log_tail_and_leaves_nothing(model_dir: Path) -> None:
    # max_model_len above the config's max_position_embeddings: vLLM refuses to start.
    server = VllmCpuServer(model_dir, block_size=BLOCK_SIZE, max_model_len=9000)
    with pytest.raises(RuntimeError, match=r"exited with status \d+ during startup") as error:
        server.start()
    assert "max_model_len (9000)" in str(error.value)
    assert not server.running and server.pid is not None
    assert process_group_members(server.pid) == []


@pytest.mark.vllm
@needs_vllm
def test_startup_timeout_stops_the_half_started_server(model_dir: Path) -> None:
    server = VllmCpuServer(model_dir, block_size=BLOCK_SIZE, startup_timeout=3.0)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not healthy after 3 s; log .*server\.log"), server:
        pytest.fail("the with-body must not run")
    assert time.monotonic() - began < 60
    assert not server.running and server.pid is not None
    assert process_group_members(server.pid) == []


# ---------------------------------------------------------------------------------------------
# One running server: tokenization, prefix cache, KV events
# ---------------------------------------------------------------------------------------------


class _EventSubscriber:
    """A plain ZMQ SUB on the server's KV-event endpoint, decoding with msgspec (test-only)."""

    def __init__(self, server: VllmCpuServer) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, server.kv_events_topic.encode())
        self._socket.connect(server.kv_events_endpoint)
        self.topic = server.kv_events_topic.encode()
        self.sequence_numbers: list[int] = []
        self.events: list[dict] = []
        time.sleep(0.5)  # let the subscription reach the publisher (ZMQ slow joiner)

    def drain(self, until, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not until(self.events):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"event not seen in {timeout} s; got {self.events!r}")
            if self._socket.poll(int(remaining * 1000)):
                topic, sequence, payload = self._socket.recv_multipart()
                assert topic == self.topic
                self.sequence_numbers.append(int.from_bytes(sequence, "big"))
                batch = msgspec.msgpack.decode(payload)
                timestamp, events = batch[0], batch[1]
                assert isinstance(timestamp, float)
                self.events.extend(events)

    def close(self) -> None:
        self._socket.close()


@pytest.fixture(scope="class")
def server(model_dir: Path) -> Iterator[VllmCpuServer]:
    """One real server for the tests of a class, stopped (whole group) at the class's end."""
    with VllmCpuServer(model_dir, block_size=BLOCK_SIZE, max_model_len=4096) as running:
        group = process_group_members(running.pid)  # type: ignore[arg-type]
        yield running
    assert _alive(group) == [], "server processes left after stop()"


@pytest.mark.vllm
@needs_vllm
class TestRunningServer:
    def _chat(self, server: VllmCpuServer, messages: list[dict], **extra: object) -> dict:
        body = {"model": server.model_name, "messages": messages, "max_tokens": 1, **extra}
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()

    def test_local_tokenize_matches_the_server(self, server: VllmCpuServer) -> None:
        conversations = [
            [{"role": "user", "content": "hello"}],
            [
                {"role": "system", "content": "You answer from the documents.\n\n"},
                {
                    "role": "user",
                    "content": "[Doc 1] Zürich ☕ naïve\n\n[Doc 2]  two  spaces\ttab\n\n"
                    "Question: <|im_end|> is text here?",
                },
            ],
            [
                {"role": "system", "content": ""},
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": " trailing space "},
            ],
        ]
        for messages in conversations:
            for add_generation_prompt in (True, False):
                answer = httpx.post(
                    f"{server.base_url}/tokenize",
                    json={
                        "model": server.model_name,
                        "messages": messages,
                        "add_generation_prompt": add_generation_prompt,
                    },
                ).json()
                local = server.tokenize(messages, add_generation_prompt=add_generation_prompt)
                assert answer["tokens"] == local, messages
        text = "Plain completion prompt, no template.\n\n[Doc 1] x"
        answer = httpx.post(
            f"{server.base_url}/tokenize", json={"model": server.model_name, "prompt": text}
        ).json()
        assert answer["tokens"] == server.tokenize(text)

    def test_prefix_cache_hit_and_block_stored_events_carry_the_session_id(
        self, server: VllmCpuServer
    ) -> None:
        subscriber = _EventSubscriber(server)
        try:
            server.reset_prefix_cache()
            messages = [
                {"role": "system", "content": "You answer from the documents."},
                {"role": "user", "content": _prose(seed=7, tokens=1000, server=server)},
            ]
            tokens = server.tokenize(messages)
            assert 950 <= len(tokens) <= 1100
            first_session, second_session = f"s-{uuid.uuid4().hex}", f"s-{uuid.uuid4().hex}"

            first = self._chat(server, messages, session_id=first_session)["usage"]
            second = self._chat(server, messages, session_id=second_session)["usage"]

            assert first["prompt_tokens"] == second["prompt_tokens"] == len(tokens)
            assert first["prompt_tokens_details"]["cached_tokens"] == 0
            cached = second["prompt_tokens_details"]["cached_tokens"]
            assert cached > 0
            # Only full blocks are reused, and the last prompt token is always recomputed.
            assert cached == (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE

            def stored(events: list[dict], session: str) -> list[dict]:
                return [
                    e
                    for e in events
                    if e.get("type") == "BlockStored" and e.get("session_id") == session
                ]

            full_blocks = len(tokens) // BLOCK_SIZE

            def first_request_stored(events: list[dict]) -> bool:
                return sum(len(e["block_hashes"]) for e in stored(events, first_session)) >= (
                    full_blocks
                )

            subscriber.drain(first_request_stored)
            types = [event["type"] for event in subscriber.events]
            assert types[0] == "AllBlocksCleared", types  # the reset, published with the next step
            first_stored = stored(subscriber.events, first_session)
            stored_tokens = [t for event in first_stored for t in event["token_ids"]]
            # The engine's blocks hold exactly the tokens we computed locally, in order.
            assert stored_tokens[: full_blocks * BLOCK_SIZE] == tokens[: full_blocks * BLOCK_SIZE]
            for event in first_stored:
                assert event["block_size"] == BLOCK_SIZE
                assert len(event["token_ids"]) == BLOCK_SIZE * len(event["block_hashes"])
            # A chain: every later event's parent is the previous event's last block.
            for previous, event in zip(first_stored, first_stored[1:]):
                assert event["parent_block_hash"] == previous["block_hashes"][-1]
            assert first_stored[0]["parent_block_hash"] is None
            # The second request reused the blocks: no BlockStored re-announces them.
            reused = {h for e in first_stored for h in e["block_hashes"]}
            for event in stored(subscriber.events, second_session):
                assert not reused.intersection(event["block_hashes"])
            numbers = subscriber.sequence_numbers
            assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
        finally:
            subscriber.close()

    def test_reset_prefix_cache_drops_the_cached_blocks(self, server: VllmCpuServer) -> None:
        messages = [{"role": "user", "content": _prose(seed=11, tokens=300, server=server)}]
        self._chat(server, messages)
        assert self._chat(server, messages)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        server.reset_prefix_cache()
        assert self._chat(server, messages)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    def test_engine_reuses_exactly_the_shared_blocks_of_an_aligned_layout(
        self, server: VllmCpuServer
    ) -> None:
        # Two requests whose aligned prompts share their first 3 of 5 blocks (PromptLayout).
        layout = PromptLayout()
        blocks = [_prose(seed=20 + i, tokens=120, server=server) for i in range(5)]
        short = layout.render_messages(blocks[:3], "When did it happen?")
        long = layout.render_messages(blocks, "Who was involved?")
        shared_text = render_chat(long)[: render_chat(long).index("[Doc 4]")]
        shared = server.tokenizer.encode(shared_text, add_special_tokens=False).ids

        def engine_tokens(messages: list[dict[str, str]]) -> list[int]:
            body = {"model": server.model_name, "messages": messages}
            return httpx.post(f"{server.base_url}/tokenize", json=body).json()["tokens"]

        long_tokens = engine_tokens(long)
        assert (
            long_tokens[: len(shared)] == shared
        )  # what the engine sees starts with the shared part
        server.reset_prefix_cache()
        self._chat(server, short)
        usage = self._chat(server, long)["usage"]
        assert usage["prompt_tokens"] == len(long_tokens)
        common = 0
        for a, b in zip(engine_tokens(short), long_tokens):
            if a != b:
                break
            common += 1
        assert common >= len(shared)
        assert usage["prompt_tokens_details"]["cached_tokens"] == common // BLOCK_SIZE * BLOCK_SIZE
