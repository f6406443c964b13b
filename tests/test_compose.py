"""docker-compose.yml and the Dockerfile, checked without Docker: the services, images,
ports, health checks and start order, and that the proxy's command line (with the
environment compose gives it) parses with our real CLI parser into valid settings."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from proxy.cli import build_parser
from proxy.server.app import settings_from_args
from proxy.server.settings import ServerSettings

REPO_ROOT = Path(__file__).resolve().parents[1]
STACKS = {"gpu": ("vllm", "proxy"), "cpu": ("vllm-cpu", "proxy-cpu")}


def _expand(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default} interpolation."""
    if isinstance(value, str):
        pattern = r"\$\{(\w+)(?:(:?-)([^}]*))?\}"
        return re.sub(pattern, lambda m: env.get(m.group(1)) or (m.group(3) or ""), value)
    if isinstance(value, list):
        return [_expand(item, env) for item in value]
    if isinstance(value, dict):
        return {key: _expand(item, env) for key, item in value.items()}
    return value


@pytest.fixture(scope="module")
def services() -> dict:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    return _expand(compose["services"], env={})


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _container_ports(service: dict) -> dict[int, str]:
    """container port -> host address it is published on."""
    published = {}
    for spec in service["ports"]:
        host_ip, host_port, container_port = spec.split(":")
        assert host_port == container_port
        published[int(container_port)] = host_ip
    return published


def _health_port(service: dict) -> int:
    test = " ".join(service["healthcheck"]["test"])
    match = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)/health", test)
    assert match, test
    return int(match.group(1))


def _mounts(service: dict) -> dict[str, str]:
    return {spec.split(":")[1]: spec.split(":")[0] for spec in service["volumes"]}


def test_services_and_profiles(services):
    assert set(services) == {name for stack in STACKS.values() for name in stack}
    for profile, names in STACKS.items():
        for name in names:
            assert services[name]["profiles"] == [profile]


def test_images(services):
    assert services["vllm"]["image"].startswith("vllm/vllm-openai:v")
    assert "vllm-cpu-release-repo:v" in services["vllm-cpu"]["image"]
    gpu = services["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert "deploy" not in services["vllm-cpu"]
    for proxy in ("proxy", "proxy-cpu"):
        assert services[proxy]["build"] == "." and services[proxy]["image"] == "ddtree-proxy:latest"


@pytest.mark.parametrize("profile", list(STACKS))
def test_vllm_service(services, profile):
    vllm = services[STACKS[profile][0]]
    command = vllm["command"]
    port = int(_flag(command, "--port"))
    assert _health_port(vllm) == port
    assert _container_ports(vllm) == {port: "127.0.0.1"}  # loopback unless asked
    assert "--enable-prefix-caching" in command  # verification depends on the prefix cache
    block_size = int(_flag(command, "--block-size"))
    assert block_size % (32 if profile == "cpu" else 16) == 0
    if profile == "cpu":  # seeded requests must never be split by chunked prefill there
        assert "--no-enable-chunked-prefill" in command
    model = _flag(command, "--model")
    assert any(model.startswith(mount + "/") for mount in _mounts(vllm))
    health = vllm["healthcheck"]
    assert health["retries"] >= 3 and health["start_period"].endswith("s")


@pytest.mark.parametrize("profile", list(STACKS))
def test_proxy_service_command_parses(services, profile):
    vllm_name, proxy_name = STACKS[profile]
    vllm, proxy = services[vllm_name], services[proxy_name]
    assert proxy["depends_on"] == {vllm_name: {"condition": "service_healthy"}}
    args = build_parser().parse_args(proxy["command"])
    assert args.command == "serve"
    env = {key: str(value) for key, value in proxy["environment"].items()}
    settings = settings_from_args(args, env=env)
    assert isinstance(settings, ServerSettings) and settings.proxy_mode
    upstream = urlparse(settings.target_url)
    assert upstream.hostname == vllm_name
    assert upstream.port == int(_flag(vllm["command"], "--port"))
    assert settings.model == _flag(vllm["command"], "--served-model-name")
    assert settings.host == "0.0.0.0"  # reachable from the host through the published port
    assert _container_ports(proxy) == {settings.port: "127.0.0.1"}
    assert _health_port(proxy) == settings.port
    assert settings.api_key is None and settings.drafter == "ngram"
    # The tokenizer dir is the model vLLM serves, mounted into both containers alike.
    assert _mounts(proxy) == _mounts(vllm)
    assert settings.tokenizer == _flag(vllm["command"], "--model")
    assert settings.tree.budget == 16 and settings.strategy == "nodes"


def test_compose_environment_overrides(services):
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    env = {"DDTREE_API_KEY": "k", "DDTREE_BUDGET": "64", "DDTREE_PUBLISH": "0.0.0.0"}
    proxy = _expand(compose["services"]["proxy"], env)
    args = build_parser().parse_args(proxy["command"])
    settings = settings_from_args(args, env={k: str(v) for k, v in proxy["environment"].items()})
    assert settings.api_key == "k" and settings.tree.budget == 64
    assert _container_ports(proxy) == {8080: "0.0.0.0"}


def test_dockerfile_matches_the_package():
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    (script,) = pyproject["project"]["scripts"]
    assert f'ENTRYPOINT ["{script}"]' in dockerfile
    assert re.search(r"^EXPOSE 8080$", dockerfile, re.M)
    assert "DDTREE_PORT=8080" in dockerfile and "DDTREE_HOST=0.0.0.0" in dockerfile
    # The default image has no torch; the engine extra's torch comes from the CPU index,
    # pinned like pyproject pins it.
    assert not any(dep.startswith("torch") for dep in pyproject["project"]["dependencies"])
    engine = pyproject["project"]["optional-dependencies"]["engine"]
    (torch_pin,) = [dep for dep in engine if dep.startswith("torch")]
    assert f'"{torch_pin}"' in dockerfile and "download.pytorch.org/whl/cpu" in dockerfile
    assert re.search(r"^ARG EXTRAS=tokenizer$", dockerfile, re.M)
    for source in re.findall(r"^COPY (.+) \./", dockerfile, re.M):
        for path in source.split():
            assert (REPO_ROOT / path).exists(), path
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".venv-vllm", ".git"} <= set(ignored)
