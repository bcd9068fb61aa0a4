"""Request validation: a front's :class:`~gateway.admission.params.RequestParams` into one
neutral :class:`ValidatedRequest` (REST and gRPC alike).

Ranges follow the OpenAI API reference (temperature >= 0, top_p in (0, 1],
presence/frequency penalties in [-2, 2], logit_bias values in [-100, 100] and at
most 300 of them, n in [1, max_n] (OpenAI allows up to 128), stop: up to 4 strings there, 16 here) and vLLM's
sampling params (top_k = -1 or 0 means "off", repetition_penalty > 0, min_p in
[0, 1], min_tokens <= max_tokens). Every error is an :class:`InvalidRequestError`
naming the parameter at fault.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from common.structured_outputs import StructuredOutputs
from gateway.admission.params import RequestParams
from gateway.admission.structured import GrammarLimits, check_structured_outputs
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.prompts import apply_completion_special_tokens, chat_prompt_ids, completion_prompt_ids
from gateway.tools.spec import ToolSpec
from protos import common_pb2

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI chat API's top_logprobs upper bound
MAX_STOP_TOKEN_IDS = 64
MAX_PENALTY = 2.0  # OpenAI: presence_penalty and frequency_penalty in [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI: each bias in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias entries
# temperature and top_p travel as protobuf ``float`` (IEEE float32): larger values become inf.
FLOAT32_MAX = 3.4028234663852886e38


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
    """

    served_model: str
    default_max_tokens: int = 512
    max_max_tokens: int = 0
    max_prompt_tokens: int = 0
    completion_special_tokens: str = "allow"
    max_n: int = 16
    grammar: GrammarLimits = GrammarLimits()


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed validation; what the queue and the responders need.

    Attributes:
        kind: "completion" or "chat".
        model: the served model id.
        prompt_token_ids: the prompt, tokenized (chat: through the chat template).
        max_tokens: new tokens allowed (>= 1), prompt + max_tokens <= context.
        temperature, top_p, top_k, seed: sampling; None = server default; top_k 0 = off.
        stop: stop strings (excluded from the output).
        return_logprobs: return the sampled token's logprob.
        top_logprobs: alternatives per token (0 = none).
        priority: priority class the client asked for (None = the key's).
        stop_token_ids: token ids that end generation (vLLM extension; kept in the output
            unless special).
        ignore_eos: keep generating past EOS until max_tokens (vLLM extension, benchmarks).
        skip_special_tokens: drop special tokens from the detokenized text (vLLM, default true).
        presence_penalty, frequency_penalty, repetition_penalty, min_p: None = off (also
            when the client sent the neutral value: 0, 0, 1, 0).
        min_tokens: EOS and stop token ids are masked until this many tokens (0 = off).
        logit_bias: ``(token_id, bias)`` pairs, ids ascending (empty = none).
        n: choices sampled from the prompt (parallel sampling, >= 1); each may generate
            ``max_tokens``.
        structured_outputs: the checked constraint on the output (None = free text).
        tools: the chat request's tools and ``tool_choice`` (None = no tools): the
            responders parse the output for calls (``gateway.tools.parser``).
    """

    kind: str
    model: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    return_logprobs: bool = False
    top_logprobs: int = 0
    priority: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1
    structured_outputs: StructuredOutputs | None = None
    tools: ToolSpec | None = None

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    def sampling_params(self) -> common_pb2.SamplingParams:
        """The protobuf ``SamplingParams`` for the queue (max_tokens always set; ``n``
        only above 1, so a one-choice entry is what it was before parallel sampling)."""
        params = common_pb2.SamplingParams(
            max_tokens=self.max_tokens, stop=list(self.stop), logprobs=self.top_logprobs,
            return_logprobs=self.return_logprobs, stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            min_tokens=self.min_tokens, logit_bias=dict(self.logit_bias),
            n=self.n if self.n > 1 else 0)
        if self.structured_outputs is not None:
            params.structured_outputs.CopyFrom(self.structured_outputs.to_proto())
        for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if value is not None:
                setattr(params, name, value)
        return params


def _number(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"'{name}' must be a number", param=name)
    try:
        number = float(value)  # an int beyond float's range raises OverflowError
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
        raise InvalidRequestError(f"'{name}' must be a finite number, got {number}", param=name)
    return number


def _float32(value: float) -> float:
    """``value`` as the worker receives it (protobuf ``float``, IEEE float32)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _integer(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"'{name}' must be an integer", param=name)
    return value


def check_sampling(temperature: Any, top_p: Any, top_k: Any, seed: Any, vocab_size: int,
                   ) -> tuple[float | None, float | None, int | None, int | None]:
    """Validated ``(temperature, top_p, top_k, seed)``; top_k -1 (vLLM's "off") becomes 0.

    Raises:
        InvalidRequestError: NaN/Inf or beyond float32's range (the queue's type),
            temperature < 0, top_p outside (0, 1] (after rounding to float32),
            top_k outside [-1, vocab_size], non-integer seed.
    """
    temp = _number("temperature", temperature)
    if temp is not None and temp < 0:
        raise InvalidRequestError(f"'temperature' must be >= 0, got {temp}", param="temperature")
    p = _number("top_p", top_p)
    if p is not None and not 0 < _float32(p) <= 1:  # 1e-300 rounds to 0 in float32
        raise InvalidRequestError(f"'top_p' must be in (0, 1], got {p}", param="top_p")
    k = _integer("top_k", top_k)
    if k is not None and not -1 <= k <= vocab_size:
        raise InvalidRequestError(
            f"'top_k' must be -1 or 0 (off) or in [1, {vocab_size}], got {k}", param="top_k")
    if k == -1:
        k = 0
    seed_ = _integer("seed", seed)
    if seed_ is not None and not -2**63 <= seed_ < 2**63:
        raise InvalidRequestError("'seed' must fit in a signed 64-bit integer", param="seed")
    return temp, p, k, seed_


def check_stop(stop: Any) -> tuple[str, ...]:
    """Stop strings as a tuple: ``None``, one string, or a list of at most 16 non-empty
    strings of at most 256 characters each.

    Raises:
        InvalidRequestError: anything else.
    """
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise InvalidRequestError("'stop' must be a string or a list of strings", param="stop")
    if len(items) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(f"'stop' allows at most {MAX_STOP_SEQUENCES} strings", param="stop")
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"each 'stop' string must have 1 to {MAX_STOP_CHARS} characters", param="stop")
    return tuple(items)


def _flag(name: str, value: Any, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"'{name}' must be a boolean", param=name)
    return value


def check_token_options(stop_token_ids: Any, ignore_eos: Any, skip_special_tokens: Any,
                        vocab_size: int) -> tuple[tuple[int, ...], bool, bool]:
    """vLLM's extra sampling parameters (vLLM ``SamplingParams`` docs): ``stop_token_ids``
    (at most 64 ints, each in [0, vocab_size)), ``ignore_eos`` (default false) and
    ``skip_special_tokens`` (default true); None takes the default.

    Raises:
        InvalidRequestError: a wrong type, a token id outside the vocabulary, too many ids.
    """
    ids = () if stop_token_ids is None else stop_token_ids
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError("'stop_token_ids' must be a list of integers",
                                  param="stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"'stop_token_ids' allows at most {MAX_STOP_TOKEN_IDS} ids",
                                  param="stop_token_ids")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"each 'stop_token_ids' entry must be an integer in [0, {vocab_size}), got {t!r}",
                param="stop_token_ids")
    return (tuple(ids), _flag("ignore_eos", ignore_eos, False),
            _flag("skip_special_tokens", skip_special_tokens, True))


def check_logprobs(return_logprobs: Any, top_logprobs: Any) -> tuple[bool, int]:
    """``(return_logprobs, top_logprobs)`` with top_logprobs in [0, 20].

    Raises:
        InvalidRequestError: top_logprobs out of range or without logprobs.
    """
    top = _integer("top_logprobs", top_logprobs) or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]",
                                  param="top_logprobs")
    if top and not return_logprobs:
        raise InvalidRequestError("'top_logprobs' requires 'logprobs'", param="top_logprobs")
    return bool(return_logprobs), top


@dataclass(frozen=True)
class Penalties:
    """Validated penalties and min-p (None = off; neutral values become None)."""

    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None


def check_penalties(presence_penalty: Any, frequency_penalty: Any, repetition_penalty: Any,
                    min_p: Any) -> Penalties:
    """OpenAI's ``presence_penalty``/``frequency_penalty`` in [-2, 2], vLLM's
    ``repetition_penalty`` > 0 and ``min_p`` in [0, 1]; the neutral value (0, 0, 1, 0)
    is the same as absent (None).

    Raises:
        InvalidRequestError: not a number, NaN/Inf, beyond float32, out of range.
    """
    found = {}
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        number = _number(name, value)
        if number is not None and not -MAX_PENALTY <= number <= MAX_PENALTY:
            raise InvalidRequestError(f"'{name}' must be in [-2, 2], got {number}", param=name)
        found[name] = number or None
    rep = _number("repetition_penalty", repetition_penalty)
    if rep is not None and not _float32(rep) > 0:  # 1e-300 rounds to 0 in float32
        raise InvalidRequestError(f"'repetition_penalty' must be > 0 (1 = off), got {rep}",
                                  param="repetition_penalty")
    mp = _number("min_p", min_p)
    if mp is not None and not 0 <= mp <= 1:
        raise InvalidRequestError(f"'min_p' must be in [0, 1], got {mp}", param="min_p")
    return Penalties(found["presence_penalty"], found["frequency_penalty"],
                     None if rep == 1 else rep, mp or None)


def _token_id_key(key: Any) -> int | None:
    """A ``logit_bias`` key as a token id: an int (gRPC), or a string of decimal digits
    (JSON object keys are strings, ``"50256"``); None for anything else."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
        return int(key)
    return None


def check_logit_bias(logit_bias: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (OpenAI: a map of token id to a bias in [-100, 100], at most 300
    entries; the ids must be in the vocabulary) as ``(id, bias)`` pairs, ids ascending.

    Raises:
        InvalidRequestError: not an object, too many entries, a key that is not a token id
            in [0, vocab_size), a bias that is not a number in [-100, 100].
    """
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, Mapping):
        raise InvalidRequestError("'logit_bias' must be an object mapping token ids to numbers",
                                  param="logit_bias")
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"'logit_bias' allows at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                                  f"got {len(logit_bias)}", param="logit_bias")
    pairs = {}
    for key, value in logit_bias.items():
        token = _token_id_key(key)
        if token is None or not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {str(key)[:40]!r}",
                param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):  # NaN fails the comparison
            raise InvalidRequestError(
                f"'logit_bias' values must be numbers in [-100, 100], got {str(value)[:40]} for "
                f"token {token}", param="logit_bias")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


def check_min_tokens(min_tokens: Any, max_tokens: int) -> int:
    """``min_tokens`` (vLLM) in [0, max_tokens] (the effective ``max_tokens``); None = 0.

    Raises:
        InvalidRequestError: not an integer, negative, above max_tokens.
    """
    value = _integer("min_tokens", min_tokens)
    if value is None:
        return 0
    if not 0 <= value <= max_tokens:
        raise InvalidRequestError(
            f"'min_tokens' must be in [0, max_tokens] = [0, {max_tokens}], got {value}",
            param="min_tokens")
    return value


def check_n(n: Any, max_n: int) -> int:
    """``n``, the choices to sample (parallel sampling), in [1, max_n]; None = 1.

    Raises:
        InvalidRequestError: not an integer, or outside [1, max_n].
    """
    value = _integer("n", n)
    if value is None:
        return 1
    if not 1 <= value <= max_n:
        raise InvalidRequestError(f"'n' must be in [1, {max_n}], got {value}", param="n")
    return value


def check_model(model: str | None, limits: RequestLimits) -> str:
    """The served model id. Raises NotFoundError for any other model (OpenAI answers 404 too)."""
    if model and model != limits.served_model:
        raise NotFoundError(f"The model '{model}' does not exist", param="model",
                            code="model_not_found")
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
    value = _integer("max_tokens", max_tokens)
    if value is None:
        return max(1, min(limits.default_max_tokens, room, limits.max_max_tokens or room))
    if value < 1:
        raise InvalidRequestError(f"'max_tokens' must be >= 1, got {value}", param="max_tokens")
    cap = limits.max_max_tokens or context
    if value > cap:
        raise InvalidRequestError(f"'max_tokens' must be <= {cap}, got {value}", param="max_tokens")
    if prompt_tokens + value > context:
        raise InvalidRequestError(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{prompt_tokens} tokens and max_tokens is {value} ({prompt_tokens + value} in total). "
            f"Reduce the prompt or max_tokens.", param="max_tokens", code="context_length_exceeded")
    return value


def validate_request(tokenizer: PromptTokenizer, limits: RequestLimits,
                     params: RequestParams) -> ValidatedRequest:
    """Validate a completion (``params.prompt``) or chat (``params.messages``) request.

    Checks, in this order: model, ``n``, sampling, penalties and min_p, logit_bias, stop
    strings, logprobs, vLLM token options, then the prompt (tokenized) and ``max_tokens``
    against the caps and the context length (tokens), then ``min_tokens`` against it, then
    the structured-outputs constraint (compiled, ``gateway.admission.structured``).

    Raises:
        InvalidRequestError: any invalid parameter (the error names it).
        NotFoundError: an unknown ``model``.
    """
    served = check_model(params.model, limits)
    n = check_n(params.n, limits.max_n)
    temp, p, k, seed_ = check_sampling(params.temperature, params.top_p, params.top_k, params.seed,
                                       tokenizer.vocab_size)
    penalties = check_penalties(params.presence_penalty, params.frequency_penalty,
                                params.repetition_penalty, params.min_p)
    bias = check_logit_bias(params.logit_bias, tokenizer.vocab_size)
    stops = check_stop(params.stop)
    want_lp, top_lp = check_logprobs(params.return_logprobs, params.top_logprobs)
    token_opts = check_token_options(params.stop_token_ids, params.ignore_eos,
                                     params.skip_special_tokens, tokenizer.vocab_size)
    if params.messages is not None:
        kind, ids = "chat", chat_prompt_ids(tokenizer, params.messages, params.tools)
    else:
        prompt = apply_completion_special_tokens(tokenizer, params.prompt, limits.completion_special_tokens)
        kind, ids = "completion", completion_prompt_ids(tokenizer, prompt)
    budget = check_lengths(len(ids), params.max_tokens, tokenizer.context_length, limits,
                           "messages" if kind == "chat" else "prompt")
    min_tokens = check_min_tokens(params.min_tokens, budget)
    if params.structured_outputs is not None:
        check_structured_outputs(params.structured_outputs, params.structured_outputs_param,
                                 tokenizer, limits.grammar)
    return ValidatedRequest(kind=kind, model=served, prompt_token_ids=tuple(ids), max_tokens=budget,
                            temperature=temp, top_p=p, top_k=k, seed=seed_, stop=stops,
                            return_logprobs=want_lp, top_logprobs=top_lp, priority=params.priority,
                            stop_token_ids=token_opts[0], ignore_eos=token_opts[1],
                            skip_special_tokens=token_opts[2],
                            presence_penalty=penalties.presence_penalty,
                            frequency_penalty=penalties.frequency_penalty,
                            repetition_penalty=penalties.repetition_penalty, min_p=penalties.min_p,
                            min_tokens=min_tokens, logit_bias=bias, n=n,
                            structured_outputs=params.structured_outputs,
                            tools=params.tools if kind == "chat" else None)
