#!/usr/bin/env bash
# Creates (or reuses) .venv: this package, editable, with the extras named in $1 (default
# "bench"), e.g. `bash scripts/setup-venv.sh all,dev`.
# torch is pinned to 2.13.0 in the extras that need it (the CPU wheel on these machines; an
# unpinned torch pulls a multi-GB CUDA build). Idempotent: a stamp records the extras and the
# hash of pyproject.toml.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-bench}"
venv="$repo_root/.venv"
python_bin="${PYTHON:-python3}"
stamp="$venv/.contextpilot-stamp-${extras//,/-}"
want="$(cat "$repo_root/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"

if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
if [[ ! -x "$venv/bin/python" ]]; then
    echo "setup-venv: creating $venv" >&2
    "$python_bin" -m venv "$venv"
fi
echo "setup-venv: installing contextpilot-integrations[$extras]" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -e "$repo_root[$extras]" >&2
echo "$want" > "$stamp"
