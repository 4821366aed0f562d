#!/usr/bin/env bash
# Creates (or reuses) .venv: the library and the benchmark (benchmarks/), both editable, with
# the library's extras named in $1 and the benchmark's in $2 (both may be empty), e.g.
#   bash scripts/setup-venv.sh all,dev testbed,mem0,hosted     (what the tests use)
#   bash scripts/setup-venv.sh "" ""                           (the main job)
# torch is pinned to 2.13.0 in the extras that need it (the CPU wheel on these machines; an
# unpinned torch pulls a multi-GB CUDA build). Idempotent: a stamp records the extras and the
# hash of both pyproject.toml files and this script.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
library_extras="${1:-}"
bench_extras="${2:-}"
venv="$repo_root/.venv"
python_bin="${PYTHON:-python3}"
stamp="$venv/.contextpilot-stamp-${library_extras//,/-}--${bench_extras//,/-}"
want="$(cat "$repo_root/pyproject.toml" "$repo_root/benchmarks/pyproject.toml" "${BASH_SOURCE[0]}" \
    | sha256sum | cut -d' ' -f1)"

if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
if [[ ! -x "$venv/bin/python" ]]; then
    echo "setup-venv: creating $venv" >&2
    "$python_bin" -m venv "$venv"
fi
library="$repo_root"
bench="$repo_root/benchmarks"
[[ -n "$library_extras" ]] && library="$library[$library_extras]"
[[ -n "$bench_extras" ]] && bench="$bench[$bench_extras]"
echo "setup-venv: installing contextpilot-integrations[$library_extras]" \
    "and contextpilot-bench[$bench_extras]" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -e "$library" -e "$bench" >&2
echo "$want" > "$stamp"
