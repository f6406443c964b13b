"""How long one engine step takes on a GPU: a roofline of the profiled model and GPU.

A step reads every weight once and the KV cache of every scheduled sequence's context,
and does 2 FLOP per parameter per scheduled token (plus attention and the lm_head of
each sampled sequence); it lasts as long as the slower of the two at an achieved
fraction of the datasheet ceiling, plus a fixed per-step cost and a per-sequence cost
(the engine's scheduling, sampling and output bookkeeping, on the host):

    step_s = max(bytes / (bandwidth * hbm_efficiency), flops / (peak * mfu))
             + step_overhead_s + per_seq_s * scheduled sequences

Constants, with sources (bf16 weights and KV cache, one GPU, no tensor parallelism):

| constant | value | source |
|---|---|---|
| H200 SXM HBM3e | 141 GB, 4.8 TB/s | https://www.nvidia.com/en-us/data-center/h200/ |
| H200 / H100 SXM bf16 dense | 989 TFLOP/s (the sheets' 1,979 is with sparsity) | same pages |
| H100 SXM HBM3 | 80 GB, 3.35 TB/s | https://www.nvidia.com/en-us/data-center/h100/ |
| Llama-3.1-8B | 32 layers, hidden 4096, MLP 14336, 32 q / 8 KV heads x 128, vocab 128256, untied | https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json |
| dense 27B | Qwen3.6-27B's dims (64 layers, hidden 5120, MLP 17408, 24 gated q / 4 KV heads x 256, vocab 248320, untied) with every layer full attention | https://huggingface.co/Qwen/Qwen3.6-27B/blob/main/config.json (`text_config`) |
| gpu_memory_utilization, block size | 0.92 (the KV budget: 92 % of HBM less the weights), 16 tokens | vLLM 0.32's defaults, `vllm/config/cache.py` |
| host: per call, per prompt | 3 ms, 0.2 ms | ASSUMPTION, `benchmarks.cost_model.FAST_HOST` |

The dense 27B is not a released model: Qwen3.6-27B runs 48 of its 64 layers as Gated
DeltaNet, which no attention mask can verify a tree through; this profile is the
attention-only target of that size the proxy is built for (`cost_model`'s `dense27b`).

The efficiencies (`Efficiency`) are ASSUMPTIONS, chosen once for both profiles and both
GPUs and checked against published vLLM decode figures in `benchmarks.gpu_sim.validation`:
75 % of datasheet bandwidth (about the cost model's decode rate: 85 % of the 4.3 TB/s
this workplace's H200 copied, `cost_model.H200_BANDWIDTH`), 55 % of peak FLOP/s for
prefill (`cost_model.PREFILL_MFU`, there of a measured 788 TFLOP/s), 2 ms per step and
40 us per scheduled sequence (vLLM's scheduler, sampler and output processing; these
two were set with the published figures in view).
"""

from __future__ import annotations

from dataclasses import dataclass

BF16 = 2  # bytes per weight and per KV element


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes: float  # datasheet capacity
    bandwidth: float  # bytes/s, datasheet
    bf16_flops: float  # FLOP/s, dense, datasheet


H200 = Gpu("H200 SXM", hbm_bytes=141e9, bandwidth=4.8e12, bf16_flops=989e12)
H100 = Gpu("H100 SXM", hbm_bytes=80e9, bandwidth=3.35e12, bf16_flops=989e12)


@dataclass(frozen=True)
class Model:
    """A dense decoder (every layer full attention, GQA, gated MLP), untied lm_head."""

    name: str
    num_layers: int
    hidden: int
    intermediate: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    attn_output_gate: bool = False  # q projection twice as wide (Qwen3.5/3.6)

    @property
    def layer_params(self) -> int:
        q_width = self.num_q_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        q_proj = self.hidden * q_width * (2 if self.attn_output_gate else 1)
        attention = q_proj + 2 * self.hidden * kv_width + q_width * self.hidden
        return attention + 3 * self.hidden * self.intermediate

    @property
    def body_params(self) -> int:
        return self.num_layers * self.layer_params

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def params_total(self) -> int:
        return self.body_params + 2 * self.lm_head_params  # embedding as large as lm_head

    @property
    def weight_bytes_read(self) -> int:
        """Bytes one step reads: every weight but the embedding (it gathers rows)."""
        return (self.body_params + self.lm_head_params) * BF16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * BF16


LLAMA31_8B = Model("Llama-3.1-8B", num_layers=32, hidden=4096, intermediate=14336,
                   num_q_heads=32, num_kv_heads=8, head_dim=128, vocab=128256)  # fmt: skip
DENSE_27B = Model("dense-27B", num_layers=64, hidden=5120, intermediate=17408, num_q_heads=24,
                  num_kv_heads=4, head_dim=256, vocab=248320, attn_output_gate=True)  # fmt: skip


@dataclass(frozen=True)
class Efficiency:
    """ASSUMPTIONS (see the module docstring), one set for every profile."""

    hbm: float = 0.75  # achieved / datasheet bandwidth
    mfu: float = 0.55  # achieved / datasheet FLOP/s
    step_overhead_s: float = 0.002  # per engine step
    per_seq_s: float = 40e-6  # per scheduled sequence per step


@dataclass(frozen=True)
class StepWork:
    """What one engine step computes, summed over its scheduled sequences."""

    num_seqs: int  # sequences scheduled (decode or a prefill chunk)
    num_tokens: int  # tokens computed: 1 per decode, the chunk per prefill
    num_sampled: int  # sequences that sample a token (lm_head rows)
    kv_tokens: int  # context tokens whose KV the step reads (each sequence's, after it)
    attention_pairs: int  # (query token, key token) pairs of causal attention


@dataclass(frozen=True)
class Profile:
    name: str
    model: Model
    gpu: Gpu
    efficiency: Efficiency = Efficiency()
    per_call_s: float = 0.003  # API server: one HTTP call (cost_model.FAST_HOST)
    per_prompt_s: float = 0.0002  # API server: each prompt of a call
    gpu_memory_utilization: float = 0.92

    def step_s(self, work: StepWork) -> float:
        model, gpu, eff = self.model, self.gpu, self.efficiency
        read = model.weight_bytes_read + work.kv_tokens * model.kv_bytes_per_token
        flops = (
            2 * model.body_params * work.num_tokens + 2 * model.lm_head_params * work.num_sampled
        )
        # QK^T and PV: 2 FLOP each per pair, per query head and head dim, in every layer
        flops += 4 * work.attention_pairs * model.num_q_heads * model.head_dim * model.num_layers
        roofline = max(read / (gpu.bandwidth * eff.hbm), flops / (gpu.bf16_flops * eff.mfu))
        return roofline + eff.step_overhead_s + eff.per_seq_s * work.num_seqs

    def num_kv_blocks(self, block_size: int) -> int:
        """KV blocks that fit beside the weights in gpu_memory_utilization of HBM."""
        free = self.gpu.hbm_bytes * self.gpu_memory_utilization - self.model.params_total * BF16
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on one {self.gpu.name}")
        return int(free // (block_size * self.model.kv_bytes_per_token))

    def decode_step_s(self, num_seqs: int = 1, context: int = 0) -> float:
        """One decode step of `num_seqs` sequences of `context` tokens each."""
        work = StepWork(num_seqs, num_seqs, num_seqs, num_seqs * (context + 1),
                        num_seqs * (context + 1))  # fmt: skip
        return self.step_s(work)


PROFILES = {
    "dense27b-h200": Profile("dense27b-h200", DENSE_27B, H200),
    "llama8b-h200": Profile("llama8b-h200", LLAMA31_8B, H200),
}


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"Unknown GPU profile: {name!r}; valid: {sorted(PROFILES)}") from None
