"""A continuous-batching engine on a virtual clock: which sequences each step serves,
and when each output token is done. Pure and deterministic (no I/O, no wall clock).

The model of vLLM 0.32's V1 scheduler, on a GPU:

* A request is *admitted* at `admit_s` (after the API server's per-call cost, which
  the caller adds) and waits FCFS. Every step first serves the running sequences (one
  decode token each, or the next chunk of an unfinished prefill), then admits waiting
  ones while fewer than `max_num_seqs` run, within a budget of `max_num_batched_tokens`
  tokens per step (chunked prefill: a prompt longer than what is left of the budget
  is split across steps). vLLM 0.32's defaults for an API server on a >= 70 GiB GPU:
  8192 tokens, 1024 sequences (`vllm/engine/arg_utils.py`).
* Prefix cache: full blocks of `block_size` tokens, each keyed by a hash chained over
  the blocks before it. When a sequence is first scheduled it reads the longest chain of
  cached blocks short of its last prompt token, which it must compute to sample (a
  fully cached prompt recomputes its last block, as vLLM's `max_cache_hit_length`), and
  registers its own prompt blocks, so prompts scheduled after it, in the same step
  too, share them (vLLM does: DESIGN.md section 3). Blocks of generated tokens are
  registered by the caller (`register`), who learns their ids from the real server.
  Capacity: the profile's KV budget less the blocks running sequences hold; the least
  recently used block is evicted first. `read_cache=False` (a request asking for
  `prompt_logprobs`) computes its whole prompt, as vLLM does.
* A prefill chunk that reaches the end of its prompt samples the first output token;
  every later step that serves the sequence samples one more. A sequence leaves after
  `max_tokens` tokens, or when aborted (a client gone) or cut short (`limit`: the real
  server stopped earlier, at EOS or a stop string).
* Step time: `Profile.step_s` of what the step computes (`roofline.py`).

Not modelled: preemption when the KV cache runs out (the benchmark's contexts use a
few thousand of the ~300 k token slots), speculative decoding inside the engine,
CUDA-graph padding of batch sizes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from benchmarks.gpu_sim.roofline import Profile, StepWork

BLOCK_SIZE = 16  # vLLM's default on GPU attention backends


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = BLOCK_SIZE
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained keys of the full blocks of `tokens`: block i's key covers blocks 0..i."""
    keys, parent = [], 0
    for end in range(block_size, len(tokens) + 1, block_size):
        parent = hash((parent, tuple(tokens[end - block_size : end])))
        keys.append(parent)
    return keys


class PrefixCache:
    """Block keys held in GPU memory, least recently used first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, keys: Sequence[int]) -> int:
        """How many leading blocks of `keys` are cached (those are touched)."""
        num_hits = 0
        for key in keys:
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            num_hits += 1
        return num_hits

    def insert(self, keys: Sequence[int], pinned_blocks: int) -> None:
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while self._blocks and len(self._blocks) > self.capacity_blocks - pinned_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


@dataclass
class _Seq:
    request_id: Hashable
    prompt: tuple[int, ...]
    max_tokens: int
    admit_s: float
    read_cache: bool
    num_computed: int = 0  # prompt tokens whose KV exists (cache hits included)
    num_output: int = 0

    @property
    def context(self) -> int:
        return self.num_computed + max(0, self.num_output - 1)


@dataclass(frozen=True)
class Step:
    start_s: float
    end_s: float
    work: StepWork
    prefill_tokens: int
    decode_tokens: int
    emitted: tuple[Hashable, ...]  # request ids that got a token at end_s
    finished: tuple[Hashable, ...]  # request ids that left at end_s


@dataclass
class Counters:
    steps: int = 0
    busy_s: float = 0.0  # simulated seconds spent in steps
    scheduled_seqs: int = 0  # sum over steps
    prefill_tokens: int = 0  # prompt tokens computed
    decode_tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens of scheduled requests
    prefix_hit_tokens: int = 0  # prompt tokens read from the prefix cache
    finished: int = 0
    aborted: int = 0
    max_seqs_per_step: int = 0


class Engine:
    """Add requests (`add`), then call `step` at `next_start`, until it returns None."""

    def __init__(self, profile: Profile, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.profile = profile
        self.config = config
        self.cache = PrefixCache(profile.num_kv_blocks(config.block_size))
        self.counters = Counters()
        self._waiting: list[_Seq] = []  # FCFS by admit_s, then arrival order
        self._running: list[_Seq] = []
        self._seqs: dict[Hashable, _Seq] = {}

    def add(self, request_id: Hashable, prompt: Sequence[int], max_tokens: int,
            admit_s: float, read_cache: bool = True) -> None:  # fmt: skip
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if not prompt or max_tokens < 1:
            raise ValueError(f"a request needs a prompt and max_tokens >= 1, got "
                             f"{len(prompt)} tokens, max_tokens {max_tokens}")  # fmt: skip
        seq = _Seq(request_id, tuple(prompt), max_tokens, admit_s, read_cache)
        self._seqs[request_id] = seq
        index = len(self._waiting)
        while index and self._waiting[index - 1].admit_s > admit_s:
            index -= 1
        self._waiting.insert(index, seq)

    def abort(self, request_id: Hashable) -> None:
        """Drop a request wherever it is (a no-op once it has left)."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        self.counters.aborted += 1
        for queue in (self._waiting, self._running):
            if seq in queue:
                queue.remove(seq)

    def limit(self, request_id: Hashable, num_tokens: int) -> None:
        """The real answer has `num_tokens` tokens: stop the sequence there."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            seq.max_tokens = max(1, min(seq.max_tokens, num_tokens))
            if seq.num_output >= seq.max_tokens:
                self._leave(seq)

    def register(self, tokens: Sequence[int]) -> None:
        """Tokens whose KV a finished computation left behind (e.g. a generated output)."""
        self.cache.insert(block_hashes(tokens, self.config.block_size), self._pinned())

    def reset_prefix_cache(self) -> None:
        self.cache.clear()

    def has(self, request_id: Hashable) -> bool:
        return request_id in self._seqs

    def next_start(self, free_s: float) -> float | None:
        """When the next step starts if the engine is free from `free_s` (None: idle)."""
        if self._running:
            return free_s
        if self._waiting:
            return max(free_s, self._waiting[0].admit_s)
        return None

    def step(self, start_s: float) -> Step:
        """Serve one step starting at `start_s` (at or after `next_start`)."""
        config = self.config
        budget = config.max_num_batched_tokens
        chunks: list[tuple[_Seq, int]] = []
        for seq in self._running:
            need = len(seq.prompt) - seq.num_computed if seq.num_computed < len(seq.prompt) else 1
            if budget == 0:
                break
            chunks.append((seq, min(need, budget)))
            budget -= chunks[-1][1]
        while (self._waiting and self._waiting[0].admit_s <= start_s and budget > 0
               and len(self._running) < config.max_num_seqs):  # fmt: skip
            seq = self._waiting.pop(0)
            self._admit(seq)
            chunk = min(len(seq.prompt) - seq.num_computed, budget)
            chunks.append((seq, chunk))
            budget -= chunk
        if not chunks:
            raise RuntimeError(f"no work to start at {start_s}: call next_start first")

        kv_tokens = attention_pairs = num_sampled = prefill = decode = 0
        emitted, finished = [], []
        for seq, chunk in chunks:
            before = seq.context
            kv_tokens += before + chunk
            attention_pairs += chunk * before + chunk * (chunk + 1) // 2
            if seq.num_computed < len(seq.prompt):
                seq.num_computed += chunk
                prefill += chunk
                samples = seq.num_computed == len(seq.prompt)
            else:
                decode += 1
                samples = True
            if samples:
                num_sampled += 1
                emitted.append(seq)
        work = StepWork(len(chunks), prefill + decode, num_sampled, kv_tokens, attention_pairs)
        end_s = start_s + self.profile.step_s(work)
        for seq in emitted:
            seq.num_output += 1
            if seq.num_output >= seq.max_tokens:
                finished.append(seq)
        for seq in finished:
            self._leave(seq)

        counters = self.counters
        counters.steps += 1
        counters.busy_s += end_s - start_s
        counters.scheduled_seqs += len(chunks)
        counters.max_seqs_per_step = max(counters.max_seqs_per_step, len(chunks))
        counters.prefill_tokens += prefill
        counters.decode_tokens += decode
        return Step(start_s, end_s, work, prefill, decode,
                    tuple(seq.request_id for seq in emitted),
                    tuple(seq.request_id for seq in finished))  # fmt: skip

    def _admit(self, seq: _Seq) -> None:
        size = self.config.block_size
        keys = block_hashes(seq.prompt, size)
        if seq.read_cache:  # whole blocks, short of the last token (it must be computed)
            seq.num_computed = self.cache.lookup(keys[: (len(seq.prompt) - 1) // size]) * size
        self.counters.prompt_tokens += len(seq.prompt)
        self.counters.prefix_hit_tokens += seq.num_computed
        self._running.append(seq)
        self.cache.insert(keys, self._pinned())

    def _leave(self, seq: _Seq) -> None:
        self._running.remove(seq)
        del self._seqs[seq.request_id]
        self.counters.finished += 1

    def _pinned(self) -> int:
        """Blocks the running sequences hold (not evictable)."""
        size = self.config.block_size
        return sum(-(-(len(seq.prompt) + seq.num_output) // size) for seq in self._running)
