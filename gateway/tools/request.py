"""A chat request's tool fields → what :class:`~gateway.admission.params.RequestParams`
carries: the checked :class:`~gateway.tools.spec.ToolSpec` and, for ``tool_choice``
``required`` or a named function, the grammar that enforces a call
(``gateway.tools.constraint``) as the request's one structured-outputs constraint.
REST (``gateway.rest.params``) and gRPC (``gateway.grpc_server``) both call
:func:`tool_fields`."""

from __future__ import annotations

from typing import Any

from common.structured_outputs import StructuredOutputs
from gateway.errors import InvalidRequestError
from gateway.tools.constraint import tool_call_constraint
from gateway.tools.spec import check_tools


def tool_fields(tools: Any, tool_choice: Any, parallel_tool_calls: Any,
                constraint: tuple[StructuredOutputs, str] | None) -> dict[str, Any]:
    """``RequestParams`` fields for the request's tools (``{}`` when it has none).

    Args:
        tools, tool_choice: the request's fields (see ``gateway.tools.spec.check_tools``).
        parallel_tool_calls: OpenAI's flag (None = true): false allows one call only.
        constraint: the client's own structured-outputs constraint and its field, if any.

    Raises:
        InvalidRequestError: invalid tools or choice (``check_tools``), a non-boolean
            ``parallel_tool_calls``, or a call to enforce on top of the client's own
            constraint (one grammar per request).
    """
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    spec = check_tools(tools, tool_choice)
    if spec is None:
        return {}
    grammar = tool_call_constraint(spec, parallel=parallel_tool_calls is not False)
    if grammar is None:
        return {"tools": spec}
    if constraint is not None:
        raise InvalidRequestError(
            f"tool_choice {spec.forced or spec.choice!r} constrains the output to a tool call, so "
            f"'{constraint[1]}' cannot constrain it too", param=constraint[1])
    return {"tools": spec, "structured_outputs": grammar, "structured_outputs_param": "tool_choice"}
