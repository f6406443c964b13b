#!/usr/bin/env bash
# The main job on the embedded default: set up, then generate with DDTree in engine
# mode (the shipped tiny target + its DFlash drafter, no vLLM needed), printing the
# text and the per-request stats. Extra arguments go to `ddtree-proxy generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ddtree-proxy generate --prompt "def fibonacci(n):" --max-tokens 96 "$@"
