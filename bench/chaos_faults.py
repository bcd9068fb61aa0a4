"""The chaos soak's faults (``bench/chaos.py``): a seeded schedule scaled to the run's length,
and how each fault is done to the fleet (``bench/chaos_fleet.py``).

Kinds (``KINDS``), each in a window of its own:

* ``worker-kill``: SIGKILL a worker (the supervisor starts a new one);
* ``worker-stop``: SIGSTOP a worker for ``hold_s`` (30 s, less when the window is short), then SIGCONT;
* ``gateway-kill``: four greedy streams start (two ``openai`` REST, two gRPC), then the
  gateway with the most waiting clients is SIGKILLed (the supervisor starts a new one); its
  streaming clients resume through the other with ``Last-Event-ID`` / ``Resume`` via nginx;
* ``redis-kill``: SIGKILL the Redis primary; the sentinels promote the replica; once they
  did, the old primary is started again (empty) and becomes the new replica;
* ``readers``: a slow reader (one SSE chunk a second) and a client that stops reading
  without closing (the gateway must cancel it after ``--stream-idle-timeout``);
* ``kv-squeeze``: long prompts, several at once, until the workers preempt.

The schedule: a warm-up (10 % of the run, at least 20 s), then ``rounds`` (one per 150 s of
the run per kind: one per 15 minutes of the six kinds; at least one) of the chosen kinds
(``--faults``, all six by default) in a seeded order, one window each; a fault starts at a
seeded point of the first fifth of its window, or later when the previous fault's effects are
not over yet (``bench/chaos.py``: it waits for an empty queue and a whole fleet, at most until
the middle of its window, and the report shows how long it waited and the queue it met).

``BOUNDS_S``: the time within which new requests must be served again after each fault
(docs/DESIGN.md, "Who owns a failure"): a worker's own stream waits for its heartbeat TTL
(10 s) before the other worker takes it over; the link keepalive drops a hung worker's link
within 2 x 5 s; nginx skips a refused gateway at once; the sentinels fail over after
``down-after-milliseconds`` (1 s here) plus their election.
"""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass

KINDS = ("worker-kill", "worker-stop", "gateway-kill", "redis-kill", "readers", "kv-squeeze")
BOUNDS_S = {"worker-kill": 15.0, "worker-stop": 15.0, "gateway-kill": 5.0, "redis-kill": 10.0,
            "readers": None, "kv-squeeze": None}


@dataclass
class Fault:
    """One scheduled fault. Times in seconds from the start of the run; ``*_after_s``
    from the injection."""

    kind: str
    window_start_s: float
    window_end_s: float
    at_s: float
    hold_s: float = 0.0
    target: str = ""
    injected_s: float | None = None
    served_after_s: float | None = None   # first probe served after the last failed one
    worst_probe_s: float | None = None    # the slowest probe answer in the window
    whole_after_s: float | None = None    # every process ready again, Redis replicated
    bound_s: float | None = None
    waited_s: float = 0.0                 # how long it waited for the previous fault's effects to end
    queue_at_fault: float | None = None   # queue depth (entries) when it was done
    open_at_fault: int | None = None      # load requests sent before it and not ended yet
    open_ended_after_s: float | None = None  # the last of those ended this long after it
    detail: str = ""


def schedule(duration_s: float, seed: int, hold_s: float = 30.0, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """The faults of a run of ``duration_s`` (see the module docstring), of the given ``kinds``.

    Raises:
        ValueError: ``duration_s`` leaves a window shorter than 20 s; ``kinds`` is empty or
            names a kind not in ``KINDS``.
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"fault kinds {unknown or '(none)'}: choose among {', '.join(KINDS)}")
    rng = random.Random(seed)
    warm = max(20.0, 0.1 * duration_s)
    chosen = list(dict.fromkeys(kinds))
    rounds = max(1, round(duration_s / (150 * len(chosen))))
    order: list[str] = []
    for _ in range(rounds):
        one = list(chosen)
        rng.shuffle(one)
        order += one
    window = (duration_s - warm) / len(order)
    if window < 20:
        raise ValueError(f"--duration {duration_s:.0f} s leaves {window:.0f} s per fault window; need >= 20 s "
                         f"(use at least {warm + 20 * len(order):.0f} s)")
    faults = []
    for i, kind in enumerate(order):
        start = warm + i * window
        faults.append(Fault(kind, round(start, 1), round(start + window, 1),
                            round(start + rng.uniform(0.0, 0.2 * window), 1),
                            hold_s=min(hold_s, 0.6 * window) if kind == "worker-stop" else 0.0,
                            bound_s=BOUNDS_S[kind]))
    return faults


def parse_kinds(text: str) -> tuple[str, ...]:
    """``--faults``: comma-separated kinds (``worker-kill,redis-kill``), or ``all``.

    Raises:
        ValueError: a name not in ``KINDS``, or none.
    """
    if text.strip() == "all":
        return KINDS
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown fault kinds {unknown or '(none)'}: choose among all, {', '.join(KINDS)}")
    return kinds


def signal_group(pid: int | None, sig: int) -> None:
    """Send ``sig`` to the process group of ``pid`` (each service has its own session).

    Raises:
        RuntimeError: the service does not run.
    """
    if not pid:
        raise RuntimeError("the service does not run")
    os.killpg(pid, sig)


SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "cont": signal.SIGCONT}
