"""Train both drafters against the frozen target, sharing one target forward per batch.

Per batch of corpus windows the target runs once (no gradients) and yields
* its hidden states at the DFlash `target_layer_ids` -- the drafter's context, and
* its next-token prediction at every position -- the label of both drafters: the
  one-hot argmax (`labels="greedy"`, default) or the whole distribution (`"soft"`);
  `dflash_objective` says why greedy fits temperature-0 DDTree.
The DFlash drafter then takes one step of the block-diffusion objective, and the
autoregressive drafter one step of next-token cross-entropy against the same
distributions (plain distillation). The target's embeddings and lm_head, which the
DFlash drafter uses as its own, stay frozen.

Training runs in stages of growing window length (a curriculum). A fresh DFlash
drafter can only predict anything by learning to attend from its mask positions to
the root and to the right context features; at first its attention is spread evenly
over every key, so with 512 context keys the useful ones get ~1/500 of it and the
gradient that would sharpen it is tiny. Measured here over 60 steps of 512 blocks:
depth-1 agreement with the target reached 0.32 with 32-token windows, 0.21 with 128
and under 0.10 with 512. Short windows first, then the long ones the drafter meets
at inference, and last the target's own greedy continuations (`rollouts.py`): the
text that temperature-0 decoding actually verifies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from proxy.drafter.dflash_model import DFlashDraftModel, select_target_features
from training.dflash_objective import (
    dflash_loss,
    draft_block_logits,
    gather_positions,
    sample_anchors,
    teacher_positions,
)
from training.lm import make_optimizer, run_steps


class BatchSource(Protocol):
    def next_batch(self) -> torch.Tensor:
        """[B, S] int64 token windows."""
        ...


@dataclass(frozen=True)
class DrafterStage:
    sampler: BatchSource  # corpus windows (WindowSampler) or target rollouts (RowSampler)
    num_steps: int
    num_anchors: int  # DFlash blocks per window


def train_drafters(
    target: torch.nn.Module,
    dflash: DFlashDraftModel,
    ar: torch.nn.Module,
    stages: list[DrafterStage],
    dflash_lr: float,
    ar_lr: float,
    warmup_steps: int,
    weight_decay: float,
    seed: int,
    labels: str = "greedy",
) -> list[dict[str, float]]:
    if labels not in ("greedy", "soft"):
        raise ValueError(f"labels must be 'greedy' or 'soft', got {labels!r}")
    label_kind = labels
    target.eval().requires_grad_(False)
    dflash.train()
    ar.train()
    config = dflash.config
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    optimizers = [
        make_optimizer([dflash], dflash_lr, weight_decay),
        make_optimizer([ar], ar_lr, weight_decay),
    ]
    anchor_generator = torch.Generator().manual_seed(seed)
    stage_of_step = [stage for stage in stages for _ in range(stage.num_steps)]

    def step_fn(step: int) -> dict[str, float]:
        stage = stage_of_step[step]
        input_ids = stage.sampler.next_batch()  # [B, S]
        batch_size, seq_len = input_ids.shape
        with torch.no_grad():
            out = target(input_ids=input_ids, output_hidden_states=True)
            features = select_target_features(out.hidden_states, config.target_layer_ids)
            logits = out.logits.float()  # [B, S, V]
            if label_kind == "greedy":
                teacher_probs = F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
            else:
                teacher_probs = F.softmax(logits, dim=-1)

        anchors = sample_anchors(
            batch_size, seq_len, stage.num_anchors, config.block_size, anchor_generator
        )
        draft_logits = draft_block_logits(
            dflash, embed_tokens, lm_head, features, input_ids, anchors, config.mask_token_id
        )  # [B, N, bs, V]
        labels = gather_positions(teacher_probs, teacher_positions(anchors, config.block_size))
        loss_dflash = dflash_loss(draft_logits, labels)
        loss_dflash.backward()
        with torch.no_grad():
            depth1 = (draft_logits[:, :, 1].argmax(-1) == labels[:, :, 1].argmax(-1)).float()

        ar_logprobs = F.log_softmax(ar(input_ids=input_ids).logits.float(), dim=-1)
        loss_ar = -(teacher_probs * ar_logprobs).sum(-1).mean()
        loss_ar.backward()
        return {
            "dflash": loss_dflash.item(),
            "acc1": depth1.mean().item(),
            "ar": loss_ar.item(),
        }

    clip = [
        [p for p in dflash.parameters() if p.requires_grad],
        [p for p in ar.parameters() if p.requires_grad],
    ]
    history = run_steps(
        step_fn, optimizers, [dflash_lr, ar_lr], len(stage_of_step), warmup_steps, "drafters", clip
    )
    dflash.eval()
    ar.eval()
    return history
