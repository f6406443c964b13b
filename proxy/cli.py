"""Command line: `ddtree-proxy generate ...` and `ddtree-proxy serve ...`.

Both build their models through the one composition root (`proxy.runtime`); heavy
imports (torch, transformers, the HTTP server) happen only in the command that needs
them."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import get_args

import pydantic

from proxy.backend.base import TargetError
from proxy.backend.vllm import Strategy
from proxy.decoding import BudgetPolicy, GenerationRequest, TreeSettings, generate
from proxy.drafter import DRAFTERS
from proxy.runtime import DEFAULT_DRAFTER, DEFAULT_TARGET_DIR, Runtime, build_runtime
from proxy.sampling import SamplingParams
from proxy.settings import RuntimeSettings


def _tree_settings(args: argparse.Namespace) -> TreeSettings:
    if args.no_draft:
        return TreeSettings(kind="none")
    kind = "chain" if args.chain else "ddtree"
    return TreeSettings(
        kind=kind, budget=args.budget, depth=args.depth, policy=args.policy or "adaptive"
    )


def _add_policy_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--budget-policy",
        dest="policy",
        choices=get_args(BudgetPolicy),
        default=None,
        help="adaptive (default): per round the nodes (up to --budget), or plain "
        "generation, with the most expected tokens/s; fixed: always --budget",
    )


def _add_tree_args(parser: argparse.ArgumentParser, default_budget: int | None) -> None:
    """Tree shape, budget policy and device flags (serve's defaults are None so that
    DDTREE_* variables can fill them)."""
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument(
        "--budget", type=int, default=default_budget, help="tree nodes per round (16)"
    )
    shape.add_argument("--chain", action="store_true", help="plain chain of depth D")
    shape.add_argument("--no-draft", action="store_true", help="no speculation at all")
    parser.add_argument("--depth", type=int, default=None, help="tree depth per round")
    _add_device_args(parser)
    _add_policy_arg(parser)


def _add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default=None,
        help="in-process models: auto (cuda if present, else cpu), cpu, cuda[:N]",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="in-process models: auto (bfloat16 on cuda, else float32), float32, bfloat16, float16",
    )


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=str(DEFAULT_TARGET_DIR), help="local target model directory"
    )
    parser.add_argument(
        "--drafter",
        default=DEFAULT_DRAFTER,
        help=f"NAME[:PATH], NAME one of {', '.join(sorted(DRAFTERS))} (default: shipped dflash)",
    )
    _add_tree_args(parser, default_budget=16)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="intra-op threads of the in-process models (default: torch's; 1 was fastest "
        "for the shipped family on 2 cores)",
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.torch_threads is not None and args.torch_threads < 1:
        raise ValueError(f"--torch-threads must be >= 1, got {args.torch_threads}")
    settings = RuntimeSettings(
        target=args.target,
        drafter=args.drafter,
        tree=_tree_settings(args),
        torch_threads=args.torch_threads,
        device=args.device,
        dtype=args.dtype,
    )
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
    from proxy.server import run_server

    return run_server(args)


# (flag, type, help) of the plain `serve` options; the defaults in parentheses are
# ServerSettings'.
_SERVE_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--host", str, "address to bind (127.0.0.1)"),
    ("--port", int, "port (8000)"),
    ("--api-key", str, "require Authorization: Bearer KEY"),
    ("--upstream-api-key", str, "API key of the upstream vLLM"),
    ("--connect-timeout", float, "upstream connect timeout, s (5)"),
    ("--read-timeout", float, "upstream read timeout, s (120)"),
    (
        "--torch-threads",
        int,
        "threads for in-process models (default: 1 in proxy mode, torch's in engine mode)",
    ),
    ("--max-retries", int, "retries of a failed verification call (4)"),
    ("--request-timeout", float, "deadline of one request, s (600)"),
    ("--max-active", int, "generations served at once (64)"),
    ("--max-queue", int, "waiting requests before 429 (256)"),
    ("--max-body-bytes", int, "largest request body before 413 (4 MiB)"),
    ("--policy-trace", str, "append one JSON line per policy decision to this file"),
)


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    # Defaults are None so that DDTREE_* environment variables can fill the gaps; the
    # real defaults live in proxy.server.settings.ServerSettings.
    parser.add_argument(
        "--target-url", default=None, help="upstream vLLM URL (proxy mode); omit for engine mode"
    )
    parser.add_argument(
        "--target",
        default=None,
        help="engine mode: local target model directory (default: shipped)",
    )
    parser.add_argument(
        "--model", default=None, help="proxy: the upstream model to serve; engine: its served name"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="proxy: the model's tokenizer files (default: found from the served model's "
        "path or the Hugging Face cache here)",
    )
    parser.add_argument(
        "--generation-config",
        default=None,
        help="proxy: as the upstream vLLM's --generation-config: auto (default), vllm, or "
        "the same folder on this host",
    )
    parser.add_argument(
        "--drafter",
        default=None,
        help=f"NAME[:PATH], NAME one of {', '.join(sorted(DRAFTERS))} "
        "(default: ngram in proxy mode, the shipped dflash in engine mode)",
    )
    _add_tree_args(parser, default_budget=None)
    parser.add_argument(
        "--strategy",
        choices=get_args(Strategy),
        default=None,
        help="proxy: verification (nodes)",
    )
    for flag, kind, help_text in _SERVE_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=help_text)
    parser.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default=None,
        help="server log level (info)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree-proxy", description="Lossless DDTree speculative decoding"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text in engine mode (in-process target)")
    gen.add_argument("--prompt", required=True, help="prompt text")
    _add_model_args(gen)
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
        "Every option can also come from the environment as DDTREE_<OPTION> "
        "(e.g. DDTREE_TARGET_URL, DDTREE_BUDGET, DDTREE_KIND=chain|none); flags win.",
    )
    _add_serve_args(serve)
    serve.set_defaults(func=_cmd_serve)
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
