"""Engine mode assembled: a local target, its tokenizer and a drafter in one process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from proxy.backend.local import LocalTarget
from proxy.drafter import load_drafter
from proxy.drafter.base import Drafter, TargetInfo

REPO_ROOT = Path(__file__).resolve().parents[1]
# The embedded default: the shipped tiny family (see models/pycoder/MODEL_CARD.md).
DEFAULT_TARGET_DIR = REPO_ROOT / "models" / "pycoder" / "target"
DEFAULT_DRAFTER = f"dflash:{REPO_ROOT / 'models' / 'pycoder' / 'dflash'}"


def target_info(config, model_dir: Path | None, model: torch.nn.Module | None) -> TargetInfo:
    return TargetInfo(
        vocab_size=int(config.vocab_size),
        num_hidden_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        model_dir=model_dir,
        model=model,
    )


@dataclass
class Engine:
    target: LocalTarget
    tokenizer: PreTrainedTokenizerBase
    drafter: Drafter | None

    @classmethod
    def load(
        cls,
        target_dir: str | Path,
        drafter_spec: str | None,
        device: str | None = None,
        dtype: str | None = None,
    ) -> "Engine":
        """device: auto (default: CUDA when present, else CPU), cpu, cuda, cuda:N;
        dtype: auto (default: bfloat16 on CUDA, float32 on CPU), float32, bfloat16,
        float16. Model drafters run on the target's device in its dtype."""
        target_dir = Path(target_dir)
        target = LocalTarget.from_dir(target_dir, dtype=dtype, device=device)
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        drafter = None
        if drafter_spec:
            info = target_info(target.model.config, target_dir, target.model)
            drafter = load_drafter(drafter_spec, info)
        return cls(target=target, tokenizer=tokenizer, drafter=drafter)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
