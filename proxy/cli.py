"""Command line: `ddtree-proxy generate ...` and `ddtree-proxy serve ...`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

import pydantic
import torch
from transformers.utils import logging as transformers_logging

from proxy.backend.base import TargetError
from proxy.decoding import GenerationRequest, TreeSettings, generate
from proxy.drafter import DRAFTERS, parse_drafter_spec
from proxy.engine import DEFAULT_DRAFTER, DEFAULT_TARGET_DIR, Engine
from proxy.sampling import SamplingParams


def _tree_settings(args: argparse.Namespace) -> TreeSettings:
    if args.no_draft:
        return TreeSettings(kind="none")
    kind = "chain" if args.chain else "ddtree"
    return TreeSettings(kind=kind, budget=args.budget, depth=args.depth)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=str(DEFAULT_TARGET_DIR), help="local target model directory"
    )
    parser.add_argument(
        "--drafter",
        default=DEFAULT_DRAFTER,
        help=f"NAME[:PATH], NAME one of {', '.join(sorted(DRAFTERS))} (default: shipped dflash)",
    )
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--budget", type=int, default=16, help="tree nodes per round")
    shape.add_argument("--chain", action="store_true", help="plain chain of depth D")
    shape.add_argument("--no-draft", action="store_true", help="no speculation at all")
    parser.add_argument("--depth", type=int, default=None, help="tree depth per round")
    parser.add_argument("--device", default=None, help="auto (default: cuda if present), cpu, cuda")
    parser.add_argument("--dtype", default=None, help="auto (bfloat16 on cuda, else float32), ...")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="intra-op threads of the in-process models (default: torch's; 1 was fastest "
        "for the shipped family on 2 cores)",
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise ValueError("prompt is empty: pass --prompt TEXT")
    tree = _tree_settings(args)
    parse_drafter_spec(args.drafter)  # fail on an unknown name before loading models
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise ValueError(f"--torch-threads must be >= 1, got {args.torch_threads}")
        torch.set_num_threads(args.torch_threads)
    drafter = None if tree.kind == "none" else args.drafter
    engine = Engine.load(args.target, drafter, device=args.device, dtype=args.dtype)
    prompt_ids = engine.encode(args.prompt)
    request = GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=args.max_tokens, sampling=sampling, tree=tree
    )
    result = asyncio.run(generate(engine.target, engine.drafter, request, engine.detokenize))
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


def _cmd_serve(args: argparse.Namespace) -> int:
    from proxy.server import run_server

    return run_server(args)


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    # Defaults are None so that DDTREE_* environment variables can fill the gaps; the
    # real defaults live in proxy.config.ServerSettings.
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
        "--tokenizer", default=None, help="proxy: local tokenizer dir (default: vLLM's /tokenize)"
    )
    parser.add_argument(
        "--drafter",
        default=None,
        help=f"NAME[:PATH], NAME one of {', '.join(sorted(DRAFTERS))} "
        "(default: ngram in proxy mode, the shipped dflash in engine mode)",
    )
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--budget", type=int, default=None, help="tree nodes per round (16)")
    shape.add_argument("--chain", action="store_true", help="plain chain of depth D")
    shape.add_argument("--no-draft", action="store_true", help="no speculation at all")
    parser.add_argument("--depth", type=int, default=None, help="tree depth per round")
    parser.add_argument("--device", default=None, help="auto (default: cuda if present), cpu, cuda")
    parser.add_argument("--dtype", default=None, help="auto (bfloat16 on cuda, else float32), ...")
    parser.add_argument(
        "--strategy", choices=["nodes", "paths"], default=None, help="proxy: verification (nodes)"
    )
    parser.add_argument("--host", default=None, help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (8000)")
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    parser.add_argument("--upstream-api-key", default=None, help="API key of the upstream vLLM")
    parser.add_argument(
        "--connect-timeout", type=float, default=None, help="upstream connect timeout, s (5)"
    )
    parser.add_argument(
        "--read-timeout", type=float, default=None, help="upstream read timeout, s (120)"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="threads for in-process models (default: 1 in proxy mode, torch's in engine mode)",
    )
    parser.add_argument(
        "--max-retries", type=int, default=None, help="retries of a failed verification call (4)"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=None, help="deadline of one request, s (600)"
    )
    parser.add_argument(
        "--max-active", type=int, default=None, help="generations served at once (64)"
    )
    parser.add_argument(
        "--max-queue", type=int, default=None, help="waiting requests before 429 (256)"
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=None, help="largest request body before 413 (4 MiB)"
    )
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


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    transformers_logging.disable_progress_bar()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TargetError) as exc:
        print(f"ddtree-proxy: error: {_one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
