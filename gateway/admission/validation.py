"""Request validation: a front's :class:`~gateway.admission.params.RequestParams` into one
neutral :class:`ValidatedRequest` (REST and gRPC alike).

The sampling parameters' types and ranges are ``common.sampling``'s (one table that the
worker checks again); what depends on this server (the model, ``n``, the prompt and
``max_tokens`` against the caps and the context length) is here. Every error is an
:class:`InvalidRequestError` naming the parameter at fault.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Iterator, Protocol

from common import sampling
from common.sampling import Sampling, SamplingError
from common.structured_outputs import StructuredOutputs
from gateway.admission.params import RequestParams
from gateway.admission.shortest_output import fewest_tokens, shortest_text
from gateway.admission.structured import GrammarLimits, check_min_tokens_under, check_structured_outputs
from gateway.errors import InvalidRequestError, ModelNotFoundError
from gateway.prompts import apply_completion_special_tokens, chat_prompt_ids, completion_prompt_ids
from gateway.tools.spec import ToolSpec
from protos import common_pb2


class PromptTokenizer(Protocol):
    """The part of ``common.tokenizer.Tokenizer`` that validation uses."""

    vocab_size: int
    context_length: int

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``."""
        ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat rendered with the model's template."""
        ...


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (built by ``gateway.admission.key_limits``), in tokens.

    Attributes:
        served_model: the only model id accepted (empty ``model`` = this one).
        default_max_tokens: used when ``max_tokens`` is absent/null, capped by the room left.
        max_max_tokens: the largest ``max_tokens`` accepted; 0 = the context length.
        max_prompt_tokens: the longest prompt accepted; 0 = the context length.
        completion_special_tokens: special tokens in a completion prompt: "allow" (control
            tokens, as vLLM), "escape" (text) or "reject" (400); ``gateway.prompts``.
        max_n: the most choices (``n``) one request may ask for.
        grammar: what a structured-outputs constraint may cost (size, depth, compile time).
        max_model_len: the model's context length as its workers announce it (0 = the
            tokenizer's ``context_length``; the smaller of the two counts).
    """

    served_model: str
    default_max_tokens: int = 512
    max_max_tokens: int = 0
    max_prompt_tokens: int = 0
    completion_special_tokens: str = "allow"
    max_n: int = 16
    grammar: GrammarLimits = GrammarLimits()
    max_model_len: int = 0


_SAMPLING_FIELDS = frozenset(f.name for f in fields(Sampling))


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed validation; what the queue and the responders need.

    The checked sampling parameters are read through the request too (``request.top_k``
    is ``request.sampling.top_k``; ``top_logprobs`` is ``sampling.logprobs``).

    Attributes:
        kind: "completion" or "chat".
        model: the name the request gave its model (an id, alias or adapter; echoed in
            responses).
        model_id: the base model's id, which picks the request streams ("" = ``model``).
        lora_name: the LoRA adapter to run ("" = the base model).
        prompt_token_ids: the prompt, tokenized (chat: through the chat template).
        sampling: the checked sampling parameters (``common.sampling.Sampling``):
            ``max_tokens`` >= 1 with prompt + max_tokens <= context; a scalar the client
            did not send (or sent at its neutral value, for the penalties and min_p) is
            None, the worker's default; top_k 0 = off.
        priority: priority class the client asked for (None = the key's).
        n: choices sampled from the prompt (parallel sampling, >= 1); each may generate
            ``max_tokens``.
        structured_outputs: the checked constraint on the output (None = free text).
        tools: the chat request's tools and ``tool_choice`` (None = no tools): the
            responders parse the output for calls (``gateway.tools.parser``).
    """

    kind: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    priority: int | None = None
    n: int = 1
    structured_outputs: StructuredOutputs | None = None
    tools: ToolSpec | None = None
    model_id: str = ""
    lora_name: str = ""

    def __getattr__(self, name: str) -> Any:
        """A sampling field of :attr:`sampling` (``max_tokens``, ``stop``, ...)."""
        if name in _SAMPLING_FIELDS:
            return getattr(self.sampling, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def top_logprobs(self) -> int:
        """Alternatives per token (0 = none)."""
        return self.sampling.logprobs

    def sampling_params(self) -> common_pb2.SamplingParams:
        """The protobuf ``SamplingParams`` for the queue (``Sampling.to_proto``: max_tokens
        always set; ``n`` only above 1, so a one-choice entry is what it was before
        parallel sampling)."""
        params = self.sampling.to_proto()
        params.n = self.n if self.n > 1 else 0
        if self.structured_outputs is not None:
            params.structured_outputs.CopyFrom(self.structured_outputs.to_proto())
        return params


@contextmanager
def _as_invalid_request() -> Iterator[None]:
    """A :class:`SamplingError` raised inside becomes the 400 that names its parameter."""
    try:
        yield
    except SamplingError as exc:
        raise InvalidRequestError(exc.message, param=exc.param) from None


def check_n(n: Any, max_n: int) -> int:
    """``n``, the choices to sample (parallel sampling), in [1, max_n]; None = 1.

    Raises:
        InvalidRequestError: not an integer, or outside [1, max_n].
    """
    with _as_invalid_request():
        value = sampling.integer("n", n)
    if value is None:
        return 1
    if not 1 <= value <= max_n:
        raise InvalidRequestError(f"'n' must be in [1, {max_n}], got {value}", param="n")
    return value


def check_model(model: str | None, limits: RequestLimits) -> str:
    """The served model id. Raises ModelNotFoundError (404 ``model_not_found``, as OpenAI)
    for any other model."""
    if model and model != limits.served_model:
        raise ModelNotFoundError(model)
    return limits.served_model


def check_lengths(prompt_tokens: int, max_tokens: Any, context: int, limits: RequestLimits,
                  prompt_param: str = "prompt") -> int:
    """The effective ``max_tokens``: absent/null → min(default, context − prompt).

    Raises:
        InvalidRequestError: max_tokens < 1 or above the cap; prompt above its cap;
            prompt + max_tokens above the context length (all in tokens).
    """
    prompt_cap = limits.max_prompt_tokens or context
    if prompt_tokens > prompt_cap or prompt_tokens >= context:
        raise InvalidRequestError(
            f"the prompt has {prompt_tokens} tokens; at most {min(prompt_cap, context - 1)} "
            f"are allowed", param=prompt_param, code="context_length_exceeded")
    room = context - prompt_tokens
    with _as_invalid_request():
        value = sampling.check_max_tokens(max_tokens)
    if value is None:
        return max(1, min(limits.default_max_tokens, room, limits.max_max_tokens or room))
    cap = limits.max_max_tokens or context
    if value > cap:
        raise InvalidRequestError(f"'max_tokens' must be <= {cap}, got {value}", param="max_tokens")
    if prompt_tokens + value > context:
        raise InvalidRequestError(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{prompt_tokens} tokens and max_tokens is {value} ({prompt_tokens + value} in total). "
            f"Reduce the prompt or max_tokens.", param="max_tokens", code="context_length_exceeded")
    return value


def check_room_for_output(params: RequestParams, tokenizer: Any, max_tokens: int) -> None:
    """Refuse a constrained request whose ``max_tokens`` cannot hold the shortest output its
    constraint allows, where that is computed (``gateway.admission.shortest_output``): it
    would end at ``length`` with output that does not parse.

    Raises:
        InvalidRequestError: ``param`` "max_tokens", ``code`` "max_tokens_too_small".
    """
    text = shortest_text(params.structured_outputs, params.tools, params.structured_outputs_param)
    if text is None:
        return
    needed = fewest_tokens(tokenizer, text)
    if max_tokens < needed:
        raise InvalidRequestError(
            f"max_tokens is {max_tokens}, but the shortest output that "
            f"'{params.structured_outputs_param}' allows, {text[:200]!r}, takes at least {needed} "
            f"tokens: raise max_tokens", param="max_tokens", code="max_tokens_too_small")


def validate_request(tokenizer: PromptTokenizer, limits: RequestLimits,
                     params: RequestParams) -> ValidatedRequest:
    """Validate a completion (``params.prompt``) or chat (``params.messages``) request.

    Checks, in this order: model, ``n``, sampling, penalties and min_p, logit_bias, stop
    strings, logprobs, vLLM token options, then the prompt (tokenized) and ``max_tokens``
    against the caps and the context length (tokens), then ``min_tokens`` against it, then
    the structured-outputs constraint (compiled, ``gateway.admission.structured``),
    ``min_tokens`` against its longest output where that is bounded (a ``choice``) and
    ``max_tokens`` against its shortest output (:func:`check_room_for_output`).

    Raises:
        InvalidRequestError: any invalid parameter (the error names it).
        NotFoundError: an unknown ``model``.
    """
    served = check_model(params.model, limits)
    n = check_n(params.n, limits.max_n)
    with _as_invalid_request():
        checked = sampling.check_fields(params, tokenizer.vocab_size)
    if params.messages is not None:
        kind, ids = "chat", chat_prompt_ids(tokenizer, params.messages, params.tools,
                                            template_kwargs=params.chat_template_kwargs)
    else:
        prompt = apply_completion_special_tokens(tokenizer, params.prompt, limits.completion_special_tokens)
        kind, ids = "completion", completion_prompt_ids(tokenizer, prompt)
        if _is_text(params.prompt):
            ids = with_bos(tokenizer, ids)
    context = tokenizer.context_length
    if limits.max_model_len:
        context = min(context, limits.max_model_len)
    budget = check_lengths(len(ids), params.max_tokens, context, limits,
                           "messages" if kind == "chat" else "prompt")
    with _as_invalid_request():
        min_tokens = sampling.check_min_tokens(params.min_tokens, budget)
    if params.structured_outputs is not None:
        _check_constraint(params, tokenizer, limits.grammar)
        check_min_tokens_under(params.structured_outputs, params.structured_outputs_param, min_tokens)
        check_room_for_output(params, tokenizer, budget)
    return ValidatedRequest(kind=kind, model=served, prompt_token_ids=tuple(ids),
                            sampling=Sampling(max_tokens=budget, min_tokens=min_tokens, **checked),
                            priority=params.priority, n=n,
                            structured_outputs=params.structured_outputs,
                            tools=params.tools if kind == "chat" else None)


def _check_constraint(params: RequestParams, tokenizer: Any, limits: GrammarLimits) -> None:
    """:func:`check_structured_outputs` of the request's constraint; when the grammar of a
    forced tool call (``tool_choice``) does not compile, the error names the first tool whose
    ``parameters`` cannot be enforced (``tools[i].function.parameters``), if one is to blame.

    Raises:
        InvalidRequestError: the constraint does not compile (see :func:`check_structured_outputs`).
    """
    from gateway.tools.constraint import arguments_schema_text

    try:
        check_structured_outputs(params.structured_outputs, params.structured_outputs_param, tokenizer, limits)
    except InvalidRequestError:
        if params.structured_outputs_param == "tool_choice" and params.tools is not None:
            for i, function in enumerate(params.tools.functions):
                check_structured_outputs(StructuredOutputs.json_schema(arguments_schema_text(function)),
                                         f"tools[{i}].function.parameters", tokenizer, limits)
        raise


def _is_text(prompt: Any) -> bool:
    """A completion prompt given as text (a string or a list of one), not as token ids."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str))


def with_bos(tokenizer: Any, ids: list[int]) -> list[int]:
    """``ids`` of a text completion prompt behind the tokens the tokenizer puts before a text
    when asked for its special tokens (the BOS of SentencePiece models whose GGUF header or
    tokenizer config says ``add_bos_token``), unless they already start with them: vLLM
    (``add_special_tokens`` defaults to true on completions) and llama-server both add it,
    and Gemma or Llama 2 prompted without it answer badly. A tokenizer that adds nothing
    (SmolLM2, GPT-2 byte-level BPE) leaves ``ids`` unchanged."""
    prefix = bos_prefix(tokenizer)
    return ids if not prefix or ids[:len(prefix)] == prefix else prefix + ids


def bos_prefix(tokenizer: Any) -> list[int]:
    """What ``tokenizer.encode(text, add_special_tokens=True)`` puts before ``text``'s own ids
    ([] when nothing), worked out once per tokenizer (tokenizers live as long as the gateway)."""
    entry = _BOS_PREFIXES.get(id(tokenizer))
    if entry is not None and entry[0] is tokenizer:
        return entry[1]
    try:
        plain = list(tokenizer.encode("a"))
        special = list(tokenizer.encode("a", add_special_tokens=True))
    except TypeError:  # a tokenizer without the flag adds nothing we know of
        plain = special = []
    prefix = next((special[:i] for i in range(len(special) - len(plain) + 1)
                   if special[i:i + len(plain)] == plain), []) if plain else []
    _BOS_PREFIXES[id(tokenizer)] = (tokenizer, prefix)
    return prefix


_BOS_PREFIXES: dict[int, tuple[Any, list[int]]] = {}
