"""gRPC ``Embed`` (``inflight.v1.Inference``) as REST's ``POST /v1/embeddings``: the proto
request becomes the same ``input`` and goes through the same :class:`gateway.embeddings.Embedder`,
so both fronts check, admit, queue and answer alike (INVALID_ARGUMENT where REST says 400)."""

from __future__ import annotations

from typing import Any

from gateway.embeddings import EmbeddingResult
from gateway.errors import InvalidRequestError
from protos import inference_pb2


def embed_input(request: inference_pb2.EmbedRequest) -> list[str] | list[list[int]]:
    """The ``input`` of ``request``: its ``texts``, or its ``token_inputs`` as id lists.

    Raises:
        InvalidRequestError: both or neither set.
    """
    if bool(request.texts) == bool(request.token_inputs):
        raise InvalidRequestError("send exactly one of 'texts' and 'token_inputs'", param="texts")
    if request.texts:
        return list(request.texts)
    return [list(t.ids) for t in request.token_inputs]


def embed_response(result: EmbeddingResult) -> inference_pb2.EmbedResponse:
    """``result`` as the proto answer: one ``EmbeddingVector`` per input, in input order."""
    return inference_pb2.EmbedResponse(
        data=[inference_pb2.EmbeddingVector(index=i, values=v) for i, v in enumerate(result.vectors)],
        prompt_tokens=result.prompt_tokens, model=result.model)


async def embed(embedder: Any, key: Any, request: inference_pb2.EmbedRequest,
                timeout_s: float | None) -> EmbeddingResult:
    """Run ``request`` for the authenticated ``key`` (``timeout_s``: the call's deadline left).

    Raises:
        InflightError: what :meth:`gateway.embeddings.Embedder.embed` raises, and
            :func:`embed_input`'s InvalidRequestError.
    """
    return await embedder.embed(key, request.model or None, embed_input(request),
                                dimensions=request.dimensions or None, timeout_s=timeout_s)
