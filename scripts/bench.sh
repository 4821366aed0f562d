#!/usr/bin/env bash
# The main job: the benchmark on a real workload with embedded defaults.
# First run creates .venv (a minute or two). Arguments go to contextpilot-bench, e.g.
#   scripts/bench.sh --workload mtrag --mode online --cache-tokens unlimited
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo_root/scripts/setup-venv.sh" bench
cd "$repo_root"
exec "$repo_root/.venv/bin/contextpilot-bench" "$@"
