"""Command line: `ddtree-proxy generate ...` and `ddtree-proxy serve ...`.

Both build their models through the one composition root (`proxy.runtime`); heavy
imports (torch, transformers, the HTTP server) happen only in the command that needs
them."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any, Literal, TypeVar, get_args, get_origin

import pydantic
from pydantic_settings import BaseSettings

from proxy.backend.base import TargetError
from proxy.decoding import GenerationRequest, TreeSettings, generate
from proxy.runtime import Runtime, build_runtime
from proxy.sampling import SamplingParams
from proxy.server.settings import ServerSettings, env_var
from proxy.settings import RuntimeSettings, Setting, nest, settings_of

SettingsT = TypeVar("SettingsT", bound=RuntimeSettings)

# Flags spelled other than --NAME (the spelling they had before every setting had a flag).
_FLAG_NAMES = {"policy": "--budget-policy"}
_REPEATABLE = frozenset({"target_url"})  # settings whose flag may be given several times
# `generate`'s settings: the in-process target and drafter, the tree, where torch runs.
_GENERATE_SETTINGS = (
    "target",
    "drafter",
    *TreeSettings.model_fields,
    "device",
    "dtype",
    "torch_threads",
)


def flag_of(setting: Setting) -> str:
    return _FLAG_NAMES.get(setting.name, "--" + setting.name.replace("_", "-"))


def _choices(annotation: Any) -> list[str] | None:
    """The values of a Literal annotation (or of the Literal in `Literal[...] | None`)."""
    for candidate in (annotation, *get_args(annotation)):
        if get_origin(candidate) is Literal:
            return list(get_args(candidate))
    return None


def help_of(setting: Setting) -> str:
    """The setting's description, its default appended."""
    text = setting.field.description or ""
    return text if setting.default is None else f"{text} (default: {setting.default})"


def _add_setting(parser: Any, setting: Setting, from_env: bool) -> None:
    """--NAME, its help the setting's, [DDTREE_NAME] appended where the environment is
    read too. The parser leaves the value a string (None when not given): the settings
    model validates it, as it validates the same value from a DDTREE_* variable."""
    help_text = help_of(setting) + (f" [{env_var(setting.name)}]" if from_env else "")
    parser.add_argument(
        flag_of(setting),
        dest=setting.name,
        default=None,
        choices=_choices(setting.field.annotation),
        help=help_text.replace("%", "%%"),
        # --target-url repeated: several replicas, joined into the setting's comma list
        action="append" if setting.name in _REPEATABLE else "store",
    )


def _add_settings(
    parser: argparse.ArgumentParser,
    model: type[RuntimeSettings],
    names: tuple[str, ...] | None = None,
) -> None:
    """A flag for each setting of `model` (or each of `names`); --chain and --no-draft
    are --kind chain and --kind none, one of the three at most."""
    from_env = issubclass(model, BaseSettings)
    for setting in settings_of(model):
        if names is not None and setting.name not in names:
            continue
        if setting.name != "kind":
            _add_setting(parser, setting, from_env)
            continue
        shape = parser.add_mutually_exclusive_group()
        _add_setting(shape, setting, from_env)
        for flag, kind, meaning in (
            ("--chain", "chain", "the rank-0 path of depth D"),
            ("--no-draft", "none", "no drafting, the target alone"),
        ):
            shape.add_argument(
                flag,
                dest="kind",
                action="store_const",
                const=kind,
                help=f"--kind {kind}: {meaning}",
            )


def settings_from_args(model: type[SettingsT], args: argparse.Namespace) -> SettingsT:
    """`model` from the flags given (a flag not given is None) over the DDTREE_*
    variables if `model` reads them (a BaseSettings: ServerSettings) over its defaults."""
    given = {name: value for name, value in vars(args).items() if value is not None}
    for name in _REPEATABLE & given.keys():
        given[name] = ",".join(given[name])
    return model(**nest(model, given))


def _cmd_generate(args: argparse.Namespace) -> int:
    settings = settings_from_args(RuntimeSettings, args)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    result = asyncio.run(_generate(settings, args.prompt, args.max_tokens, sampling))
    stats = result.stats.to_dict()
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason,
                    "stats": stats,
                }
            )
        )
    else:
        print(args.prompt + result.text)
        print(
            f"\n[{len(result.token_ids)} tokens, {stats['rounds']} rounds, "
            f"mean acceptance length {stats['mean_acceptance_length']:.2f}, "
            f"draft {stats['draft_s']:.3f}s, tree {stats['tree_s']:.3f}s, "
            f"verify {stats['verify_s']:.3f}s]",
            file=sys.stderr,
        )
    return 0


async def _generate(
    settings: RuntimeSettings, prompt: str, max_tokens: int, sampling: SamplingParams
):
    runtime: Runtime = await build_runtime(settings)
    try:
        prompt_ids = await runtime.tokens.encode(prompt, add_special_tokens=False)
        request = GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling, tree=settings.tree
        )
        return await generate(
            runtime.target, runtime.drafter, request, runtime.detokenizer(), runtime.policy
        )
    finally:
        await runtime.aclose()


def _cmd_serve(args: argparse.Namespace) -> int:
    from proxy.server.app import run_server

    return run_server(settings_from_args(ServerSettings, args))


def _cmd_report(args: argparse.Namespace) -> int:
    """Fetch a serving proxy's A/B report; print it as tables (or JSON), plot it."""
    import httpx

    from proxy.ab.report import format_report, plot

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/") + "/ddtree/report"
    try:
        response = httpx.get(url, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {exc}") from None
    if response.status_code != 200:
        raise ValueError(f"{url} answered {response.status_code}: {response.text[:200]}")
    data = response.json()
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    if args.plot:
        try:
            plot(data, args.plot)
        except RuntimeError as exc:  # matplotlib missing
            raise ValueError(str(exc)) from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree-proxy", description="Lossless DDTree speculative decoding"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text in engine mode (in-process target)")
    gen.add_argument("--prompt", required=True, help="prompt text")
    _add_settings(gen, RuntimeSettings, _GENERATE_SETTINGS)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API",
        description="Serve /v1/completions and /v1/chat/completions. With --target-url: proxy "
        "mode in front of an unmodified vLLM server; without: engine mode (in-process target). "
        "Every option can also come from the environment variable in brackets; a flag wins, "
        "an empty variable counts as unset.",
    )
    _add_settings(serve, ServerSettings)
    serve.set_defaults(func=_cmd_serve)

    ab = sub.add_parser("report", help="print a serving proxy's A/B report")
    ab.add_argument("--url", required=True, help="the proxy's base URL, e.g. http://127.0.0.1:8080")
    ab.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY"),
                    help="the proxy's API key (default: DDTREE_API_KEY)")  # fmt: skip
    ab.add_argument("--plot", metavar="FILE", help="also write a PNG (needs matplotlib)")
    ab.add_argument("--json", action="store_true", help="print the report's JSON")
    ab.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it")
    ab.set_defaults(func=_cmd_report)
    return parser


def _one_line(exc: Exception) -> str:
    if isinstance(exc, pydantic.ValidationError):
        err = exc.errors()[0]
        field = ".".join(str(part) for part in err["loc"]) or "value"
        return f"{field}: {err['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _quiet_model_loading() -> None:
    """No per-load progress bars from Transformers (when it is installed at all)."""
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # a proxy-only install: no local models to load
        return
    transformers_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    _quiet_model_loading()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TargetError) as exc:
        print(f"ddtree-proxy: error: {_one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
