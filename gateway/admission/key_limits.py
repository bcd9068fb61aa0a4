"""Admission: what one API key may ask for, and what a request costs.

This is where the per-key caps of the design's admission order live (used by
validation). The stateful checks that follow validation — sliding windows
(requests/min, tokens/min), the in-flight cap and queue-depth backpressure — run
in Redis, in ``gateway.admission.ratelimit``, with the cost computed here.
"""

from __future__ import annotations

import logging

from gateway.keys import LOWEST_PRIORITY, KeyRecord
from gateway.settings import GatewaySettings
from gateway.admission.validation import RequestLimits, ValidatedRequest

log = logging.getLogger(__name__)


def _tighter(a: int, b: int) -> int:
    """The smaller of two caps where 0 means "none"."""
    if not a or not b:
        return a or b
    return min(a, b)


def limits_for(settings: GatewaySettings, key: KeyRecord) -> RequestLimits:
    """The request limits for ``key``: the tighter of the server's and the key's caps (tokens)."""
    return RequestLimits(
        served_model=settings.served_model_name,
        default_max_tokens=settings.default_max_tokens,
        max_max_tokens=_tighter(settings.max_max_tokens, key.max_max_tokens),
        max_prompt_tokens=key.max_prompt_tokens,
        max_n=settings.max_n,
        completion_special_tokens=settings.completion_special_tokens,
    )


def priority_for(key: KeyRecord, requested: int | None) -> int:
    """The priority class of a request: the key's, or a lower one the client asked for
    (0 = highest; a client can never raise its priority above its key's). A key stored with a
    priority outside 0 to ``LOWEST_PRIORITY`` (written before ``inflight keys`` checked it, or by
    hand) is clamped into that range with a warning (once per key and value): no worker reads
    any other class's stream, so its requests would wait there forever."""
    own = key.priority
    if not 0 <= own <= LOWEST_PRIORITY:
        own = min(LOWEST_PRIORITY, max(0, own))
        _warn_clamped_once(key, own)
    if requested is None:
        return own
    return min(LOWEST_PRIORITY, max(own, requested))


_CLAMPED_WARNED: set[tuple[str, int]] = set()  # (key id, stored priority) already logged


def _warn_clamped_once(key: KeyRecord, used: int) -> None:
    """Log a key's out-of-range priority once per gateway process and stored value, not on
    every request it sends."""
    if (key.key_id, key.priority) in _CLAMPED_WARNED:
        return
    _CLAMPED_WARNED.add((key.key_id, key.priority))
    log.warning("key %s has priority %s outside 0..%d; using %d (fix it: inflight keys set %s "
                "--priority N)", key.key_id, key.priority, LOWEST_PRIORITY, used, key.key_id)


def cost_tokens(request: ValidatedRequest) -> int:
    """Admission cost of a request in tokens: prompt + n × max_tokens, its worst case (the
    prompt is prefilled once and its KV blocks are shared; each of the n choices may
    generate max_tokens). The release refunds what the choices did not use."""
    return request.prompt_tokens + request.n * request.max_tokens
