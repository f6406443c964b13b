"""MODEL_CARD.md of the shipped family, rendered from the trainer's metrics.json."""

from __future__ import annotations


def _row(values: list[float]) -> str:
    return " | ".join(f"{value:.3f}" for value in values)


def _accuracy_table(metrics: dict) -> str:
    heldout, slice_, rollouts = metrics["heldout"], metrics["slice"], metrics["heldout_rollouts"]
    depths = len(heldout["dflash_acc_vs_target"])
    header = "| data | labels | " + " | ".join(f"d={d}" for d in range(1, depths + 1)) + " |"
    rule = "|---|---|" + "---|" * depths
    rows = [
        f"| held-out prefixes + target's greedy continuation ({rollouts['num_blocks']} blocks) "
        f"| target greedy | {_row(rollouts['dflash_acc_vs_target'])} |",
        f"| held-out (stride {heldout['anchor_stride']}, {heldout['num_blocks']} blocks) "
        f"| target greedy | {_row(heldout['dflash_acc_vs_target'])} |",
        f"| held-out | corpus text | {_row(heldout['dflash_acc_vs_text'])} |",
        f"| test slice (every anchor, {slice_['num_blocks']} blocks) "
        f"| target greedy | {_row(slice_['dflash_acc_vs_target'])} |",
        f"| test slice | corpus text | {_row(slice_['dflash_acc_vs_text'])} |",
    ]
    return "\n".join([header, rule, *rows])


def _stage_table(hp: dict) -> str:
    rows = [
        "   | stage | window | batch | DFlash blocks per window | steps |",
        "   |---|---|---|---|---|",
    ]
    stages = zip(
        hp["drafter_seq_lens"],
        hp["drafter_batch_sizes"],
        hp["drafter_anchors"],
        hp["drafter_steps"],
        strict=True,
    )
    for stage_idx, (seq_len, batch_size, anchors, steps) in enumerate(stages, start=1):
        rows.append(f"   | {stage_idx} | {seq_len} corpus | {batch_size} | {anchors} | {steps} |")
    if not hp["rollout_steps"]:
        return "\n".join(rows)
    window = hp["rollout_prefix_len"] + hp["rollout_new_tokens"]
    rows.append(
        f"   | {len(rows) - 1} | {window} = {hp['rollout_prefix_len']} corpus + "
        f"{hp['rollout_new_tokens']} target greedy ({hp['rollout_count']} rollouts) "
        f"| {hp['rollout_batch_size']} | {hp['rollout_anchors']} | {hp['rollout_steps']} |"
    )
    return "\n".join(rows)


def _label_text(hp: dict, training: dict) -> str:
    if hp["drafter_labels"] == "greedy":
        return f"""Label at depth d = the target's greedy (argmax) token at
     position anchor+d-1, teacher-forced along the text: exactly what temperature-0
     verification accepts, so the drafter's probabilities estimate P(target's greedy
     token = x) -- what DDTree's heap ranks nodes by. (Labelled with the target's whole
     distribution instead, the drafter came out flatter than that and DDTree at budget
     32 gained only 1.16x over the chain on HumanEval, see `dflash_objective.py`.) Peak LR
     {hp["dflash_lr"]}. Final loss {training["dflash_final_loss"]:.3f} (cross-entropy)."""
    return f"""Label at depth d = the target's next-token *distribution* at
     position anchor+d-1 (distillation; speculative decoding accepts what the target
     emits, not what the corpus says). Peak LR {hp["dflash_lr"]}. Final loss
     {training["dflash_final_loss"]:.3f} (soft cross-entropy, includes the target's entropy)."""


def _ar_ppl_note(hp: dict) -> str:
    if hp["drafter_labels"] != "greedy":
        return ""
    return (
        " on corpus text (high by design: trained on the target's one-hot argmax, it is"
        " confident, and the corpus token is often not the target's choice)"
    )


def render_card(metrics: dict) -> str:
    hp, sizes, corpus = metrics["hparams"], metrics["sizes"], metrics["corpus"]
    heldout, slice_, timings = metrics["heldout"], metrics["slice"], metrics["timings_s"]
    rollouts = metrics["heldout_rollouts"]
    cpu = metrics["cpu_timings_s"]
    training = metrics["training"]
    total_mb = sizes["target_mb"] + sizes["dflash_mb"] + sizes["ar_mb"]
    heldout_list = "\n".join(f"  `{name}`" for name in corpus["heldout_files"])
    return f"""# pycoder: a tiny Qwen3 family for DDTree on CPU

Three models trained from scratch, on CPU, on the Python standard library's own
source, so that DDTree speculative decoding can be measured with a drafter that was
really trained against its target. They write plausible-looking Python, nothing more.

| model | directory | architecture | parameters | file |
|---|---|---|---|---|
| target | `target/` | Qwen3, layers {hp["target_layers"]}, hidden {hp["target_hidden"]}, heads {hp["target_heads"]} (KV heads {hp["target_kv_heads"]}), head dim {hp["target_hidden"] // hp["target_heads"]}, vocab {hp["vocab_size"]} | {sizes["target_params"] / 1e6:.2f} M | {sizes["target_mb"]:.1f} MB |
| DFlash drafter | `dflash/` | z-lab `DFlashDraftModel`, layers {hp["dflash_layers"]}, block {hp["block_size"]}, features of target layers {sizes["dflash_target_layer_ids"]}; uses the target's embeddings and lm_head | {sizes["dflash_params"] / 1e6:.2f} M | {sizes["dflash_mb"]:.1f} MB |
| autoregressive drafter | `ar/` | Qwen3, layers {hp["ar_layers"]}, hidden {hp["ar_hidden"]}, same tokenizer | {sizes["ar_params"] / 1e6:.2f} M | {sizes["ar_mb"]:.1f} MB |

All weights fp32 safetensors, {total_mb:.1f} MB in total. `target/` is a plain
Transformers/vLLM model directory (config.json, model.safetensors, tokenizer files,
generation_config.json, ChatML chat template); `dflash/` is in z-lab's checkpoint
layout (`--drafter dflash:models/pycoder/dflash`); `ar/` is a plain causal LM
(`--drafter autoregressive:models/pycoder/ar`).

## Held-out results

Target perplexity (per token, context up to {hp["seq_len"]} tokens):
**{heldout["target_ppl"]:.3f}** on all held-out files ({heldout["num_tokens"]} tokens);
**{slice_["target_ppl"]:.3f}** on the fixed test slice ({slice_["num_tokens"]} tokens).
The target's greedy token equals the next corpus token {heldout["target_top1_vs_text"]:.1%}
of the time.

DFlash drafter, top-1 accuracy per depth d (block position d after the root), against
the target's own greedy token (teacher-forced along the corpus text; at d=1 exactly
the token engine-mode verification accepts) and against the corpus text:

{_accuracy_table(metrics)}

The first row is what temperature-0 decoding meets: {hp["heldout_rollouts"]} held-out
prefixes of {hp["rollout_prefix_len"]} tokens, continued {hp["heldout_rollout_tokens"]} tokens by the target's
own greedy decoding, blocks rooted at every generated position. There, the mean
acceptance length of the plain DFlash chain (1 + leading depths right) is
**{rollouts["dflash_chain_tau"]:.2f}**; on corpus text (teacher-forced) it would be
{heldout["dflash_chain_tau"]:.2f}.

Autoregressive drafter: held-out perplexity {heldout["ar_ppl"]:.3f}{_ar_ppl_note(hp)}; its top-1 equals
the target's greedy token {heldout["ar_top1_vs_target"]:.1%} of the time on held-out
text, {rollouts["ar_top1_vs_target"]:.1%} on the target's greedy continuations.

`tests/test_family.py` recomputes the test-slice perplexity and the DFlash depth-1
accuracy (vs target greedy) from the shipped files and checks them against
`metrics.json` (within 2%). The slice (text in `heldout_slice.json`) is, per held-out
file, whole lines from its middle, evaluated as [EOS] + tokens.

## How it was trained

```
{metrics["command"]}
```

Seed {metrics["seed"]}, torch intra-op threads fixed at {metrics["threads"]},
`torch.use_deterministic_algorithms(True)`; Python {metrics["python_version"]}, torch
{metrics["torch_version"]}. Same machine + same thread count -> same weights.

1. **Corpus**: every `.py` file of CPython {metrics["python_version"]}'s standard library
   (`sysconfig.get_paths()['stdlib']`), sorted by path, without `test/`, `tests/`,
   `idlelib/`, `lib2to3/`, `turtledemo/`, `site-packages/`. Every
   {hp["heldout_every"]}th file (from index {hp["heldout_every"] // 2}) is held out:
   {corpus["num_train_files"]} training files ({corpus["train_bytes"] / 1e6:.1f} MB,
   {corpus["train_tokens"]} tokens), {corpus["num_heldout_files"]} held-out files.
2. **Tokenizer**: byte-level BPE (`tokenizers`), vocabulary {hp["vocab_size"]} including
   `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<|mask|>` (DFlash's mask token),
   trained on the training files only: {corpus["bytes_per_token"]} bytes per token.
   Each file is one document, preceded by `<|endoftext|>`.
3. **Target**: initialised as a bigram model of the training stream
   (`training/bigram_init.py`: embeddings and lm_head fitted, {hp["bigram_steps"]}
   full-batch steps, to the count-weighted bigram cross-entropy; every block's
   `o_proj`/`down_proj` zeroed so the fresh network *is* that bigram model) -- with
   half a million training tokens, a random start spends most of them relearning
   which token follows which. Then next-token cross-entropy on random
   {hp["seq_len"]}-token windows, batch
   {hp["batch_size"]}, {hp["target_steps"]} steps ({training["target_tokens_seen"]} tokens),
   AdamW (betas 0.9/0.95, weight decay {hp["weight_decay"]}), peak LR {hp["target_lr"]},
   {hp["warmup_steps"]} warm-up steps then cosine to a tenth. Final training loss
   {training["target_final_loss"]:.3f} nats.
4. **Drafters**, against the frozen target, one target forward per batch feeding
   both, in stages of growing window length ({training["drafter_tokens_seen"]} tokens in all;
   a fresh DFlash drafter learns where to attend far faster over short contexts, see
   `training/distill.py`):

{_stage_table(hp)}

   * DFlash: block-diffusion objective (public DFlash recipes: SpecForge, NVIDIA
     Model-Optimizer): random anchors per window (table above); each block = the
     anchor token + {hp["block_size"] - 1} `<|mask|>` tokens at positions anchor..anchor+{hp["block_size"] - 1},
     attending to the target features of positions before the anchor and,
     bidirectionally, to its own block; cross-entropy at the masked positions with
     weight exp(-(d-1)/4). {_label_text(hp, training)}
   * Autoregressive: bigram-initialised like the target, then next-token
     cross-entropy against the same labels.
     Peak LR {hp["ar_lr"]}. Final loss {training["ar_final_loss"]:.3f}.

Training time, measured with {metrics["threads"]} torch thread(s) on a 2-core machine
({metrics["cpu"]}) that other jobs shared while it ran -- wall clock (pessimistic: it
includes waiting for a core) and this process's CPU time:

| phase | wall | CPU |
|---|---|---|
| corpus + tokenizer | {timings["tokenizer"]:.0f} s | {cpu["tokenizer"]:.0f} s |
| target (bigram init + training) | {timings["target"]:.0f} s | {cpu["target"]:.0f} s |
| drafters | {timings["drafters"]:.0f} s | {cpu["drafters"]:.0f} s |
| evaluation | {timings["evaluation"]:.0f} s | {cpu["evaluation"]:.0f} s |
| **total** | **{timings["total"] / 60:.1f} min** | **{cpu["total"] / 60:.1f} min** |

One thread is the default because a 2-thread OpenMP run on a shared 2-core machine
was measured several times slower (each barrier waits for the busy core); on a quiet
machine `--threads 2` is faster still (different bits, same recipe).

## Limits

Trained for minutes on a few MB: it continues Python plausibly for a few lines, then
drifts or repeats. Trained on windows of {hp["seq_len"]} tokens; longer contexts are
outside its training distribution. Not instruction-tuned (the chat template exists
so chat requests are well-formed). For speed measurements only.

## Licence

Training data: CPython standard library sources, Python Software Foundation License
(`heldout_slice.json` contains short excerpts of them). Weights: the repository's
licence.

Held-out files:
{heldout_list}
"""
