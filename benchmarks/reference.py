"""Engine mode side by side with the authors' reference DDTree code, prompt by prompt.

    git clone https://github.com/liranringel/ddtree /path/to/ddtree  # anywhere outside this repo
    .venv/bin/pip install loguru datasets   # the reference's own imports (no flash-attn on CPU)
    .venv/bin/python -m benchmarks.reference --reference-dir /path/to/ddtree

Both sides load the same target and DFlash drafter (default: the shipped `pycoder` family),
fp32, one torch thread, greedy, EOS ignored, `--max-tokens` new tokens per prompt. For each
prompt and each setting (autoregressive, DFlash chain, DDTree at each budget) the reference
(`dflash_generate` / `ddtree_generate`) and ours (`proxy.decoding.generate` on the engine)
run one right after the other, alternating which goes first, so load changes on a shared
machine hit both alike. Times are the wall-clock of the whole call, prefill included.

Acceptance is compared round by round. The reference takes the first new token from its
prefill and starts drafting after it; our loop prefills all but the last prompt token and
makes the first token part of round one. So that both see the same rounds, ours is run a
second time (untimed) on prompt + that first token, for one token fewer, and its per-round
acceptance lengths are compared with the reference's. The reference's last round may
accept tokens past `max_new_tokens` that it then drops; it counts them in its tau.

Nothing is fetched: `--reference-dir` is the user's own checkout, imported unchanged, with
two adaptations made from here: on a machine without CUDA its `cuda_time` (which
synchronises CUDA) becomes `time.perf_counter`, and its `DynamicCache` gets the
`crop(length)` it was written for (keep the first `length` positions; Transformers 5.x
only accepts a negative count of positions to drop).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from benchmarks.run import DEFAULT_DFLASH_DIR, DEFAULT_TARGET_DIR, load_prompts, machine_info
from proxy.decoding import GenerationRequest, TreeSettings, generate
from proxy.runtime import REPO_ROOT, load_engine
from proxy.sampling import SamplingParams

WARMUP_TOKENS = 8


@dataclass
class Side:
    """One implementation at one setting, summed over prompts."""

    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time: less sensitive than wall-clock to other jobs
    tokens: int = 0
    acceptance: list[int] = field(default_factory=list)  # every round of every prompt
    outputs: list[list[int]] = field(default_factory=list)
    rounds: int = 0
    # seconds per phase, summed: ours from GenerationStats (draft, tree, verify = verify +
    # walk + keeping the path), the reference from its own stage_times
    phases: dict[str, float] = field(default_factory=dict)

    def add_phases(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def ms_per_round(self) -> dict[str, float]:
        """Per phase, plus `other` = the rest of the wall-clock (prefill, loop, Python)."""
        rounds = max(self.rounds, 1)
        out = {phase: 1e3 * seconds / rounds for phase, seconds in self.phases.items()}
        out["other"] = 1e3 * (self.wall_s - sum(self.phases.values())) / rounds
        out["total"] = 1e3 * self.wall_s / rounds
        return out

    @property
    def tau(self) -> float:
        return float(np.mean(self.acceptance)) if self.acceptance else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


@dataclass
class RoundCompare:
    """Per-round acceptance of the reference vs ours on the same rounds."""

    rounds: int = 0  # reference rounds compared
    our_rounds: int = 0  # our rounds on the same inputs (prompt + the first token)
    tokens: int = 0  # tokens both commit over those rounds (max_tokens - 1 per prompt)
    identical: int = 0  # rounds with equal acceptance length
    differ_last_only: int = 0  # prompts whose only differing rounds are the last one or two
    differ_earlier: int = 0  # prompts with a differing round before the last two
    first_differences: list[dict] = field(default_factory=list)


class LegacyCropCache(DynamicCache):
    """`crop(length)` keeps the first `length` positions, as the reference expects."""

    def crop(self, max_length: int) -> None:
        excess = self.get_seq_length() - max_length
        if excess > 0:
            super().crop(-excess)


def load_reference(reference_dir: Path):
    """Import the reference's `ddtree`, `dflash` and `model` modules from its checkout."""
    if not (reference_dir / "ddtree.py").is_file():
        raise SystemExit(f"{reference_dir} has no ddtree.py: give a checkout of liranringel/ddtree")
    sys.path.insert(0, str(reference_dir))
    modules = [importlib.import_module(name) for name in ("ddtree", "dflash", "model")]
    for module in modules[:2]:
        module.DynamicCache = LegacyCropCache
        if not torch.cuda.is_available():
            module.cuda_time = time.perf_counter
    return modules


def settings(budgets: tuple[int, ...]) -> list[tuple[str, TreeSettings]]:
    return [
        ("autoregressive", TreeSettings(kind="none")),
        ("chain", TreeSettings(kind="chain")),
        *((f"ddtree B={b}", TreeSettings(kind="ddtree", budget=b)) for b in budgets),
    ]


class Runner:
    def __init__(self, args):
        ref_ddtree, ref_dflash, ref_model = load_reference(args.reference_dir)
        self.ref_ddtree, self.ref_dflash = ref_ddtree, ref_dflash
        ref_ddtree.maybe_enable_cpp_compact(not args.no_cpp_compact)
        self.ref_target = AutoModelForCausalLM.from_pretrained(
            str(args.target_dir), dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.ref_draft = ref_model.DFlashDraftModel.from_pretrained(
            str(args.dflash_dir), dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.engine = load_engine(args.target_dir, f"dflash:{args.dflash_dir}")

    def reference(self, prompt_ids: list[int], tree: TreeSettings, max_tokens: int):
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        common = dict(
            model=self.ref_draft,
            target=self.ref_target,
            input_ids=input_ids,
            mask_token_id=self.ref_draft.mask_token_id,
            max_new_tokens=max_tokens,
            stop_token_ids=None,
        )
        if tree.kind == "ddtree":
            return self.ref_ddtree.ddtree_generate(
                **common, block_size=self.ref_draft.block_size, tree_budget=tree.budget
            )
        block_size = 1 if tree.kind == "none" else self.ref_draft.block_size
        return self.ref_dflash.dflash_generate(**common, block_size=block_size)

    def ours(self, prompt_ids: list[int], tree: TreeSettings, max_tokens: int):
        request = GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=0.0),
            tree=tree,
            ignore_eos=True,
        )
        drafter = None if tree.kind == "none" else self.engine.drafter
        return asyncio.run(
            generate(self.engine.target, drafter, request, self.engine.detokenizer())
        )


def compare_rounds(
    ref_rounds: list[int], our_rounds: list[int], tokens: int, compare: RoundCompare, where
):
    compare.rounds += len(ref_rounds)
    compare.our_rounds += len(our_rounds)
    compare.tokens += tokens
    differing = [
        idx
        for idx in range(max(len(ref_rounds), len(our_rounds)))
        if idx >= len(ref_rounds) or idx >= len(our_rounds) or ref_rounds[idx] != our_rounds[idx]
    ]
    compare.identical += len(ref_rounds) - sum(idx < len(ref_rounds) for idx in differing)
    if not differing:
        return
    last = len(ref_rounds) - 1
    if min(differing) >= last - 1:
        compare.differ_last_only += 1
    else:
        compare.differ_earlier += 1
    first = min(differing)
    compare.first_differences.append(
        {
            **where,
            "round": first,
            "of": len(ref_rounds),
            "reference": ref_rounds[first : first + 3],
            "ours": our_rounds[first : first + 3],
        }
    )


def run(args) -> dict:
    runner = Runner(args)
    _, prompts = load_prompts(
        runner.engine.tokens.tokenizer, args.prompts, 2048 - args.max_tokens - 32
    )
    table = settings(args.budgets)
    for _, tree in table:  # warm-up, untimed
        runner.reference(prompts[0], tree, WARMUP_TOKENS)
        runner.ours(prompts[0], tree, WARMUP_TOKENS)
    ref_sides = {name: Side() for name, _ in table}
    our_sides = {name: Side() for name, _ in table}
    compares = {name: RoundCompare() for name, tree in table if tree.kind != "none"}
    for prompt_idx, prompt_ids in enumerate(prompts):
        for name, tree in table:
            order = ("reference", "ours") if prompt_idx % 2 == 0 else ("ours", "reference")
            for side in order:
                start, start_cpu = time.perf_counter(), time.process_time()
                if side == "reference":
                    ref_out = runner.reference(prompt_ids, tree, args.max_tokens)
                else:
                    our_out = runner.ours(prompt_ids, tree, args.max_tokens)
                record = ref_sides[name] if side == "reference" else our_sides[name]
                record.wall_s += time.perf_counter() - start
                record.cpu_s += time.process_time() - start_cpu
                record.tokens += args.max_tokens
            ref_tokens = ref_out.output_ids[0, len(prompt_ids) :].tolist()
            ref_sides[name].outputs.append(ref_tokens)
            our_sides[name].outputs.append(our_out.token_ids)
            ref_sides[name].rounds += len(ref_out.acceptance_lengths) or args.max_tokens
            ref_sides[name].add_phases(
                {  # tree_build_* are parts of tree_build
                    stage: seconds
                    for stage, seconds in ref_out.stage_times.items()
                    if not stage.startswith("tree_build_")
                }
            )
            stats = our_out.stats
            our_sides[name].rounds += stats.rounds
            our_sides[name].add_phases(
                {"draft": stats.draft_s, "tree": stats.tree_s, "verify": stats.verify_s}
            )
            if tree.kind == "none":
                continue
            ref_sides[name].acceptance += list(ref_out.acceptance_lengths)
            our_sides[name].acceptance += our_out.stats.acceptance_lengths
            aligned = runner.ours(prompt_ids + ref_tokens[:1], tree, args.max_tokens - 1)
            compare_rounds(
                list(ref_out.acceptance_lengths),
                aligned.stats.acceptance_lengths,
                args.max_tokens - 1,
                compares[name],
                {"prompt": prompt_idx, "setting": name},
            )
        print(f"prompt {prompt_idx + 1}/{len(prompts)} done", file=sys.stderr)
    rows = []
    for name, _ in table:
        ref, ours = ref_sides[name], our_sides[name]
        compare = compares.get(name)
        rows.append(
            {
                "setting": name,
                "reference_tau": ref.tau,
                "ours_tau": ours.tau,
                "reference_tokens_per_s": ref.tokens_per_s,
                "ours_tokens_per_s": ours.tokens_per_s,
                "ours_over_reference": ref.wall_s / ours.wall_s,
                "ours_over_reference_cpu_time": ref.cpu_s / ours.cpu_s,
                "reference_ms_per_round": ref.ms_per_round(),
                "ours_ms_per_round": ours.ms_per_round(),
                "mismatched_prompts": sum(
                    a != b for a, b in zip(ref.outputs, ours.outputs, strict=True)
                ),
                # tau over the tokens each side keeps, on the same rounds: the reference's
                # own tau also counts what its last round accepted past max_tokens.
                "reference_tau_kept_tokens": compare.tokens / compare.rounds if compare else None,
                "ours_tau_same_rounds": compare.tokens / compare.our_rounds if compare else None,
                "rounds_compared": compare.rounds if compare else None,
                "rounds_identical": compare.identical if compare else None,
                "prompts_differing_last_rounds_only": compare.differ_last_only if compare else None,
                "prompts_differing_earlier": compare.differ_earlier if compare else None,
                "first_differences": compare.first_differences if compare else [],
            }
        )
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.reference " + " ".join(sys.argv[1:]),
        "machine": machine_info(),
        "load_avg": list(os.getloadavg()),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }


def render_markdown(report: dict) -> str:
    lines = [
        f"Engine mode vs the authors' reference code ({report['date']}, "
        f"`{report['command']}`): {report['prompts']} HumanEval prompts, "
        f"{report['max_tokens']} new tokens, greedy, EOS ignored, "
        f"{report['machine']['torch_threads']} torch thread(s), interleaved per prompt.",
        "",
        "| setting | reference tau | ours tau | reference tok/s | ours tok/s | ours / reference "
        "| ours / reference, CPU time | same-round acceptance equal | tau on kept tokens, "
        "reference / ours | output mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        same = kept = "-"
        if row["rounds_compared"] is not None:
            same = f"{row['rounds_identical']}/{row['rounds_compared']}"
            kept = f"{row['reference_tau_kept_tokens']:.3f} / {row['ours_tau_same_rounds']:.3f}"
        lines.append(
            f"| {row['setting']} | {row['reference_tau']:.2f} | {row['ours_tau']:.2f} "
            f"| {row['reference_tokens_per_s']:.1f} | {row['ours_tokens_per_s']:.1f} "
            f"| {row['ours_over_reference']:.2f} | {row['ours_over_reference_cpu_time']:.2f} "
            f"| {same} | {kept} | {row['mismatched_prompts']} |"
        )
    lines += [
        "",
        "Milliseconds per round (reference: its own `stage_times`; `draft` leaves out its "
        "first draft, `commit` is walk + KV compaction; ours: `verify` includes the walk "
        "and keeping the path; `other` is the rest of the wall-clock, prefill included):",
        "",
        "| setting | reference | ours |",
        "|---|---|---|",
    ]
    for row in report["rows"]:
        cells = [
            ", ".join(f"{phase} {ms:.2f}" for phase, ms in row[key].items())
            for key in ("reference_ms_per_round", "ours_ms_per_round")
        ]
        lines.append(f"| {row['setting']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.reference", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--reference-dir", type=Path, required=True, help="a checkout of liranringel/ddtree"
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budgets", default="16,32", help="DDTree budgets, comma-separated")
    parser.add_argument("--target-dir", type=Path, default=DEFAULT_TARGET_DIR)
    parser.add_argument("--dflash-dir", type=Path, default=DEFAULT_DFLASH_DIR)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument(
        "--no-cpp-compact",
        action="store_true",
        help="use the reference's Python KV compaction instead of its inline C++ one",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "reference"
    )
    args = parser.parse_args(argv)
    args.budgets = tuple(int(b) for b in args.budgets.split(",") if b)
    if args.prompts < 1 or args.max_tokens < 2:
        parser.error("need --prompts >= 1 and --max-tokens >= 2")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = render_markdown(report)
    args.out.with_suffix(".md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
