"""A shared-step GPU simulator, the benchmark's GPU upstream (`python -m benchmarks.gpu_sim`).

| module | what |
|---|---|
| `roofline` | GPUs, models and profiles (sourced constants); one step's time |
| `engine` | the continuous-batching engine on a virtual clock: scheduling, prefix cache |
| `server` | the HTTP upstream in front of a real vLLM: releases on the engine's timeline |
| `validation` | the profiles against published vLLM decode figures |
"""
