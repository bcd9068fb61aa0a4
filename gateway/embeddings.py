"""Embeddings (REST ``POST /v1/embeddings``, gRPC ``Embed``): inputs checked, admitted, queued
for the model's pooling workers, and answered in input order.

A request's inputs (strings, or token-id arrays) are checked and tokenized with the model's
tokenizer (:func:`check_inputs`: none empty, each within the model's context and the key's
prompt cap, ids inside the vocabulary); the model must be one served for embeddings
(``ModelRegistry.resolve_model(name, task="embed")``: a model of another task is a 400
``model_not_supported``, an unknown one 404). The whole request is admitted once, as any
request (:meth:`Admission.reserve`: the key's requests/min, its tokens/min with the inputs'
tokens as the cost, one in-flight slot, the queue depth), and each input is queued as its own
entry with ``QueuedRequest.embedding`` set, on the model's stream, so several pooling workers
may share one batch of inputs. Each entry ends with one ``StepOutput.embeddings`` entry
(or a ``Finished`` error: a worker that does not pool refuses it, 400). The reservation is
released once, with the inputs' tokens as used; a client that goes away cancels what is
still queued or running, and a worker whose link drops has its entries re-queued
(gateway/continuation.py), as for generation.

Encoding: ``float`` gives the values as JSON numbers; ``base64`` the little-endian float32
bytes base64-encoded (OpenAI's format, which the ``openai`` client asks for by default).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.admission.key_limits import priority_for
from gateway.admission.ratelimit import Reservation
from gateway.errors import DeadlineExceededError, InflightError, InvalidRequestError, UnavailableError, from_worker
from gateway.keys import KeyRecord
from protos import common_pb2, link_pb2, queue_pb2

log = logging.getLogger(__name__)

#: The most inputs one request may carry (OpenAI's limit).
MAX_INPUTS = 2048
#: The largest ``dimensions`` the queue entry can carry (a uint32 field); the model's own
#: size, usually far below, is the worker's check.
MAX_DIMENSIONS = 2**32 - 1
ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingInputs:
    """A checked embeddings request.

    Attributes:
        token_ids: each input's token ids, in input order (none empty).
        dimensions: the vector length asked for (0 = the model's).
        normalize: L2-normalize each vector (vLLM's extra ``normalize``; default true).
    """

    token_ids: tuple[tuple[int, ...], ...]
    dimensions: int = 0
    normalize: bool = True

    @property
    def prompt_tokens(self) -> int:
        """Tokens over every input: the request's cost and its usage."""
        return sum(len(ids) for ids in self.token_ids)


@dataclass(frozen=True)
class EmbeddingResult:
    """The answer: ``vectors[i]`` (float32 values) is input ``i``'s; ``prompt_tokens`` summed
    over the inputs; ``model`` the name the request gave (or the default model's id)."""

    vectors: list[list[float]]
    prompt_tokens: int
    model: str
    rate_limit_headers: dict[str, str]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def input_kind(raw: Any) -> str:
    """``"texts"`` (a string or a list of strings) or ``"tokens"`` (a list of ids or a list of
    id lists), OpenAI's four shapes of ``input``.

    Raises:
        InvalidRequestError: anything else, an empty list, more than :data:`MAX_INPUTS` inputs
            (one array of token ids is one input, whatever its length).
    """
    if isinstance(raw, str):
        return "texts"
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("'input' must be a non-empty string, array of strings, array of token ids "
                                  "or array of token-id arrays", param="input")
    if all(_is_int(x) for x in raw):
        return "tokens"  # one input, however long: its length is the model's context's to cap
    if len(raw) > MAX_INPUTS:
        raise InvalidRequestError(f"'input' has {len(raw)} items; at most {MAX_INPUTS} are allowed", param="input")
    if all(isinstance(x, str) for x in raw):
        return "texts"
    if all(isinstance(x, list) and all(_is_int(t) for t in x) for x in raw):
        return "tokens"
    raise InvalidRequestError("'input' mixes types: send strings, or token ids, or arrays of token ids",
                              param="input")


def check_dimensions(dimensions: Any) -> int:
    """``dimensions`` (None = 0, the model's size); the upper bound is the model's hidden size,
    which only the worker knows: it refuses a larger value (400).

    Raises:
        InvalidRequestError: not a positive integer, or above :data:`MAX_DIMENSIONS`.
    """
    if dimensions is None:
        return 0
    if not _is_int(dimensions) or dimensions < 1:
        raise InvalidRequestError(f"'dimensions' must be a positive integer, got {dimensions!r}", param="dimensions")
    if dimensions > MAX_DIMENSIONS:
        raise InvalidRequestError(f"'dimensions' must be at most the model's embedding size, got {dimensions}",
                                  param="dimensions")
    return dimensions


def _check_unicode(text: str, index: int) -> None:
    """A text that is not valid Unicode (a lone surrogate such as ``"\\ud800"`` from JSON) is a
    400 naming ``input``, not a tokenizer crash (as gateway.prompts does for chat/completions)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"input {index} contains text that is not valid Unicode ({exc.reason})",
                                  param="input") from exc


def check_inputs(tokenizer: Any, raw: Any, dimensions: Any, normalize: Any, *, max_model_len: int,
                 max_prompt_tokens: int = 0) -> EmbeddingInputs:
    """Check and tokenize an embeddings request's ``input`` (see :func:`input_kind`): a text is
    encoded with the tokenizer's special tokens (the BOS, or the EOS an embedding model's
    tokenizer appends, as vLLM's ``add_special_tokens`` default); token ids are taken as given.
    Runs the tokenizer: call it off the event loop.

    Args:
        tokenizer: the model's tokenizer (``encode(text, add_special_tokens)``, ``vocab_size``).
        max_model_len: the model's context length in tokens (no input may be longer).
        max_prompt_tokens: the key's cap on one input's tokens (0 = none).

    Raises:
        InvalidRequestError: an empty input, one above the context (``context_length_exceeded``)
            or the key's cap, a token id outside the vocabulary, a bad ``dimensions`` or
            ``normalize`` (each names its parameter).
    """
    dims = check_dimensions(dimensions)
    if normalize is not None and not isinstance(normalize, bool):
        raise InvalidRequestError(f"'normalize' must be true or false, got {normalize!r}", param="normalize")
    kind = input_kind(raw)
    if kind == "texts":
        texts = [raw] if isinstance(raw, str) else raw
        if any(not t for t in texts):
            raise InvalidRequestError("'input' holds an empty string", param="input")
        for i, t in enumerate(texts):
            _check_unicode(t, i)
        ids = [list(tokenizer.encode(t, add_special_tokens=True)) for t in texts]
    else:
        ids = [raw] if _is_int(raw[0]) else raw
        vocab = tokenizer.vocab_size
        for i, one in enumerate(ids):
            bad = next((t for t in one if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"input {i}: token id {bad} is outside the vocabulary [0, {vocab})",
                                          param="input")
    cap = min(max_model_len, max_prompt_tokens) if max_prompt_tokens else max_model_len
    for i, one in enumerate(ids):
        if not one:
            raise InvalidRequestError(f"input {i} is empty", param="input")
        if len(one) > cap:
            raise InvalidRequestError(f"input {i} has {len(one)} tokens; at most {cap} are allowed "
                                      f"(the model's context is {max_model_len})", param="input",
                                      code="context_length_exceeded")
    return EmbeddingInputs(tuple(tuple(x) for x in ids), dims, normalize is not False)


def encode_vector(values: list[float], encoding_format: str) -> list[float] | str:
    """One embedding as OpenAI sends it: the float list, or (``base64``) its little-endian
    float32 bytes base64-encoded."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


class Embedder:
    """Submits embeddings requests through a gateway service (its admission, queue, request
    table and settings) and waits for their vectors.

    Args:
        service: the :class:`gateway.service.GatewayService`.
    """

    def __init__(self, service: Any):
        self._service = service

    async def embed(self, key: KeyRecord, model: str | None, raw_input: Any, *, dimensions: Any = None,
                    normalize: Any = None, timeout_s: float | None = None) -> EmbeddingResult:
        """Check, admit, queue and answer one embeddings request of the authenticated ``key``
        (see the module docstring); ``timeout_s`` (seconds left, e.g. the gRPC deadline)
        shortens the server's request timeout.

        Raises:
            InvalidRequestError: a bad input or parameter, a model that does not embed, or a
                worker's refusal (``dimensions`` above the model's size).
            NotFoundError: an unknown model.
            RateLimitError: a per-key window, the in-flight cap or the queue depth.
            DeadlineExceededError: not answered within the timeout.
            UnavailableError: Redis unreachable, no worker, a worker's link lost past retries.
        """
        service = self._service
        called = time.monotonic()
        resolved = await resolve_embedding_model(service, model, key)
        limits = service.settings
        inputs = await asyncio.to_thread(
            check_inputs, resolved.tokenizer, raw_input, dimensions, normalize,
            max_model_len=resolved.max_model_len, max_prompt_tokens=key.max_prompt_tokens)
        budget_s = limits.request_timeout_s
        if timeout_s is not None:
            budget_s = min(budget_s, max(0.0, timeout_s - (time.monotonic() - called)))
        priority = priority_for(key, None)  # the key's class, clamped into the served ones
        reservation = await service.admission.reserve(key, inputs.prompt_tokens, priority, resolved.model_id)
        headers = reservation.rate_limit.headers() if reservation.rate_limit is not None else {}
        used = 0
        try:
            vectors = await self._run(key, resolved.model_id, inputs, priority, budget_s)
            used = inputs.prompt_tokens
            service.metrics.prompt_tokens.labels(resolved.model_id).inc(used)
            log.info("embedded", extra={"tenant": key.tenant, "key_id": key.key_id, "inputs": len(vectors),
                                        "prompt_tokens": used, "e2e_s": round(time.monotonic() - called, 4)})
        except InflightError as err:
            err.headers.update(headers)
            raise
        finally:
            await service.detached(service.admission.release(reservation, used))
        return EmbeddingResult(vectors, inputs.prompt_tokens, resolved.name, headers)

    async def _run(self, key: KeyRecord, model_id: str, inputs: EmbeddingInputs, priority: int,
                   budget_s: float) -> list[list[float]]:
        """Queue one entry per input and wait for every vector (input order); on any error or
        cancellation the entries not answered are cancelled (XDEL or ``Cancel``)."""
        service = self._service
        table = service.request_table
        deadline = time.monotonic() + budget_s
        ids = [f"emb-{uuid.uuid4().hex}" for _ in inputs.token_ids]
        answered: set[str] = set()
        waiting = []
        try:
            for rid, tokens in zip(ids, inputs.token_ids):
                pending = table.register(rid, 1)
                waiting.append(pending)
                pending.message = queued_embedding(rid, tokens, key, model_id, priority, inputs,
                                                   deadline_unix_s=time.time() + budget_s,
                                                   reply_to=service.settings.reply_to)
                try:
                    pending.ticket = await service.queue.enqueue(pending.message)
                except InflightError as err:
                    table.fail(rid, err)
                    answered.add(rid)
                    raise
            vectors = []
            for pending in waiting:
                vectors.append(await self._answer(pending.events, deadline))
                answered.add(pending.request_id)
            return vectors
        finally:
            left = [rid for rid in ids if rid not in answered]
            if left:
                await service.detached(self._cancel(left))

    async def _cancel(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            await self._service.request_table.cancel(rid)

    @staticmethod
    async def _answer(events: asyncio.Queue, deadline: float) -> list[float]:
        """The vector an entry's ``events`` (its ``PendingRequest.events``) bring.

        Raises:
            DeadlineExceededError: ``deadline`` (monotonic s) passed first.
            InflightError: the worker refused or failed it, or its link was lost.
        """
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                event = await asyncio.wait_for(events.get(), remaining)
            except (TimeoutError, asyncio.TimeoutError):
                raise DeadlineExceededError("the embeddings request did not finish before its deadline") from None
            if isinstance(event, InflightError):
                raise event
            if isinstance(event, link_pb2.Embedding):
                return list(event.values)
            if isinstance(event, link_pb2.Finished):
                if event.finish_reason == common_pb2.FINISH_REASON_ERROR:
                    raise _worker_error(event)
                if event.finish_reason == common_pb2.FINISH_REASON_ABORT:
                    raise UnavailableError("the worker aborted the embeddings request; retry it", code="aborted")
                # a worker that generated instead (one older than --runner pooling): no vector
                raise InvalidRequestError("this model's workers generate text and do not serve embeddings "
                                          "(start them with --runner pooling)", param="model",
                                          code="model_not_supported")
            # deltas of such a worker: wait for its Finished


def _worker_error(finished: link_pb2.Finished) -> InflightError:
    """The error of a worker's ``Finished``; its refusal of ``dimensions`` (above the model's
    embedding size, which only the worker knows: worker/engine/pooling_engine.py) names that
    parameter, as the gateway's own check does."""
    err = from_worker(finished.error_code, finished.error)
    if isinstance(err, InvalidRequestError) and finished.error.startswith("dimensions "):
        return InvalidRequestError(finished.error, param="dimensions")
    return err


def queued_embedding(request_id: str, tokens: tuple[int, ...], key: KeyRecord, model_id: str, priority: int,
                     inputs: EmbeddingInputs, *, deadline_unix_s: float, reply_to: str) -> queue_pb2.QueuedRequest:
    """The queue entry of one input: ``embedding`` set (the worker pools instead of
    generating), ``sampling.max_tokens`` 1 (unused; a continuation checks it), cost = its tokens."""
    return queue_pb2.QueuedRequest(
        request_id=request_id, tenant=key.tenant, prompt_token_ids=list(tokens),
        sampling=common_pb2.SamplingParams(max_tokens=1), priority=priority, deadline_unix_s=deadline_unix_s,
        reply_to=reply_to, enqueued_unix_s=time.time(), model=model_id, key_id=key.key_id, cost=len(tokens),
        embedding=common_pb2.EmbeddingParams(dimensions=inputs.dimensions, normalize=inputs.normalize))


async def resolve_embedding_model(service: Any, model: str | None, key: KeyRecord | None = None) -> Any:
    """The model an embeddings request names, served for embeddings: the model registry's
    ``resolve_model(name, task="embed")`` (gateway/model_registry.py, through
    ``Admission.resolve``), a ``ResolvedModel`` (``name``, ``model_id``, ``tokenizer``,
    ``max_model_len``).

    Raises:
        NotFoundError: no such model, or one ``key`` may not use (404 ``model_not_found``).
        InvalidRequestError: the model generates text (400 ``model_not_supported``).
        UnavailableError: its workers report another tokenizer (``tokenizer_mismatch``).
    """
    return await service.admission.resolve(model, "embed", key)
