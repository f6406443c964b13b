"""The block-diffusion objective of a DFlash drafter, for training and evaluation.

One training window of S tokens gives the frozen target's features (hidden states
at `target_layer_ids`) for every position. We pick N *anchor* positions a in
[1, S - block_size]; each anchor makes one block

    inputs     x[a]   MASK    MASK   ...  MASK          (block_size tokens)
    positions  a      a+1     a+2    ...  a+bs-1
    predicts   -      tok a+1 tok a+2 ... tok a+bs-1    (block position j = depth j)

which sees the context features of positions < a (strictly: at decode time the
root's own features do not exist yet -- the target has not processed the root) and
its own block, bidirectionally, but no other block. All N blocks of a window go
through the drafter in one forward, kept apart by the attention mask.

The loss at depth j is a cross-entropy weighted by exp(-(j - 1) / decay) (decay 4.0,
as in the public DFlash recipes): early depths decide whether later ones are ever
reached, so they matter most. The label of depth j comes from the frozen target at
position a + j - 1 (teacher-forced on the text), not from the corpus token: speculative
decoding accepts what the *target* emits. `distill.train_drafters` offers two labels:

* `greedy` (default): one-hot of the target's argmax -- exactly the token a
  temperature-0 verifier accepts. The drafter's probabilities then estimate
  P(target's greedy token = x), which is what DDTree's best-first heap ranks nodes by.
* `soft`: the target's whole next-token distribution (plain distillation). Its
  probabilities are flatter than P(argmax = x): the target's top token carries, say,
  0.4 of its own softmax yet is the argmax every time. On the pycoder family the soft
  drafter spread DDTree's budget over siblings it did not need (engine tau at budget
  32 only 1.16x the chain's on HumanEval, against 1.33x with the same drafter's
  logits sharpened by 1/0.7) -- the mismatch that made us switch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LOSS_DECAY = 4.0


def sample_anchors(
    batch_size: int, seq_len: int, num_anchors: int, block_size: int, generator: torch.Generator
) -> torch.Tensor:
    """[batch_size, num_anchors] int64, sorted, distinct per row, in [1, seq_len - block_size]."""
    num_candidates = seq_len - block_size
    if num_anchors > num_candidates:
        raise ValueError(f"{num_anchors} anchors do not fit a window of {seq_len} tokens")
    scores = torch.rand(batch_size, num_candidates, generator=generator)
    picks = scores.topk(num_anchors, dim=1).indices + 1  # [B, N] in 1..S-bs
    return picks.sort(dim=1).values


def block_inputs(
    input_ids: torch.Tensor,  # [B, S] int64
    anchors: torch.Tensor,  # [B, N] int64
    block_size: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block token ids, block position ids), each [B, N * block_size] int64."""
    batch_size, num_anchors = anchors.shape
    offsets = torch.arange(block_size)
    positions = (anchors[:, :, None] + offsets).reshape(batch_size, -1)  # [B, N*bs]
    tokens = torch.full((batch_size, num_anchors, block_size), mask_token_id, dtype=torch.long)
    tokens[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return tokens.reshape(batch_size, -1), positions


def block_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[B, 1, N * bs, S + N * bs] bool (True = attend): block n sees context positions
    < anchors[:, n] and every position of block n itself."""
    batch_size, num_anchors = anchors.shape
    num_queries = num_anchors * block_size
    query_block = torch.arange(num_queries) // block_size  # [Q]
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    sees_context = torch.arange(seq_len)[None, None, :] < query_anchor[:, :, None]  # [B, Q, S]
    sees_block = (query_block[:, None] == query_block[None, :]).expand(batch_size, -1, -1)
    return torch.cat([sees_context, sees_block], dim=2)[:, None]


def depth_weights(block_size: int, decay: float = LOSS_DECAY) -> torch.Tensor:
    """[block_size] float: 0 for the root (block position 0), exp(-(j-1)/decay) for depth j."""
    depth = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(depth - 1).clamp(min=0) / decay)
    weights[0] = 0.0
    return weights


def teacher_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, N, bs] int64: the window position whose next-token prediction is the label of
    each block position (a + j - 1 for depth j; the root's entry is a dummy, weight 0)."""
    return anchors[:, :, None] + torch.arange(block_size).clamp(min=1) - 1


def draft_block_logits(
    drafter: torch.nn.Module,
    embed_tokens: torch.nn.Module,
    lm_head: torch.nn.Module,
    features: torch.Tensor,  # [B, S, F] target features of the window
    input_ids: torch.Tensor,  # [B, S] int64
    anchors: torch.Tensor,  # [B, N] int64
    mask_token_id: int,
) -> torch.Tensor:
    """Drafter logits [B, N, block_size, V] for every block of the window."""
    block_size = drafter.config.block_size
    batch_size, seq_len = input_ids.shape
    block_ids, block_positions = block_inputs(input_ids, anchors, block_size, mask_token_id)
    context_positions = torch.arange(seq_len).expand(batch_size, -1)
    hidden = drafter(
        noise_embedding=embed_tokens(block_ids),
        target_hidden=features,
        position_ids=torch.cat([context_positions, block_positions], dim=1),
        attention_mask=block_attention_mask(anchors, seq_len, block_size),
    )  # [B, N*bs, H]
    return lm_head(hidden).view(batch_size, anchors.shape[1], block_size, -1)


def gather_positions(per_position: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """per_position [B, S, ...] gathered at positions [B, N, bs] -> [B, N, bs, ...]."""
    batch_size, num_anchors, block_size = positions.shape
    flat = positions.reshape(batch_size, -1)
    index = flat.view(*flat.shape, *([1] * (per_position.dim() - 2)))
    index = index.expand(-1, -1, *per_position.shape[2:])
    return torch.gather(per_position, 1, index).view(
        batch_size, num_anchors, block_size, *per_position.shape[2:]
    )


def dflash_loss(
    draft_logits: torch.Tensor,  # [B, N, bs, V]
    teacher_probs: torch.Tensor,  # [B, N, bs, V] label distribution per block position
    decay: float = LOSS_DECAY,
) -> torch.Tensor:
    """Depth-weighted cross-entropy (root position excluded), normalised by the weights."""
    block_size = draft_logits.shape[2]
    per_position = -(teacher_probs * F.log_softmax(draft_logits.float(), dim=-1)).sum(-1)
    weights = depth_weights(block_size, decay)  # [bs]
    return (per_position * weights).sum() / (weights.sum() * math.prod(per_position.shape[:2]))


def leading_hits(draft_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, N] int64: per block, how many depths from 1 on match the labels before the
    first miss (the tokens a chain verifier would accept)."""
    hits = draft_logits[:, :, 1:].argmax(-1) == labels[:, :, 1:]  # [B, N, bs-1]
    return hits.long().cumprod(-1).sum(-1)


def depth_hits(draft_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[bs - 1] int64: per depth 1..bs-1, how many blocks' top-1 equals the label.
    draft_logits [B, N, bs, V]; labels [B, N, bs] int64 (position 0 ignored)."""
    hits = draft_logits[:, :, 1:].argmax(-1) == labels[:, :, 1:]  # [B, N, bs-1]
    return hits.flatten(0, 1).sum(0)
