"""Where the engine harness finds what lives outside the package: the Python that runs vLLM and
the cache of prepared model directories.

The package may run from a source checkout (``pip install -e .``) or be installed from a wheel;
neither location is assumed.

The Python that runs vLLM (vLLM's CPU build sits in its own environment: its torch pins clash
with the benchmark's), first found of:

1. an explicit path: the ``python`` argument (``VllmCpuServer(vllm_python=...)``,
   ``contextpilot-bench --engine-python``, ``python -m contextpilot_integrations.engines serve
   --vllm-python``);
2. ``$CONTEXTPILOT_VLLM_PYTHON``;
3. ``.venv-vllm/bin/python`` in the source checkout the package runs from, when present
   (``scripts/setup-vllm-env.sh`` makes it);
4. the running interpreter, when it can import ``vllm``.

An explicit path or the environment variable is taken as given: when it does not name an
executable there is no vLLM Python (nothing else is tried behind the user's back).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

__all__ = [
    "VLLM_PYTHON_ENV",
    "default_model_dir",
    "find_vllm_python",
    "require_vllm_python",
    "source_checkout",
]

VLLM_PYTHON_ENV = "CONTEXTPILOT_VLLM_PYTHON"
"""Environment variable naming the Python that runs vLLM."""

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def source_checkout() -> Path | None:
    """The root of the source checkout the package runs from (the directory holding its
    ``pyproject.toml``), or None for an installed package."""
    project = _PACKAGE_ROOT / "pyproject.toml"
    if not project.is_file():
        return None
    try:
        text = project.read_text(encoding="utf-8")
    except OSError:
        return None
    return _PACKAGE_ROOT if 'name = "contextpilot-integrations"' in text else None


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


def default_model_dir(name: str = "vllm-model") -> Path:
    """Where a prepared model directory is cached: ``.cache/contextpilot/<name>`` in the source
    checkout, else under ``$XDG_CACHE_HOME`` (default ``~/.cache``) ``/contextpilot/<name>``."""
    checkout = source_checkout()
    if checkout is not None:
        return checkout / ".cache" / "contextpilot" / name
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "contextpilot" / name
