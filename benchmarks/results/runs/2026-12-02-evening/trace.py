"""Trace the adaptive controller's decisions in benchmark cells (shim or vllm)."""
import asyncio, contextvars, json, sys, time, argparse
from pathlib import Path
import numpy as np
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
from benchmarks import adaptive as A, upstream
from proxy.adaptive import controller as C, costs as K
from proxy.decoding import GenerationRequest, generate

RID = contextvars.ContextVar("rid", default=-1)
T0 = [time.perf_counter()]
LOG = []
def ev(kind, **kw):
    LOG.append(dict(t=round(time.perf_counter() - T0[0], 3), rid=RID.get(), ev=kind, **kw))

def wrap(cls, name, fmt=None):
    orig = getattr(cls, name)
    def f(self, *a, **k):
        r = orig(self, *a, **k)
        extra = fmt(self, r, *a) if fmt else {}
        ev(name, **extra)
        return r
    setattr(cls, name, f)

wrap(C.Controller, "start", lambda s, r: dict(plain=s.plain, trial=s._trial_left, start_rate=round(s.costs.start_round_rate(), 1), plain_rate=round(1/s.costs.plain_token_s(), 1) if s.costs.plain_token_s() else None))
wrap(C.Controller, "_begin_trial")
wrap(C.Controller, "_go_plain")
wrap(C.Controller, "_go_speculative", lambda s, r, *a: dict(pred=a[0] if a else None))
wrap(K.CostModel, "load_changed", lambda s, r, *a: dict(slowdown=round(a[0], 3), start_rate=round(s.start_round_rate(), 1)))
wrap(K.CostModel, "trial_won", lambda s, r, *a: dict(rate=round(a[0], 1)))
orig_obs = C.Controller.observe_rate
def obs(self, n, sec):
    ev("round", n=n, s=round(sec, 3), trial=self._trial_left)
    return orig_obs(self, n, sec)
C.Controller.observe_rate = obs
orig_plain = K.CostModel.observe_plain
def op(self, n, sec, resumed):
    ev("plain", n=n, s=round(sec, 3), resumed=resumed)
    return orig_plain(self, n, sec, resumed)
K.CostModel.observe_plain = op

CELL = [0]
async def _proxied(target, drafter, tree, state, prompts, max_tokens, concurrency):
    sem = asyncio.Semaphore(concurrency)
    CELL[0] += 1
    cell = CELL[0]
    async def detok(ids): return ""
    t0 = time.perf_counter()
    async def one(i, p):
        async with sem:
            RID.set(cell * 100 + i)
            ev("begin", policy=tree.policy)
            r = await generate(target, drafter, GenerationRequest(p, max_tokens, tree=tree, ignore_eos=True, stream=False), detok, state)
            ev("end", rounds=r.stats.rounds, plain=r.stats.plain_tokens, calls=r.stats.plain_calls, dt=round(time.perf_counter() - t0, 3))
            return r.stats
    out = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    ev("cell", policy=tree.policy, dt=round(time.perf_counter() - t0, 3), cell=cell)
    return out
A._proxied = _proxied
orig_direct = A._direct
async def _direct(*a):
    t0 = time.perf_counter(); r = await orig_direct(*a); ev("cell", policy="direct", dt=round(time.perf_counter() - t0, 3)); return r
A._direct = _direct

p = argparse.ArgumentParser()
p.add_argument("--scale", type=float, default=15)
p.add_argument("--conc", default="16")
p.add_argument("--reps", type=int, default=5)
p.add_argument("--fixed-reps", type=int, default=2)
p.add_argument("--sets", default="code,random")
p.add_argument("--out", default="/tmp/trace-log.jsonl")
p.add_argument("--shim", type=int, default=1)
args = p.parse_args()
from transformers import AutoTokenizer
model_dir = A.DEFAULT_TARGET_DIR
tok = AutoTokenizer.from_pretrained(str(model_dir))
_, code = A.load_prompts(tok, 16, 400)
rng = np.random.default_rng(0)
rand = [rng.integers(10, 4000, size=len(x)).tolist() for x in code]
sets = {k: v for k, v in {"code": code, "random": rand}.items() if k in args.sets.split(",")}
ns = argparse.Namespace(prompts=8, max_tokens=64, reps=args.reps, shim_reps=args.reps, fixed_reps=args.fixed_reps)
server = upstream.start(model_dir, Path("/tmp/trace-vllm.log"), 2048)
try:
    if args.shim:
        port = upstream.free_port(); shim = A._serve_shim(server.url, port, args.scale)
        url, sc = f"http://127.0.0.1:{port}", args.scale
    else:
        shim = None; url, sc = server.url, None
    try:
        rows = asyncio.run(A._run_upstream("gpu-shim" if shim else "vllm", url, server.model, model_dir, sets, [int(c) for c in args.conc.split(",")], ns, shim_scale=sc))
    finally:
        if shim: shim.terminate(); shim.wait(10)
finally:
    server.stop()
with open(args.out, "w") as f:
    for e in LOG: f.write(json.dumps(e) + "\n")
for r in rows:
    if "config" in r:
        print(r["prompts"], r["concurrency"], r["config"], round(r["tokens_per_s"], 1), round(r["vs_direct"], 3), [round(x) for x in r["rep_tokens_per_s"]], r.get("plain_share"), r.get("switches"))
