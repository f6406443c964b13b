"""Project CPU-measured rounds onto a large target on one GPU (the motivating case:
Qwen3.6-27B served by vLLM on one H200).

What carries over from the CPU run, per round: the tree shape (context length,
nodes, depths, leaves), the acceptance length, the upstream calls, and the host-side
costs that stay on a CPU in the product (n-gram drafting, tree building, the Python
loop). What does not carry over is the target's compute, which the model replaces:

    t_round = calls * per_call_s + prompts * per_prompt_s          (vLLM API + scheduler)
            + max(decode_step_s, flops(recomputed tokens, prompts) / flops_rate)
            + prompts * (context * kv_bytes_per_token + state_bytes) / bandwidth
            + drafter_s + tree_s + loop_s

* `recomputed tokens`: what vLLM's prefix cache cannot serve (`_nodes_recompute`);
  the `paths` strategy asks for prompt_logprobs, which turns the cache off, so it
  recomputes every prompt in full; engine mode computes root + nodes once.
* A forward pass is memory-bound (weights read once: one decode step) until its
  arithmetic outgrows that; `max` is the roofline.
* Baseline: one request per prompt: prefill, then one decode step per token (plus
  the call's host cost for direct vLLM; none for engine mode).

Every number is measured (on these CPUs in the same benchmark run, or on this
workplace's H200 as recorded in /work/.library/device/KINDS.md), a public figure with
its source, or marked ASSUMPTION. Edit them here and re-project a saved report:

    .venv/bin/python -m benchmarks.cost_model [benchmarks/results/latest.json]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

# --- H200 ---------------------------------------------------------------------------
# Measured on this workplace's H200 (KINDS.md, 2026-10-28 and 2026-11-04): a device-
# to-device copy moved ~4.3 TB/s (bytes read + written); an 8192^3 bf16 matmul ran at
# 769-798 TFLOP/s on random data. NVIDIA's datasheet says 4.8 TB/s HBM3e and ~989
# TFLOP/s dense bf16; the measured numbers are the ceilings used here.
H200_BANDWIDTH = 4.3e12  # bytes/s
H200_BF16_FLOPS = 788e12  # FLOP/s
# ASSUMPTION: the fractions of those ceilings a tuned server (vLLM, CUDA graphs) reaches.
DECODE_BANDWIDTH_EFFICIENCY = 0.85  # batch-1 decode streams the weights at 85% of copy speed
PREFILL_MFU = 0.55  # prefill of a few hundred to a few thousand tokens

# --- Qwen3.6-27B --------------------------------------------------------------------
# Public config of the Qwen3.5/3.6 27B dense model (model_type qwen3_5_text; the fields
# vLLM 0.32's qwen3_5.py reads): 64 layers, every 4th full attention (16), the other 48
# Gated DeltaNet (GDN); hidden 5120, MLP 17408, vocab 248320, untied lm_head; attention:
# 24 query heads with an output gate, 4 KV heads of dim 256; GDN: 16 key heads and 48
# value heads of dim 128, conv kernel 4; mamba_ssm_dtype float32 (vLLM 0.32 applies it
# to its SSM cache, model_executor/models/config.py).
QWEN36_27B = dict(
    num_layers=64,
    num_full_attention_layers=16,
    hidden=5120,
    intermediate=17408,
    vocab=248320,
    num_q_heads=24,
    num_kv_heads=4,
    head_dim=256,
    gdn_key_heads=16,
    gdn_value_heads=48,
    gdn_head_dim=128,
    conv_kernel=4,
    ssm_state_bytes_per_value=4,
)
BF16 = 2


def qwen36_shape(cfg: dict = QWEN36_27B) -> dict[str, float]:
    """Parameter counts and cache sizes derived from the config fields above."""
    hidden, heads = cfg["hidden"], cfg["num_q_heads"]
    kv_heads, head_dim = cfg["num_kv_heads"], cfg["head_dim"]
    num_full = cfg["num_full_attention_layers"]
    num_gdn = cfg["num_layers"] - num_full
    key_dim = cfg["gdn_key_heads"] * cfg["gdn_head_dim"]
    value_dim = cfg["gdn_value_heads"] * cfg["gdn_head_dim"]
    mlp = 3 * hidden * cfg["intermediate"]
    # q with its output gate, k, v, o
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    attention += heads * head_dim * hidden
    # in_proj for q, k, v, z; b and a (one scalar per value head each); out_proj
    gdn = hidden * (2 * key_dim + 2 * value_dim) + 2 * hidden * cfg["gdn_value_heads"]
    gdn += value_dim * hidden
    body = cfg["num_layers"] * mlp + num_full * attention + num_gdn * gdn
    lm_head = hidden * cfg["vocab"]
    conv_state = (2 * key_dim + value_dim) * (cfg["conv_kernel"] - 1) * BF16
    ssm_state = cfg["gdn_value_heads"] * cfg["gdn_head_dim"] ** 2 * cfg["ssm_state_bytes_per_value"]
    return {
        "params_total": body + 2 * lm_head,  # embed_tokens is as large as lm_head
        "params_read_per_step": body + lm_head,  # a decode step gathers one embedding row
        "body_params": body,
        "lm_head_params": lm_head,
        "kv_bytes_per_token": 2 * num_full * kv_heads * head_dim * BF16,
        "state_bytes": num_gdn * (conv_state + ssm_state),
        "attn_page_bytes_per_token_layer": 2 * kv_heads * head_dim * BF16,
        "gdn_page_bytes_layer": conv_state + ssm_state,
    }


def hybrid_block_size(shape: dict[str, float], kernel_block: int = 16) -> int:
    """vLLM 0.32 (`Platform._align_hybrid_block_size`): the attention block grows until
    one block's KV page holds a GDN state page; prefix caching of a hybrid model
    ("align" mode) then reuses state only at multiples of that block."""
    per_block = kernel_block * shape["attn_page_bytes_per_token_layer"]
    return int(kernel_block * math.ceil(shape["gdn_page_bytes_layer"] / per_block))


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    decode_step_s: float  # one batch-1 decode step of the target
    flops_per_token: float  # forward arithmetic per recomputed token (lm_head excluded)
    flops_per_prompt: float  # lm_head for the one position each prompt samples
    flops_rate: float  # achieved FLOP/s
    bandwidth: float  # achieved bytes/s for KV and recurrent-state reads
    block_size: int  # prefix-cache granularity (tokens)
    kv_bytes_per_token: float
    state_bytes_per_prompt: float  # recurrent state read + written per prompt (hybrid)
    engine_mode: bool  # can engine mode (tree attention mask) serve this target at all?
    # ASSUMPTION: drafter time per round on the GPU, HF eager, launch-bound.
    dflash_s: float = 0.003  # one forward of a few-layer DFlash over its block
    ar_step_s: float = 0.004  # one step of a ~0.6B autoregressive drafter, per depth

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.flops_rate / self.flops_per_token


def default_scenarios() -> list[Scenario]:
    shape = qwen36_shape()
    common = dict(
        decode_step_s=shape["params_read_per_step"]
        * BF16
        / (H200_BANDWIDTH * DECODE_BANDWIDTH_EFFICIENCY),
        flops_per_token=2 * shape["body_params"],
        flops_per_prompt=2 * shape["lm_head_params"],
        flops_rate=H200_BF16_FLOPS * PREFILL_MFU,
        bandwidth=H200_BANDWIDTH * DECODE_BANDWIDTH_EFFICIENCY,
    )
    block = hybrid_block_size(shape)
    return [
        Scenario(
            name="qwen36",
            description=(
                "Qwen3.6-27B (hybrid: 48 GDN + 16 attention layers) on vLLM 0.32, one H200, "
                f"bf16; hybrid prefix caching reuses state only every {block} tokens; "
                "engine mode cannot verify a tree through recurrent layers"
            ),
            block_size=block,
            kv_bytes_per_token=shape["kv_bytes_per_token"],
            state_bytes_per_prompt=2 * shape["state_bytes"],
            engine_mode=False,
            **common,
        ),
        Scenario(
            name="dense27b",
            description=(
                "ASSUMPTION: an attention-only target of the same size (Qwen3.6-27B's "
                "weights, all 64 layers full attention) on vLLM, one H200, bf16, block 16"
            ),
            block_size=16,
            kv_bytes_per_token=4 * shape["kv_bytes_per_token"],
            state_bytes_per_prompt=0.0,
            engine_mode=True,
            **common,
        ),
    ]


@dataclass(frozen=True)
class HostCosts:
    """Host-side cost of one upstream call to vLLM (HTTP, request set-up, scheduling,
    output processing), which a GPU does not speed up."""

    name: str
    per_call_s: float
    per_prompt_s: float
    source: str


# ASSUMPTION: a server-class host CPU that runs vLLM's API server and scheduler with
# cores to spare (these machines share 2 cores between vLLM, the proxy and the model).
FAST_HOST = HostCosts("fasthost", 0.003, 0.0002, "ASSUMPTION: server-class host, idle cores")
# ASSUMPTION, used when the run measured no proxy rounds to fit (--no-proxy).
UNMEASURED_HOST = HostCosts("cpuhost", 0.02, 0.002, "ASSUMPTION: no proxy rounds were measured")


def _nodes_recompute(r: dict[str, np.ndarray], block: int) -> np.ndarray:
    """[rounds] tokens vLLM computes for one nodes-strategy round.

    All prompts of a round go in one batch, and vLLM registers a prompt's full blocks
    when it schedules it, so the root's prompt computes the context past the blocks
    cached in earlier rounds, and every node's prompt reads the context's full blocks
    and computes its tail: (context mod block) + depth tokens. A block that runs into
    the drafted path is shared by the deeper nodes below it but counted for each, so
    this slightly overestimates deep chains (the report compares it with vLLM's own
    counters: recomputed_tokens_est_per_round vs recomputed_tokens_per_round).
    """
    context = r["context_len"]
    root = context - (r["seen_len"] // block) * block
    nodes = r["num_nodes"] * (context - (context // block) * block) + r["sum_node_depth"]
    return root + nodes


def recomputed_tokens(
    r: dict[str, np.ndarray], mode: str, strategy: str | None, block: int
) -> np.ndarray:
    """[rounds] tokens each round makes the target compute."""
    if mode == "engine":  # one forward over root + nodes; the prompt once, at the start
        first = r["seen_len"] == 0
        return r["num_nodes"] + 1 + np.where(first, r["context_len"] - 1, 0)
    if strategy == "paths":
        return r["num_leaves"] * r["context_len"] + r["sum_leaf_depth"]
    return _nodes_recompute(r, block)


def prompts_per_round(r: dict[str, np.ndarray], mode: str, strategy: str | None) -> np.ndarray:
    if mode == "engine":
        return np.ones_like(r["num_nodes"])
    return r["num_leaves"] if strategy == "paths" else r["num_nodes"] + 1


def fit_host_costs(rounds: list[dict[str, np.ndarray]], cpu_step_s: float, block: int) -> dict:
    """Least squares over every measured `nodes` round:
    verify_s = a + b * prompts + c * recomputed_tokens. The intercept `a` includes one CPU
    forward's pass over the weights, so the per-call host cost is a - cpu_step_s."""
    prompts = np.concatenate([r["num_nodes"] + 1 for r in rounds]).astype(float)
    recomputed = np.concatenate([_nodes_recompute(r, block) for r in rounds]).astype(float)
    verify_s = np.concatenate([r["verify_s"] for r in rounds])
    design = np.stack([np.ones_like(verify_s), prompts, recomputed], axis=1)
    coef, *_ = np.linalg.lstsq(design, verify_s, rcond=None)
    if coef[2] < 0:
        # A target so cheap that its compute drowns in the per-prompt cost (and
        # recomputed tokens grow with prompts): fit the two host terms alone.
        design = design[:, :2]
        coef = np.append(np.linalg.lstsq(design, verify_s, rcond=None)[0], 0.0)
        design = np.column_stack([design, recomputed])
    ss_res = float(((verify_s - design @ coef) ** 2).sum())
    ss_tot = float(((verify_s - verify_s.mean()) ** 2).sum()) or 1.0
    return {
        "per_call_s": float(coef[0]),
        "per_prompt_s": float(coef[1]),
        "per_token_s": float(coef[2]),
        "r2": 1.0 - ss_res / ss_tot,
        "num_rounds": int(verify_s.size),
        "cpu_step_s": cpu_step_s,
    }


def project_row(
    row: dict, r: dict[str, np.ndarray], scenario: Scenario, host: HostCosts, prompt_lens: list[int]
) -> dict[str, float] | None:
    """Projected tokens/s and speedup over the scenario's own baseline; None where the
    scenario cannot run the row (engine mode on a hybrid target)."""
    mode = row["mode"]
    if mode == "engine" and not scenario.engine_mode:
        return None
    if mode == "engine":  # no HTTP hop
        host = HostCosts("engine", 0.0, 0.0, "engine mode: in-process")
    prompt_lens = prompt_lens[: row["num_prompts"]]  # proxy mode may run a prefix of them
    baseline = sum(_plain_request_s(scenario, host, n, row["max_tokens"]) for n in prompt_lens)
    if row["tree"] == "none":
        total = baseline
    else:
        recompute = recomputed_tokens(r, mode, row["strategy"], scenario.block_size)
        prompts = prompts_per_round(r, mode, row["strategy"])
        flops = recompute * scenario.flops_per_token + prompts * scenario.flops_per_prompt
        compute = np.maximum(scenario.decode_step_s, flops / scenario.flops_rate)
        read_bytes = prompts * (
            r["context_len"] * scenario.kv_bytes_per_token + scenario.state_bytes_per_prompt
        )
        calls = row["upstream_calls_per_round"] or 0.0
        upstream = calls * host.per_call_s + prompts * host.per_prompt_s
        per_round = (
            _drafter_s(row, scenario) + (row["tree_ms_per_round"] + row["loop_ms_per_round"]) / 1e3
        )
        total = float((compute + read_bytes / scenario.bandwidth + upstream).sum())
        total += len(recompute) * per_round
    return {"tokens_per_s": row["generated_tokens"] / total, "speedup": baseline / total}


def _plain_request_s(
    scenario: Scenario, host: HostCosts, prompt_len: int, max_tokens: int
) -> float:
    prefill_flops = prompt_len * scenario.flops_per_token + scenario.flops_per_prompt
    prefill = max(scenario.decode_step_s, prefill_flops / scenario.flops_rate)
    return host.per_call_s + host.per_prompt_s + prefill + (max_tokens - 1) * scenario.decode_step_s


def _drafter_s(row: dict, scenario: Scenario) -> float:
    if row["drafter"] == "dflash":
        return scenario.dflash_s
    if row["drafter"] == "autoregressive":
        return scenario.ar_step_s * row["depth"]
    return row["draft_ms_per_round"] / 1e3  # ngram runs on the host CPU anyway: as measured


def project_report(
    rows: list[dict],
    rounds: dict[str, dict[str, np.ndarray]],
    prompt_lens: list[int],
    server_block: int,
    scenarios: list[Scenario] | None = None,
) -> dict:
    """Fit the host costs on the run's proxy rounds, add `gpu_<scenario>_<host>_tokens_per_s`
    and `..._speedup` to every row (None where it does not apply), and return what was
    assumed, for the report."""
    scenarios = scenarios or default_scenarios()
    nodes_rounds = [
        rounds[row["id"]] for row in rows if row["mode"] == "proxy" and row["strategy"] == "nodes"
    ]
    direct = next((row for row in rows if row["mode"] == "vllm-direct"), None)
    fit = None
    measured = UNMEASURED_HOST
    if nodes_rounds and direct is not None:
        fit = fit_host_costs(
            nodes_rounds, direct["wall_s"] / direct["generated_tokens"], server_block
        )
        measured = HostCosts(
            "cpuhost",
            max(fit["per_call_s"] - fit["cpu_step_s"], 0.0),
            max(fit["per_prompt_s"], 0.0),
            f"fitted on this run's {fit['num_rounds']} nodes-strategy rounds (2-core CPU host)",
        )
    hosts = [measured, FAST_HOST]
    for row in rows:
        for scenario in scenarios:
            for host in hosts:
                result = project_row(row, rounds.get(row["id"], {}), scenario, host, prompt_lens)
                key = f"gpu_{scenario.name}_{host.name}"
                row[f"{key}_tokens_per_s"] = (
                    None if result is None else round(result["tokens_per_s"], 2)
                )
                row[f"{key}_speedup"] = None if result is None else round(result["speedup"], 3)
    return {
        "scenarios": [
            {**asdict(s), "prefill_tokens_per_s": s.prefill_tokens_per_s} for s in scenarios
        ],
        "hosts": [asdict(host) for host in hosts],
        "host_fit": fit,
        "constants": {
            "H200_BANDWIDTH": H200_BANDWIDTH,
            "H200_BF16_FLOPS": H200_BF16_FLOPS,
            "DECODE_BANDWIDTH_EFFICIENCY": DECODE_BANDWIDTH_EFFICIENCY,
            "PREFILL_MFU": PREFILL_MFU,
            "qwen36_27b": {**QWEN36_27B, **qwen36_shape()},
        },
    }


def load_rounds(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """latest_rounds.npz -> {row id: {field: [rounds] array}}."""
    rounds: dict[str, dict[str, np.ndarray]] = {}
    with np.load(path) as archive:
        for key in archive.files:
            row_id, _, name = key.partition("::")
            rounds.setdefault(row_id, {})[name] = archive[key]
    return rounds


def main(argv: list[str] | None = None) -> None:
    from benchmarks.report import projection_markdown

    parser = argparse.ArgumentParser(description="Re-project a saved benchmark report.")
    parser.add_argument(
        "report", nargs="?", type=Path, default=Path(__file__).parent / "results" / "latest.json"
    )
    parser.add_argument("--decode-step-ms", type=float, help="override the decode step time")
    parser.add_argument("--prefill-tokens-per-s", type=float, help="override prefill speed")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    rows = report["rows"]
    rounds = load_rounds(args.report.with_name(args.report.stem + "_rounds.npz"))
    scenarios = default_scenarios()
    if args.decode_step_ms:
        scenarios = [replace(s, decode_step_s=args.decode_step_ms / 1e3) for s in scenarios]
    if args.prefill_tokens_per_s:
        scenarios = [
            replace(s, flops_rate=args.prefill_tokens_per_s * s.flops_per_token) for s in scenarios
        ]
    block = (report["metadata"].get("vllm") or {}).get("block_size", 32)
    cost = project_report(rows, rounds, report["metadata"]["prompt_tokens"], block, scenarios)
    print(projection_markdown(rows, cost))


if __name__ == "__main__":
    main()
