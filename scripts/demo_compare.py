"""Send the same greedy completions through the proxy and straight to vLLM; say in words
what happened.

Used by scripts/demo.sh once the stack is up. Three passes over a few prompts: a warm-up
(untimed; the proxy's adaptive policy measures speculation and plain generation), the
proxy as it is by default against vLLM alone, and the proxy with speculation forced on
every step (`"ddtree": {"policy": "fixed"}`). Greedy, so every output must equal
vLLM's token for token. Last, the proxy's A/B report of its two arms (the direct arm:
the prompts sent with `x-ddtree: off`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import httpx

from proxy.ab.report import MIN_REQUESTS, format_report

# Prompts on which the shipped target (8.5 M parameters, trained on Python's standard
# library) writes code-shaped text under greedy decoding; a lone function header sends
# it into a loop of docstring quotes.
PROMPTS = (
    'def isdir(s):\n    """Return true if the pathname refers to an existing directory."""',
    "def _get_sep(path):\n    if isinstance(path, bytes):\n        return b'/'\n    else:",
    "class Queue:\n\n    def __init__(self):\n        self._items = []\n\n    def",
    "    def __contains__(self, key):\n        return key in self._data\n\n    def __len__(self):",
)


@dataclass
class Answer:
    text: str
    seconds: float
    num_tokens: int
    ddtree: dict  # usage.ddtree: what the proxy did ({} from vLLM)


def complete(url: str, body: dict, timeout: float, headers: dict | None = None) -> Answer:
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, headers=headers)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        sys.exit(f"demo: {url} answered {response.status_code}: {response.text[:500]}")
    data = response.json()
    usage = data.get("usage", {})
    return Answer(data["choices"][0]["text"], seconds, usage.get("completion_tokens", 0),
                  usage.get("ddtree", {}))


@dataclass
class Totals:
    """What the proxy did over one pass, summed over its requests."""

    seconds: float = 0.0
    num_tokens: int = 0
    plain_tokens: int = 0
    rounds: int = 0
    verify_calls: int = 0
    plain_calls: int = 0
    draft_calls: int = 0

    def add(self, answer: Answer) -> None:
        self.seconds += answer.seconds
        self.num_tokens += answer.num_tokens
        self.plain_tokens += answer.ddtree.get("plain_tokens", 0)
        self.rounds += answer.ddtree.get("rounds", 0)
        self.verify_calls += answer.ddtree.get("upstream_calls", 0)
        self.plain_calls += answer.ddtree.get("plain_calls", 0)
        self.draft_calls += answer.ddtree.get("draft_calls", 0)

    @property
    def tau(self) -> float:
        """Tokens per speculation round (accepted drafted tokens + the bonus token)."""
        return (self.num_tokens - self.plain_tokens) / self.rounds if self.rounds else 0.0


def plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def describe(name: str, totals: Totals, direct_s: float) -> list[str]:
    speculated = totals.num_tokens - totals.plain_tokens
    share = speculated / totals.num_tokens if totals.num_tokens else 0.0
    lines = [f"{name}: {totals.seconds:.2f} s for {totals.num_tokens} tokens, "
             f"{direct_s / totals.seconds:.2f}x the speed of vLLM alone"]
    lines.append(f"    speculated: {speculated} tokens ({share:.0%}) in "
                 f"{plural(totals.rounds, 'DDTree round')}; plain: {totals.plain_tokens} "
                 f"tokens ({1 - share:.0%}) that vLLM generated on its own, the proxy "
                 "stepping aside")
    if totals.rounds:
        lines.append(f"    tau {totals.tau:.2f}: a round committed {totals.tau:.2f} tokens on "
                     "average (the drafted tokens vLLM agreed with, plus one of its own)")
    lines.append(f"    calls: {plural(totals.verify_calls, 'verification call')} to the target "
                 f"vLLM (one per round), {plural(totals.draft_calls, 'call')} to the draft "
                 f"vLLM, {plural(totals.plain_calls, 'plain generation call')}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--proxy-url", required=True)
    parser.add_argument("--vllm-url", required=True)
    parser.add_argument("--model", default=None, help="the model vLLM serves (default: its first)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable; default: built-in)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()

    prompts = args.prompt or list(PROMPTS)
    model = args.model or httpx.get(f"{args.vllm_url}/v1/models").json()["data"][0]["id"]
    bodies = [{"model": model, "prompt": prompt, "max_tokens": args.max_tokens,
               "temperature": 0} for prompt in prompts]
    forced = {"ddtree": {"policy": "fixed"}}

    print(f"[demo] {len(prompts)} prompts x {args.max_tokens} tokens, greedy, each sent to "
          "vLLM alone and through the proxy. The shipped target is an 8.5 M-parameter model "
          "trained on a CPU on Python's standard library: expect code-shaped text, not "
          "working code.")
    print("[demo] warm-up (untimed): each prompt once each way, so that the proxy has "
          "measured both speculation and vLLM's plain generation before the timed pass")
    for body in bodies:
        complete(args.vllm_url, body, args.timeout)
        complete(args.proxy_url, body, args.timeout)
        complete(args.proxy_url, {**body, **forced}, args.timeout)

    direct, default, fixed = Totals(), Totals(), Totals()
    num_identical = 0
    for prompt_idx, body in enumerate(bodies):
        alone = complete(args.vllm_url, body, args.timeout)
        proxied = complete(args.proxy_url, body, args.timeout)
        speculated = complete(args.proxy_url, {**body, **forced}, args.timeout)
        direct.add(alone)
        default.add(proxied)
        fixed.add(speculated)
        same = proxied.text == alone.text and speculated.text == alone.text
        num_identical += same
        print(f"--- prompt {prompt_idx + 1} of {len(bodies)} " + "-" * 50)
        print(body["prompt"])
        print("--- ... and what the model wrote after it "
              + ("(the same through the proxy and from vLLM alone) ---" if same else "---"))
        print(proxied.text.strip("\n"))
        if not same:
            print(f"!! vLLM alone wrote instead: {alone.text!r}")

    print("=" * 72)
    print(f"Identical output: {num_identical} of {len(bodies)} completions are token for token "
          "what vLLM alone wrote, through the proxy both ways below.")
    print(f"vLLM alone: {direct.seconds:.2f} s for {direct.num_tokens} tokens "
          f"({1000 * direct.seconds / max(1, direct.num_tokens):.1f} ms a token)")
    for line in describe("Proxy, default (adaptive) policy", default, direct.seconds):
        print(line)
    for line in describe("Proxy, speculation forced on every step", fixed, direct.seconds):
        print(line)
    if fixed.verify_calls:
        round_ms = 1000 * fixed.seconds / fixed.verify_calls
        token_ms = 1000 * direct.seconds / max(1, direct.num_tokens)
        print(f"Why: on this CPU a verification round took about {round_ms:.0f} ms (an HTTP "
              f"call, vLLM scheduling a batch of tree prompts, the drafter) while vLLM alone "
              f"makes a token every {token_ms:.0f} ms, so a round must commit about "
              f"{round_ms / token_ms:.0f} tokens to break even and this tiny model's drafts "
              f"gave {fixed.tau:.1f}; the adaptive policy measures this and steps aside. "
              "On a GPU serving a large model one decode step costs more than a round's "
              "overhead, so speculation is projected to pay there (docs/PERFORMANCE.md).")
    ab_pass(args.proxy_url, bodies, args.timeout)
    return 0 if num_identical == len(bodies) else 1


def ab_pass(proxy_url: str, bodies: list[dict], timeout: float) -> None:
    """The proxy's A/B report (`ddtree-proxy report`): every request above that the proxy
    served with DDTree is in its DDTree arm; send the prompts through the proxy with
    `x-ddtree: off` (vLLM's answer relayed: the direct arm) until that arm has the
    report's minimum for a ratio, and print the report as a user running `--ab-split`
    would read it."""
    rounds = -(-MIN_REQUESTS // len(bodies))
    print("=" * 72)
    print(f"[demo] A/B: each prompt {rounds} times through the proxy with header "
          "'x-ddtree: off' (the direct arm: vLLM's answer relayed), then the proxy's own "
          "report of both arms (GET /ddtree/report). Its DDTree arm is every request above "
          "that the proxy served, the forced-speculation ones included; with --ab-split "
          "the proxy splits live traffic itself (README, A/B testing)")
    for _ in range(rounds):
        for body in bodies:
            complete(proxy_url, body, timeout, headers={"x-ddtree": "off"})
    response = httpx.get(f"{proxy_url}/ddtree/report", timeout=timeout)
    response.raise_for_status()
    print(format_report(response.json()))


if __name__ == "__main__":
    sys.exit(main())
