"""The parameters of one generation request, as a front hands them to validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from common.structured_outputs import StructuredOutputs
from gateway.tools.spec import ToolSpec


@dataclass(frozen=True)
class RequestParams:
    """What a client asked for, before validation: REST (``gateway.rest.params``) and gRPC
    (``gateway.grpc_server.request_params``) both build one; ``validate_request`` checks it.

    A front maps its wire format onto these fields and checks nothing but its own
    schema, so the types below are the shapes validation accepts, not promises:
    REST leaves the vLLM extensions untyped, and validation rejects a wrong type or
    range with an error that names the field. ``None`` means "not sent" (the
    server's default applies).

    Attributes:
        prompt: completion input: a string, a list holding one string, or token ids.
        messages: chat input, ``{"role": ..., "content": ...}`` mappings (``None``: a
            completion request).
        model: the model id asked for; ``None`` or empty = the served one.
        max_tokens: new tokens to generate, at most (tokens).
        temperature: sampling temperature, >= 0 (0 = greedy).
        top_p: nucleus mass, in (0, 1].
        top_k: candidates kept, in [1, vocab size]; -1 or 0 = off.
        seed: sampling seed, a signed 64-bit integer.
        stop: a stop string or up to 16 of them, each 1 to 256 characters.
        n: choices sampled from the prompt (parallel sampling), in [1, the server's ``max_n``].
        return_logprobs: return the sampled token's log-probability.
        top_logprobs: alternatives per token, in [0, 20] (needs ``return_logprobs``).
        priority: the priority class asked for (0 = highest); never above the key's.
        stop_token_ids: token ids that end generation, at most 64 (vLLM extension).
        ignore_eos: generate past EOS until ``max_tokens`` (vLLM extension).
        skip_special_tokens: drop special tokens from the text (vLLM extension, default true).
        presence_penalty, frequency_penalty: OpenAI's penalties, in [-2, 2] (0 = off).
        repetition_penalty: vLLM's repetition penalty, > 0 (1 = off).
        min_p: vLLM's min-p, in [0, 1] (0 = off).
        min_tokens: tokens before EOS/stop token ids may end generation, in [0, max_tokens].
        logit_bias: token id (an int, or its decimal string as JSON object keys are) ->
            bias in [-100, 100]; at most 300 entries.
        structured_outputs: the constraint on the output (grammar-constrained decoding), as
            ``gateway.admission.structured.structured_outputs_from_fields`` built it from
            the client's fields, or as a front built it (tool calls); validation checks that
            it compiles within the server's limits.
        structured_outputs_param: the request field the constraint came from (named by
            its errors).
        tools: the chat request's tools and ``tool_choice``, checked
            (``gateway.tools.request.tool_fields``); None = no tools.
    """

    prompt: str | Sequence[str] | Sequence[int] | None = None
    messages: Sequence[Any] | None = None
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    n: int | None = None
    return_logprobs: bool = False
    top_logprobs: int | None = None
    priority: int | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: Mapping[Any, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    structured_outputs_param: str = "structured_outputs"
    tools: ToolSpec | None = None
