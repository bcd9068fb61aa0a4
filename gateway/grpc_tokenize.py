"""gRPC ``Tokenize`` and ``Detokenize`` (``inflight.v1.Inference``) as REST's ``/tokenize``
and ``/detokenize``: the proto request becomes REST's body and goes through the same
functions (``gateway.rest.tokenize``), so both fronts count and check alike."""

from __future__ import annotations

from gateway.errors import InvalidRequestError
from gateway.rest.tokenize import (DetokenizeRequest, TokenizeRequest, detokenized,
                                   prompt_token_ids, token_strs)
from gateway.service import GatewayService
from gateway.tools.grpc_tools import chat_messages, tool_list
from protos import inference_pb2


def tokenize_body(request: inference_pb2.TokenizeRequest) -> TokenizeRequest:
    """REST's ``/tokenize`` body of ``request``: ``prompt`` or ``chat`` (as ``messages``),
    unset ``add_special_tokens`` left to REST's defaults (true for a prompt, false for
    chat), unset ``add_generation_prompt`` true.

    Raises:
        InvalidRequestError: ``tools`` without chat input, a tool whose ``parameters`` is
            not JSON.
    """
    source = request.WhichOneof("input")
    tools = tool_list(request.tools)
    if tools and source != "chat":
        raise InvalidRequestError("'tools' need chat input (TokenizeRequest.chat)", param="tools")
    return TokenizeRequest(
        model=request.model or None,
        prompt=request.prompt if source == "prompt" else None,
        messages=chat_messages(request.chat) if source == "chat" else None,
        tools=tools or None,
        add_special_tokens=(request.add_special_tokens
                            if request.HasField("add_special_tokens") else None),
        add_generation_prompt=(request.add_generation_prompt
                               if request.HasField("add_generation_prompt") else True),
        return_token_strs=request.return_token_strs)


def tokenize(service: GatewayService, request: inference_pb2.TokenizeRequest
             ) -> inference_pb2.TokenizeResponse:
    """The answer to ``Tokenize``; runs the tokenizer, so call it off the event loop.

    Raises:
        InvalidRequestError: what :func:`tokenize_body` and REST's ``prompt_token_ids``
            raise (neither input, an empty prompt, invalid messages or tools).
    """
    body = tokenize_body(request)
    ids = prompt_token_ids(service, body)
    return inference_pb2.TokenizeResponse(
        count=len(ids), max_model_len=getattr(service, "max_model_len", 0) or service.tokenizer.context_length,
        tokens=ids,
        token_strs=token_strs(service, ids) if body.return_token_strs else ())


def detokenize(service: GatewayService, request: inference_pb2.DetokenizeRequest
               ) -> inference_pb2.DetokenizeResponse:
    """The answer to ``Detokenize``: the text of ``request.tokens``, special tokens kept.

    Raises:
        InvalidRequestError: a token id outside the vocabulary (``param`` "tokens").
    """
    text = detokenized(service, DetokenizeRequest(model=request.model or None,
                                                  tokens=list(request.tokens)))
    return inference_pb2.DetokenizeResponse(prompt=text)
