"""Late shares behind the GPU simulator per dilation: every cell of benchmarks.adaptive
(code and random-token prompts, 1, 4 and 16 clients; direct, fixed and adaptive; one
repetition each) on one vLLM-CPU serving the shipped target, its prefix cache emptied
before each run, a fresh simulator per run.

    PYTHONPATH=. .venv/bin/python benchmarks/results/runs/2026-12-03-gpu-sim-dilation/measure.py \
        DILATIONS REPEATS OUT.jsonl
"""

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
from transformers import AutoTokenizer

from benchmarks import upstream
from benchmarks.adaptive import _run_upstream, gpu_sim_stats, serve_gpu_sim
from benchmarks.run import DEFAULT_TARGET_DIR, load_prompts

dilations = [float(x) for x in sys.argv[1].split(",")]
repeats = int(sys.argv[2])
out = Path(sys.argv[3])
model_dir = DEFAULT_TARGET_DIR
tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
_, code = load_prompts(tokenizer, 16, 400)  # as benchmarks.adaptive.main, --prompts 8
rng = np.random.default_rng(0)
prompt_sets = {"code": code, "random": [rng.integers(10, 4000, size=len(p)).tolist() for p in code]}
args = SimpleNamespace(prompts=8, max_tokens=64, reps=1, sim_reps=1, fixed_reps=1)
server = upstream.start(model_dir, Path(tempfile.gettempdir()) / "gpu-sim-dilation-vllm.log", 2048)
try:
    for repeat in range(repeats):
        for dilation in dilations:
            server.reset_prefix_cache()
            port = upstream.free_port()
            sim = serve_gpu_sim(server.url, port, "dense27b-h200", dilation)
            url = f"http://127.0.0.1:{port}"
            try:
                start, load_before = time.time(), os.getloadavg()
                rows = asyncio.run(_run_upstream("gpu-sim", url, server.model, model_dir,
                                                 prompt_sets, [1, 4, 16], args, sim=True))
                stats = gpu_sim_stats(url)
            finally:
                sim.terminate()
                sim.wait(10)
            record = {"dilation": dilation, "repeat": repeat, "wall_s": time.time() - start,
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                      "cells": [{k: row[k] for k in ("prompts", "concurrency", "config",
                                                     "late_share", "tokens_per_s", "vs_direct")}
                                for row in rows if "config" in row],
                      "sim_stats": stats}
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            worst = max(c["late_share"] for c in record["cells"])
            print(f"dilation {dilation:g} repeat {repeat}: worst cell late {worst:.3f}, "
                  f"{record['wall_s']:.0f} s", flush=True)
finally:
    server.stop()
