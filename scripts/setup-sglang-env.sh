#!/usr/bin/env bash
# Creates (or reuses) /work/main/.venv-sglang: the environment of the `sglang` test tier.
#
# It holds the real SGLang 0.5.23 code without its GPU dependencies (see
# docs/DESIGN.md, "SGLang KV events"):
#   - sglang==0.5.23 installed --no-deps;
#   - torch==2.13.0, which resolves to the CPU wheel on these machines (checked below);
#   - the packages SGLang needs at import time;
#   - this package, editable, with what its sync tests need.
#   - the KV-event module of SGLang 0.5.18 (the last release with the positional wire shape),
#     extracted from its wheel to $venv/sglang-0.5.18/kv_events.py; the tier runs its real
#     publisher beside 0.5.23's (the module imports only msgspec, pyzmq and pydantic).
# torchvision is never installed: PyPI's build is CUDA-only and swaps in CUDA torch. The tier
# provides an import-time stand-in instead (a meta-path finder in tests/sync/conftest.py).
#
# Idempotent: a stamp file records the hash of this script; when it matches and the environment
# still imports, nothing is installed again.
#
# Usage: bash scripts/setup-sglang-env.sh        (then: .venv-sglang/bin/python -m pytest -m sglang tests/sync)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SGLANG_VENV:-$repo_root/.venv-sglang}"
python_bin="${PYTHON:-python3.11}"
stamp="$venv/.contextpilot-setup-stamp"
script_hash="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"

if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$script_hash" ]] \
    && [[ -f "$venv/sglang-0.5.18/kv_events.py" ]] \
    && "$venv/bin/python" -c "import sglang, torch, zmq, msgspec, contextpilot_integrations" 2>/dev/null; then
    echo "setup-sglang-env: reusing $venv"
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    echo "setup-sglang-env: creating $venv"
    "$python_bin" -m venv "$venv"
fi
# pip reports the pins of sglang's GPU requirements as conflicts (it is installed --no-deps on
# purpose) and the local index prints location warnings: keep the log to what matters.
pip() {
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2> >(
        grep -v -e "^WARNING: Location" -e "^sglang 0.5.23 requires" \
            -e "dependency resolver does not currently" >&2 || true
    )
}

# Pin torch for every later resolution so that no dependency can swap in a CUDA build, and make
# any request for torchvision fail loudly instead of installing it.
constraints="$venv/contextpilot-constraints.txt"
printf 'torch==2.13.0\ntorchvision==0.0.0.dev0\n' > "$constraints"

pip "torch==2.13.0"
pip --no-deps "sglang==0.5.23"
# Import-time needs of sglang.srt.mem_cache and sglang.srt.disaggregation.kv_events.
pip -c "$constraints" \
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq \
    tqdm IPython aiohttp dill transformers tokenizers safetensors huggingface_hub regex pyyaml \
    triton apache-tvm-ffi sentencepiece compressed-tensors loguru gguf
# This package and the test tooling of the sync tests.
pip -c "$constraints" -e "$repo_root" scipy pytest pytest-timeout pytest-asyncio hypothesis

old_module="$venv/sglang-0.5.18/kv_events.py"
if [[ ! -f "$old_module" ]]; then
    download="$(mktemp -d)"
    "$venv/bin/python" -m pip download --quiet --no-deps --dest "$download" "sglang==0.5.18" \
        2> >(grep -v "^WARNING: Location" >&2 || true)
    mkdir -p "$(dirname "$old_module")"
    "$venv/bin/python" - "$download" "$old_module" <<'PY'
import pathlib
import sys
import zipfile

download, target = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = download.glob("sglang-0.5.18-*.whl")
with zipfile.ZipFile(wheel) as archive:
    target.write_bytes(archive.read("sglang/srt/disaggregation/kv_events.py"))
PY
    rm -rf "$download"
fi

"$venv/bin/python" - <<'PY'
import importlib.metadata as md

import torch

assert torch.version.cuda is None, f"torch must be the CPU build, got cuda={torch.version.cuda}"
assert md.version("sglang") == "0.5.23", md.version("sglang")
try:
    md.version("torchvision")
except md.PackageNotFoundError:
    pass
else:
    raise SystemExit("torchvision must not be installed in .venv-sglang")
print("setup-sglang-env: torch", torch.__version__, "sglang", md.version("sglang"))
PY
echo "$script_hash" > "$stamp"
echo "setup-sglang-env: ready at $venv"
