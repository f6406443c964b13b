#!/usr/bin/env bash
# vLLM's router (the `vllm-router` package) in its own venv, for the test of the proxy's
# --session-header behind a session-affinity router (tests/test_replicas_vllm.py).
#
#   scripts/vllm_router.sh install     # idempotent: a working install returns at once
#
# Environment knob: ROUTER_VENV (default <repo>/.venv-router).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${ROUTER_VENV:-$REPO_ROOT/.venv-router}"
VERSION="0.1.17"

case "${1:-}" in
  install)
    if [ -x "$VENV/bin/vllm-router" ] && "$VENV/bin/python" -c \
        "import importlib.metadata as m; assert m.version('vllm-router') == '$VERSION'" 2>/dev/null; then
      exit 0
    fi
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet "vllm-router==$VERSION"
    ;;
  *)
    echo "usage: $0 install" >&2
    exit 2
    ;;
esac
