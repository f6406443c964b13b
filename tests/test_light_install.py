"""A torch-free install serves proxy mode, with default flags, as a drop-in.

`pip install .` with no extras, into a fresh venv, must bring neither torch nor
transformers (proxy mode needs neither: the target is a vLLM over HTTP, text comes from
the model's tokenizer.json through the light `tokenizers` library). That venv's
`ddtree-proxy serve --target-url URL` -- no other flag -- in front of the session's real
vLLM must give vLLM's own greedy output, pass the differential suite
(tests/differential.py), and make at most 2 auxiliary calls to vLLM (/tokenize,
/detokenize) per request: none per token.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import serving
from differential import Case, Result, compare, generate_cases, observe, report
from metrics import scrape

from benchmarks.upstream import REPO_ROOT, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

HEAVY = ("torch", "transformers")
DIFFERENTIAL_SEED = 20261201  # tests/test_differential.py's CI seed
NUM_CASES = 300
MAX_AUX_CALLS = 2  # per request: a chat template's /tokenize, nothing per token
# What a checkout holds that is not source: venvs, caches and build outputs.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv*", "__pycache__", "*.egg-info", "build", ".*_cache", ".hypothesis"
)


def _pip(venv: Path, *args: str) -> None:
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", *args], capture_output=True, text=True
    )
    assert result.returncode == 0, f"pip {' '.join(args)} failed:\n{result.stderr[-4000:]}"


@pytest.fixture(scope="session")
def light_venv(tmp_path_factory) -> Path:
    """A fresh venv (this interpreter's Python) with `pip install <checkout>`, no extras,
    not editable. pip reuses its cache and may reach the package index."""
    root = tmp_path_factory.mktemp("light")
    source = root / "src"  # a copy, so the build writes nothing into the checkout
    shutil.copytree(REPO_ROOT, source, ignore=NOT_SOURCE)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # Resolve first: a default dependency on torch must fail here, before pip fetches
    # a multi-GB wheel, and name the packages that pulled it in.
    report = root / "resolution.json"
    _pip(venv, "install", "--dry-run", "--quiet", "--report", str(report), str(source))
    resolved = {
        entry["metadata"]["name"].lower(): entry["metadata"].get("requires_dist") or []
        for entry in json.loads(report.read_text())["install"]
    }
    heavy = sorted(set(HEAVY) & set(resolved))
    pullers = sorted(
        {
            name
            for name, requires in resolved.items()
            for req in requires
            if "extra ==" not in req and re.match(r"[A-Za-z0-9._-]+", req)[0].lower() in HEAVY
        }
    )
    assert not heavy, f"`pip install .` would install {heavy} (required by {pullers})"
    _pip(venv, "install", "--quiet", str(source))
    return venv


def test_heavy_packages_are_not_installed(light_venv):
    for module in HEAVY:
        probe = subprocess.run(
            [str(light_venv / "bin" / "python"), "-c", f"import {module}"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, module


@pytest.fixture(scope="module")
def light_proxy(light_venv, vllm_server, tmp_path_factory):
    """The light venv's `ddtree-proxy serve --target-url URL`, default flags otherwise:
    (its URL, its log)."""
    port = free_port()
    log = tmp_path_factory.mktemp("light-proxy") / "proxy.log"
    command = [str(light_venv / "bin" / "ddtree-proxy"), "serve", "--target-url",
               vllm_server.url, "--port", str(port)]  # fmt: skip
    with serving(command, port, log) as url:
        yield url, log


def aux_calls(url: str) -> dict[str, float]:
    """The proxy's ddtree_upstream_aux_calls_total by path."""
    return {
        sample.labels["path"]: sample.value
        for sample in scrape(url).samples
        if sample.name == "ddtree_upstream_aux_calls_total"
    }


def test_start_up_names_the_local_tokenizer(light_proxy, vllm_server):
    _, log = light_proxy
    assert f"text: tokenizer.json in {vllm_server.model_dir} (served path)" in log.read_text()


def test_light_install_serves_proxy_mode_losslessly(light_proxy, vllm_server):
    url, _ = light_proxy
    tokenized = httpx.post(
        f"{vllm_server.url}/tokenize",
        json={"model": vllm_server.model, "prompt": "def add(a, b):\n    return a + b\n"},
        timeout=60,
    )
    tokenized.raise_for_status()
    token_prompt = tokenized.json()["tokens"]
    for prompt in (token_prompt, "import os\nimport sys\n\ndef main("):
        body = {"model": vllm_server.model, "prompt": prompt, "max_tokens": 24,
                "temperature": 0, "return_token_ids": True}  # fmt: skip
        direct = httpx.post(f"{vllm_server.url}/v1/completions", json=body, timeout=120)
        proxied = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert direct.status_code == proxied.status_code == 200, proxied.text
        (want,), (got,) = direct.json()["choices"], proxied.json()["choices"]
        assert got["token_ids"] == want["token_ids"], prompt
        assert got["text"] == want["text"], prompt
        assert len(want["token_ids"]) > 0


def _send(url: str, case: Case):
    kwargs = (
        {"content": case.body, "headers": {"content-type": "application/json"}}
        if isinstance(case.body, bytes)
        else {"json": case.body}
    )
    response = httpx.post(url + case.path, timeout=300, **kwargs)
    return observe(case, response.status_code, response.headers.get("content-type", ""),
                   response.content)  # fmt: skip


def test_differential_suite_with_at_most_two_aux_calls_per_request(light_proxy, vllm_server):
    """The differential suite's CI cases, one at a time so that the proxy's /metrics tells
    each request's auxiliary calls apart: every answer as vLLM's (less docs/FIDELITY.md's
    intended differences), at most MAX_AUX_CALLS per request, none to /detokenize."""
    url, _ = light_proxy
    vocab_size = json.loads((vllm_server.model_dir / "config.json").read_text())["vocab_size"]
    max_model_len = httpx.get(vllm_server.url + "/v1/models").json()["data"][0]["max_model_len"]
    cases = generate_cases(DIFFERENTIAL_SEED, NUM_CASES, vllm_server.model, vocab_size,
                           max_model_len)  # fmt: skip
    results, calls = [], []
    for case in cases:
        want = _send(vllm_server.url, case)
        before = aux_calls(url)
        got = _send(url, case)
        after = aux_calls(url)
        calls.append({path: after[path] - before.get(path, 0.0) for path in after})
        results.append(Result(case, want, got, compare(case, want, got)))
    text = report(results)
    most = max(sum(per.values()) for per in calls)
    print(f"\n[light install, default flags] most auxiliary calls per request: {most}\n{text}")
    assert [r for r in results if r.diffs] == [], text
    over = [(c.labels, n) for c, n in zip(cases, calls, strict=True) if sum(n.values()) > 2]
    assert most <= MAX_AUX_CALLS, over
    # Completion prompts are tokenized here; a chat prompt's template is vLLM's, once.
    by_endpoint: dict[str, set[tuple[float, float]]] = {"completions": set(), "chat": set()}
    for case, per in zip(cases, calls, strict=True):
        by_endpoint[case.endpoint].add((per["/tokenize"], per["/detokenize"]))
    assert by_endpoint == {"completions": {(0, 0)}, "chat": {(0, 0), (1, 0)}}, by_endpoint
    labels = {label for case in cases for label in case.labels}
    assert labels >= {"stream", "logprobs", "stop", "sampled", "token_id_prompt"}, labels
