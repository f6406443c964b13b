"""Held-out metrics of a model family, shared by the trainer and `tests/test_family.py`.

Definitions (all on held-out windows, each token predicted from its own window's
prefix):
* target perplexity = exp(mean next-token NLL in nats) under the target.
* target greedy token at position t = argmax of the target's next-token distribution
  given the window's tokens 0..t.
* DFlash depth-d accuracy: over blocks rooted at anchor a (every `anchor_stride`-th
  position from 1), the share whose top-1 at block position d equals
  - `vs_target`: the target's greedy token at a + d - 1 (teacher-forced on the text;
    for d = 1 this is exactly the token engine-mode verification accepts), or
  - `vs_text`: the corpus token at a + d.
* DFlash chain tau: mean over blocks of 1 + the leading depths whose top-1 equals
  the target's greedy token (on the target's own greedy continuations: exactly the
  chain's acceptance length at temperature 0; on corpus text a teacher-forced proxy).
* AR drafter: its perplexity and how often its top-1 equals the target's greedy token.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from proxy.drafter.dflash_model import DFlashDraftModel, select_target_features
from training.dflash_objective import (
    depth_hits,
    draft_block_logits,
    gather_positions,
    leading_hits,
)

ANCHORS_PER_FORWARD = 64  # blocks drafted per drafter forward during evaluation


@dataclass
class FamilyMetrics:
    num_windows: int
    num_tokens: int  # predicted tokens
    target_ppl: float
    target_top1_vs_text: float  # how often the target's greedy token is the corpus token
    num_blocks: int
    dflash_acc_vs_target: list[float]  # [block_size - 1], depth 1 first
    dflash_acc_vs_text: list[float]
    # Mean over blocks of 1 + the number of leading depths whose top-1 equals the
    # target's greedy token: on the target's own greedy continuations this is exactly
    # the acceptance length (tau) of the plain DFlash chain at temperature 0.
    dflash_chain_tau: float
    ar_ppl: float | None = None
    ar_top1_vs_target: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def slice_windows(tokenizer, texts: list[str], eos_token_id: int) -> list[torch.Tensor]:
    """The fixed evaluation slice: each text as one window [EOS, tokens...] int64."""
    return [
        torch.tensor([eos_token_id, *tokenizer.encode(text, add_special_tokens=False)])
        for text in texts
    ]


@torch.inference_mode()
def evaluate_family(
    target: torch.nn.Module,
    dflash: DFlashDraftModel,
    windows: list[torch.Tensor],  # each [len] int64
    anchor_stride: int = 1,
    ar: torch.nn.Module | None = None,
    first_anchor: int = 1,
) -> FamilyMetrics:
    """first_anchor: the first block root position (e.g. where a rollout's generated
    part starts); roots then every `anchor_stride` positions up to len - block_size."""
    config = dflash.config
    block_size = config.block_size
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    total_nll = total_ar_nll = 0.0
    num_tokens = target_hits = ar_agree = num_blocks = 0
    hits_vs_target = torch.zeros(block_size - 1, dtype=torch.long)
    hits_vs_text = torch.zeros(block_size - 1, dtype=torch.long)
    chain_accepted = 0
    for window in windows:
        input_ids = window[None]  # [1, L]
        out = target(input_ids=input_ids, output_hidden_states=True)
        logits = out.logits[0].float()  # [L, V]
        greedy = logits.argmax(-1)  # [L]: the target's token after each position
        total_nll += float(F.cross_entropy(logits[:-1], window[1:], reduction="sum"))
        num_tokens += len(window) - 1
        target_hits += int((greedy[:-1] == window[1:]).sum())
        if ar is not None:
            ar_logits = ar(input_ids=input_ids).logits[0, :-1].float()
            total_ar_nll += float(F.cross_entropy(ar_logits, window[1:], reduction="sum"))
            ar_agree += int((ar_logits.argmax(-1) == greedy[:-1]).sum())

        features = select_target_features(out.hidden_states, config.target_layer_ids)
        all_anchors = torch.arange(first_anchor, len(window) - block_size + 1, anchor_stride)
        for chunk in all_anchors.split(ANCHORS_PER_FORWARD):
            anchors = chunk[None]  # [1, N]
            draft_logits = draft_block_logits(
                dflash, embed_tokens, lm_head, features, input_ids, anchors, config.mask_token_id
            )  # [1, N, bs, V]
            label_positions = anchors[:, :, None] + torch.arange(block_size)  # [1, N, bs]
            text_labels = gather_positions(input_ids, label_positions)
            target_labels = gather_positions(greedy[None], (label_positions - 1).clamp(min=0))
            hits_vs_text += depth_hits(draft_logits, text_labels)
            hits_vs_target += depth_hits(draft_logits, target_labels)
            chain_accepted += int(leading_hits(draft_logits, target_labels).sum())
            num_blocks += chunk.numel()
    return FamilyMetrics(
        num_windows=len(windows),
        num_tokens=num_tokens,
        target_ppl=math.exp(total_nll / num_tokens),
        target_top1_vs_text=target_hits / num_tokens,
        num_blocks=num_blocks,
        dflash_acc_vs_target=(hits_vs_target / num_blocks).tolist(),
        dflash_acc_vs_text=(hits_vs_text / num_blocks).tolist(),
        dflash_chain_tau=1.0 + chain_accepted / num_blocks,
        ar_ppl=None if ar is None else math.exp(total_ar_nll / num_tokens),
        ar_top1_vs_target=None if ar is None else ar_agree / num_tokens,
    )
