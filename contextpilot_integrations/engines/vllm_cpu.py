"""vLLM's CPU build as a real engine with random weights: model directory and server lifecycle.

The recipe, the flags and the traps are in ``../shared/notes/engine-kv-events.md`` ("vLLM on a
CPU, with random weights"). Two parts:

- :func:`prepare_model_dir` writes, with no download, a small ``LlamaForCausalLM`` config and a
  byte-level BPE tokenizer trained with the ``tokenizers`` package on the Python standard
  library's own files (already on every machine that runs Python), with a chat template. vLLM
  serves it with ``--load-format dummy`` (random weights): prefill cost and prefix caching do not
  depend on the weights' values.
- :class:`VllmCpuServer` starts ``vllm.entrypoints.openai.api_server`` from the vLLM environment
  (``scripts/setup-vllm-env.sh`` makes ``.venv-vllm``) with prefix caching, cached-token usage
  and KV-cache events over ``ipc://``, waits until it answers, and stops the whole process group
  on exit, on errors and on Ctrl-C.

CLI: ``python -m contextpilot_integrations.engines.vllm_cpu prepare --dir DIR`` and
``python -m contextpilot_integrations.engines.vllm_cpu serve --dir DIR``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
VLLM_PYTHON_ENV = "CONTEXTPILOT_VLLM_PYTHON"

BOS_TOKEN = "<|bos|>"
PAD_TOKEN = "<|pad|>"
MESSAGE_START = "<|im_start|>"
MESSAGE_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, PAD_TOKEN, MESSAGE_START, MESSAGE_END)  # ids 0..3, in this order
CHAT_ROLES = ("system", "user", "assistant")

# ChatML-style template, written on one line because transformers renders chat templates with
# trim_blocks/lstrip_blocks. `render_chat` below is the same function in Python; the vllm test
# tier checks both against the server's /tokenize.
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

# Parts of the standard library left out of the tokenizer corpus: caches, third-party packages
# (they differ between environments) and test data (odd encodings, generated noise).
_CORPUS_EXCLUDED_PARTS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests"}
)
_CORPUS_SUFFIXES = (".py", ".txt", ".rst")


# --------------------------------------------------------------------------------------------
# Model directory
# --------------------------------------------------------------------------------------------


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
    """Token ids vLLM prefills for ``prompt`` with a model from :func:`prepare_model_dir`.

    A string is encoded as ``/v1/completions`` does (``add_special_tokens=True``; the tokenizer
    has no post-processor, so nothing is added). A message list is rendered with
    :func:`render_chat` and encoded as ``/v1/chat/completions`` does (``add_special_tokens=False``;
    the template writes ``<|bos|>``). The ``vllm`` test tier checks both against the server's
    ``/tokenize``.

    Raises:
        TypeError, ValueError: see :func:`render_chat`.
    """
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True).ids)
    text = render_chat(prompt, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


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

    Special tokens :data:`SPECIAL_TOKENS` get ids 0..3; the 256 byte symbols follow, then merges
    up to ``vocab`` entries (fewer when the corpus runs out of pairs seen twice). Training in
    ``tokenizers`` is deterministic for the same texts in the same order.

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
    trained on :func:`corpus_files`), ``tokenizer_config.json`` (special tokens and
    :data:`CHAT_TEMPLATE`) and ``contextpilot_model.json`` (the arguments and a SHA-256 of the
    training corpus, to tell two machines' tokenizers apart). Serve it with
    ``--load-format dummy``. The same arguments on the same Python and ``tokenizers`` versions
    give byte-identical files. Existing files of those names are overwritten.

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
        "generator": "contextpilot_integrations.engines.vllm_cpu.prepare_model_dir",
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
    _write_text(
        directory / "contextpilot_model.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    )
    logger.info(
        "wrote model dir %s: %d-layer/%d llama, tokenizer of %d tokens from %d stdlib files",
        directory,
        layers,
        hidden,
        tokenizer.get_vocab_size(),
        len(files),
    )
    return directory


# --------------------------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------------------------


def find_vllm_python() -> Path | None:
    """The interpreter of the vLLM environment, or None when it is not installed.

    ``$CONTEXTPILOT_VLLM_PYTHON`` when set, else ``<repo>/.venv-vllm/bin/python`` (made by
    ``scripts/setup-vllm-env.sh``).
    """
    configured = os.environ.get(VLLM_PYTHON_ENV)
    candidate = Path(configured) if configured else DEFAULT_VLLM_PYTHON
    return candidate if candidate.is_file() and os.access(candidate, os.X_OK) else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_group_members(pgid: int) -> list[int]:
    """Live (non-zombie) process ids whose process group is ``pgid``, read from ``/proc``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="utf-8", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _load_prctl() -> object | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


# Looked up in the parent: the child of a fork should not load libraries before exec.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the Python process that started the server
    # dies without running its cleanup (SIGKILL), the server gets SIGTERM instead of living on.
    # Linux delivers it when the *thread* that forked exits, so start servers from a long-lived
    # thread (normally the main one).
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)  # type: ignore[operator]


class VllmCpuServer:
    """A vLLM OpenAI-compatible server on the CPU, random weights, KV events over ``ipc://``.

    Use as a context manager::

        with VllmCpuServer(model_dir, block_size=32, num_gpu_blocks=200) as server:
            httpx.post(f"{server.base_url}/v1/chat/completions", json={...,
                       "session_id": plan.rid})

    Flags (source: the note "vLLM on a CPU, with random weights"): ``--load-format dummy
    --dtype bfloat16 --enable-prefix-caching --enforce-eager --enable-prompt-tokens-details``,
    ``--kv-events-config`` with a ZMQ publisher on ``ipc://<work_dir>/kv-events.ipc`` (topic
    ``kv-events``) and a replay ROUTER on ``ipc://<work_dir>/kv-replay.ipc``. Environment:
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB), ``OMP_NUM_THREADS``, ``VLLM_CACHE_ROOT`` inside the work
    dir, ``VLLM_SERVER_DEV_MODE=1`` (for ``/reset_prefix_cache``), offline Hugging Face hub.

    The server runs in its own process group (session); :meth:`stop` sends SIGTERM to the whole
    group, waits ``stop_timeout`` seconds, then SIGKILLs what is left. It runs on normal exit,
    on exceptions, on Ctrl-C (also during startup) and at interpreter exit; on Linux the server
    also gets SIGTERM if the starting process is killed outright (``PR_SET_PDEATHSIG``).

    Attributes (valid after :meth:`start`): ``base_url`` (``http://127.0.0.1:PORT``),
    ``kv_events_endpoint``, ``replay_endpoint``, ``kv_events_topic``, ``model_dir``,
    ``model_name`` (the served model name to put in requests), ``tokenizer`` (the model's
    ``tokenizers.Tokenizer``), ``block_size``, ``log_path``, ``pid``.
    """

    kv_events_topic = "kv-events"

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        block_size: int = 128,
        num_gpu_blocks: int | None = None,
        max_model_len: int = 4096,
        kv_cache_space_gib: int = 1,
        omp_threads: int = 2,
        port: int | None = None,
        seed: int = 0,
        model_name: str | None = None,
        work_dir: str | os.PathLike[str] | None = None,
        vllm_python: str | os.PathLike[str] | None = None,
        startup_timeout: float = 240.0,
        stop_timeout: float = 20.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        """Configure (nothing starts until :meth:`start` or ``with``).

        Args:
            model_dir: a directory from :func:`prepare_model_dir` (``config.json`` and
                ``tokenizer.json`` required).
            block_size: KV block size in tokens; vLLM's CPU backend needs a multiple of 32.
            num_gpu_blocks: fix the number of KV blocks (``--num-gpu-blocks-override``), for a
                small cache that evicts; None sizes it from ``kv_cache_space_gib``.
            max_model_len: longest prompt + output, in tokens.
            kv_cache_space_gib: ``VLLM_CPU_KVCACHE_SPACE``, whole GiB.
            omp_threads: ``OMP_NUM_THREADS`` for the engine processes. vLLM 0.32's CPU worker
                binds its own OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND=auto``: every core
                but one, which is left to the scheduler; on 2 cores, 1 thread on core 0) and
                then sets its own thread count; ``VLLM_CPU_OMP_THREADS_BIND=nobind`` in the
                caller's environment makes it use ``omp_threads`` unpinned instead.
            port: HTTP port on 127.0.0.1; None picks a free one.
            seed: ``--seed`` (the dummy weights).
            model_name: served model name; default the directory's name.
            work_dir: where the log, the IPC sockets and vLLM's cache go; None makes a
                temporary directory that :meth:`stop` removes (kept if startup fails, for the
                log). IPC socket paths must stay under 100 bytes.
            vllm_python: the vLLM environment's interpreter; default :func:`find_vllm_python`.
            startup_timeout: seconds to wait for ``/health``.
            stop_timeout: seconds between SIGTERM and SIGKILL.
            extra_args: more ``api_server`` arguments, appended.

        Raises:
            ValueError: a bad size (block size not a positive multiple of 32, a cache smaller
                than ``max_model_len``, ...), or a work dir too long for IPC paths.
            FileNotFoundError: the model directory lacks ``config.json``/``tokenizer.json``,
                or there is no vLLM environment.
        """
        self.model_dir = Path(model_dir).resolve()
        for required in ("config.json", "tokenizer.json"):
            if not (self.model_dir / required).is_file():
                raise FileNotFoundError(
                    f"model_dir {self.model_dir} has no {required}; run prepare_model_dir first"
                )
        if not isinstance(block_size, int) or block_size <= 0 or block_size % 32:
            raise ValueError(
                f"block_size must be a positive multiple of 32 (vLLM CPU), got {block_size!r}"
            )
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if num_gpu_blocks is not None and num_gpu_blocks * block_size < max_model_len:
            raise ValueError(
                f"num_gpu_blocks ({num_gpu_blocks}) x block_size ({block_size}) must hold "
                f"max_model_len ({max_model_len}) tokens"
            )
        if kv_cache_space_gib <= 0:
            raise ValueError(f"kv_cache_space_gib must be a positive int, got {kv_cache_space_gib}")
        if omp_threads <= 0:
            raise ValueError(f"omp_threads must be positive, got {omp_threads}")
        self._requested_work_dir = Path(work_dir).resolve() if work_dir is not None else None
        if self._requested_work_dir is not None:
            self._check_ipc_path_length(self._requested_work_dir)
        python = Path(vllm_python) if vllm_python is not None else find_vllm_python()
        if python is None or not python.is_file():
            looked_at = vllm_python or os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON
            raise FileNotFoundError(
                f"no vLLM environment ({looked_at}); run scripts/setup-vllm-env.sh or set "
                f"{VLLM_PYTHON_ENV}"
            )
        self.vllm_python = python
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.kv_cache_space_gib = kv_cache_space_gib
        self.omp_threads = omp_threads
        self.seed = seed
        self.model_name = model_name or self.model_dir.name
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = tuple(extra_args)
        self._requested_port = port
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self._process: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._log_file: IO[bytes] | None = None
        self.work_dir: Path | None = None
        self.port: int | None = None
        self.startup_seconds: float | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    @staticmethod
    def _check_ipc_path_length(work_dir: Path) -> None:
        longest = f"ipc://{work_dir}/kv-replay.ipc"
        if len(str(work_dir)) + len("/kv-replay.ipc") > 100:
            raise ValueError(f"work_dir too long for a unix socket path: {longest!r}")

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The API server's process id, also its process group id (kept after :meth:`stop`, to
        check that the group is gone); None before the first start."""
        return self._pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._require_started().port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"ipc://{self._require_started().work_dir}/kv-events.ipc"

    @property
    def replay_endpoint(self) -> str:
        return f"ipc://{self._require_started().work_dir}/kv-replay.ipc"

    @property
    def log_path(self) -> Path:
        return self._require_started().work_dir / "server.log"  # type: ignore[operator]

    def _require_started(self) -> VllmCpuServer:
        if self.work_dir is None or self.port is None:
            raise RuntimeError("the server has not been started (use start() or `with`)")
        return self

    def command(self) -> list[str]:
        """The server's command line (valid after the port and work dir are chosen)."""
        kv_events_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_events_endpoint,
            "topic": self.kv_events_topic,
            "replay_endpoint": self.replay_endpoint,
        }
        args = [
            str(self.vllm_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model_name,
            "--load-format",
            "dummy",
            "--dtype",
            "bfloat16",
            "--seed",
            str(self.seed),
            "--enable-prefix-caching",
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--kv-events-config",
            json.dumps(kv_events_config),
        ]
        if self.num_gpu_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        return args + list(self.extra_args)

    def _environment(self) -> dict[str, str]:
        assert self.work_dir is not None
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
                "OMP_NUM_THREADS": str(self.omp_threads),
                "VLLM_CACHE_ROOT": str(self.work_dir / "vllm-cache"),
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        # A virtualenv activated in the caller must not leak into the engine's interpreter.
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(key, None)
        return env

    def start(self) -> VllmCpuServer:
        """Start the server and wait until ``/health`` answers 200.

        Returns:
            self.

        Raises:
            RuntimeError: already running, or the server exited during startup (message has
                the exit status and the log's last lines).
            TimeoutError: no healthy answer within ``startup_timeout`` (the server is stopped;
                message has the log's last lines).
        """
        if self._process is not None:
            raise RuntimeError(f"server already started (pid {self._process.pid})")
        if self._requested_work_dir is not None:
            self.work_dir = self._requested_work_dir
            self.work_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.work_dir = Path(tempfile.mkdtemp(prefix="vllm-cpu-"))
        self._check_ipc_path_length(self.work_dir)
        self.port = self._requested_port or _free_port()
        began = time.monotonic()
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log_file = log_file
        command = self.command()
        logger.info("starting vLLM CPU server on %s: %s", self.base_url, " ".join(command))
        try:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self.work_dir,
                env=self._environment(),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            self._pid = self._process.pid
            atexit.register(self.stop)
            self._wait_healthy(began)
        except BaseException:
            self.stop(remove_work_dir=False)
            raise
        self.startup_seconds = time.monotonic() - began
        logger.info("vLLM CPU server ready in %.1f s (pid %d)", self.startup_seconds, self.pid)
        return self

    def _wait_healthy(self, began: float) -> None:
        assert self._process is not None
        deadline = began + self.startup_timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                status = self._process.poll()
                if status is not None:
                    raise RuntimeError(
                        f"vLLM CPU server exited with status {status} during startup; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"vLLM CPU server not healthy after {self.startup_timeout:.0f} s; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log ("" before start)."""
        if self.work_dir is None or not self.log_path.is_file():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 64 * 1024))
            text = log.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, remove_work_dir: bool = True) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after ``stop_timeout``.

        Idempotent. Removes the temporary work dir unless the caller chose it or
        ``remove_work_dir`` is False.
        """
        atexit.unregister(self.stop)
        process = self._process
        if process is not None:
            pgid = process.pid  # start_new_session: the server leads its own group
            self._signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout
            while time.monotonic() < deadline:
                process.poll()
                if process.returncode is not None and not process_group_members(pgid):
                    break
                time.sleep(0.2)
            else:
                logger.warning("vLLM CPU server group %d ignored SIGTERM; sending SIGKILL", pgid)
                self._signal_group(pgid, signal.SIGKILL)
                process.wait()
                kill_deadline = time.monotonic() + 5.0
                while process_group_members(pgid) and time.monotonic() < kill_deadline:
                    time.sleep(0.1)
            self._process = None
            logger.info("vLLM CPU server stopped (status %s)", process.returncode)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if (
            remove_work_dir
            and self.work_dir is not None
            and self._requested_work_dir is None
            and self.work_dir.exists()
        ):
            shutil.rmtree(self.work_dir, ignore_errors=True)

    @staticmethod
    def _signal_group(pgid: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signum)

    def __enter__(self) -> VllmCpuServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- requests -----------------------------------------------------------------------------

    def tokenize(
        self,
        prompt: str | Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids the server prefills for ``prompt``: :func:`tokenize_prompt` with this
        model's tokenizer (no request to the server)."""
        return tokenize_prompt(self.tokenizer, prompt, add_generation_prompt=add_generation_prompt)

    def reset_prefix_cache(self, timeout: float = 10.0) -> None:
        """Drop every cached prefix block (``POST /reset_prefix_cache``, dev mode).

        vLLM then publishes ``AllBlocksCleared`` with its next engine step. The reset fails
        while blocks are held by running requests; it is retried until ``timeout`` seconds.

        Raises:
            RuntimeError: the server kept refusing (requests still running) or answered an
                HTTP error.
        """
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=30.0) as client:
            while True:
                response = client.post(f"{self.base_url}/reset_prefix_cache")
                if response.status_code != 200:
                    raise RuntimeError(
                        f"POST /reset_prefix_cache answered {response.status_code}: "
                        f"{response.text[:200]}"
                    )
                if response.json().get("success", False):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"prefix cache not reset within {timeout} s (requests still hold blocks)"
                    )
                time.sleep(0.2)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m contextpilot_integrations.engines.vllm_cpu",
        description="Prepare and serve a random-weights model on vLLM's CPU build.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    prepare = commands.add_parser("prepare", help="write the model directory (no download)")
    prepare.add_argument("--dir", required=True, type=Path, help="model directory to write")
    prepare.add_argument("--seed", type=int, default=0)
    prepare.add_argument("--hidden", type=int, default=512)
    prepare.add_argument("--layers", type=int, default=8)
    prepare.add_argument("--heads", type=int, default=8)
    prepare.add_argument("--kv-heads", type=int, default=2)
    prepare.add_argument("--intermediate", type=int, default=1024)
    prepare.add_argument("--vocab", type=int, default=8192)
    prepare.add_argument("--max-positions", type=int, default=8192)

    serve = commands.add_parser("serve", help="run the server until Ctrl-C")
    serve.add_argument("--dir", required=True, type=Path, help="model directory (prepare first)")
    serve.add_argument("--block-size", type=int, default=128, help="KV block tokens (x32)")
    serve.add_argument("--num-blocks", type=int, default=None, help="fix the KV block count")
    serve.add_argument("--max-model-len", type=int, default=4096)
    serve.add_argument("--kv-cache-gib", type=int, default=1)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--work-dir", type=Path, default=None)
    serve.add_argument("--startup-timeout", type=float, default=240.0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.command == "prepare":
        began = time.monotonic()
        directory = prepare_model_dir(
            args.dir,
            seed=args.seed,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            vocab=args.vocab,
            max_positions=args.max_positions,
        )
        print(f"model dir ready: {directory} ({time.monotonic() - began:.1f} s)")
        return 0
    server = VllmCpuServer(
        args.dir,
        block_size=args.block_size,
        num_gpu_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        kv_cache_space_gib=args.kv_cache_gib,
        port=args.port,
        seed=args.seed,
        work_dir=args.work_dir,
        startup_timeout=args.startup_timeout,
    )
    with server:
        print(f"base_url           {server.base_url}")
        print(f"model              {server.model_name}")
        print(f"kv_events_endpoint {server.kv_events_endpoint} (topic {server.kv_events_topic})")
        print(f"replay_endpoint    {server.replay_endpoint}")
        print(f"log                {server.log_path}")
        print(f"ready in {server.startup_seconds:.1f} s; Ctrl-C to stop", flush=True)
        try:
            while server.running:
                time.sleep(1.0)
        except KeyboardInterrupt:
            print("stopping")
            return 0
        print(f"server exited on its own; log tail:\n{server.log_tail()}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
