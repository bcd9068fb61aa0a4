"""Seeded benchmark workloads: which prompt, how many output tokens, and when each request arrives.

Closed workload: every request arrives at t = 0 (a saturation test).
Open workload: Poisson arrivals at ``rate`` requests/s, i.e. exponential
inter-arrival gaps with mean ``1 / rate`` seconds (as vLLM's
``benchmarks/benchmark_serving.py`` does with ``--request-rate``).
Output lengths are drawn from ``[min_tokens, max_tokens]``, uniformly
(default) or log-uniformly (``output_dist="log-uniform"``: as many requests
between 16 and 32 tokens as between 256 and 512, the long tail of chat
answers, where most are short), and enforced with ``ignore_eos`` so every
system generates the same token count.

How much continuous batching can gain over request-level (static) batching
depends on that distribution: a static batch runs until its longest request
ends, so with every step costing the same, continuous batching produces at
most ``E[max of B lengths] / E[length]`` times static's tokens/s
(:func:`request_level_bound`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

PROMPTS_PATH = Path(__file__).with_name("prompts.jsonl")


@dataclass(frozen=True)
class WorkloadSpec:
    """What to send.

    Attributes:
        num_requests: requests in the run.
        rate: mean arrival rate in requests/s (Poisson); None = closed (all at t = 0).
        min_tokens, max_tokens: output length range in tokens, uniform, inclusive.
        seed: seeds prompt choice, output lengths and arrival gaps.
        shared_prefix_tokens: about this many tokens of one fixed system
            prompt go before every request's chat turn (0 = none); see
            :func:`shared_system_prompt`.
        output_dist: "uniform" or "log-uniform" output lengths (module docstring).
    """

    num_requests: int = 32
    rate: float | None = None
    min_tokens: int = 16
    max_tokens: int = 512
    seed: int = 0
    shared_prefix_tokens: int = 0
    output_dist: str = "uniform"

    @property
    def kind(self) -> str:
        """"closed" or "open"."""
        return "closed" if self.rate is None else "open"

    def describe(self) -> str:
        """One line for tables and CSV."""
        arrivals = "all at t=0" if self.rate is None else f"Poisson {self.rate:g} req/s"
        shared = f", shared system prompt ~{self.shared_prefix_tokens} tokens" if self.shared_prefix_tokens else ""
        return (f"{self.num_requests} requests, {arrivals}, output tokens {self.output_dist} "
                f"{self.min_tokens}..{self.max_tokens} (mean {mean_length(self):.0f}), seed {self.seed}{shared}")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    Attributes:
        request_id: unique id ("r0007").
        prompt: the user message (a chat turn).
        output_tokens: tokens to generate (max_tokens with ignore_eos).
        arrival_s: seconds after the start of the run.
        system: system message before the chat turn ("" = none, the
            template's default).
    """

    request_id: str
    prompt: str
    output_tokens: int
    arrival_s: float
    system: str = ""


_SYSTEM_PARAGRAPH = (
    "You are a careful, friendly assistant for the inflight serving team. Answer in plain English, "
    "keep answers short and concrete, say when you are unsure, and never invent facts, names, numbers "
    "or sources. Prefer lists for steps, code blocks for code, and SI units for measurements. "
)


def shared_system_prompt(tokenizer, num_tokens: int) -> str:
    """One fixed system prompt of about ``num_tokens`` tokens of ``tokenizer``
    (a fixed paragraph repeated, cut to ``num_tokens`` ids and decoded; the
    chat template adds its own few tokens around it)."""
    if num_tokens <= 0:
        return ""
    text = _SYSTEM_PARAGRAPH
    while len(tokenizer.encode(text, add_special_tokens=False)) < num_tokens:
        text += _SYSTEM_PARAGRAPH
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:num_tokens]).strip()


def load_prompts(path: Path = PROMPTS_PATH) -> list[str]:
    """The real chat prompts kept in ``bench/prompts.jsonl`` (one JSON object per line, key "prompt")."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def make_workload(spec: WorkloadSpec, prompts: list[str]) -> list[BenchRequest]:
    """The requests of ``spec``, sorted by arrival; same spec, same list.

    Raises:
        ValueError: empty prompts, num_requests < 1, bad token range or rate <= 0.
    """
    if not prompts or spec.num_requests < 1 or not 1 <= spec.min_tokens <= spec.max_tokens:
        raise ValueError(f"bad workload: {spec} with {len(prompts)} prompts")
    if spec.shared_prefix_tokens < 0:
        raise ValueError("shared_prefix_tokens must be >= 0")
    if spec.rate is not None and spec.rate <= 0:
        raise ValueError("rate must be > 0 requests/s")
    if spec.output_dist not in OUTPUT_DISTS:
        raise ValueError(f"output_dist {spec.output_dist!r}: expected one of {', '.join(OUTPUT_DISTS)}")
    rng = random.Random(spec.seed)
    arrival = 0.0
    requests = []
    for i in range(spec.num_requests):
        if spec.rate is not None and i > 0:
            arrival += rng.expovariate(spec.rate)
        requests.append(BenchRequest(f"r{i:04d}", rng.choice(prompts), _draw_length(spec, rng), arrival))
    return requests


OUTPUT_DISTS = ("uniform", "log-uniform")


def _draw_length(spec: WorkloadSpec, rng: random.Random) -> int:
    if spec.output_dist == "uniform":
        return rng.randint(spec.min_tokens, spec.max_tokens)
    # floor of exp(U(ln min, ln(max + 1))): P(k) = ln((k + 1) / k) / ln((max + 1) / min)
    drawn = int(math.exp(rng.uniform(math.log(spec.min_tokens), math.log(spec.max_tokens + 1))))
    return min(max(drawn, spec.min_tokens), spec.max_tokens)  # rounding at the edges


def length_pmf(spec: WorkloadSpec) -> dict[int, float]:
    """P(output length = k tokens) for k in [min_tokens, max_tokens] under ``spec.output_dist``."""
    lo, hi = spec.min_tokens, spec.max_tokens
    if spec.output_dist == "uniform":
        return {k: 1.0 / (hi - lo + 1) for k in range(lo, hi + 1)}
    span = math.log((hi + 1) / lo)
    return {k: math.log((k + 1) / k) / span for k in range(lo, hi + 1)}


def mean_length(spec: WorkloadSpec) -> float:
    """E[output length] in tokens."""
    return sum(k * p for k, p in length_pmf(spec).items())


def request_level_bound(spec: WorkloadSpec, batch: int) -> float:
    """``E[max of batch lengths] / E[length]``: the most continuous batching can gain
    over static batching of ``batch`` requests when a step costs the same at any
    batch size (a static batch lasts as long as its longest request; continuous
    batching keeps every slot busy). Exact for the discrete distribution:
    ``E[max] = sum_k P(max >= k) = sum_k 1 - F(k - 1)^batch``."""
    cdf, expected_max = 0.0, 0.0
    for k, p in sorted(length_pmf(spec).items()):
        expected_max += 1.0 - min(cdf, 1.0) ** batch
        cdf += p
    return (spec.min_tokens - 1 + expected_max) / mean_length(spec)
