"""The configurations the benchmark measures, and one report row from each.

Engine mode: the target in-process (proxy.runtime.load_engine), DFlash drafting. Proxy mode:
the same decoding loop verifying against a real vLLM server over HTTP (VLLMTarget),
with the n-gram and autoregressive drafters, plus direct vLLM as the baseline. The
served drafters `vllm` and `vllm+overlap` put the autoregressive drafter's model files on
a second vLLM (`--drafter vllm:URL`; `+overlap`: the next round drafted while the tree is
verified), in the same run as the in-process drafter on the same files.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from benchmarks import cost_model, upstream
from benchmarks.harness import Measurement, count_mismatches, measure, output_digest
from proxy.backend.vllm import VLLMTarget
from proxy.backend.vllm_tokens import VLLMTokens
from proxy.decoding import TreeSettings, resolve_depth
from proxy.drafter import load_drafter
from proxy.drafter.base import TargetInfo
from proxy.runtime import load_engine

WARMUP_TOKENS = 8  # untimed tokens on the first prompt before each configuration
SERVED_DRAFTERS = {"vllm": "overlap=0", "vllm+overlap": "overlap=1"}  # name -> options
DRAFT_MAX_LOGPROBS = 64  # the draft server's --max-logprobs (as in the demo and compose)


@dataclass(frozen=True)
class Config:
    mode: str  # engine | proxy
    tree: TreeSettings
    drafter: str | None
    strategy: str | None = None

    @property
    def id(self) -> str:
        parts = [self.mode, self.tree.kind, self.drafter or "target"]
        if self.strategy:
            parts.append(self.strategy)
        if self.tree.kind == "ddtree":
            parts.append(f"b{self.tree.budget}")
        return "/".join(parts)


# --- rows --------------------------------------------------------------------------------


def make_row(
    config: Config,
    depth: int | None,
    m: Measurement,
    baseline_id: str,
    baseline: Measurement,
    metrics: dict[str, float] | None,
    block: int | None,
) -> dict:
    rounds = m.num_rounds
    acceptance = [length for stats in m.stats for length in stats.acceptance_lengths]
    nodes = [n for stats in m.stats for n in stats.tree_nodes]
    draft_s = sum(stats.draft_s for stats in m.stats)
    tree_s = sum(stats.tree_s for stats in m.stats)
    verify_s = sum(stats.verify_s for stats in m.stats)
    mismatched_prompts, mismatched_tokens = count_mismatches(m.outputs, baseline.outputs)
    proxy = config.mode == "proxy"
    row = {
        "id": config.id,
        "mode": config.mode,
        "tree": config.tree.kind,
        "drafter": config.drafter,
        "strategy": config.strategy,
        "budget": config.tree.budget if config.tree.kind == "ddtree" else None,
        "depth": depth,
        "baseline": baseline_id,
        "num_prompts": len(m.outputs),
        "max_tokens": max(len(output) for output in m.outputs),
        "generated_tokens": m.generated_tokens,
        "wall_s": m.wall_s,
        "tau": float(np.mean(acceptance)),
        "tokens_per_s": m.generated_tokens / m.wall_s,
        "speedup_vs_baseline": baseline.wall_s / m.wall_s,
        "rounds": rounds,
        "nodes_per_round": float(np.mean(nodes)),
        "target_tokens_per_round": sum(s.verify_prompt_tokens for s in m.stats) / rounds,
        "recomputed_tokens_per_round": None,
        "recomputed_tokens_est_per_round": None,
        "prompts_per_round": None,
        "upstream_calls_per_round": sum(s.upstream_calls for s in m.stats) / rounds
        if proxy
        else None,
        "prefix_cache_hit_rate": None,
        "prefix_cache_hits_per_prompt_token": None,
        "mismatched_prompts": mismatched_prompts,
        "mismatched_tokens": mismatched_tokens,
        "output_digest": output_digest(m.outputs),
        "draft_ms_per_round": 1e3 * draft_s / rounds,
        "tree_ms_per_round": 1e3 * tree_s / rounds,
        "verify_ms_per_round": 1e3 * verify_s / rounds,
        "loop_ms_per_round": 1e3 * max(m.wall_s - draft_s - tree_s - verify_s, 0.0) / rounds,
        # Served drafters: calls to the draft server per round, rounds left without a draft.
        "draft_calls_per_round": sum(s.draft_calls for s in m.stats) / rounds,
        "draft_failures": sum(s.draft_failures for s in m.stats),
    }
    if proxy:
        arrays = m.rounds.arrays()
        row["prompts_per_round"] = float(
            np.mean(cost_model.prompts_per_round(arrays, "proxy", config.strategy))
        )
        row["recomputed_tokens_est_per_round"] = float(
            np.mean(cost_model.recomputed_tokens(arrays, "proxy", config.strategy, block))
        )
        row.update(cache_columns(metrics, rounds, extra_tokens=0))
    return row


def cache_columns(metrics: dict[str, float] | None, rounds: int, extra_tokens: int) -> dict:
    """Prefix-cache columns from a /metrics delta; `extra_tokens` = decode tokens computed."""
    if metrics is None:
        return {}
    hits = metrics[upstream.PREFIX_HITS]
    queries = metrics[upstream.PREFIX_QUERIES]
    prompt_tokens = metrics[upstream.PROMPT_TOKENS]
    return {
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "prefix_cache_hits_per_prompt_token": hits / prompt_tokens if prompt_tokens else None,
        "recomputed_tokens_per_round": (prompt_tokens - hits + extra_tokens) / rounds,
    }


# --- engine mode -----------------------------------------------------------------------


def engine_configs(budgets) -> list[Config]:
    return [
        Config("engine", TreeSettings(kind="none"), None),
        Config("engine", TreeSettings(kind="chain"), "dflash"),
        *(Config("engine", TreeSettings(kind="ddtree", budget=b), "dflash") for b in budgets),
    ]


def run_engine(args, prompts, bar) -> tuple[list[dict], dict, list[list[int]]]:
    engine = load_engine(args.target_dir, f"dflash:{args.dflash_dir}")
    rows, rounds = [], {}
    baseline: Measurement | None = None
    baseline_id = ""
    for config in engine_configs(args.budgets):
        drafter = engine.drafter if config.drafter else None
        depth = resolve_depth(config.tree, drafter) if drafter else None
        bar.set_description(config.id)
        with tqdm(total=len(prompts), desc="prompts", leave=False, file=sys.stderr) as inner:
            m = asyncio.run(
                measure(
                    engine.target,
                    drafter,
                    config.tree,
                    prompts,
                    args.max_tokens,
                    engine.detokenizer(),
                    WARMUP_TOKENS,
                    progress=inner,
                )
            )
        if baseline is None:
            baseline, baseline_id = m, config.id
        rows.append(make_row(config, depth, m, baseline_id, baseline, None, None))
        rounds[config.id] = m.rounds.arrays()
        bar.update(1)
    return rows, rounds, baseline.outputs


# --- proxy mode ------------------------------------------------------------------------


def proxy_configs(args) -> list[Config]:
    configs = []
    for drafter in args.proxy_drafters:
        trees = [TreeSettings(kind="chain")] + [
            TreeSettings(kind="ddtree", budget=b) for b in args.budgets
        ]
        for tree in trees:
            for strategy in args.strategies:
                too_big = args.paths_max_budget is not None and tree.budget > args.paths_max_budget
                if strategy == "paths" and tree.kind == "ddtree" and too_big:
                    continue
                configs.append(Config("proxy", tree, drafter, strategy))
    return configs


def measure_direct(
    server: upstream.Upstream, prompts, max_tokens: int, bar
) -> tuple[dict, list[list[int]]]:
    """Plain greedy /v1/completions, one prompt at a time: the proxy rows' baseline."""
    server.complete_greedy([prompts[0]], min(WARMUP_TOKENS, max_tokens))
    server.reset_prefix_cache()
    before = server.metrics()
    outputs, wall_s = [], 0.0
    for prompt_ids in tqdm(prompts, desc="prompts", leave=False, file=sys.stderr):
        start = time.perf_counter()
        outputs.extend(server.complete_greedy([prompt_ids], max_tokens))
        wall_s += time.perf_counter() - start
    after = server.metrics()
    bar.update(1)
    generated = sum(len(output) for output in outputs)
    delta = {key: after[key] - before[key] for key in after}
    row = {
        "id": "vllm-direct", "mode": "vllm-direct", "tree": "none", "drafter": None,
        "strategy": None, "budget": None, "depth": None, "baseline": "vllm-direct",
        "num_prompts": len(prompts), "max_tokens": max_tokens, "generated_tokens": generated,
        "wall_s": wall_s, "tau": 1.0, "tokens_per_s": generated / wall_s,
        "speedup_vs_baseline": 1.0, "rounds": generated, "nodes_per_round": 0.0,
        "target_tokens_per_round": (sum(map(len, prompts)) + generated) / generated,
        "recomputed_tokens_est_per_round": None, "prompts_per_round": 1.0,
        "upstream_calls_per_round": len(prompts) / generated,
        "prefix_cache_hit_rate": None, "prefix_cache_hits_per_prompt_token": None,
        "recomputed_tokens_per_round": None,
        "mismatched_prompts": 0, "mismatched_tokens": 0, "output_digest": output_digest(outputs),
        "draft_ms_per_round": 0.0,
        "tree_ms_per_round": 0.0, "verify_ms_per_round": 1e3 * wall_s / generated,
        "loop_ms_per_round": 0.0,
    }  # fmt: skip
    row.update(cache_columns(delta, generated, extra_tokens=generated))
    return row, outputs


async def run_proxy_configs(args, server: upstream.Upstream, prompts, direct: Measurement, bar):
    tokenizer = AutoTokenizer.from_pretrained(str(args.target_dir))

    async def detokenize(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=True)

    config = AutoConfig.from_pretrained(str(args.target_dir))
    info = TargetInfo(
        vocab_size=int(config.vocab_size),
        num_hidden_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        model_dir=args.target_dir,
        model=None,
    )
    target = await VLLMTarget.connect(server.url, server.model, model_dir=args.target_dir)
    drafters = {}
    for name in args.proxy_drafters:
        if name in SERVED_DRAFTERS:
            # Long timeout: a draft that times out would go plain and skew tau.
            spec = f"vllm:{args.draft_vllm_url},top_k={DRAFT_MAX_LOGPROBS},timeout=60"
            drafters[name] = load_drafter(f"{spec},{SERVED_DRAFTERS[name]}", info)
            await drafters[name].connect(VLLMTokens.of(target))
        elif name == "autoregressive":
            drafters[name] = load_drafter(f"{name}:{args.ar_dir}", info)
        else:
            drafters[name] = load_drafter(name, info)
    rows, rounds = [], {}
    try:
        for cfg in proxy_configs(args):
            drafter = drafters[cfg.drafter]
            bar.set_description(cfg.id)
            snapshot: dict[str, float] = {}
            before_timing = functools.partial(_reset_and_snapshot, server, snapshot)
            with tqdm(total=len(prompts), desc="prompts", leave=False, file=sys.stderr) as inner:
                m = await measure(
                    target,
                    drafter,
                    cfg.tree,
                    prompts,
                    args.max_tokens,
                    detokenize,
                    WARMUP_TOKENS,
                    before_timing,
                    progress=inner,
                    strategy=cfg.strategy,
                )
            after = server.metrics()
            delta = {key: after[key] - snapshot[key] for key in after}
            depth = resolve_depth(cfg.tree, drafter)
            rows.append(make_row(cfg, depth, m, "vllm-direct", direct, delta, server.block_size))
            rounds[cfg.id] = m.rounds.arrays()
            bar.update(1)
    finally:
        await target.aclose()
        for drafter in drafters.values():
            if hasattr(drafter, "aclose"):
                await drafter.aclose()
    return rows, rounds


def _reset_and_snapshot(server: upstream.Upstream, snapshot: dict[str, float]) -> None:
    """Right before timing: an empty prefix cache, and the counters to diff against."""
    server.reset_prefix_cache()
    snapshot.update(server.metrics())


def run_proxy(args, prompts, bar, log_dir: Path):
    max_model_len = int(AutoConfig.from_pretrained(str(args.target_dir)).max_position_embeddings)
    if args.vllm_url:
        server = upstream.connect(args.vllm_url, args.target_dir, args.vllm_block_size)
    else:
        bar.set_description("starting vLLM")
        server = upstream.start(
            args.target_dir, log_dir / "vllm.log", min(max_model_len, 4096), args.vllm_block_size
        )
    draft_server = None
    if any(name in SERVED_DRAFTERS for name in args.proxy_drafters) and not args.draft_vllm_url:
        bar.set_description("starting the draft vLLM")
        try:
            draft_server = upstream.start(
                args.ar_dir,
                log_dir / "draft-vllm.log",
                min(max_model_len, 4096),
                args.vllm_block_size,
                extra_args=("--max-logprobs", str(DRAFT_MAX_LOGPROBS)),
            )
        except BaseException:
            server.stop()
            raise
        args.draft_vllm_url = draft_server.url
    try:
        direct_row, direct_outputs = measure_direct(server, prompts, args.max_tokens, bar)
        direct = Measurement(
            outputs=direct_outputs, wall_s=direct_row["wall_s"], stats=[], rounds=None
        )
        rows, rounds = asyncio.run(run_proxy_configs(args, server, prompts, direct, bar))
    finally:
        server.stop()
        if draft_server is not None:
            draft_server.stop()
    info = {
        "url": server.url if args.vllm_url else "started by the benchmark",
        "version": upstream.vllm_version(),
        "block_size": server.block_size,
        "max_model_len": min(max_model_len, 4096),
        "prefix_cache_reset": server.can_reset_cache,
        "num_prompts": len(prompts),
        "paths_max_budget": args.paths_max_budget,
    }
    return [direct_row, *rows], rounds, direct_outputs, info
