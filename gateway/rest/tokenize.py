"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes (its OpenAI server's
"Tokenizer API").

``/tokenize`` takes a ``prompt`` (text, tokenized as ``/v1/completions`` would; vLLM's
default ``add_special_tokens: true`` adds the BOS a model asks for) or chat ``messages``
(rendered with the model's chat template and the request's ``tools`` exactly as
``/v1/chat/completions`` renders them, so ``count`` is that route's ``prompt_tokens``;
``add_generation_prompt`` default true, ``add_special_tokens`` default false) and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` only with
``return_token_strs``, else null). ``/detokenize`` takes ``tokens`` and answers
``{"prompt"}`` (special tokens kept, as vLLM).

Both are admitted like any request (the key, then the body, then one request counted in
the key's requests/min window, ``Admission.admit_unqueued``) and never queued: the
gateway's own tokenizer answers, off the event loop. They serve any model with a tokenizer,
embedding (pooling) models too, as vLLM's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, SkipValidation, StrictBool, StrictInt

from gateway.errors import InvalidRequestError
from gateway.model_registry import ModelScope
from gateway.prompts import (apply_completion_special_tokens, chat_prompt_ids,
                             completion_prompt_ids)
from gateway.rest import openapi_doc as doc
from gateway.rest import schemas
from gateway.rest.api_key import authorization_of
from gateway.service import GatewayService
from gateway.tools.spec import check_tools

#: The statuses of ``/tokenize`` and ``/detokenize`` (nothing is queued: no 500/504).
TOKENIZE_ERRORS = (400, 401, 404, 413, 429, 503)


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` (vLLM's ``TokenizeCompletionRequest``)
    or ``messages`` (its ``TokenizeChatRequest``, with ``tools`` as chat completions)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: SkipValidation[list[schemas.ChatMessageParam] | None] = None
    tools: SkipValidation[list[schemas.ToolParam] | None] = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeResponse(BaseModel):
    """``count`` tokens ``tokens`` (ids); ``max_model_len`` is the served context length
    (tokens); ``token_strs`` the tokens' strings with ``return_token_strs``, else null."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: ``tokens``, ids in [0, vocabulary size)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    """The text of the tokens (special tokens kept)."""

    prompt: str


def prompt_token_ids(service: GatewayService, body: TokenizeRequest) -> list[int]:
    """The token ids ``body`` asks for (see the module docstring); runs the tokenizer, so
    call it off the event loop.

    Raises:
        InvalidRequestError: neither or both of ``prompt`` and ``messages``; an invalid
            message, tool or prompt (naming it).
    """
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("send exactly one of 'prompt' and 'messages'", param="prompt")
    tokenizer = service.tokenizer
    if body.messages is not None:
        ids = chat_prompt_ids(tokenizer, body.messages, check_tools(body.tools, None),
                              add_generation_prompt=body.add_generation_prompt)
        if body.add_special_tokens:  # vLLM: the template's text tokenized with them too
            prefix = list(tokenizer.encode("", add_special_tokens=True))
            if prefix and ids[:len(prefix)] != prefix:
                ids = prefix + ids
        return ids
    prompt = apply_completion_special_tokens(tokenizer, body.prompt,
                                             service.settings.completion_special_tokens)
    return completion_prompt_ids(tokenizer, prompt, add_special_tokens=body.add_special_tokens
                                 is not False)


def tokenized(service: GatewayService | ModelScope, body: TokenizeRequest) -> TokenizeResponse:
    """``/tokenize``'s answer: :func:`prompt_token_ids`, the context length of the model
    (its ``max_model_len`` for a :class:`ModelScope`) and, when asked, the token strings."""
    ids = prompt_token_ids(service, body)
    strs = token_strs(service, ids) if body.return_token_strs else None
    length = getattr(service, "max_model_len", 0) or service.tokenizer.context_length
    return TokenizeResponse(count=len(ids), max_model_len=length, tokens=ids, token_strs=strs)


def detokenized(service: GatewayService, body: DetokenizeRequest) -> str:
    """The text of ``body.tokens``.

    Raises:
        InvalidRequestError: a token id outside the vocabulary (``param`` "tokens").
    """
    vocab = service.tokenizer.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})",
                                  param="tokens")
    return service.tokenizer.decode(body.tokens, skip_special_tokens=False)


def token_strs(service: GatewayService, ids: list[int]) -> list[str]:
    """Each token's string in the vocabulary (``return_token_strs``; a test tokenizer
    without one: the token's decoded text)."""
    hf = getattr(service.tokenizer, "hf", None)
    return [hf.id_to_token(i) if hf is not None else service.tokenizer.decode([i]) for i in ids]


async def admit_unqueued(service: GatewayService, request: Request, model: str | None,
                         work: Any, *args: Any, task: str | None = "generate") -> tuple[Any, dict[str, str]]:
    """:func:`admit_unqueued_with` the request's ``Authorization`` (or ``x-api-key``)."""
    return await admit_unqueued_with(service, authorization_of(request), model, work, *args, task=task)


async def admit_unqueued_with(service: GatewayService, authorization: str | None,
                              model: str | None, work: Any, *args: Any,
                              task: str | None = "generate") -> tuple[Any, dict[str, str]]:
    """Admission of a request answered at once (REST and gRPC): the key of
    ``authorization`` (``Bearer <key>``), the ``model`` (resolved by the model registry: an
    unknown one is a 404 ``model_not_found`` with nothing counted; one serving another task
    than ``task`` a 400 ``model_not_supported``; ``task`` None: any model, for the
    tokenizer routes), ``work(*args)`` in a
    thread (its checks and its answer; an argument that is ``service`` is given as a
    :class:`gateway.model_registry.ModelScope` of the model, so the work uses that model's
    tokenizer), then one request in the key's requests/min window. Returns
    ``(work's result, the key's rate-limit headers)``.

    Raises:
        InflightError: authentication, a bad body (what ``work`` raises), an unknown
            model, requests/min, Redis unreachable.
    """
    key = await service.admission.authenticate(authorization)
    scope = ModelScope(service, await service.admission.resolve(model, task, key=key))
    result = await asyncio.to_thread(work, *(scope if a is service else a for a in args))
    headers = await service.admission.admit_unqueued(key)
    return result, headers


def tokenize_router(service: GatewayService) -> APIRouter:
    """The routes ``POST /tokenize`` and ``POST /detokenize`` of ``service``."""
    router = APIRouter()

    @router.post("/tokenize", response_model=TokenizeResponse,
                 responses=doc.error_responses(*TOKENIZE_ERRORS))
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        answer, headers = await admit_unqueued(service, request, body.model, tokenized, service, body,
                                               task=None)
        return JSONResponse(answer.model_dump(), headers=headers)

    @router.post("/detokenize", response_model=DetokenizeResponse,
                 responses=doc.error_responses(*TOKENIZE_ERRORS))
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        text, headers = await admit_unqueued(service, request, body.model, detokenized,
                                             service, body, task=None)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump(), headers=headers)

    return router
