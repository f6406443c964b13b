"""Build small Qwen3-architecture model directories that both Transformers and vLLM load.

Used by the tests (random-weight targets and drafters of chosen shapes) and by the
model-family trainer. No hub access: the tokenizer is built locally with the
`tokenizers` library.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END, MASK_TOKEN]

# ChatML, the format of the Qwen family, so chat requests look like the real thing.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_level_tokenizer(corpus: list[str] | None = None, vocab_size: int = 260) -> Tokenizer:
    """A byte-level BPE tokenizer: the 256 bytes, the special tokens, and (when a
    corpus is given) BPE merges up to `vocab_size`. With no corpus, no merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(SPECIAL_TOKENS)),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus or [], trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path) -> PreTrainedTokenizerFast:
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END, MASK_TOKEN],
        chat_template=CHAT_TEMPLATE,
    )
    hf_tokenizer.save_pretrained(str(out_dir))
    return hf_tokenizer


def qwen3_config(
    vocab_size: int,
    num_layers: int,
    hidden_size: int,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    eos_token_id: int = 0,
    initializer_range: float = 0.02,
) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        initializer_range=initializer_range,
        torch_dtype="float32",
    )


def random_qwen3(
    out_dir: str | Path,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    initializer_range: float = 0.02,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a random-weight fp32 Qwen3 with the byte-level tokenizer to `out_dir`.

    A larger `initializer_range` spreads the logits, which keeps greedy argmaxes
    away from near-ties that would make exact-equality tests flaky.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_tokenizer()
    hf_tokenizer = save_tokenizer(tokenizer, out_dir)
    config = qwen3_config(
        vocab_size=len(hf_tokenizer),
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        eos_token_id=hf_tokenizer.eos_token_id,
        initializer_range=initializer_range,
        max_position_embeddings=max_position_embeddings,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float().eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir
