"""The public gRPC front: ``inflight.v1.Inference`` (grpc.aio), plus the standard
``grpc.health.v1`` health service and server reflection.

Auth is the ``authorization: Bearer <key>`` metadata entry. A client that
cancels or disconnects ends its handler, which sends ``Cancel`` to the worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.sampling import grpc_fields
from gateway.admission.params import RequestParams
from gateway.admission.structured import structured_outputs_from_proto
from gateway.errors import (InflightError, InvalidRequestError, grpc_details, grpc_status,
                            grpc_trailers)
from gateway.embeddings import Embedder
from gateway.grpc_embed import embed, embed_response
from gateway.grpc_tokenize import detokenize, tokenize
from gateway.metrics import model_scope
from gateway.rest.tokenize import admit_unqueued_with
from gateway.service import GatewayService
from gateway.tools.grpc_tools import ToolCallResponses, chat_messages, tools_json
from gateway.tools.request import tool_fields
from protos import inference_pb2, inference_pb2_grpc

_SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes are not a valid message (corrupt wire data, a string field
    that is not UTF-8). grpc answers UNKNOWN when a deserializer raises, so the
    deserializer returns this instead and the handler answers INVALID_ARGUMENT."""

    reason: str


def _lenient(message_type):
    """A request deserializer for ``message_type`` that returns :class:`Undecodable`
    instead of raising ``DecodeError``."""
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(str(exc))
    return parse


def _undecodable_error(request) -> InvalidRequestError | None:
    if isinstance(request, Undecodable):
        return InvalidRequestError(f"the request is not a valid message: {request.reason}",
                                   code="invalid_message")
    return None


def _metadata(context: grpc.aio.ServicerContext, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return value
    return None


def _optional(msg, name: str):
    return getattr(msg, name) if msg.HasField(name) else None


def request_params(request: inference_pb2.GenerateRequest) -> RequestParams:
    """The :class:`RequestParams` of a ``GenerateRequest``. Where proto3 has no presence,
    the zero value means "not sent" (``n`` 0; the sampling fields:
    ``common.sampling.grpc_fields``, e.g. ``max_tokens`` 0, ``logprobs`` 0, no ``stop``);
    no ``input`` at all is an InvalidRequestError naming both inputs; validation checks the fields as it does
    REST's. A raw ``prompt`` goes through the same ``validate_request`` as REST's
    ``/v1/completions``, so the gateway's ``completion_special_tokens`` setting (allow /
    escape / reject, applied by ``gateway.prompts.apply_completion_special_tokens``) holds
    for it too.
    ``structured_outputs`` constrains the output as REST's field of that name does.
    ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (chat only) are checked as REST's
    (``gateway.tools.request.tool_fields``; docs/TOOLS.md)."""
    s = request.sampling
    source = request.WhichOneof("input")
    prompt, messages = None, None
    if source == "chat":
        messages = chat_messages(request.chat)
    elif source:
        prompt = request.prompt
    else:  # "'prompt' is required" (REST completions' words) hid that chat input serves too
        raise InvalidRequestError("GenerateRequest needs an input: 'prompt' or 'chat'", param="prompt")
    structured = _structured(s)
    tools, tool_choice, parallel = tools_json(request)
    if source != "chat" and (tools or tool_choice is not None):
        raise InvalidRequestError("'tools' need chat input (GenerateRequest.chat)", param="tools")
    constraint = (structured["structured_outputs"], structured["structured_outputs_param"]) \
        if structured else None
    structured.update(tool_fields(tools, tool_choice, parallel, constraint))
    return RequestParams(
        prompt=prompt, messages=messages, model=request.model or None, n=s.n or None,
        priority=_optional(request, "priority"), **grpc_fields(s), **structured)


def _structured(s) -> dict:
    """``SamplingParams.structured_outputs`` as ``RequestParams`` fields (none when unset);
    its shape is checked as REST's ``structured_outputs`` is (InvalidRequestError)."""
    found = structured_outputs_from_proto(s.structured_outputs)
    return {} if found is None else {"structured_outputs": found[0], "structured_outputs_param": found[1]}


def _checked(work):
    """``work(service, request)`` that first refuses an :class:`Undecodable` request."""
    def run(service: GatewayService, request):
        undecodable = _undecodable_error(request)
        if undecodable is not None:
            raise undecodable
        return work(service, request)
    return run


class InferenceService(inference_pb2_grpc.InferenceServicer):
    """``Generate`` and ``Resume`` (server-streaming), ``ListModels``, ``Tokenize``,
    ``Detokenize`` and ``Embed`` over a :class:`GatewayService`."""

    def __init__(self, service: GatewayService):
        self._service = service
        self._embedder = Embedder(service)

    async def Generate(self, request: inference_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext):
        """Stream the completion (one message per worker delta, each choice's last with
        its finish_reason + usage; n > 1 choices interleaved, each message with its index). Errors abort with the mapped status code; a client
        cancel or the deadline sends ``Cancel`` to the worker. A key with limits gets
        OpenAI's ``x-ratelimit-*`` values as initial metadata, admitted or refused."""
        async for response in self._serve(request, context, "grpc.Generate", self._start):
            yield response

    async def Resume(self, request: inference_pb2.ResumeRequest, context: grpc.aio.ServicerContext):
        """Resume a ``Generate`` stream whose connection broke (through any gateway, with the
        key that started it): the messages after its first ``offset`` output tokens, from the
        stream's journal (gateway/stream_journal.py), relayed while the stream's gateway still
        streams it and continued here once it is gone (gateway/stream_relay.py). Unknown
        stream (or another key's): NOT_FOUND; ``offset`` not where a message ended, another
        request, or ``n`` > 1 with nobody streaming it any more: INVALID_ARGUMENT."""
        async for response in self._serve(request, context, "grpc.Resume", self._resume):
            yield response

    async def _serve(self, request, context: grpc.aio.ServicerContext, endpoint: str, start):
        """The responses of the generation ``start(request, context)`` begins (it returns
        the generation and the deltas its client already has: a resume's)."""
        metrics = self._service.metrics
        try:
            with model_scope() as noted:  # not across the yields below: the stream's model is gen's
                gen, had = await start(request, context)
        except InflightError as err:
            metrics.count_request(endpoint, grpc_status(err).name, model_name=noted[0])
            if err.headers:  # an admission rejection: the key's x-ratelimit-* values
                await context.send_initial_metadata(tuple(err.headers.items()))
            await context.abort(grpc_status(err), grpc_details(err), grpc_trailers(err))
        if gen.rate_limit_headers:
            await context.send_initial_metadata(tuple(gen.rate_limit_headers.items()))
        status = "OK"
        tools = gen.request.tools
        calls = ToolCallResponses(gen.request_id, tools, gen.internal_id) if tools and tools.parses_calls else None
        if calls is not None:  # a resume goes on with the parse its client has
            calls.restore(had)
        try:
            async for event in gen.events():
                if calls is None:
                    yield self._response(gen.request_id, event)
                    continue
                for response in calls.responses(event):
                    yield response
        except InflightError as err:
            status = grpc_status(err).name
            await context.abort(grpc_status(err), grpc_details(err))
        finally:
            await gen.close()
            metrics.count_request(endpoint, status, model_name=gen.request.model_id or gen.request.model)

    async def _start(self, request: inference_pb2.GenerateRequest,
                     context: grpc.aio.ServicerContext):
        service = self._service
        key = await service.admission.authenticate(_metadata(context, "authorization"))
        undecodable = _undecodable_error(request)
        if undecodable is not None:
            raise undecodable
        gen = await service.submit(key, request_params(request), request_id=request.request_id,
                                   timeout_s=context.time_remaining())
        await service.start_journal(gen, int(time.time()), key)
        return gen, ()

    async def _resume(self, request: inference_pb2.ResumeRequest, context: grpc.aio.ServicerContext):
        service = self._service
        key = await service.admission.authenticate(_metadata(context, "authorization"))
        undecodable = _undecodable_error(request)
        if undecodable is not None:
            raise undecodable
        _journal, point = await service.resume_point(key, request.request_id, request.offset)
        original = request.request
        gen = await service.submit(key, request_params(original), request_id=original.request_id,
                                   timeout_s=context.time_remaining(), resume=point)
        await service.start_journal(gen, point.created, key)
        return gen, point.deltas

    @staticmethod
    def _response(request_id: str, event) -> inference_pb2.GenerateResponse:
        if event.DESCRIPTOR.name == "Delta":
            return inference_pb2.GenerateResponse(request_id=request_id, text=event.text,
                                                  token_ids=event.token_ids,
                                                  logprobs=event.logprobs, index=event.index)
        return inference_pb2.GenerateResponse(request_id=request_id, index=event.index,
                                              finish_reason=event.finish_reason, usage=event.usage)

    async def ListModels(self, request, context: grpc.aio.ServicerContext):
        """Every model (gateway/model_registry.py: configured, aliases, adapters; context length
        in tokens, created, parent, scale_from_zero, task), as REST's ``/v1/models``; requires a
        valid key."""
        try:
            key = await self._service.admission.authenticate(_metadata(context, "authorization"))
            undecodable = _undecodable_error(request)
            if undecodable is not None:
                raise undecodable
        except InflightError as err:
            await context.abort(grpc_status(err), grpc_details(err))
        infos = [inference_pb2.ModelInfo(id=e.id, owned_by="inflight", context_length=e.max_model_len,
                                         created=e.created, parent=e.parent, scale_from_zero=e.scale_from_zero,
                                         task=e.task)
                 for e in await self._service.models.listing() if key.may_use(e.id)]
        return inference_pb2.ListModelsResponse(models=infos)


    async def Tokenize(self, request: inference_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> inference_pb2.TokenizeResponse:
        """A prompt or chat messages to token ids, as REST's ``/tokenize``
        (``gateway.grpc_tokenize``); admitted and answered at once (see :meth:`_unqueued`)."""
        return await self._unqueued(request, context, "grpc.Tokenize", _checked(tokenize))

    async def Detokenize(self, request: inference_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> inference_pb2.DetokenizeResponse:
        """Token ids to text, as REST's ``/detokenize``; admitted as :meth:`Tokenize`."""
        return await self._unqueued(request, context, "grpc.Detokenize", _checked(detokenize))

    async def Embed(self, request: inference_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> inference_pb2.EmbedResponse:
        """One embedding per input, in input order, as REST's ``/v1/embeddings``
        (``gateway.grpc_embed``): admitted as a generation (the inputs' tokens in the key's
        tokens/min window) and queued for the model's pooling workers. Errors abort with the
        mapped status (INVALID_ARGUMENT for bad input, NOT_FOUND for an unknown model)."""
        service = self._service
        with model_scope():
            try:
                key = await service.admission.authenticate(_metadata(context, "authorization"))
                undecodable = _undecodable_error(request)
                if undecodable is not None:
                    raise undecodable
                result = await embed(self._embedder, key, request, context.time_remaining())
            except InflightError as err:
                service.metrics.count_request("grpc.Embed", grpc_status(err).name)
                if err.headers:
                    await context.send_initial_metadata(tuple(err.headers.items()))
                await context.abort(grpc_status(err), grpc_details(err), grpc_trailers(err))
            if result.rate_limit_headers:
                await context.send_initial_metadata(tuple(result.rate_limit_headers.items()))
            service.metrics.count_request("grpc.Embed", "OK")
        return embed_response(result)

    async def _unqueued(self, request, context: grpc.aio.ServicerContext, endpoint: str, work):
        """``work(service, request)``'s answer, admitted like REST's tokenizer routes
        (``gateway.rest.tokenize.admit_unqueued_with``: the key, ``model``, the work in a
        thread, one request in the key's requests/min window; never queued). The key's
        ``x-ratelimit-*`` values go out as initial metadata, admitted or refused; errors
        abort with the mapped status (RESOURCE_EXHAUSTED with ``retry-after`` trailers)."""
        metrics = self._service.metrics
        model = None if isinstance(request, Undecodable) else request.model or None
        with model_scope():
            try:
                answer, headers = await admit_unqueued_with(
                    self._service, _metadata(context, "authorization"), model, work, self._service,
                    request, task=None)  # any model with a tokenizer, embedding ones too (vLLM)
            except InflightError as err:
                metrics.count_request(endpoint, grpc_status(err).name)
                if err.headers:
                    await context.send_initial_metadata(tuple(err.headers.items()))
                await context.abort(grpc_status(err), grpc_details(err), grpc_trailers(err))
            if headers:
                await context.send_initial_metadata(tuple(headers.items()))
            metrics.count_request(endpoint, "OK")
        return answer


def _add_inference(servicer: InferenceService, server: grpc.aio.Server) -> None:
    """``inference_pb2_grpc.add_InferenceServicer_to_server`` with lenient request
    deserializers (see :class:`Undecodable`): one handler per RPC of the service's descriptor
    (protos/inference.proto), unary or server-streaming as declared there."""
    handlers = {}
    for method in inference_pb2.DESCRIPTOR.services_by_name["Inference"].methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        request, response = (getattr(inference_pb2, t.name) for t in (method.input_type, method.output_type))
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=_lenient(request),
                                     response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(_SERVICE_NAME, handlers)


def add_public_services(server: grpc.aio.Server, service: GatewayService) -> health.aio.HealthServicer:
    """Register Inference, health (SERVING) and reflection on ``server``; returns the
    health servicer so the caller can flip it to NOT_SERVING at shutdown."""
    _add_inference(InferenceService(service), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return health_servicer


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
