"""Next-token training and held-out negative log-likelihood of a causal LM."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from training.corpus import WindowSampler


def lr_at(step: int, num_steps: int, peak_lr: float, warmup_steps: int) -> float:
    """Linear warm-up to `peak_lr`, then cosine decay to a tenth of it."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(
    modules: list[torch.nn.Module], lr: float, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of `modules`; matrices decay, norms do not."""
    params = [p for module in modules for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def next_token_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of tokens 1..S-1 given their prefixes; input_ids [B, S] int64."""
    logits = model(input_ids=input_ids).logits  # [B, S, V]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


def run_steps(
    step_fn: Callable[[int], dict[str, float]],
    optimizers: list[torch.optim.Optimizer],
    peak_lrs: list[float],
    num_steps: int,
    warmup_steps: int,
    desc: str,
    clip_params: list[list[torch.nn.Parameter]],
    max_grad_norm: float = 1.0,
) -> list[dict[str, float]]:
    """The shared optimisation loop: set the scheduled learning rates, let `step_fn`
    compute losses and call backward, clip, step. Returns `step_fn`'s logs."""
    history = []
    progress = tqdm(range(num_steps), desc=desc, mininterval=5.0, smoothing=0.1)
    for step in progress:
        for optimizer, peak_lr in zip(optimizers, peak_lrs, strict=True):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, num_steps, peak_lr, warmup_steps)
        logs = step_fn(step)
        for params in clip_params:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        history.append(logs)
        progress.set_postfix({key: f"{value:.3f}" for key, value in logs.items()}, refresh=False)
    return history


def train_causal_lm(
    model: torch.nn.Module,
    sampler: WindowSampler,
    num_steps: int,
    peak_lr: float,
    warmup_steps: int,
    weight_decay: float,
    desc: str,
) -> list[dict[str, float]]:
    """Plain next-token training on windows from `sampler`."""
    model.train()
    optimizer = make_optimizer([model], peak_lr, weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]

    def step_fn(step: int) -> dict[str, float]:
        loss = next_token_loss(model, sampler.next_batch())
        loss.backward()
        return {"loss": loss.item()}

    history = run_steps(step_fn, [optimizer], [peak_lr], num_steps, warmup_steps, desc, [params])
    model.eval()
    return history

