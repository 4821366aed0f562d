#!/usr/bin/env bash
# The main job: the benchmark on a real workload with embedded defaults.
# First run creates .venv (a minute or two). Arguments go to contextpilot-bench, e.g.
#   scripts/bench.sh --workload mtrag --mode online --cache-tokens unlimited
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras=bench
[[ " $* " == *" --retriever mem0 "* || " $* " == *" --retriever=mem0 "* ]] && extras=bench,mem0,embeddings
bash "$repo_root/scripts/setup-venv.sh" "$extras"
cd "$repo_root"
exec "$repo_root/.venv/bin/contextpilot-bench" "$@"
