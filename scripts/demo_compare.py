"""Send one completion through the proxy and the same one straight to vLLM; print both.

Used by scripts/demo.sh once the stack is up. Greedy, so the two texts must match.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx


def _complete(url: str, body: dict, timeout: float) -> tuple[dict, float]:
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        sys.exit(f"demo: {url} answered {response.status_code}: {response.text[:500]}")
    return response.json(), elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--proxy-url", required=True)
    parser.add_argument("--vllm-url", required=True)
    parser.add_argument("--model", default=None, help="the model vLLM serves (default: its first)")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()

    model = args.model or httpx.get(f"{args.vllm_url}/v1/models").json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }
    # One untimed request each first: the first call pays for warm-up on both sides.
    _complete(args.vllm_url, {**body, "max_tokens": 4}, args.timeout)
    _complete(args.proxy_url, {**body, "max_tokens": 4}, args.timeout)
    direct, direct_s = _complete(args.vllm_url, body, args.timeout)
    proxied, proxied_s = _complete(args.proxy_url, body, args.timeout)

    text = proxied["choices"][0]["text"]
    ddtree = proxied.get("usage", {}).get("ddtree", {})
    num_tokens = proxied.get("usage", {}).get("completion_tokens", 0)
    print(args.prompt + text)
    print("-" * 60)
    same = text == direct["choices"][0]["text"]
    print(f"identical to vLLM's own output: {same}")
    print(
        f"DDTree via proxy : {proxied_s:.2f} s, {num_tokens} tokens, "
        f"{ddtree.get('rounds')} rounds, mean acceptance length (tau) "
        f"{ddtree.get('mean_acceptance_length')}, upstream calls {ddtree.get('upstream_calls')}, "
        f"draft-server calls {ddtree.get('draft_calls')}"
    )
    print(f"vLLM direct      : {direct_s:.2f} s")
    print(f"proxy / direct wall-clock: {proxied_s / direct_s:.2f}x  (CPU-only machine; see README)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
