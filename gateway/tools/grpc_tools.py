"""Tool calls over gRPC (``inflight.v1.Inference/Generate``): the request's ``tools``,
``tool_choice`` and chat history in the shapes REST's checks take, and the worker's
events into ``GenerateResponse`` messages carrying ``tool_calls`` deltas (docs/TOOLS.md)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from gateway.errors import InvalidRequestError
from gateway.rest.stream_rebuild import StableIds
from gateway.tools.parser import Emitted, ToolCallStream
from gateway.tools.spec import ToolSpec
from protos import common_pb2, inference_pb2


def chat_messages(chat: inference_pb2.ChatMessages) -> list[dict[str, Any]]:
    """The messages as REST's JSON has them (``tool_call_id`` and ``tool_calls`` only when
    set), for ``gateway.prompts`` to check and render."""
    out = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type or "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls]
        out.append(message)
    return out


def tools_json(request: inference_pb2.GenerateRequest) -> tuple[Any, Any, bool | None]:
    """``(tools, tool_choice, parallel_tool_calls)`` as REST's JSON has them (None when
    absent).

    Raises:
        InvalidRequestError: a ``parameters`` that is not JSON (naming
            ``tools[i].function.parameters``).
    """
    tools = tool_list(request.tools)
    which = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    choice: Any = None
    if which == "mode":
        choice = request.tool_choice.mode
    elif which == "function_name":
        choice = {"type": "function", "function": {"name": request.tool_choice.function_name}}
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
    return tools or None, choice, parallel


def tool_list(tools: Iterable[inference_pb2.Tool]) -> list[dict[str, Any]]:
    """The ``Tool`` messages as REST's ``tools`` JSON has them (empty when none).

    Raises:
        InvalidRequestError: a ``parameters`` that is not JSON (naming
            ``tools[i].function.parameters``).
    """
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        function: dict[str, Any] = {"name": tool.function.name}
        if tool.function.description:
            function["description"] = tool.function.description
        if tool.function.parameters:
            try:
                function["parameters"] = json.loads(tool.function.parameters)
            except (ValueError, RecursionError) as exc:
                raise InvalidRequestError(f"tools[{i}].function.parameters is not JSON: {exc}",
                                          param=f"tools[{i}].function.parameters") from None
        out.append({"type": tool.type or "function", "function": function})
    return out


class ToolCallResponses:
    """``GenerateResponse`` messages of a request with tools: each choice's text through
    its own :class:`~gateway.tools.parser.ToolCallStream`; ``text`` is the content outside
    calls, ``tool_calls`` the call deltas. At a choice's end what the parser held back goes
    out (in one message) before the finish, whose reason is FINISH_REASON_TOOL_CALLS when
    the choice made calls and ended by itself.

    Args:
        request_id: the id the client sees.
        tools: the request's tools (``tool_choice`` other than ``none``).
        seed: the stream's internal request id; choice ``i``'s calls get the ids of
            ``StableIds(f"{seed}/{i}")`` (gateway/rest/stream_rebuild.py), the same on a
            gateway that resumes the stream (:meth:`restore`).
    """

    def __init__(self, request_id: str, tools: ToolSpec, seed: str) -> None:
        self._request_id = request_id
        self._tools = tools
        self._seed = seed
        self._streams: dict[int, ToolCallStream] = {}  # per choice index

    def _stream(self, index: int) -> ToolCallStream:
        if index not in self._streams:
            ids = StableIds(f"{self._seed}/{index}")
            self._streams[index] = self._tools.stream(lambda: ids("call"))
        return self._streams[index]

    def restore(self, had: Iterable[Any]) -> None:
        """Rebuild the parse its client has: the deltas ``had`` (a resume's
        ``ResumePoint.deltas``) fed, their messages dropped; the next ones continue it."""
        for delta in had:
            self.responses(delta)

    def _message(self, emitted: Emitted, index: int, **fields: Any) -> inference_pb2.GenerateResponse:
        calls = [inference_pb2.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "",
                                             arguments=d.arguments) for d in emitted.calls]
        return inference_pb2.GenerateResponse(request_id=self._request_id, index=index,
                                              text=emitted.content, tool_calls=calls, **fields)

    def responses(self, event: Any) -> list[inference_pb2.GenerateResponse]:
        """The messages for one worker ``Delta`` or ``Finished``."""
        stream = self._stream(event.index)
        if event.DESCRIPTOR.name == "Delta":
            return [self._message(stream.feed(event.text), event.index,
                                  token_ids=event.token_ids, logprobs=event.logprobs)]
        out = []
        rest = stream.finish()
        if rest:
            out.append(self._message(rest, event.index))
        reason = event.finish_reason
        if stream.calls and reason == common_pb2.FINISH_REASON_STOP:
            reason = common_pb2.FINISH_REASON_TOOL_CALLS
        out.append(inference_pb2.GenerateResponse(request_id=self._request_id, index=event.index,
                                                  finish_reason=reason, usage=event.usage))
        return out
