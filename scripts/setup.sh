#!/usr/bin/env bash
# Create .venv with the project, its engine extra (torch, transformers) and the dev
# tools. Idempotent: a rerun with an unchanged pyproject.toml takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
stamp=.venv/.ddtree-setup-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi

echo "[setup] creating .venv (first run takes a few minutes)" >&2
"$python" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch==2.13.0 CPU: use the wheel on disk when there is one; PyPI's default build is
# a multi-GB CUDA one.
find_links=()
for dir in /opt/wheels "$HOME/wheels"; do
    if ls "$dir"/torch-2.13.0+cpu*.whl >/dev/null 2>&1; then
        find_links=(--find-links "$dir")
        break
    fi
done
if [ ${#find_links[@]} -eq 0 ]; then
    wheel=$(find / -name 'torch-2.13.0+cpu*.whl' -print -quit 2>/dev/null || true)
    [ -n "$wheel" ] && find_links=(--find-links "$(dirname "$wheel")")
fi
.venv/bin/pip install -q "${find_links[@]}" -e '.[engine,dev]'
echo "$want" > "$stamp"
echo "[setup] done" >&2
