"""The parameters of one generation request, as a front hands them to validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from common.sampling import SamplingInput
from common.structured_outputs import StructuredOutputs
from gateway.tools.spec import ToolSpec


@dataclass(frozen=True)
class RequestParams(SamplingInput):
    """What a client asked for, before validation: REST (``gateway.rest.params``) and gRPC
    (``gateway.grpc_server.request_params``) both build one; ``validate_request`` checks it.

    A front maps its wire format onto these fields and checks nothing but its own
    schema, so the types below are the shapes validation accepts, not promises:
    validation rejects a wrong type or range with an error that names the field.
    ``None`` means "not sent" (the server's default applies). The sampling fields
    (``max_tokens``, ``temperature``, ..., ``logit_bias``) are those of
    :class:`common.sampling.SamplingInput`, documented there.

    Attributes:
        prompt: completion input: a string, a list holding one string, or token ids.
        messages: chat input, ``{"role": ..., "content": ...}`` mappings (``None``: a
            completion request).
        model: the model id asked for; ``None`` or empty = the served one.
        n: choices sampled from the prompt (parallel sampling), in [1, the server's ``max_n``].
        priority: the priority class asked for (0 = highest); never above the key's.
        structured_outputs: the constraint on the output (grammar-constrained decoding), as
            ``gateway.admission.structured.structured_outputs_from_fields`` built it from
            the client's fields, or as a front built it (tool calls); validation checks that
            it compiles within the server's limits.
        structured_outputs_param: the request field the constraint came from (named by
            its errors).
        tools: the chat request's tools and ``tool_choice``, checked
            (``gateway.tools.request.tool_fields``); None = no tools.
        chat_template_kwargs: more variables for the chat template (vLLM's extra
            parameter, e.g. ``{"enable_thinking": false}``), checked by
            ``gateway.template_kwargs``; None = none.
    """

    prompt: str | Sequence[str] | Sequence[int] | None = None
    messages: Sequence[Any] | None = None
    model: str | None = None
    n: int | None = None
    priority: int | None = None
    structured_outputs: StructuredOutputs | None = None
    structured_outputs_param: str = "structured_outputs"
    tools: ToolSpec | None = None
    chat_template_kwargs: Any = None
