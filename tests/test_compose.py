"""docker-compose.yml (+ docker-compose.gpu.yml) and the Dockerfile, checked without
Docker: the three services (target vLLM, draft vLLM, proxy), images, ports, health
checks and start order, the vLLM-CPU capabilities, read-only model mounts, and that the
proxy's command line (with the environment compose gives it) parses with our real CLI
parser into valid settings whose drafter is the draft vLLM. The GPU stack is the base
file with the override merged as compose merges it. The Dockerfile: a pinned base image,
the dependency layer before the source, no models in the image, and a health check that
follows the configured port (run as written against a local server)."""

from __future__ import annotations

import json
import os
import posixpath
import re
import subprocess
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from proxy.cli import build_parser, settings_from_args
from proxy.drafter import parse_drafter_spec
from proxy.drafter.served import ServedOptions
from proxy.runtime import DEFAULT_TARGET_DIR
from proxy.runtime import REPO_ROOT as RUNTIME_REPO_ROOT
from proxy.server.settings import ServerSettings, env_var

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"vllm", "vllm-draft", "proxy"}  # target vLLM, draft vLLM, ddtree-proxy
GPU_OVERRIDE = "docker-compose.gpu.yml"


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


def _merge(base, override):
    """Compose's merge of an override file, for the keys these files use: mappings
    merge key by key, anything else (command, image, device lists) is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base[key], value) if key in base else value
        return merged
    return override


def _load(*files: str, env: dict[str, str] | None = None) -> dict:
    merged: dict = {}
    for name in files:
        merged = _merge(merged, yaml.safe_load((REPO_ROOT / name).read_text())["services"])
    return _expand(merged, env or {})


STACKS = {"cpu": ("docker-compose.yml",), "gpu": ("docker-compose.yml", GPU_OVERRIDE)}


@pytest.fixture(scope="module", params=list(STACKS))
def stack(request) -> tuple[str, dict]:
    return request.param, _load(*STACKS[request.param])


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _container_ports(service: dict) -> dict[int, tuple[str, int]]:
    """container port -> (host address, host port) it is published on."""
    published = {}
    for spec in service["ports"]:
        host_ip, host_port, container_port = spec.split(":")
        published[int(container_port)] = (host_ip, int(host_port))
    return published


def _health_port(service: dict) -> int:
    test = " ".join(service["healthcheck"]["test"])
    match = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)/health", test)
    assert match, test
    return int(match.group(1))


def _mounts(service: dict) -> dict[str, str]:
    return {spec.split(":")[1]: spec.split(":")[0] for spec in service["volumes"]}


def test_plain_up_starts_the_three_service_stack():
    """`docker compose up` with no profile or flag starts everything (the CPU demo)."""
    services = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    assert set(services) == SERVICES
    assert not any("profiles" in service for service in services.values())
    override = yaml.safe_load((REPO_ROOT / GPU_OVERRIDE).read_text())["services"]
    assert set(override) <= SERVICES  # it only changes services, it adds none


def test_images(stack):
    profile, services = stack
    for name in ("vllm", "vllm-draft"):
        image = services[name]["image"]
        if profile == "cpu":
            assert "vllm-cpu-release-repo:v" in image and "deploy" not in services[name]
        else:
            assert image.startswith("vllm/vllm-openai:v")
            (gpu,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
            assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert services["proxy"]["build"] == "." and services["proxy"]["image"] == "ddtree-proxy:latest"


@pytest.mark.parametrize("name", ["vllm", "vllm-draft"])
def test_vllm_services(stack, name):
    profile, services = stack
    vllm = services[name]
    command = vllm["command"]
    port = int(_flag(command, "--port"))
    assert _health_port(vllm) == port
    host_ip, _ = _container_ports(vllm)[port]
    assert host_ip == "127.0.0.1"  # loopback unless asked
    assert "--enable-prefix-caching" in command  # verification and drafting rely on it
    block_size = int(_flag(command, "--block-size"))
    assert block_size % (32 if profile == "cpu" else 16) == 0
    if profile == "cpu" and name == "vllm":  # seeded node prompts: no chunked prefill
        assert "--no-enable-chunked-prefill" in command
    model = _flag(command, "--model")
    assert any(model.startswith(mount + "/") for mount in _mounts(vllm))
    health = vllm["healthcheck"]
    assert health["retries"] >= 3 and health["start_period"].endswith("s")
    host_ports = {services[n]["ports"][0].split(":")[1] for n in ("vllm", "vllm-draft", "proxy")}
    assert len(host_ports) == 3  # no two services on one host port


def _proxy_settings(services: dict, monkeypatch: pytest.MonkeyPatch) -> ServerSettings:
    proxy = services["proxy"]
    args = build_parser().parse_args(proxy["command"])
    assert args.command == "serve"
    for key, value in proxy["environment"].items():
        monkeypatch.setenv(key, str(value))
    return settings_from_args(ServerSettings, args)


def test_proxy_service_command_parses(stack, monkeypatch):
    _, services = stack
    vllm, draft, proxy = services["vllm"], services["vllm-draft"], services["proxy"]
    assert proxy["depends_on"] == {
        "vllm": {"condition": "service_healthy"},
        "vllm-draft": {"condition": "service_healthy"},
    }
    settings = _proxy_settings(services, monkeypatch)
    assert isinstance(settings, ServerSettings) and settings.proxy_mode
    upstream = urlparse(settings.target_url)
    assert upstream.hostname == "vllm"
    assert upstream.port == int(_flag(vllm["command"], "--port"))
    assert settings.model == _flag(vllm["command"], "--served-model-name")
    assert settings.host == "0.0.0.0"  # reachable from the host through the published port
    assert _container_ports(proxy) == {settings.port: ("127.0.0.1", 8080)}
    assert _health_port(proxy) == settings.port
    assert settings.api_key is None
    # The drafter is the draft vLLM, asked for no more log-probs than it serves.
    name, spec = parse_drafter_spec(settings.drafter)
    options = ServedOptions.parse(spec)
    assert name == "vllm" and urlparse(options.url).hostname == "vllm-draft"
    assert urlparse(options.url).port == int(_flag(draft["command"], "--port"))
    assert options.top_k <= int(_flag(draft["command"], "--max-logprobs"))
    assert options.top_k >= settings.tree.budget  # a full top-k for the default budget
    # Every model dir is the same host folder, mounted into the three containers alike.
    assert _mounts(proxy) == _mounts(vllm) == _mounts(draft)
    assert settings.tokenizer == _flag(vllm["command"], "--model")
    assert settings.tree.budget == 16 and settings.strategy == "nodes"


def test_compose_environment_overrides(monkeypatch):
    env = {
        "DDTREE_API_KEY": "k",
        "DDTREE_BUDGET": "64",
        "DDTREE_PUBLISH": "0.0.0.0",
        "DDTREE_DRAFTER": "ngram",
        "DDTREE_MODELS": "./gpu-models",
        "DDTREE_DRAFT_DIR": "draft",
        "DDTREE_MODEL_NAME": "qwen3-8b",
    }
    services = _load(*STACKS["gpu"], env=env)
    settings = _proxy_settings(services, monkeypatch)
    assert settings.api_key == "k" and settings.tree.budget == 64 and settings.drafter == "ngram"
    assert _container_ports(services["proxy"]) == {8080: ("0.0.0.0", 8080)}
    assert _flag(services["vllm-draft"]["command"], "--model") == "/models/draft"
    assert settings.model == "qwen3-8b" == _flag(services["vllm"]["command"], "--served-model-name")
    assert _mounts(services["vllm-draft"]) == {"/models": "./gpu-models"}


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


# --- The Dockerfile, instruction by instruction ----------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    instructions = []
    pending = ""
    for line in (REPO_ROOT / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def _copy_sources(arguments: str) -> list[str]:
    """The sources of `COPY [--flags] SRC... DEST`."""
    paths = [word for word in arguments.split() if not word.startswith("--")]
    return paths[:-1]


def _is_under(path: str, folder: str) -> bool:
    path = posixpath.normpath(path)
    return path in (".", folder) or path.startswith(folder + "/")


def _dockerignore() -> set[str]:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    return {line.strip().rstrip("/") for line in lines if line.strip() and not line.startswith("#")}


def test_base_image_is_pinned():
    """A full Python version and the image digest: a rebuild gets the same base, and the
    Python it runs satisfies requires-python."""
    (image,) = [arguments for keyword, arguments in _dockerfile() if keyword == "FROM"]
    match = re.fullmatch(r"python:(\d+\.\d+\.\d+)-slim-(\w+)@sha256:([0-9a-f]{64})", image)
    assert match, f"FROM {image}: want python:X.Y.Z-slim-DISTRO@sha256:DIGEST"
    requires_python = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "requires-python"
    ]
    assert SpecifierSet(requires_python).contains(match.group(1)), (image, requires_python)


def test_dependencies_are_installed_before_the_source():
    """Editing a file under proxy/ reuses the dependency layer: the dependencies are
    installed from pyproject.toml alone, before the source is copied, and the package's
    own install after the source resolves no dependencies."""
    instructions = _dockerfile()

    def first(what: str, matches) -> int:
        found = [idx for idx, (keyword, args) in enumerate(instructions) if matches(keyword, args)]
        assert found, f"no {what} in the Dockerfile"
        return found[0]

    dependencies_at = first(
        "dependency install from pyproject.toml",
        lambda keyword, args: (
            keyword == "RUN" and "pip install" in args and "pyproject.toml" in args
        ),
    )
    source_at = first(
        "COPY of proxy/",
        lambda keyword, args: (
            keyword == "COPY" and any(_is_under(path, "proxy") for path in _copy_sources(args))
        ),
    )
    assert dependencies_at < source_at
    copied_first = {
        path
        for keyword, args in instructions[:dependencies_at]
        if keyword == "COPY"
        for path in _copy_sources(args)
    }
    assert copied_first == {"pyproject.toml"}, copied_first
    installs_after = [
        args
        for keyword, args in instructions[source_at:]
        if keyword == "RUN" and "pip install" in args
    ]
    assert installs_after and all("--no-deps" in args for args in installs_after)


def test_models_are_mounted_not_baked_into_the_image():
    instructions = _dockerfile()
    copied = [
        path for keyword, args in instructions if keyword == "COPY" for path in _copy_sources(args)
    ]
    assert not any(_is_under(path, "models") for path in copied), copied
    ignored = _dockerignore()
    assert "models" in ignored  # 43 MB the build never reads stays out of its context
    assert not any(posixpath.normpath(path) in ignored for path in copied), (copied, ignored)
    # Engine mode's default model paths are relative to the repository root, which is the
    # WORKDIR only while the package is installed editable there; the documented mount
    # must be that folder.
    (workdir,) = [args for keyword, args in instructions if keyword == "WORKDIR"]
    assert any(
        keyword == "RUN" and re.search(r"pip install .*(-e|--editable) \.(\s|$)", args)
        for keyword, args in instructions
    )
    models = DEFAULT_TARGET_DIR.relative_to(RUNTIME_REPO_ROOT).parts[0]
    mount = f":{workdir}/{models}:ro"
    assert mount in (REPO_ROOT / "Dockerfile").read_text()
    assert mount in (REPO_ROOT / "README.md").read_text()


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):  # no request lines in the test output
        pass


def test_healthcheck_probes_the_configured_port(monkeypatch):
    """The image's HEALTHCHECK, run as written, follows DDTREE_PORT (the variable the
    server binds to): healthy when /health answers there, unhealthy when nothing does."""
    variable = env_var("port")
    monkeypatch.setenv(variable, "9123")
    assert ServerSettings().port == 9123
    (health,) = [args for keyword, args in _dockerfile() if keyword == "HEALTHCHECK"]
    command = json.loads(health[health.index("CMD") + len("CMD") :])
    assert command[0] == "python" and not re.search(r":\d+/health", " ".join(command)), command
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def probe() -> int:
        env = {"PATH": os.environ.get("PATH", ""), variable: str(port)}
        return subprocess.run(
            [sys.executable, *command[1:]], env=env, capture_output=True
        ).returncode

    try:
        assert probe() == 0
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert probe() != 0


# --- Compose: what vLLM-CPU needs, mounts, start order --------------------------------


@pytest.mark.parametrize("name", ["vllm", "vllm-draft"])
def test_vllm_cpu_may_bind_its_threads(name):
    """vLLM's CPU docs run the image with --cap-add SYS_NICE and --security-opt
    seccomp=unconfined (the engine pins its OpenMP threads to cores and their memory to a
    NUMA node), and with a large /dev/shm (here the host's IPC namespace)."""
    vllm = _load(*STACKS["cpu"])[name]
    assert "VLLM_CPU_OMP_THREADS_BIND" in vllm["environment"]
    assert "SYS_NICE" in vllm.get("cap_add", [])
    assert any(re.fullmatch(r"seccomp[=:]unconfined", opt) for opt in vllm.get("security_opt", []))
    assert vllm.get("ipc") == "host" or "shm_size" in vllm


def test_model_mounts_are_read_only(stack):
    _, services = stack
    for name, service in services.items():
        assert service["volumes"] and all(spec.endswith(":ro") for spec in service["volumes"]), name


def test_gpu_draft_server_starts_after_the_target_is_healthy():
    """vLLM sizes its KV cache from whole-GPU free-memory deltas, so two servers starting
    together on one GPU count each other's loading as their own: the draft server starts
    only once the target's is up."""
    services = _load(*STACKS["gpu"])
    assert "healthcheck" in services["vllm"]
    assert services["vllm-draft"]["depends_on"] == {"vllm": {"condition": "service_healthy"}}


REPLICAS_OVERRIDE = "docker-compose.replicas.yml"


def test_replicas_override_puts_two_identical_targets_behind_the_proxy(monkeypatch):
    """The override adds vllm-2, a copy of vllm (same model, flags, mounts, health check)
    on its own host port, and the proxy lists both replicas and waits for both."""
    base = _load("docker-compose.yml")
    services = _load("docker-compose.yml", REPLICAS_OVERRIDE)
    assert set(services) == SERVICES | {"vllm-2"}
    first, second = services["vllm"], services["vllm-2"]
    assert second["command"] == first["command"]
    for key in ("image", "volumes", "ipc", "cap_add", "security_opt", "healthcheck", "restart"):
        assert second[key] == first[key], key
    assert first["environment"].keys() == second["environment"].keys()
    host_ports = {services[n]["ports"][0].split(":")[1] for n in services}
    assert len(host_ports) == len(services)  # no two services on one host port
    settings = _proxy_settings(services, monkeypatch)
    port = _flag(first["command"], "--port")
    assert settings.target_urls == [f"http://vllm:{port}", f"http://vllm-2:{port}"]
    assert services["proxy"]["depends_on"] == base["proxy"]["depends_on"] | {
        "vllm-2": {"condition": "service_healthy"}
    }
    # Everything else of the proxy's command is the base file's.
    base_command = base["proxy"]["command"]
    assert [part for part in services["proxy"]["command"] if part != "http://vllm-2:8000"] == [
        *base_command[:3], "--target-url", *base_command[3:]
    ]  # fmt: skip
