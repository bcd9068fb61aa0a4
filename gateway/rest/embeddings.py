"""``POST /v1/embeddings`` in OpenAI's shape (gateway/embeddings.py does the work).

Body: ``input`` (a string, an array of strings, an array of token ids or an array of
token-id arrays), ``model``, ``encoding_format`` (``float``, the default, or ``base64``:
little-endian float32 bytes), ``dimensions``, ``user`` (accepted, unused) and vLLM's extra
``normalize``. Answer: ``{"object": "list", "data": [{"object": "embedding", "index": i,
"embedding": ...}], "model", "usage": {"prompt_tokens", "total_tokens"}}``, ``data`` in input
order. A client that disconnects before the answer cancels what is still queued or running.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, SkipValidation

from gateway.embeddings import Embedder, EmbeddingResult, encode_vector
from gateway.rest import openapi_doc as doc
from gateway.rest.api_key import authorization_of
from gateway.rest.delivery import CLIENT_CLOSED_STATUS

#: The statuses of ``/v1/embeddings``.
EMBEDDINGS_ERRORS = (400, 401, 404, 413, 429, 500, 503, 504)


class EmbeddingRequest(BaseModel):
    """OpenAI's ``CreateEmbeddingRequest`` (``input``'s shape is checked by
    ``gateway.embeddings.check_inputs``, which names what is wrong)."""

    model_config = ConfigDict(extra="ignore")
    input: SkipValidation[str | list[str] | list[int] | list[list[int]]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: SkipValidation[int | None] = None
    user: str | None = None
    normalize: SkipValidation[bool | None] = None


class EmbeddingData(BaseModel):
    """One input's vector: float32 values, or their base64 little-endian bytes."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Tokens over every input (no completion tokens)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """OpenAI's ``CreateEmbeddingResponse``."""

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def embedding_response(result: EmbeddingResult, encoding_format: str) -> dict[str, Any]:
    """The response body of ``result`` with each vector encoded as ``encoding_format``."""
    data = [EmbeddingData(index=i, embedding=encode_vector(v, encoding_format))
            for i, v in enumerate(result.vectors)]
    usage = EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens)
    return EmbeddingResponse(data=data, model=result.model, usage=usage).model_dump()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def embeddings_router(service: Any) -> APIRouter:
    """The route ``POST /v1/embeddings`` of ``service`` (a ``GatewayService``)."""
    router = APIRouter()
    embedder = Embedder(service)

    @router.post("/v1/embeddings", response_model=EmbeddingResponse,
                 responses=doc.error_responses(*EMBEDDINGS_ERRORS))
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        key = await service.admission.authenticate(authorization_of(request))
        work = asyncio.ensure_future(embedder.embed(key, body.model, body.input, dimensions=body.dimensions,
                                                    normalize=body.normalize))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left: cancelling the work cancels its entries
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                return Response(status_code=CLIENT_CLOSED_STATUS)
            result = work.result()  # InflightError propagates to the error handlers
        finally:
            gone.cancel()
        return JSONResponse(embedding_response(result, body.encoding_format), headers=result.rate_limit_headers)

    return router

