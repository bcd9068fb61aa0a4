"""Admission, the one owner of the design's order (DESIGN.md "Gateway admission"):

1. authenticate the API key (:meth:`Admission.authenticate`);
2. validate the parameters under the key's caps (:meth:`Admission.validate`);
3. per-key sliding windows, requests/min then tokens/min;
4. the key's in-flight cap;
5. global queue-depth backpressure.

A front calls step 1 on its own (its checks of the request's shape come after the
key: a request with a bad key is a 401 whatever else is wrong with it), then
``GatewayService.submit``, which calls :meth:`Admission.admit` for steps 2 to 5
before it enqueues. Steps 3 to 5 are one Lua script (``ratelimit``), which
reserves the request in every structure only when all of them pass. Each
rejection is an ``InflightError`` counted in ``inflight_gateway_rejections_total``
by reason and ``model_name`` (the served model once resolved, else ""); nothing is reserved on any failure. Each decision of steps 3 to 5 is also
counted per key (``inflight_gateway_key_admissions_total{tenant, key_id, outcome}``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, TypeVar

import redis.asyncio

from common.fleet import record_rejection
from common.redis_keys import stream_name
from gateway.admission import key_limits
from gateway.admission.params import RequestParams
from gateway.admission.ratelimit import AdmissionPolicy, Limiter, Reservation
from gateway.admission.request_id import check_request_id
from gateway.admission.validation import PromptTokenizer, ValidatedRequest, validate_request
from gateway.admission.workers import WorkerGate
from gateway.errors import InflightError, RateLimitError, rejection_reason
from gateway.keys import KeyRecord, authenticate_async, bearer_token
from gateway.metrics import GatewayMetrics, note_model
from gateway.model_registry import ModelRegistry, ResolvedModel
from gateway.settings import GatewaySettings

INFLIGHT_TTL_MARGIN_S = 30.0  # an unreleased in-flight slot lives request_timeout_s + this

T = TypeVar("T")
log = logging.getLogger(__name__)
#: ``(authorization value, key)`` a REST route authenticated before FastAPI read its body
#: (gateway/rest/auth_first.py), for :meth:`Admission.authenticate` to return again.
PRE_AUTHENTICATED: ContextVar[tuple[str | None, KeyRecord] | None] = ContextVar("pre_authenticated", default=None)


@dataclass(frozen=True)
class Decision:
    """A request that passed every check that needs no reservation.

    Attributes:
        request: the validated request.
        client_request_id: the client's own id, checked (None: the server makes one).
        priority: the priority class it is queued in (0 = highest; never above the key's).
        cost_tokens: what it reserves in the key's tokens/min window: prompt + n × max_tokens.
    """

    request: ValidatedRequest
    client_request_id: str | None
    priority: int
    cost_tokens: int


@dataclass(frozen=True)
class Admitted(Generic[T]):
    """An admitted request: the decision, its reservation (release it exactly once, see
    :meth:`Admission.release`) and what the caller's ``before_reserve`` returned."""

    decision: Decision
    reservation: Reservation
    prepared: T



def limited_model(model: ResolvedModel) -> str:
    """The name a key's model list and per-model limits use for ``model``: an adapter's own
    name, else the base model's id (aliases count as the id)."""
    return model.lora_name or model.model_id


def windowed_name(key: KeyRecord, canonical: str, sent: str) -> str:
    """The model whose per-key windows a request of ``key`` counts in: ``canonical`` (an
    adapter's name or the model id: limits set for the id cover its aliases), else the alias
    the request ``sent`` where the key has limits for that name only."""
    if key.limits_for_model(canonical) is None and sent and key.limits_for_model(sent) is not None:
        return sent
    return canonical

class Admission:
    """Authentication, validation and per-key/queue admission of one gateway.

    Args:
        settings: caps, request timeout (seconds), queue limits, ``require_worker``.
        client: asyncio Redis (keys, windows, heartbeats).
        models: the gateway's models (gateway/model_registry.py): which model a request
            names, its tokenizer (prompt tokens, context length); a tokenizer alone serves
            one model, ``settings.served_model_name``.
        metrics: ``rejections`` is counted here.
        queue_streams: ``(priority, model)`` -> the model's workers' own streams of that
            priority, whose entries count towards its queue depth beside the shared stream's
            (the KV-aware router's); None: none.
    """

    def __init__(self, settings: GatewaySettings, client: redis.asyncio.Redis,
                 models: ModelRegistry | PromptTokenizer, metrics: GatewayMetrics,
                 queue_streams: Callable[[int, str], Awaitable[list[str]]] | None = None):
        self.settings = settings
        self.redis = client
        if not isinstance(models, ModelRegistry):
            models = ModelRegistry.single(client, settings.served_model_name, models)
        self.models = models
        self.tokenizer = models.default.tokenizer  # the default model's
        self.metrics = metrics
        self.limiter = Limiter(client, AdmissionPolicy(
            inflight_ttl_s=settings.request_timeout_s + INFLIGHT_TTL_MARGIN_S,
            busy_retry_after_s=settings.busy_retry_after_s))
        self.workers = WorkerGate(models, settings.require_worker)
        self._queue_streams = queue_streams

    async def authenticate(self, authorization: str | None) -> KeyRecord:
        """Step 1: the key record behind an ``Authorization: Bearer <key>`` value; the one
        found for this request before its body was read (:data:`PRE_AUTHENTICATED`, same
        value) is not looked up again.

        Raises:
            AuthenticationError: missing, malformed, unknown or revoked key.
            UnavailableError: Redis unreachable.
        """
        done = PRE_AUTHENTICATED.get()
        if done is not None and done[0] == authorization:
            return done[1]
        try:
            return await authenticate_async(self.redis, bearer_token(authorization))
        except InflightError as err:
            self._count_rejection(err)
            raise

    async def resolve(self, model: str | None, task: str | None = "generate",
                      key: KeyRecord | None = None) -> ResolvedModel:
        """The model a request names (``ModelRegistry.resolve_model``), its refusal counted;
        with ``key``, one that key may use (``KeyRecord.models``: the name sent or the
        model's own id, an adapter's name for an adapter).

        Raises:
            ModelNotFoundError: 404 ``model_not_found``: no such model, or not for ``key``
                (OpenAI's answer for a model an organization cannot use).
            InvalidRequestError, UnavailableError: as ``resolve_model``.
        """
        try:
            # the key's access first: a model it may not use is a 404 before its task is told
            resolved = await self.models.resolve_model(model, task, key.may_use if key is not None else None)
            note_model(resolved.model_id)  # the request's model_name in inflight_gateway_requests_total
            return resolved
        except InflightError as err:
            self._count_rejection(err)
            raise

    async def validate(self, key: KeyRecord, params: RequestParams) -> ValidatedRequest:
        """Step 2: validate ``params`` under ``key``'s limits (see ``validate_request``) with
        the tokenizer and context length of the model it names (:meth:`resolve`: an unknown
        model is a 404 here, before anything is reserved).

        Runs in a worker thread: tokenizing a prompt near the 1 MB body limit takes
        about 0.7 s, and the tokenizer releases the GIL
        (:meth:`common.tokenizer.Tokenizer.encode`), so other requests' streams go
        on meanwhile instead of stalling behind it.

        Raises:
            InvalidRequestError, NotFoundError: the parameter at fault is named.
            UnavailableError: the model is refused (``tokenizer_mismatch``).
        """
        model = await self.resolve(params.model, key=key)
        limits = dataclasses.replace(key_limits.limits_for(self.settings, key), served_model=model.name,
                                     max_model_len=model.max_model_len)
        try:
            request = await asyncio.to_thread(validate_request, model.tokenizer, limits, params)
        except InflightError as err:
            self._count_rejection(err, model.model_id)
            raise
        return dataclasses.replace(request, model_id=model.model_id, lora_name=model.lora_name)

    async def admit(self, key: KeyRecord, params: RequestParams,
                    before_reserve: Callable[[Decision], T], *,
                    request_id: str | None = None) -> Admitted[T]:
        """Steps 2 to 5 for an authenticated ``key``: validate ``params``, check the
        client's ``request_id`` and that a worker is alive (``require_worker``), then
        reserve the request in the key's windows, its in-flight set and the queue.

        ``before_reserve(decision)`` runs after the checks that need no reservation and
        before the reservation; the caller uses it for what must hold before a slot is
        taken (its request id is free, its queue message builds). What it raises
        propagates with nothing reserved; what it returns is ``Admitted.prepared``.

        Raises:
            InvalidRequestError, NotFoundError: a parameter or ``request_id`` (validation),
                or the cost alone exceeds the key's tokens/min.
            UnavailableError: no worker heartbeat while ``require_worker`` (code
                ``no_worker``), or Redis unreachable.
            RateLimitError: requests/min, tokens/min, in-flight cap or queue depth
                (``code`` key_rate, key_tokens, in_flight, queue_full; retry_after_s set).
        """
        request = await self.validate(key, params)
        client_request_id = check_request_id(request_id)  # not a counted rejection
        await self._check_workers(request.model_id)
        priority = key_limits.priority_for(key, request.priority)
        decision = Decision(request, client_request_id, priority, key_limits.cost_tokens(request))
        prepared = before_reserve(decision)
        reservation = await self._reserve(key, decision.cost_tokens, priority, request.model_id,
                                          windowed_name(key, request.lora_name or request.model_id, request.model))
        return Admitted(decision, reservation, prepared)

    async def reserve(self, key: KeyRecord, cost_tokens: int, priority: int, model_id: str) -> Reservation:
        """Steps 3 to 5 for a request its front checked itself (embeddings,
        gateway/embeddings.py): a ready worker of ``model_id`` (``require_worker``), then one
        request of ``cost_tokens`` tokens in the key's windows, its in-flight cap and the queue
        depth of ``model_id``'s streams of ``priority``, and the key's windows for ``model_id``
        where it has some. Release it once with :meth:`release`.

        Raises:
            UnavailableError: no worker (``no_worker``), or Redis unreachable.
            RateLimitError: requests/min, tokens/min, in-flight cap or queue depth.
            InvalidRequestError: the cost alone exceeds the key's tokens/min.
        """
        await self._check_workers(model_id)
        return await self._reserve(key, cost_tokens, priority, model_id, model_id)

    async def _check_workers(self, model_id: str) -> None:
        """A ready worker of ``model_id`` exists (``require_worker``); a refusal is counted."""
        try:
            await self.workers.check(model_id)
        except InflightError as err:
            self._count_rejection(err, model_id)
            raise

    async def _reserve(self, key: KeyRecord, cost_tokens: int, priority: int, model_id: str,
                       limited: str) -> Reservation:
        """The rate-limit script's reservation (steps 3 to 5) in ``model_id``'s streams, with
        the key's windows for model ``limited`` (an adapter's name, else the model id) when
        it has limits for it (``KeyRecord.model_limits``); its decision counted."""
        try:
            streams = [stream_name(priority, model_id)]
            if self._queue_streams is not None and self.settings.queue_limit(priority):
                streams += await self._queue_streams(priority, model_id)
            reservation = await self.limiter.admit(key, cost_tokens, streams, self.settings.queue_limit(priority),
                                                   model=limited)
        except InflightError as err:
            await self._count_refused(key, err, model_id)
            raise
        self._count_key(key, "admitted")
        return reservation

    async def admit_unqueued(self, key: KeyRecord) -> dict[str, str]:
        """Step 3's requests/min window alone, for a request answered at once and never
        queued (``/tokenize``, ``/detokenize``, ``/v1/messages/count_tokens``): counted
        there like any request, no tokens reserved, no in-flight slot, no queue check.
        Returns the key's ``x-ratelimit-*`` headers (requests only).

        Raises:
            RateLimitError: the key's requests/min (``code`` key_rate, retry_after_s set).
            UnavailableError: Redis unreachable.
        """
        try:
            state = await self.limiter.count_request(key)
        except InflightError as err:
            await self._count_refused(key, err)
            raise
        self._count_key(key, "admitted")
        return state.headers() if state is not None else {}

    async def _count_refused(self, key: KeyRecord, err: InflightError, model_id: str | None = None) -> None:
        """Count a refusal by the rate-limit step: the rejection metric (under ``model_id``,
        by default the request's noted model), and for a 429 the key's counter and the fleet
        view's 10 s bucket."""
        self._count_rejection(err, model_id)
        if isinstance(err, RateLimitError):
            self._count_key(key, rejection_reason(err))
            await self._record_429(rejection_reason(err))

    async def release(self, reservation: Reservation, used_tokens: int,
                      rollback: bool = False) -> None:
        """Release ``reservation`` (see ``Limiter.release``; tokens); a Redis failure is
        logged, not raised: the in-flight slot then expires by its TTL."""
        try:
            await self.limiter.release(reservation, used_tokens, rollback)
        except InflightError as exc:
            log.warning("could not release %s: %s", reservation.member, exc.message)

    async def _record_429(self, reason: str) -> None:
        """Count a 429 of ``reason`` in Redis for the fleet view's "429s of the last minute"
        (common/fleet.py), summed over every gateway; a Redis failure only loses the count."""
        try:
            await record_rejection(self.redis, reason)
        except (redis.RedisError, OSError) as exc:
            log.debug("429 not counted for the fleet view: %s", exc)

    def _count_rejection(self, err: InflightError, model_id: str | None = None) -> None:
        """Count ``err`` in ``inflight_gateway_rejections_total`` under ``model_id`` (a served
        model's id), by default the model the request's scope noted ("" before one was)."""
        self.metrics.count_rejection(rejection_reason(err), model_id)

    def _count_key(self, key: KeyRecord, outcome: str) -> None:
        """Count one rate-limiter decision for ``key`` (``inflight_gateway_key_admissions_total``):
        labelled by tenant and the public key_id, both set by the operator at key creation,
        so a client cannot grow the label set."""
        self.metrics.key_admissions.labels(tenant=key.tenant, key_id=key.key_id, outcome=outcome).inc()
