"""The simulator's decode figures against published vLLM figures for the same model
class and GPU, same batch and lengths (`python -m benchmarks.gpu_sim.validation`).

A published figure is the wall time of one offline batch (`vllm bench latency` /
`benchmarks/benchmark_latency.py`: `batch` prompts of `input_len` random tokens, each
generating `output_len` tokens, EOS ignored): the prefill step(s), then `output_len - 1`
decode steps. The simulated figure runs the same batch through `Engine` with the API
server's costs set to zero (an offline run has no HTTP front end). Sources:

* LLM-Inference-Bench (Argonne; Chitty-Venkata et al., arXiv:2411.00136), vLLM
  `benchmark_latency.py`, fp16 Llama-3-8B (same shapes as Llama-3.1-8B), one H100 80 GB
  HBM3, input = output = 128 tokens; the `Latency` column (seconds) of
  https://github.com/argonne-lcf/LLM-Inference-Bench/blob/main/Plots/All_results.csv
  (rows `Nvidia H100 GPU,1,vLLM,meta-llama/Meta-Llama-3-8B,128,<batch>`). An H100, not
  an H200: the simulator runs them on `roofline.H100` (3.35 TB/s: the H200's 4.8 x
  0.70, same 989 TFLOP/s), the profile's model and efficiencies unchanged. The paper
  does not name the H100's form factor; the SXM's bandwidth is the one that fits (a
  PCIe H100 at 2.0 TB/s cannot read the 15 GB of weights in the 7.7 ms per token
  measured at batch 1).
* vLLM's own nightly performance benchmark on an H200 (`latency_llama8B_tp1`:
  Llama-3.1-8B, input 32, output 128, batch 8, mean latency 833.421 ms),
  https://buildkite.com/vllm/performance-benchmark/builds/9515.

As of this writing (`python -m benchmarks.gpu_sim.validation`; tests/test_gpu_sim.py
holds every row within 25 %):

| GPU | batch | in / out | published | simulated | tok/s per request | error |
|---|---|---|---|---|---|---|
| H100 | 1 | 128 / 128 | 0.994 s | 1.027 s | 129 / 125 | +3% |
| H100 | 16 | 128 / 128 | 1.165 s | 1.170 s | 110 / 109 | +0% |
| H100 | 32 | 128 / 128 | 1.307 s | 1.325 s | 98 / 97 | +1% |
| H100 | 64 | 128 / 128 | 1.688 s | 1.635 s | 76 / 78 | -3% |
| H200 | 8 | 32 / 128 | 0.833 s | 0.837 s | 154 / 153 | +0% |

No published vLLM figure for a dense ~27B model on one H100 or H200 at batch 1 or 16
was found in vLLM's docs, issues, recipes and benchmark pages (searched 2026-12-03):
the dense 27B profile is not validated on its own, only through the efficiencies it
shares with the 8B.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from benchmarks.gpu_sim.engine import Engine
from benchmarks.gpu_sim.roofline import H100, H200, LLAMA31_8B, Profile

ARGONNE = "https://github.com/argonne-lcf/LLM-Inference-Bench/blob/main/Plots/All_results.csv"
VLLM_CI = "https://buildkite.com/vllm/performance-benchmark/builds/9515"


@dataclass(frozen=True)
class Published:
    gpu: str  # a key of GPUS
    batch: int
    input_len: int
    output_len: int
    latency_s: float  # wall time of the whole batch
    source: str


GPUS = {"H100": H100, "H200": H200}
PUBLISHED_8B = (
    Published("H100", 1, 128, 128, 0.9939330658666686, ARGONNE),
    Published("H100", 16, 128, 128, 1.1650919041333434, ARGONNE),
    Published("H100", 32, 128, 128, 1.3065569956999903, ARGONNE),
    Published("H100", 64, 128, 128, 1.6882608920667432, ARGONNE),
    Published("H200", 8, 32, 128, 0.833421, VLLM_CI),
)


def offline_batch_s(profile: Profile, batch: int, input_len: int, output_len: int) -> float:
    """Wall time of one offline batch of distinct random prompts on the simulated engine."""
    engine = Engine(replace(profile, per_call_s=0.0, per_prompt_s=0.0))
    for req_idx in range(batch):
        prompt = [(req_idx * input_len + pos) % 100_000 + 1 for pos in range(input_len)]
        engine.add(req_idx, prompt, output_len, admit_s=0.0)
    free_s = 0.0
    while (start_s := engine.next_start(free_s)) is not None:
        free_s = engine.step(start_s).end_s
    return free_s


def table(profile: Profile) -> list[dict]:
    """One row per published figure: published and simulated latency, decode tokens/s
    per request (output_len / latency), and the error of the simulated figure."""
    assert profile.model == LLAMA31_8B, "the published figures are for Llama-3(.1)-8B"
    rows = []
    for pub in PUBLISHED_8B:
        simulated = offline_batch_s(replace(profile, gpu=GPUS[pub.gpu]), pub.batch,
                                    pub.input_len, pub.output_len)  # fmt: skip
        rows.append({"gpu": pub.gpu, "batch": pub.batch, "input_len": pub.input_len,
                     "output_len": pub.output_len, "published_s": pub.latency_s,
                     "simulated_s": simulated,
                     "published_tok_s": pub.output_len / pub.latency_s,
                     "simulated_tok_s": pub.output_len / simulated,
                     "error": simulated / pub.latency_s - 1, "source": pub.source})  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| GPU | batch | in / out | published | simulated | tok/s per request, "
             "published / simulated | error | source |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        lines.append(
            f"| {row['gpu']} | {row['batch']} | {row['input_len']} / {row['output_len']} "
            f"| {row['published_s']:.3f} s | {row['simulated_s']:.3f} s "
            f"| {row['published_tok_s']:.0f} / {row['simulated_tok_s']:.0f} "
            f"| {row['error']:+.0%} | {row['source']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from benchmarks.gpu_sim.roofline import PROFILES

    print(markdown(table(PROFILES["llama8b-h200"])))
