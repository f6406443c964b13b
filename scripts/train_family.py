"""Train the shipped tiny model family on the Python standard library, on CPU.

    .venv/bin/python scripts/train_family.py --out models/pycoder

builds, deterministically (fixed seed, fixed torch thread count):
  OUT/target   a Qwen3 causal LM (config, model.safetensors, tokenizer, generation
               config): what `vllm serve OUT/target` and engine mode load as is
  OUT/dflash   a DFlash block-diffusion drafter trained against the frozen target, in
               z-lab's checkpoint format (`--drafter dflash:OUT/dflash`)
  OUT/ar       a much smaller Qwen3 with the same tokenizer, distilled from the target
               (`--drafter autoregressive:OUT/ar`)
  OUT/metrics.json, OUT/heldout_slice.json, OUT/MODEL_CARD.md

Phases: tokenizer (byte-level BPE on the training files) -> target (next-token loss)
-> both drafters against the frozen target (see training/distill.py) ->
held-out evaluation. Timings of each phase go into the card.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

# training/ is a package of the repository, not of the installed runtime (`pip install .`
# ships only proxy/): run as a script, this file finds it next to scripts/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import Qwen3ForCausalLM

from proxy.drafter.dflash_model import (
    DFlashConfig,
    DFlashDraftModel,
    build_target_layer_ids,
    save_checkpoint,
)
from training.bigram_init import apply_bigram_init, bigram_counts, fit_bigram_factors
from training.card import render_card
from training.corpus import (
    WindowSampler,
    chunk_documents,
    encode_documents,
    list_source_files,
    read_sources,
    split_heldout,
    stdlib_root,
)
from training.distill import DrafterStage, train_drafters
from training.evaluate import evaluate_family, slice_windows
from training.lm import train_causal_lm
from training.modelgen import MASK_TOKEN, byte_level_tokenizer, qwen3_config, save_tokenizer
from training.rollouts import RowSampler, greedy_rollouts, sample_prefixes

REPO_ROOT = Path(__file__).resolve().parents[1]
ROLLOUT_BATCH = 32  # sequences decoded together when generating rollouts

# THREADS_NOTE: one intra-op thread by default. The weights depend on the thread count
# (float reduction order), so it is fixed and recorded; and on a 2-core machine shared
# with other jobs a 2-thread OpenMP run was measured several times slower than a
# 1-thread one (threads stall at every barrier while the other core is taken). On a
# quiet machine, --threads 2 runs about 1.7x faster (different bits, same recipe).


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "models" / "pycoder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads, fixed for reproducibility (see THREADS_NOTE)",
    )
    # corpus
    parser.add_argument("--heldout-every", type=int, default=50)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    # target
    parser.add_argument("--target-layers", type=int, default=16)
    parser.add_argument("--target-hidden", type=int, default=192)
    parser.add_argument("--target-heads", type=int, default=3)
    parser.add_argument("--target-kv-heads", type=int, default=1)
    parser.add_argument("--target-steps", type=int, default=180)
    parser.add_argument("--target-lr", type=float, default=2e-3)
    parser.add_argument(
        "--bigram-steps", type=int, default=40, help="full-batch steps of the bigram init"
    )
    # drafters
    parser.add_argument("--dflash-layers", type=int, default=2)
    parser.add_argument(
        "--dflash-feature-layers",
        type=int,
        default=3,
        help="how many target layers feed the drafter (z-lab's spacing)",
    )
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument(
        "--drafter-seq-lens",
        type=int,
        nargs="+",
        default=[32, 128, 512],
        help="window length of each drafter stage (a curriculum, see training/distill.py)",
    )
    parser.add_argument("--drafter-batch-sizes", type=int, nargs="+", default=[32, 8, 4])
    parser.add_argument(
        "--drafter-anchors", type=int, nargs="+", default=[16, 64, 96], help="blocks per window"
    )
    parser.add_argument("--drafter-steps", type=int, nargs="+", default=[100, 60, 40])
    parser.add_argument(
        "--rollout-prefix-len", type=int, default=256, help="corpus tokens before a rollout"
    )
    parser.add_argument("--rollout-new-tokens", type=int, default=256)
    parser.add_argument("--rollout-count", type=int, default=96, help="rollouts to train on")
    parser.add_argument("--rollout-batch-size", type=int, default=4)
    parser.add_argument("--rollout-anchors", type=int, default=96)
    parser.add_argument(
        "--rollout-steps", type=int, default=50, help="last drafter stage: target rollouts"
    )
    parser.add_argument(
        "--drafter-labels",
        choices=("greedy", "soft"),
        default="greedy",
        help="drafters learn the target's argmax (what T=0 accepts) or its distribution",
    )
    parser.add_argument("--dflash-lr", type=float, default=3e-3)
    parser.add_argument("--ar-layers", type=int, default=2)
    parser.add_argument("--ar-hidden", type=int, default=128)
    parser.add_argument("--ar-lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    # evaluation
    parser.add_argument("--heldout-anchor-stride", type=int, default=4)
    parser.add_argument("--slice-files", type=int, default=6)
    parser.add_argument("--slice-max-tokens", type=int, default=384)
    parser.add_argument(
        "--heldout-rollouts", type=int, default=16, help="held-out prefixes continued greedily"
    )
    parser.add_argument("--heldout-rollout-tokens", type=int, default=128)
    return parser.parse_args(argv)


def slice_texts(tokenizer, texts: list[str], max_tokens: int) -> list[str]:
    """From each text, the longest run of whole lines starting at its middle line that
    encodes to at most `max_tokens` tokens (the middle of a file is code, not a header)."""
    pieces = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        start = len(lines) // 2
        end = start
        while end < len(lines):
            candidate = "".join(lines[start : end + 1])
            if len(tokenizer.encode(candidate).ids) > max_tokens:
                break
            end += 1
        pieces.append("".join(lines[start:end]))
    return pieces


def recipe_args(argv: list[str]) -> list[str]:
    """The command-line arguments without --out: where the files go does not change
    them, so the recorded command is the same for a staging directory."""
    kept, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg == "--out":
            skip_next = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return kept


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stage_args = (
        args.drafter_seq_lens,
        args.drafter_batch_sizes,
        args.drafter_anchors,
        args.drafter_steps,
    )
    if len({len(values) for values in stage_args}) != 1:
        raise ValueError(
            "--drafter-seq-lens, --drafter-batch-sizes, --drafter-anchors and "
            "--drafter-steps need one value per stage each"
        )
    drafter_stages = list(zip(*stage_args, strict=True))
    # Before any work: a fixed thread count makes float reductions, hence the trained
    # weights, reproducible on one machine.
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    # Wall-clock per phase, and this process's CPU time: on a shared machine the wall
    # clock includes time spent waiting for a core, the CPU time does not.
    timings: dict[str, float] = {}
    cpu_timings: dict[str, float] = {}
    started, cpu_started = time.perf_counter(), time.process_time()

    def lap(name: str, since: tuple[float, float]) -> tuple[float, float]:
        now = (time.perf_counter(), time.process_time())
        timings[name] = round(now[0] - since[0], 1)
        cpu_timings[name] = round(now[1] - since[1], 1)
        print(
            f"[train_family] {name}: {timings[name]:.1f} s wall, {cpu_timings[name]:.1f} s CPU",
            flush=True,
        )
        return now

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    root = stdlib_root()
    files = list_source_files(root)
    train_files, heldout_files = split_heldout(files, args.heldout_every)
    train_texts = read_sources(root, train_files)
    heldout_texts = read_sources(root, heldout_files)
    print(
        f"[train_family] corpus {root}: {len(train_files)} training files, "
        f"{len(heldout_files)} held out",
        flush=True,
    )

    # --- tokenizer --------------------------------------------------------------
    tick = (started, cpu_started)
    tokenizer = byte_level_tokenizer(train_texts, args.vocab_size)
    target_dir, dflash_dir, ar_dir = out / "target", out / "dflash", out / "ar"
    hf_tokenizer = save_tokenizer(tokenizer, target_dir)
    save_tokenizer(tokenizer, ar_dir)
    eos_id = hf_tokenizer.eos_token_id
    mask_id = hf_tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    train_stream = torch.cat(encode_documents(tokenizer, train_texts, eos_id))
    heldout_docs = encode_documents(tokenizer, heldout_texts, eos_id)
    heldout_windows = chunk_documents(heldout_docs, args.seq_len)
    corpus_bytes = sum(len(text.encode()) for text in train_texts)
    tick = lap("tokenizer", tick)

    # --- target -----------------------------------------------------------------
    target_config = qwen3_config(
        vocab_size=len(hf_tokenizer),
        num_layers=args.target_layers,
        hidden_size=args.target_hidden,
        num_heads=args.target_heads,
        num_kv_heads=args.target_kv_heads,
        eos_token_id=eos_id,
    )
    target_config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    target = Qwen3ForCausalLM(target_config)
    counts = bigram_counts(train_stream, target_config.vocab_size)
    apply_bigram_init(
        target, *fit_bigram_factors(counts, args.target_hidden, args.bigram_steps, seed=args.seed)
    )
    sampler = WindowSampler(train_stream, args.seq_len, args.batch_size, seed=args.seed)
    target_history = train_causal_lm(
        target,
        sampler,
        args.target_steps,
        args.target_lr,
        args.warmup_steps,
        args.weight_decay,
        desc="target",
    )
    target.save_pretrained(str(target_dir), safe_serialization=True)
    tick = lap("target", tick)

    # --- drafters ---------------------------------------------------------------
    feature_layers = build_target_layer_ids(args.target_layers, args.dflash_feature_layers)
    dflash_config = DFlashConfig.for_target(
        target_config,
        mask_token_id=mask_id,
        num_hidden_layers=args.dflash_layers,
        block_size=args.block_size,
        target_layer_ids=feature_layers,
    )
    dflash = DFlashDraftModel.random(dflash_config, seed=args.seed + 1)
    ar_config = qwen3_config(
        vocab_size=len(hf_tokenizer),
        num_layers=args.ar_layers,
        hidden_size=args.ar_hidden,
        num_heads=4,
        num_kv_heads=2,
        eos_token_id=eos_id,
    )
    ar_config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed + 2)
    ar = Qwen3ForCausalLM(ar_config)
    apply_bigram_init(
        ar, *fit_bigram_factors(counts, args.ar_hidden, args.bigram_steps, seed=args.seed)
    )
    stages = [
        DrafterStage(
            WindowSampler(train_stream, seq_len, batch_size, seed=args.seed + 3 + stage_idx),
            num_steps,
            num_anchors,
        )
        for stage_idx, (seq_len, batch_size, num_anchors, num_steps) in enumerate(drafter_stages)
    ]
    rollouts = torch.zeros(0, 0, dtype=torch.long)
    if args.rollout_steps:
        prefixes = sample_prefixes(
            train_stream, args.rollout_prefix_len, args.rollout_count, seed=args.seed + 5
        )
        rollouts = greedy_rollouts(target, prefixes, args.rollout_new_tokens, ROLLOUT_BATCH)
        stages.append(
            DrafterStage(
                RowSampler(rollouts, args.rollout_batch_size, seed=args.seed + 6),
                args.rollout_steps,
                args.rollout_anchors,
            )
        )
    drafter_history = train_drafters(
        target,
        dflash,
        ar,
        stages,
        args.dflash_lr,
        args.ar_lr,
        args.warmup_steps,
        args.weight_decay,
        seed=args.seed + 4,
        labels=args.drafter_labels,
    )
    save_checkpoint(dflash, dflash_dir)
    ar.save_pretrained(str(ar_dir), safe_serialization=True)
    tick = lap("drafters", tick)

    # --- evaluation ----------------------------------------------------------------
    heldout = evaluate_family(
        target, dflash, heldout_windows, anchor_stride=args.heldout_anchor_stride, ar=ar
    )
    texts = slice_texts(tokenizer, heldout_texts[: args.slice_files], args.slice_max_tokens)
    slice_metrics = evaluate_family(target, dflash, slice_windows(hf_tokenizer, texts, eos_id))
    # Held-out prefixes continued by the target itself: what temperature-0 decoding
    # verifies. Blocks are rooted in the generated part only.
    long_windows = [w for w in heldout_windows if len(w) >= args.rollout_prefix_len]
    picks = torch.linspace(0, len(long_windows) - 1, args.heldout_rollouts).long().tolist()
    heldout_prefixes = torch.stack([long_windows[idx][: args.rollout_prefix_len] for idx in picks])
    heldout_rollouts = greedy_rollouts(
        target, heldout_prefixes, args.heldout_rollout_tokens, ROLLOUT_BATCH
    )
    rollout_metrics = evaluate_family(
        target, dflash, list(heldout_rollouts), first_anchor=args.rollout_prefix_len, ar=ar
    )
    tick = lap("evaluation", tick)
    timings["total"] = round(time.perf_counter() - started, 1)
    cpu_timings["total"] = round(time.process_time() - cpu_started, 1)

    (out / "heldout_slice.json").write_text(
        json.dumps(
            {
                "description": "Fixed evaluation slice re-checked by tests/test_family.py: per "
                "file, whole lines from its middle; each evaluated as "
                "[EOS] + tokens, DFlash anchors at every position.",
                "licence": "Python Software Foundation License (excerpts of CPython's stdlib)",
                "python_version": platform.python_version(),
                "files": heldout_files[: args.slice_files],
                "texts": texts,
            },
            indent=1,
        )
        + "\n"
    )
    command = "python scripts/train_family.py " + shlex.join(
        recipe_args(argv if argv is not None else sys.argv[1:])
    )
    metrics = {
        "command": command.strip(),
        "seed": args.seed,
        "threads": args.threads,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "cpu": cpu_name(),
        "timings_s": timings,
        "cpu_timings_s": cpu_timings,
        "corpus": {
            "root": "<stdlib>",
            "num_train_files": len(train_files),
            "num_heldout_files": len(heldout_files),
            "train_bytes": corpus_bytes,
            "train_tokens": len(train_stream),
            "bytes_per_token": round(corpus_bytes / len(train_stream), 3),
            "heldout_files": heldout_files,
        },
        "hparams": {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in vars(args).items()
        },
        "sizes": {
            "target_params": param_count(target),
            "dflash_params": param_count(dflash),
            "ar_params": param_count(ar),
            "target_mb": round(dir_size_mb(target_dir), 2),
            "dflash_mb": round(dir_size_mb(dflash_dir), 2),
            "ar_mb": round(dir_size_mb(ar_dir), 2),
            "dflash_target_layer_ids": list(feature_layers),
        },
        "training": {
            "target_tokens_seen": args.target_steps * args.batch_size * args.seq_len,
            "drafter_tokens_seen": sum(
                seq_len * batch_size * num_steps
                for seq_len, batch_size, _, num_steps in drafter_stages
            )
            + args.rollout_steps * args.rollout_batch_size * rollouts.shape[1],
            "target_final_loss": sum(h["loss"] for h in target_history[-20:]) / 20,
            "dflash_final_loss": sum(h["dflash"] for h in drafter_history[-20:]) / 20,
            "ar_final_loss": sum(h["ar"] for h in drafter_history[-20:]) / 20,
        },
        "heldout": heldout.to_dict() | {"anchor_stride": args.heldout_anchor_stride},
        "slice": slice_metrics.to_dict() | {"anchor_stride": 1},
        "heldout_rollouts": rollout_metrics.to_dict() | {"anchor_stride": 1},
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out / "MODEL_CARD.md").write_text(render_card(metrics))
    print(
        json.dumps(
            {
                "timings_s": timings,
                "heldout_ppl": heldout.target_ppl,
                "dflash_acc_vs_target": heldout.dflash_acc_vs_target,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
