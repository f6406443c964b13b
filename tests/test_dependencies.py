"""pyproject.toml's dependencies match what proxy/ imports: every third-party module it
imports is declared (in the base or a runtime extra), and the base install declares
exactly what the server path imports when its modules load. Import names map to
distributions through the installed metadata (`prometheus_client` -> prometheus-client)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from proxy.drafter import DRAFTERS
from proxy.runtime import PROXY_DEFAULT_DRAFTER

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "proxy"
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
DEV_EXTRAS = {"dev"}  # test and tooling dependencies: proxy/ must not need them
# Base dependencies the server uses without importing them when its modules load.
LOADED_WHEN_SERVING = {
    "uvloop",  # imported as serving starts (proxy.server.app._run_loop)
    "httptools",  # uvicorn's HTTP parser: uvicorn picks it where it is installed
}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: list[str]) -> set[str]:
    return {_canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)[0]) for req in requirements}


BASE = _names(PYPROJECT["dependencies"])
RUNTIME_EXTRAS = {
    extra: _names(requirements)
    for extra, requirements in PYPROJECT["optional-dependencies"].items()
    if extra not in DEV_EXTRAS
}


def _source(module: str) -> Path | None:
    path = REPO_ROOT.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _imported(node: ast.AST) -> list[str]:
    """Absolute module names an import statement names (`from a import b`: a and a.b,
    since b may be a submodule); relative imports are the package's own."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return []


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _load_time_imports(statements: list[ast.stmt]) -> list[str]:
    """What importing a module imports: its top-level statements, into if/try/with
    blocks and class bodies, but not function bodies or `if TYPE_CHECKING:` blocks."""
    names = []
    for node in statements:
        names += _imported(node)
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                names += _load_time_imports(node.body)
            names += _load_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                names += _load_time_imports(block)
            for handler in node.handlers:
                names += _load_time_imports(handler.body)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            names += _load_time_imports(node.body)
    return names


def _third_party(names) -> set[str]:
    tops = {name.split(".")[0] for name in names}
    return {top for top in tops if top != PACKAGE and top not in sys.stdlib_module_names}


def _distributions(modules: set[str], declared: set[str]) -> dict[str, set[str]]:
    """module -> the distributions that provide it (the declared one where several do)."""
    providers = importlib.metadata.packages_distributions()
    missing = sorted(module for module in modules if module not in providers)
    assert not missing, f"imported by {PACKAGE}/ but not installed here: {missing}"
    result = {}
    for module in modules:
        dists = {_canonical(dist) for dist in providers[module]}
        result[module] = (dists & declared) or dists
    return result


def _server_path_modules() -> set[str]:
    """The package's modules that load when the console script serves proxy mode with
    its default drafter: the entry point's module, the `serve` command's server module
    (which the CLI imports on use) and the drafter's module (the registry imports it by
    name), then every package module they import at load time."""
    (entry,) = PYPROJECT["scripts"].values()
    roots = [
        entry.partition(":")[0],
        f"{PACKAGE}.server.app",
        DRAFTERS[PROXY_DEFAULT_DRAFTER].partition(":")[0],
    ]
    seen: set[str] = set()
    while roots:
        module = roots.pop()
        if module in seen:
            continue
        seen.add(module)
        tree = ast.parse(_source(module).read_text())
        for name in _load_time_imports(tree.body):
            parts = name.split(".")
            if parts[0] != PACKAGE:
                continue
            # Importing a.b.c loads the packages a and a.b first.
            roots += [
                ".".join(parts[:depth])
                for depth in range(1, len(parts) + 1)
                if _source(".".join(parts[:depth]))
            ]
    return seen


def test_every_import_is_declared():
    declared = BASE.union(*RUNTIME_EXTRAS.values())
    importers: dict[str, list[str]] = {}
    for path in sorted((REPO_ROOT / PACKAGE).rglob("*.py")):
        names = [name for node in ast.walk(ast.parse(path.read_text())) for name in _imported(node)]
        for module in _third_party(names):
            importers.setdefault(module, []).append(str(path.relative_to(REPO_ROOT)))
    undeclared = {
        module: (sorted(dists), importers[module])
        for module, dists in _distributions(set(importers), declared).items()
        if not dists & declared
    }
    assert not undeclared, f"imported but declared in no runtime extra nor the base: {undeclared}"


def test_base_install_declares_what_the_server_loads():
    modules = _server_path_modules()
    assert f"{PACKAGE}.server.app" in modules and f"{PACKAGE}.runtime" in modules
    names = [
        name
        for module in modules
        for name in _load_time_imports(ast.parse(_source(module).read_text()).body)
    ]
    loaded = set().union(*_distributions(_third_party(names), BASE).values())
    assert loaded - BASE == set(), "the server imports these at load time; declare them in the base"
    assert BASE - loaded == LOADED_WHEN_SERVING, "declared in the base but not imported by the server path"


def test_the_server_runs_on_uvloop_with_httptools():
    """What LOADED_WHEN_SERVING says: serving starts on uvloop's event loop, and uvicorn
    parses HTTP with httptools."""
    import asyncio

    import uvicorn

    from proxy.server.app import _run_loop

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert _run_loop(loop_module()).startswith("uvloop")
    config = uvicorn.Config(lambda scope, receive, send: None)
    config.load()
    assert config.http_protocol_class.__module__.endswith("httptools_impl")
