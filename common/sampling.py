"""The sampling parameters, defined once for both sides of the queue (no torch).

Names are OpenAI's and vLLM's. Ranges follow the OpenAI API reference (temperature >= 0,
top_p in (0, 1], presence/frequency penalties in [-2, 2], logit_bias values in [-100, 100]
and at most 300 of them, stop: up to 4 strings there, 16 here) and vLLM's sampling params
(top_k = -1 or 0 means "off", repetition_penalty > 0, min_p in [0, 1], min_tokens <=
max_tokens).

* :data:`PARAMS` is the table of the scalar parameters: name, type, the engine's value when
  unset, range check, and what the REST schema documents.
* :class:`SamplingInput` holds the fields as a front received them (unchecked);
  :func:`rest_fields` and :func:`grpc_fields` build them from a REST body and from a
  ``GenerateRequest.sampling``.
* :func:`check_fields` and :func:`check_min_tokens` check them (the gateway: a 400 naming
  the field); :class:`Sampling` is the checked result, which converts to and from the
  queued ``SamplingParams`` protobuf and checks itself again (:meth:`Sampling.validate`,
  the worker) with the same functions and messages.

Every refusal is a :class:`SamplingError` naming the parameter at fault.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

from protos import common_pb2

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI chat API's top_logprobs upper bound
MAX_STOP_TOKEN_IDS = 64
MAX_PENALTY = 2.0  # OpenAI: presence_penalty and frequency_penalty in [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI: each bias in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias entries
# temperature, top_p and the penalties travel as protobuf ``float`` (IEEE float32): larger
# values become inf.
FLOAT32_MAX = 3.4028234663852886e38


class SamplingError(ValueError):
    """A sampling parameter of the wrong type or out of range.

    Attributes:
        message: what is wrong, naming the parameter (also ``str(error)``).
        param: the parameter's name, as the client spelled it.
    """

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


def number(name: str, value: Any) -> float | None:
    """``value`` as a float (None stays None).

    Raises:
        SamplingError: not an int or float (a bool is not), NaN/Inf ("must be a finite
            number"), or beyond float32's range (the queue's type; "must be at most ...").
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingError(f"'{name}' must be a number", name)
    try:
        as_float = float(value)  # an int beyond float's range raises OverflowError
    except OverflowError:
        as_float = math.inf
    if not math.isfinite(as_float):
        raise SamplingError(f"'{name}' must be a finite number, got {as_float}", name)
    if abs(as_float) > FLOAT32_MAX:  # finite, but not as the queue's float32
        raise SamplingError(f"'{name}' must be at most {FLOAT32_MAX:.4g} in magnitude (a 32-bit float), "
                            f"got {as_float}", name)
    return as_float


def integer(name: str, value: Any) -> int | None:
    """``value`` as an int (None stays None; a float with an integral value is accepted).

    Raises:
        SamplingError: anything else (a bool is not an integer).
    """
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(f"'{name}' must be an integer", name)
    return value


def _float32(value: float) -> float:
    """``value`` as the worker receives it (protobuf ``float``, IEEE float32)."""
    return struct.unpack("f", struct.pack("f", value))[0]


@dataclass(frozen=True)
class Bounds:
    """What a range may depend on: the model's vocabulary size (tokens) and the request's
    effective ``max_tokens`` (tokens)."""

    vocab_size: int
    max_tokens: int = 0


def _temperature(name: str, value: float, bounds: Bounds) -> float:
    if value < 0:
        raise SamplingError(f"'{name}' must be >= 0, got {value}", name)
    return value


def _top_p(name: str, value: float, bounds: Bounds) -> float:
    if not 0 < _float32(value) <= 1:  # 1e-300 rounds to 0 in float32
        raise SamplingError(f"'{name}' must be in (0, 1], got {value}", name)
    return value


def _top_k(name: str, value: int, bounds: Bounds) -> int:
    if not -1 <= value <= bounds.vocab_size:
        raise SamplingError(
            f"'{name}' must be -1 or 0 (off) or in [1, {bounds.vocab_size}], got {value}", name)
    return 0 if value == -1 else value


def _seed(name: str, value: int, bounds: Bounds) -> int:
    if not -2**63 <= value < 2**63:
        raise SamplingError(f"'{name}' must fit in a signed 64-bit integer", name)
    return value


def _penalty(name: str, value: float, bounds: Bounds) -> float:
    if not -MAX_PENALTY <= value <= MAX_PENALTY:
        raise SamplingError(f"'{name}' must be in [-2, 2], got {value}", name)
    return value


def _positive(name: str, value: float, bounds: Bounds) -> float:
    if not _float32(value) > 0:  # 1e-300 rounds to 0 in float32
        raise SamplingError(f"'{name}' must be > 0 (1 = off), got {value}", name)
    return value


def _unit(name: str, value: float, bounds: Bounds) -> float:
    if not 0 <= value <= 1:
        raise SamplingError(f"'{name}' must be in [0, 1], got {value}", name)
    return value


def _up_to_max_tokens(name: str, value: int, bounds: Bounds) -> int:
    if not 0 <= value <= bounds.max_tokens:
        raise SamplingError(
            f"'{name}' must be in [0, max_tokens] = [0, {bounds.max_tokens}], got {value}", name)
    return value


@dataclass(frozen=True)
class Param:
    """One scalar sampling parameter.

    Attributes:
        name: the OpenAI/vLLM name: the REST field, the ``SamplingParams`` protobuf field
            and the attribute of :class:`SamplingInput` and :class:`Sampling`.
        is_integer: an integer (else a number, sent as float32).
        default: the engine's value when the parameter is unset (None: stays None).
        check: ``(name, value, bounds) -> value``: the range check (the value is already
            of the right type, not None); raises :class:`SamplingError`; may normalize
            (top_k -1 becomes 0).
        unset_when_default: the gateway queues the default value as unset (a penalty at
            its neutral value is the same as none).
        proto_optional: a proto3 ``optional`` field (presence says "sent"); otherwise
            zero means unset.
        needs_max_tokens: the range depends on the effective ``max_tokens``, so the
            gateway checks it after the prompt (:func:`check_min_tokens`).
        json_schema: the bounds the REST schema documents (None: none).
    """

    name: str
    is_integer: bool
    default: float | int | None
    check: Callable[[str, Any, Bounds], Any]
    unset_when_default: bool = False
    proto_optional: bool = True
    needs_max_tokens: bool = False
    json_schema: dict[str, Any] | None = None

    def parse(self, value: Any, bounds: Bounds) -> Any:
        """``value`` checked (None = unset, returned as is).

        Raises:
            SamplingError: a wrong type or out of range, naming the parameter.
        """
        value = integer(self.name, value) if self.is_integer else number(self.name, value)
        return None if value is None else self.check(self.name, value, bounds)


#: The scalar parameters, in the order they are checked.
PARAMS: tuple[Param, ...] = (
    Param("temperature", False, 1.0, _temperature),
    Param("top_p", False, 1.0, _top_p),
    Param("top_k", True, 0, _top_k),  # vLLM extension
    Param("seed", True, None, _seed),
    Param("presence_penalty", False, 0.0, _penalty, unset_when_default=True,
          json_schema={"minimum": -2, "maximum": 2}),
    Param("frequency_penalty", False, 0.0, _penalty, unset_when_default=True,
          json_schema={"minimum": -2, "maximum": 2}),
    Param("repetition_penalty", False, 1.0, _positive, unset_when_default=True,  # vLLM
          json_schema={"exclusiveMinimum": 0}),
    Param("min_p", False, 0.0, _unit, unset_when_default=True,  # vLLM
          json_schema={"minimum": 0, "maximum": 1}),
    Param("min_tokens", True, 0, _up_to_max_tokens, proto_optional=False,  # vLLM
          needs_max_tokens=True, json_schema={"minimum": 0}),
)
PARAMS_BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}


def check_stop(stop: Any) -> tuple[str, ...]:
    """Stop strings as a tuple: ``None``, one string, or a list of at most 16 non-empty
    strings of at most 256 characters each.

    Raises:
        SamplingError: anything else.
    """
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise SamplingError("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_SEQUENCES:
        raise SamplingError(f"'stop' allows at most {MAX_STOP_SEQUENCES} strings", "stop")
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise SamplingError(f"each 'stop' string must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return tuple(items)


def _flag(name: str, value: Any, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SamplingError(f"'{name}' must be a boolean", name)
    return value


def check_token_options(stop_token_ids: Any, ignore_eos: Any, skip_special_tokens: Any,
                        vocab_size: int) -> tuple[tuple[int, ...], bool, bool]:
    """vLLM's extra sampling parameters (vLLM ``SamplingParams`` docs): ``stop_token_ids``
    (at most 64 ints, each in [0, vocab_size)), ``ignore_eos`` (default false) and
    ``skip_special_tokens`` (default true); None takes the default.

    Raises:
        SamplingError: a wrong type, a token id outside the vocabulary, too many ids.
    """
    ids = () if stop_token_ids is None else stop_token_ids
    if not isinstance(ids, (list, tuple)):
        raise SamplingError("'stop_token_ids' must be a list of integers", "stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise SamplingError(f"'stop_token_ids' allows at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise SamplingError(
                f"each 'stop_token_ids' entry must be an integer in [0, {vocab_size}), got {t!r}",
                "stop_token_ids")
    return (tuple(ids), _flag("ignore_eos", ignore_eos, False),
            _flag("skip_special_tokens", skip_special_tokens, True))


def check_top_logprobs(value: Any, name: str = "top_logprobs") -> int:
    """Alternatives per token, in [0, 20]; None = 0. ``name``: the field as the caller
    calls it (REST's ``top_logprobs``, the queue's ``logprobs``).

    Raises:
        SamplingError: not an integer, or out of range.
    """
    top = integer(name, value) or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise SamplingError(f"'{name}' must be in [0, {MAX_TOP_LOGPROBS}]", name)
    return top


def check_logprobs(return_logprobs: Any, top_logprobs: Any) -> tuple[bool, int]:
    """``(return_logprobs, top_logprobs)`` with top_logprobs in [0, 20].

    Raises:
        SamplingError: top_logprobs out of range or without logprobs.
    """
    top = check_top_logprobs(top_logprobs)
    if top and not return_logprobs:
        raise SamplingError("'top_logprobs' requires 'logprobs'", "top_logprobs")
    return bool(return_logprobs), top


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
        SamplingError: not an object, too many entries, a key that is not a token id in
            [0, vocab_size), a bias that is not a number in [-100, 100].
    """
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, Mapping):
        raise SamplingError("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise SamplingError(f"'logit_bias' allows at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                            f"got {len(logit_bias)}", "logit_bias")
    pairs = {}
    for key, value in logit_bias.items():
        token = _token_id_key(key)
        if token is None or not 0 <= token < vocab_size:
            raise SamplingError(
                f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {str(key)[:40]!r}",
                "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):  # NaN fails the comparison
            raise SamplingError(
                f"'logit_bias' values must be numbers in [-100, 100], got {str(value)[:40]} for "
                f"token {token}", "logit_bias")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


def check_max_tokens(value: Any) -> int | None:
    """``max_tokens`` as an integer >= 1 (None = not sent); the caps that depend on the
    server and the context are the gateway's.

    Raises:
        SamplingError: not an integer, or below 1.
    """
    tokens = integer("max_tokens", value)
    if tokens is not None and tokens < 1:
        raise SamplingError(f"'max_tokens' must be >= 1, got {tokens}", "max_tokens")
    return tokens


def check_min_tokens(min_tokens: Any, max_tokens: int) -> int:
    """``min_tokens`` (vLLM) in [0, max_tokens] (the effective ``max_tokens``); None = 0.

    Raises:
        SamplingError: not an integer, negative, above max_tokens.
    """
    value = PARAMS_BY_NAME["min_tokens"].parse(min_tokens, Bounds(0, max_tokens))
    return 0 if value is None else value


@dataclass(frozen=True, kw_only=True)
class SamplingInput:
    """The sampling fields of one request as a front received them, unchecked: the types
    below are the shapes :func:`check_fields` accepts, not promises (REST leaves the vLLM
    extensions untyped; the checks reject a wrong type with an error naming the field).
    ``None`` means "not sent" (the default applies).

    Attributes:
        max_tokens: new tokens to generate, at most (tokens).
        temperature: sampling temperature, >= 0 (0 = greedy).
        top_p: nucleus mass, in (0, 1].
        top_k: candidates kept, in [1, vocab size]; -1 or 0 = off.
        seed: sampling seed, a signed 64-bit integer.
        stop: a stop string or up to 16 of them, each 1 to 256 characters.
        return_logprobs: return the sampled token's log-probability.
        top_logprobs: alternatives per token, in [0, 20] (needs ``return_logprobs``).
        stop_token_ids: token ids that end generation, at most 64 (vLLM extension).
        ignore_eos: generate past EOS until ``max_tokens`` (vLLM extension).
        skip_special_tokens: drop special tokens from the text (vLLM extension, default true).
        presence_penalty, frequency_penalty: OpenAI's penalties, in [-2, 2] (0 = off).
        repetition_penalty: vLLM's repetition penalty, > 0 (1 = off).
        min_p: vLLM's min-p, in [0, 1] (0 = off).
        min_tokens: tokens before EOS/stop token ids may end generation, in [0, max_tokens].
        logit_bias: token id (an int, or its decimal string as JSON object keys are) ->
            bias in [-100, 100]; at most 300 entries.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    return_logprobs: bool = False
    top_logprobs: int | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: Mapping[Any, Any] | None = None


#: The :class:`SamplingInput` fields a REST body carries under the same name (the
#: logprobs fields differ between completions and chat; the fronts map them).
REST_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(SamplingInput) if f.name not in ("return_logprobs", "top_logprobs"))


def rest_fields(body: Any) -> dict[str, Any]:
    """The :class:`SamplingInput` fields of a REST body (any object with attributes of
    those names, e.g. the pydantic request), by name; the logprobs fields excepted."""
    return {name: getattr(body, name) for name in REST_FIELDS}


def grpc_fields(s: common_pb2.SamplingParams) -> dict[str, Any]:
    """The :class:`SamplingInput` fields of a ``GenerateRequest.sampling``, by name. Where
    proto3 has no presence, the zero value means "not sent" (``max_tokens`` 0, ``logprobs``
    0, no ``stop``, ``min_tokens`` 0, an empty ``logit_bias``); ``logprobs`` > 0 asks for
    logprobs too; ``skip_special_tokens`` is always true (a proto3 bool cannot say
    "default")."""
    found: dict[str, Any] = dict(
        max_tokens=s.max_tokens or None, stop=list(s.stop) or None,
        return_logprobs=s.return_logprobs or s.logprobs > 0, top_logprobs=s.logprobs or None,
        stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, skip_special_tokens=True,
        logit_bias=dict(s.logit_bias) or None)
    for p in PARAMS:
        if p.proto_optional:
            found[p.name] = getattr(s, p.name) if s.HasField(p.name) else None
        else:
            found[p.name] = getattr(s, p.name) or None
    return found


def check_fields(given: SamplingInput, vocab_size: int) -> dict[str, Any]:
    """Check every field of ``given`` but ``max_tokens`` and ``min_tokens`` (their ranges
    depend on the prompt: :func:`check_min_tokens`): the table's scalars in
    :data:`PARAMS` order (a parameter sent at its neutral value, where the table says so,
    becomes unset), then logit_bias, stop strings, logprobs, vLLM token options.

    Returns:
        keyword arguments of :class:`Sampling` (all but ``max_tokens`` and ``min_tokens``).

    Raises:
        SamplingError: the first field of a wrong type or out of range.
    """
    bounds = Bounds(vocab_size)
    checked: dict[str, Any] = {}
    for p in PARAMS:
        if p.needs_max_tokens:
            continue
        value = p.parse(getattr(given, p.name), bounds)
        checked[p.name] = None if p.unset_when_default and value == p.default else value
    checked["logit_bias"] = check_logit_bias(given.logit_bias, vocab_size)
    checked["stop"] = check_stop(given.stop)
    checked["return_logprobs"], checked["logprobs"] = check_logprobs(given.return_logprobs,
                                                                     given.top_logprobs)
    (checked["stop_token_ids"], checked["ignore_eos"],
     checked["skip_special_tokens"]) = check_token_options(
        given.stop_token_ids, given.ignore_eos, given.skip_special_tokens, vocab_size)
    return checked


@dataclass(frozen=True)
class Sampling:
    """Checked sampling parameters of one request, as queued (``SamplingParams`` in
    ``protos/common.proto``). A scalar of :data:`PARAMS` may be None, "unset": the engine
    takes the table's default (``resolved``).

    Attributes:
        max_tokens: most tokens to generate (>= 1); reaching it finishes with "length".
        temperature: 0 = greedy (argmax); > 0 divides the logits.
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose
            probability sums to >= top_p (Holtzman et al. ICLR'20); 1 = off.
        top_k: keep the k most likely tokens; 0 or -1 = off.
        seed: makes the random draws of this request depend only on (seed, index of the
            token in the output), whatever else is batched.
        stop: strings that end the output (finish "stop"); the output is cut before the
            first occurrence.
        stop_token_ids: token ids that end the output (finish "stop"); the id is returned
            and counted, its text is not.
        ignore_eos: keep generating past the tokenizer's EOS tokens.
        logprobs: number of top alternatives (0..20) to return per token.
        return_logprobs: return the sampled token's log-probability (implied by
            ``logprobs > 0``).
        skip_special_tokens: leave special tokens out of the text.
        presence_penalty: OpenAI's, in [-2, 2]: subtracted from the logit of every token
            that already occurs in the output (0 = off).
        frequency_penalty: OpenAI's, in [-2, 2]: times a token's count in the output,
            subtracted from its logit (0 = off).
        repetition_penalty: vLLM's and transformers' (Keskar et al. 2019, CTRL), > 0: a
            token seen in the prompt or the output has a positive logit divided by it and
            a negative one multiplied (1 = off).
        min_p: in [0, 1]: after temperature, drop tokens whose probability is below
            ``min_p`` times the most likely token's (Nguyen et al. 2024; 0 = off).
        min_tokens: EOS and ``stop_token_ids`` are masked until the output has this many
            tokens (vLLM's meaning; stop strings still stop).
        logit_bias: (token id, bias) pairs, bias in [-100, 100], added to the logits
            before sampling (OpenAI's ``logit_bias``); a mapping is accepted and stored
            as pairs, ids ascending.
    """

    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    return_logprobs: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # Accept lists/strings/dicts from callers but store hashable tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))

    def _resolve_defaults(self) -> None:
        """Give every unset scalar the table's default (for subclasses' ``__post_init__``)."""
        for p in PARAMS:
            if getattr(self, p.name) is None and p.default is not None:
                object.__setattr__(self, p.name, p.default)

    @classmethod
    def from_proto(cls, p: common_pb2.SamplingParams, **extra: Any):
        """A queued ``SamplingParams`` as ``cls`` (``extra``: a subclass's own fields):
        ``max_tokens`` at least 1, an unset optional scalar None (its default where
        ``cls`` resolves them), ``return_logprobs`` implied by ``logprobs > 0``.
        ``n`` and ``structured_outputs`` are the caller's."""
        values: dict[str, Any] = dict(
            max_tokens=max(1, p.max_tokens), stop=tuple(p.stop),
            stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=p.logprobs,
            return_logprobs=p.return_logprobs or p.logprobs > 0,
            skip_special_tokens=p.skip_special_tokens, logit_bias=dict(p.logit_bias))
        for param in PARAMS:
            if not param.proto_optional:
                values[param.name] = getattr(p, param.name)
            else:
                values[param.name] = getattr(p, param.name) if p.HasField(param.name) else None
        return cls(**values, **extra)

    def to_proto(self) -> common_pb2.SamplingParams:
        """The queued ``SamplingParams`` (an unset scalar stays unset; ``n`` and
        ``structured_outputs`` are the caller's)."""
        params = common_pb2.SamplingParams(
            max_tokens=self.max_tokens, stop=list(self.stop), logprobs=self.logprobs,
            return_logprobs=self.return_logprobs, stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            logit_bias=dict(self.logit_bias))
        for p in PARAMS:
            value = getattr(self, p.name)
            if value is not None:
                setattr(params, p.name, value)
        return params

    def value(self, name: str) -> Any:
        """The scalar ``name``'s effective value: its table default when unset."""
        value = getattr(self, name)
        return PARAMS_BY_NAME[name].default if value is None else value

    @property
    def penalizes(self) -> bool:
        """True when a penalty reads the request's token history."""
        return (self.value("presence_penalty") != 0 or self.value("frequency_penalty") != 0
                or self.value("repetition_penalty") != 1)

    def validate(self, vocab_size: int) -> None:
        """Check every field against its range, as the gateway did (same messages).

        Args:
            vocab_size: the model's vocabulary size (bounds top_k and token ids).

        Raises:
            SamplingError: (a ValueError) naming the first field out of range.
        """
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise SamplingError(f"'max_tokens' must be an integer, got {self.max_tokens!r}", "max_tokens")
        check_max_tokens(self.max_tokens)
        bounds = Bounds(vocab_size, self.max_tokens)
        for p in PARAMS:
            p.parse(getattr(self, p.name), bounds)
        check_stop(self.stop)
        check_token_options(self.stop_token_ids, self.ignore_eos, self.skip_special_tokens, vocab_size)
        check_top_logprobs(self.logprobs, "logprobs")
        check_logit_bias(dict(self.logit_bias), vocab_size)
