"""A torch-free install serves proxy mode.

`pip install .` with no extras, into a fresh venv, must bring neither torch nor
transformers (proxy mode needs neither: the target is a vLLM over HTTP, tokenising is
vLLM's /tokenize), and that venv's `ddtree-proxy serve --target-url ... --drafter ngram`
must give the session's real vLLM's own greedy output, token for token and text for text.
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

from benchmarks.upstream import REPO_ROOT, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

HEAVY = ("torch", "transformers")
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


def test_light_install_serves_proxy_mode_losslessly(light_venv, vllm_server, tmp_path):
    port = free_port()
    command = [str(light_venv / "bin" / "ddtree-proxy"), "serve", "--target-url",
               vllm_server.url, "--drafter", "ngram", "--port", str(port)]  # fmt: skip
    tokenized = httpx.post(
        f"{vllm_server.url}/tokenize",
        json={"model": vllm_server.model, "prompt": "def add(a, b):\n    return a + b\n"},
        timeout=60,
    )
    tokenized.raise_for_status()
    token_prompt = tokenized.json()["tokens"]
    with serving(command, port, tmp_path / "proxy.log") as url:
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
