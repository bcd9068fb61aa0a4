"""Which worker a request should go to: a cost per worker from its cached prefix and its
load, and the rule for falling back to the shared stream. Pure functions, no I/O.

The cost follows NVIDIA Dynamo's KV router (``--router-mode kv``): in KV blocks,

    cost(w) = kv_overlap_score_weight × prefill_blocks(w) + decode_blocks(w)

where ``prefill_blocks`` are the prompt's blocks ``w`` does not hold (what it would have to
prefill) plus, for each request waiting there (in its engine, read but not started, or on
its own stream), as many blocks as this prompt has (the best guess of the prefill queued
ahead of it), and ``decode_blocks`` the KV blocks ``w``'s running sequences hold (Dynamo's
"potential prefill blocks" and "potential active blocks"). The lowest cost wins (``router_temperature``
0, Dynamo's default); above 0 a worker is drawn with probability ∝ exp(-c / T) over the costs
min-max normalised to [0, 1] (Dynamo's softmax sampling).

The fallback is SGLang's cache-aware router's ``cache_threshold``: the request is routed to
the winner's own stream only when the winner holds at least that fraction of the prompt's
blocks; otherwise (or with a single live worker) no worker stands out for its cache and
the request goes to the shared stream, which the workers pull from as they have room
(least-loaded by construction).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    """The router's tunables (names as NVIDIA Dynamo's and SGLang's routers name them).

    Attributes:
        mode: "kv" (route by cached prefix and load; Dynamo's ``--router-mode kv``) or
            "shared" (routing off: every request goes to the shared stream).
        kv_overlap_score_weight: weight of the blocks to prefill against the running
            sequences' blocks (Dynamo's ``--kv-overlap-score-weight``; higher favours cache hits
            over balance, 0 ignores the cache). Default 2.0, where Dynamo's is 1.0: a prompt
            block to prefill costs far more than a block of a running sequence (a whole
            prefill step against a share of a decode step), so a worker that holds the prefix
            and decodes one request should still win over an idle one that holds nothing
            (bench/RESULTS.md run 23).
        router_temperature: 0 = always the lowest cost (Dynamo's default); > 0 samples.
        cache_threshold: the least fraction (0..1] of the prompt's full blocks the chosen
            worker must hold for the request to go to its own stream (SGLang router's
            ``--cache-threshold``, default 0.5).
        max_prefix_blocks: blocks of a prompt hashed and looked up at most (llm-d's
            ``maxPrefixBlocksToMatch``; bounds the work for very long prompts).
    """

    mode: str = "kv"
    kv_overlap_score_weight: float = 2.0
    router_temperature: float = 0.0
    cache_threshold: float = 0.5
    max_prefix_blocks: int = 512

    def __post_init__(self) -> None:
        if self.mode not in ("kv", "shared"):
            raise ValueError(f"router_mode must be kv or shared, got {self.mode!r}")
        if self.kv_overlap_score_weight < 0 or self.router_temperature < 0:
            raise ValueError("kv_overlap_score_weight and router_temperature must be >= 0")
        if not 0 < self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in (0, 1], got {self.cache_threshold}")
        if self.max_prefix_blocks < 1:
            raise ValueError(f"max_prefix_blocks must be >= 1, got {self.max_prefix_blocks}")


@dataclass(frozen=True)
class WorkerView:
    """One live worker as the router sees it for one request.

    Attributes:
        worker_id: the worker's id.
        overlap_blocks: leading blocks of the prompt its prefix cache holds.
        used_blocks: KV blocks its running sequences hold (total - free).
        waiting: requests waiting there: in its engine, read but not started, and on its
            own stream of this priority.
    """

    worker_id: str
    overlap_blocks: int
    used_blocks: int
    waiting: int


@dataclass(frozen=True)
class Choice:
    """The router's answer: ``worker_id`` None = the shared stream; ``overlap_blocks`` the
    prompt blocks the chosen worker holds (0 for the shared stream)."""

    worker_id: str | None
    overlap_blocks: int = 0


def cost(view: WorkerView, prompt_blocks: int, weight: float) -> float:
    """Dynamo's KV router cost of ``view`` for a prompt of ``prompt_blocks`` full blocks."""
    prefill = max(0, prompt_blocks - view.overlap_blocks) + view.waiting * max(1, prompt_blocks)
    return weight * prefill + view.used_blocks


def choose(views: list[WorkerView], prompt_blocks: int, config: RouterConfig,
           rng: random.Random | None = None) -> Choice:
    """Pick a worker for a prompt of ``prompt_blocks`` full blocks, or the shared stream.

    Ties in cost are broken at random (``rng``), so equal workers share the load. With
    fewer than two live workers nobody can stand out: a lone worker reads the shared
    stream anyway, and an own stream would only make its requests wait for the takeover
    if it died.
    """
    if config.mode != "kv" or len(views) < 2 or prompt_blocks < 1:
        return Choice(None)
    rng = rng or random.Random()
    costs = [cost(v, prompt_blocks, config.kv_overlap_score_weight) for v in views]
    best = _sample(costs, config.router_temperature, rng)
    winner = views[best]
    if winner.overlap_blocks < max(1, math.ceil(config.cache_threshold * prompt_blocks)):
        return Choice(None)
    return Choice(winner.worker_id, winner.overlap_blocks)


def _sample(costs: list[float], temperature: float, rng: random.Random) -> int:
    """The index of the lowest cost (ties at random), or with ``temperature`` > 0 one drawn
    with probability ∝ exp(-normalised cost / temperature)."""
    low, high = min(costs), max(costs)
    if temperature <= 0 or high == low:
        return rng.choice([i for i, c in enumerate(costs) if c == low])
    weights = [math.exp(-((c - low) / (high - low)) / temperature) for c in costs]
    return rng.choices(range(len(costs)), weights=weights, k=1)[0]
