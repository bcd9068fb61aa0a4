"""REST bodies → :class:`~gateway.admission.params.RequestParams` (the fields validation checks)."""

from __future__ import annotations

from typing import Any

from common.sampling import SamplingError, check_top_logprobs, rest_fields
from gateway.admission.params import RequestParams
from gateway.admission.structured import structured_outputs_from_fields
from gateway.errors import InvalidRequestError
from gateway.rest import schemas
from gateway.tools.request import tool_fields


def _sampling(body: schemas._SamplingFields) -> dict[str, Any]:
    """The fields completions and chat share, by ``RequestParams`` field name (the
    sampling ones: ``common.sampling.rest_fields``)."""
    return dict(model=body.model, n=body.n, priority=body.priority, **rest_fields(body),
                **_structured(body))


def _structured(body: schemas._SamplingFields) -> dict[str, Any]:
    """``structured_outputs`` (and the field it came from) from ``response_format``, vLLM's
    ``structured_outputs`` or a ``guided_*`` field (400 when malformed or more than one)."""
    guided = {name: getattr(body, name) for name in
              ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}
    found = structured_outputs_from_fields(body.response_format, body.structured_outputs, guided)
    if found is None:
        return {}
    return {"structured_outputs": found[0], "structured_outputs_param": found[1]}


def completion_params(body: schemas.CompletionRequest) -> RequestParams:
    """``POST /v1/completions``: ``logprobs`` (an int, OpenAI's legacy field) asks for the
    sampled token's logprob plus that many alternatives. It is checked here, under its own
    name: validation knows it only as chat's ``top_logprobs``, a field this route has not.

    Raises:
        InvalidRequestError: ``logprobs`` not an integer in [0, 20] (``param`` ``logprobs``).
    """
    if body.logprobs is not None:
        try:
            check_top_logprobs(body.logprobs, "logprobs")
        except SamplingError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from None
    return RequestParams(prompt=body.prompt, **_sampling(body),
                         return_logprobs=body.logprobs is not None, top_logprobs=body.logprobs)


def chat_params(body: schemas.ChatCompletionRequest) -> RequestParams:
    """``POST /v1/chat/completions``: ``max_completion_tokens``, when sent, wins over
    ``max_tokens`` (OpenAI deprecated the latter for chat); ``logprobs`` is a boolean and
    ``top_logprobs`` the alternatives. ``tools``/``tool_choice``/``parallel_tool_calls``:
    ``gateway.tools.request.tool_fields`` (``required`` or a named function adds the
    grammar that enforces the call)."""
    fields = _sampling(body)
    if body.max_completion_tokens is not None:
        fields["max_tokens"] = body.max_completion_tokens
    constraint = None
    if "structured_outputs" in fields:
        constraint = (fields["structured_outputs"], fields["structured_outputs_param"])
    fields.update(tool_fields(body.tools, body.tool_choice, body.parallel_tool_calls, constraint))
    return RequestParams(messages=body.messages, chat_template_kwargs=body.chat_template_kwargs, **fields,
                         return_logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs)
