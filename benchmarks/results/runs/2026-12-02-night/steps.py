"""Direct vLLM-CPU against the adaptive proxy, cell after cell, with vLLM's own engine-step count
(`vllm:iteration_tokens_total_count` from /metrics) and each vLLM thread's CPU time per cell.

  .venv/bin/python benchmarks/results/runs/2026-12-02-night/steps.py ITERS none|renice-engine code|random CONC

NGRAM=1 in the environment starts vLLM with its n-gram speculation; the vLLM thread binding is
whatever scripts/vllm_cpu.sh and the environment give it. A record of the 2026-12-02 night
measurements, not part of the benchmark (not linted, not collected)."""
import asyncio, json, os, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from benchmarks import adaptive, upstream
from proxy.adaptive import AdaptiveState
from proxy.backend.vllm import VLLMTarget
from proxy.decoding import TreeSettings
from proxy.drafter import load_drafter
from proxy.drafter.base import TargetInfo
from transformers import AutoTokenizer

def threads(pids):
    out = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                st = open(f"/proc/{pid}/task/{tid}/stat").read()
                comm = st[st.index("(")+1:st.rindex(")")]
                f = st[st.rindex(")")+2:].split()
                out[(pid, int(tid), comm)] = (int(f[11]) + int(f[12]), int(f[36]))  # utime+stime, processor
            except FileNotFoundError:
                pass
    return out

def vllm_pids():
    r = subprocess.run(["pgrep", "-f", "vllm|VLLM"], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split() if int(p) != os.getpid()]

async def main():
    md = adaptive.DEFAULT_TARGET_DIR
    tok = AutoTokenizer.from_pretrained(str(md))
    _, code = adaptive.load_prompts(tok, 16, 400)
    import numpy as np
    rng = np.random.default_rng(0)
    rnd = [rng.integers(10, 4000, size=len(p)).tolist() for p in code]
    which, conc = sys.argv[3], int(sys.argv[4])
    ps = code if which == "code" else rnd
    prompts = [ps[i % len(ps)] for i in range(max(8, conc))]
    extra = ("--speculative-config", adaptive.NGRAM_SPEC) if os.environ.get("NGRAM") else ()
    server = upstream.start(md, Path("/tmp/steps-vllm.log"), 2048, extra_args=extra)
    try:
        cfg = json.loads((md / "config.json").read_text())
        info = TargetInfo(cfg["vocab_size"], cfg["num_hidden_layers"], cfg["hidden_size"], model_dir=md)
        drafter = load_drafter("ngram", info)
        target = await VLLMTarget.connect(server.url, server.model, model_dir=md)
        state = AdaptiveState()
        tree = TreeSettings(budget=8, policy="adaptive")
        direct = lambda: adaptive._direct(server.url, server.model, prompts, 64, conc)
        async def timed(f):
            t = time.perf_counter(); n = await f(); return round(len(prompts) * 64 / (time.perf_counter() - t))
        pids = vllm_pids()
        mode = sys.argv[2]
        for pid in pids:
            cmd = open(f"/proc/{pid}/cmdline").read()
            comm = open(f"/proc/{pid}/comm").read().strip()
            print(pid, comm, cmd[:60].replace("\0", " "))
            if mode == "renice-engine" and comm.startswith("VLLM::EngineCor"):
                print(subprocess.run(["renice", "-n", "19", "-p", str(pid)], capture_output=True, text=True).stdout)
        names = {}
        import httpx, re
        def steps():
            text = httpx.get(server.url + "/metrics", timeout=30).text
            got = {}
            for name in ("vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum", "vllm:num_preemptions_total", "vllm:request_success_total"):
                vals = [float(m.group(1)) for m in re.finditer("^" + re.escape(name) + r"(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)]
                got[name.split(":")[1]] = sum(vals)
            return got
        async def measured(label, f):
            s0 = steps()
            b = threads(pids); t = time.perf_counter(); n = await f(); w = time.perf_counter() - t
            a = threads(pids)
            s1 = steps()
            print({k: s1[k] - s0[k] for k in s0})
            top = {f"{k[2][:12]}.{k[1]}": a[k][0] - b.get(k, (0, 0))[0] for k in a if a[k][0] - b.get(k, (0, 0))[0] > 1}
            print(json.dumps({"cfg": label, "tok_s": round(len(prompts) * 64 / w), "wall": round(w, 2), "jiffies": top}), flush=True)
        for i in range(int(sys.argv[1])):
            await measured("adaptive", lambda: adaptive._proxied(target, drafter, tree, state, prompts, 64, conc))
            await measured("direct", direct)
    finally:
        server.stop()

asyncio.run(main())
