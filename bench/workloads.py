"""Seeded benchmark workloads: which prompt, how many output tokens, and when each request arrives.

Closed workload: every request arrives at t = 0 (a saturation test).
Open workload: Poisson arrivals at ``rate`` requests/s, i.e. exponential
inter-arrival gaps with mean ``1 / rate`` seconds (as vLLM's
``benchmarks/benchmark_serving.py`` does with ``--request-rate``).
Output lengths are drawn uniformly from ``[min_tokens, max_tokens]`` and
enforced with ``ignore_eos`` so every system generates the same token count.
"""

from __future__ import annotations

import json
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
    """

    num_requests: int = 32
    rate: float | None = None
    min_tokens: int = 16
    max_tokens: int = 512
    seed: int = 0
    shared_prefix_tokens: int = 0

    @property
    def kind(self) -> str:
        """"closed" or "open"."""
        return "closed" if self.rate is None else "open"

    def describe(self) -> str:
        """One line for tables and CSV."""
        arrivals = "all at t=0" if self.rate is None else f"Poisson {self.rate:g} req/s"
        shared = f", shared system prompt ~{self.shared_prefix_tokens} tokens" if self.shared_prefix_tokens else ""
        return (f"{self.num_requests} requests, {arrivals}, output tokens uniform "
                f"{self.min_tokens}..{self.max_tokens}, seed {self.seed}{shared}")


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
    rng = random.Random(spec.seed)
    arrival = 0.0
    requests = []
    for i in range(spec.num_requests):
        if spec.rate is not None and i > 0:
            arrival += rng.expovariate(spec.rate)
        requests.append(BenchRequest(f"r{i:04d}", rng.choice(prompts),
                                     rng.randint(spec.min_tokens, spec.max_tokens), arrival))
    return requests
