"""Every implementation against the protocol the layers call it through.

The decoding loop, the runtime and the server see drafters, draft sessions, targets,
target sessions and tokenizers only through the protocols in `proxy.drafter.base`,
`proxy.backend.base` and `proxy.tokens`. No layer probes for optional features, so an
implementation must offer every member: each method, with the protocol's parameter
names, awaitable where the protocol's is; and each attribute, on the class or set in
its constructor.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from typing import Protocol

import pytest

from proxy.backend.base import Target, TargetSession
from proxy.drafter.base import Drafter, DraftSession
from proxy.tokens import Tokens

IMPLEMENTATIONS: dict[type, tuple[str, ...]] = {
    Drafter: (
        "proxy.drafter.ngram:NgramDrafter",
        "proxy.drafter.autoregressive:AutoregressiveDrafter",
        "proxy.drafter.dflash:DFlashDrafter",
        "proxy.drafter.served:ServedDrafter",
    ),
    DraftSession: (
        "proxy.drafter.ngram:NgramSession",
        "proxy.drafter.autoregressive:AutoregressiveSession",
        "proxy.drafter.dflash:DFlashSession",
        "proxy.drafter.served:ServedSession",
    ),
    Target: (
        "proxy.backend.engine.local:LocalTarget",
        "proxy.backend.vllm:VLLMTarget",
        "proxy.backend.replicas:ReplicaSet",
    ),
    TargetSession: (
        "proxy.backend.engine.local:LocalSession",
        "proxy.backend.vllm:VLLMSession",
        "proxy.backend.replicas:ReplicaSession",
    ),
    Tokens: (
        "proxy.tokens:LocalTokens",
        "proxy.tokens:TokenizerFile",
        "proxy.backend.vllm_tokens:VLLMTokens",
    ),
}
MISSING = object()


def _load(spec: str) -> type:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _members(protocol: type) -> tuple[dict[str, object], set[str]]:
    """(methods by name, attribute names) a protocol declares."""
    methods = {
        name: value
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, classmethod))
    }
    attributes = set(getattr(protocol, "__annotations__", {}))
    return methods, attributes


def _constructor_attributes(cls: type) -> set[str]:
    """Names a class's constructor assigns to `self.<name>` (anywhere in its MRO)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if not inspect.isfunction(init):  # none, or object's own
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    if target.value.id == "self":
                        names.add(target.attr)
    return names


def _parameter_names(func: object) -> list[str]:
    params = list(inspect.signature(func).parameters)
    return params[1:] if params and params[0] in ("self", "cls") else params


CASES = [(protocol, spec) for protocol, specs in IMPLEMENTATIONS.items() for spec in specs]


@pytest.mark.parametrize(
    "protocol, spec", CASES, ids=[f"{p.__name__}-{s.split(':')[1]}" for p, s in CASES]
)
def test_implementation_offers_every_member_of_its_protocol(protocol: type, spec: str):
    cls = _load(spec)
    methods, attributes = _members(protocol)
    assert methods or attributes, f"{protocol.__name__} declares nothing"
    for name, declared in methods.items():
        found = inspect.getattr_static(cls, name, MISSING)
        assert found is not MISSING, f"{cls.__name__} lacks {protocol.__name__}.{name}"
        if isinstance(declared, classmethod):
            declared = declared.__func__
        want_async = inspect.iscoroutinefunction(declared) or inspect.isasyncgenfunction(declared)
        impl = found.__func__ if isinstance(found, (classmethod, staticmethod)) else found
        got_async = inspect.iscoroutinefunction(impl) or inspect.isasyncgenfunction(impl)
        assert want_async == got_async, (
            f"{cls.__name__}.{name} must {'' if want_async else 'not '}be awaitable, "
            f"as {protocol.__name__}.{name}"
        )
        wanted = _parameter_names(declared)
        extra = list(inspect.signature(impl).parameters.values())[len(wanted) + 1 :]
        assert _parameter_names(impl)[: len(wanted)] == wanted and all(
            param.default is not param.empty for param in extra
        ), (
            f"{cls.__name__}.{name}{inspect.signature(impl)} does not match "
            f"{protocol.__name__}.{name}{inspect.signature(declared)}"
        )
    assigned = _constructor_attributes(cls)
    for name in attributes:
        on_class = inspect.getattr_static(cls, name, MISSING) is not MISSING
        assert on_class or name in assigned, (
            f"{cls.__name__} has no attribute {name!r} of {protocol.__name__} "
            "(neither on the class nor set by its constructor)"
        )


def test_every_implementation_is_listed():
    """A new drafter, target or tokenizer class is checked here too: every class in
    `proxy/` that has a protocol's methods must be in IMPLEMENTATIONS."""
    import pkgutil

    import proxy

    listed = {spec for specs in IMPLEMENTATIONS.values() for spec in specs}
    missing = []
    for info in pkgutil.walk_packages(proxy.__path__, "proxy."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency absent in this install
            continue
        for name, cls in vars(module).items():
            if not inspect.isclass(cls) or cls.__module__ != info.name:
                continue
            if Protocol in cls.__mro__:
                continue
            for protocol in IMPLEMENTATIONS:
                methods, _ = _members(protocol)
                if all(inspect.getattr_static(cls, m, MISSING) is not MISSING for m in methods):
                    if f"{info.name}:{name}" not in listed:
                        missing.append(f"{info.name}:{name} ({protocol.__name__})")
    assert not missing, f"implementations not checked against their protocol: {missing}"
