"""Structured outputs at the edge: parse a request's constraint and check that it compiles.

The fronts call :func:`structured_outputs_from_fields` with the raw fields a client sent
(OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``); validation then calls
:func:`check_structured_outputs`, which compiles the grammar with llguidance against the
model's tokenizer, under llguidance's resource limits and a wall-clock budget, and computes
the first token mask. A constraint that is malformed, unsupported, too large or too slow
is an :class:`InvalidRequestError` (HTTP 400 / gRPC INVALID_ARGUMENT) naming the field,
so the worker only ever compiles grammars that compiled here. No torch: llguidance is a
Rust extension with no Python dependencies.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import llguidance
import numpy as np

from common.structured_outputs import StructuredOutputs
from gateway.admission.closed_schema import close_schema
from gateway.errors import InvalidRequestError

#: vLLM ``structured_outputs`` keys that pick the kind.
_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
#: vLLM options that change nothing here (whitespace is never free here; see
#: ``common.structured_outputs.JSON_OPTIONS``), accepted and ignored.
_VLLM_IGNORED = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


@dataclass(frozen=True)
class GrammarLimits:
    """What a constraint may cost (the gateway's checks; llguidance's own limits apply too).

    Attributes:
        max_spec_chars: the schema/regex/grammar text plus the choices, in characters
            (OpenAI caps a strict schema's names and enum values at 120,000 characters).
        max_json_depth: nesting of the JSON schema document (objects and arrays).
        compile_budget_s: seconds the compile and the first token mask may take (wall clock).
        lexer_fuel: llguidance's ``initial_lexer_fuel`` (about 50k units per ms).
        step_lexer_fuel: llguidance's ``step_lexer_fuel``, per token mask (about 14k per ms).
        max_lexer_states: llguidance's ``max_lexer_states`` (1-2 kB of memory each).
    """

    max_spec_chars: int = 128 * 1024
    max_json_depth: int = 64
    compile_budget_s: float = 2.0
    lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    max_lexer_states: int = 250_000

    def parser_limits(self) -> llguidance.LLParserLimits:
        """The llguidance limits object (worker and gateway build it from the same values)."""
        return llguidance.LLParserLimits(initial_lexer_fuel=self.lexer_fuel,
                                         step_lexer_fuel=self.step_lexer_fuel,
                                         max_lexer_states=self.max_lexer_states,
                                         verbose_errors=False)


def structured_outputs_from_fields(response_format: Any = None, structured_outputs: Any = None,
                                   guided: Mapping[str, Any] | None = None,
                                   ) -> tuple[StructuredOutputs, str] | None:
    """The one constraint a request asks for and the field it came from (as precise as the
    request says: ``response_format.json_schema.schema``, ``structured_outputs.regex``,
    ``guided_json``; errors about it name that field), or None.

    Args:
        response_format: OpenAI's: ``{"type": "text"}`` (none), ``{"type": "json_object"}``
            or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
        structured_outputs: vLLM's object with exactly one of ``json`` (a schema, object or
            JSON text), ``regex``, ``choice`` (strings), ``grammar`` (Lark or GBNF),
            ``json_object`` (true).
        guided: vLLM's older fields by name (``guided_json``, ``guided_regex``,
            ``guided_choice``, ``guided_grammar``); None values are absent.

    Raises:
        InvalidRequestError: a malformed field, an unsupported kind, or more than one
            constraint in one request (naming the field).
    """
    found: list[tuple[str, StructuredOutputs]] = []
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if structured_outputs is not None:
        found.append(("structured_outputs", _from_vllm(structured_outputs)))
    for name, value in (guided or {}).items():
        if value is not None:
            found.append((name, _build(_GUIDED[name], value, name)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequestError(f"only one of {names} may constrain the output", param=found[1][0])
    if not found:
        return None
    name, spec = found[0]
    if name == "response_format":
        name = "response_format.json_schema.schema" if spec.kind == "json" else name
    elif name == "structured_outputs":
        name = f"structured_outputs.{spec.kind}"
    return spec, name


def structured_outputs_from_proto(message: Any) -> tuple[StructuredOutputs, str] | None:
    """gRPC's ``SamplingParams.structured_outputs`` (an ``inflight.v1.StructuredOutputs``)
    and the field it came from, or None when no kind is set; shapes are checked as
    :func:`structured_outputs_from_fields` checks vLLM's.

    Raises:
        InvalidRequestError: a malformed value (a ``json`` that is not a JSON object, an
            empty regex, grammar or choice list, ``json_object`` false).
    """
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    value = list(message.choice.choices) if kind == "choice" else getattr(message, kind)
    param = f"sampling.structured_outputs.{kind}"
    return _build(kind, value, param), param


def _from_response_format(value: Any) -> StructuredOutputs | None:
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise InvalidRequestError("'response_format' must be an object with a 'type'", param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs.any_json_object()
    if kind != "json_schema":
        raise InvalidRequestError(
            f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
            param="response_format", code="unsupported_parameter")
    body = value.get("json_schema")
    if not isinstance(body, Mapping) or "schema" not in body:
        raise InvalidRequestError("'response_format.json_schema' must be an object with a 'schema'",
                                  param="response_format.json_schema")
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError("'response_format.json_schema.strict' must be a boolean",
                                  param="response_format.json_schema.strict")
    return _build("json", body["schema"], "response_format.json_schema.schema", strict=bool(strict))


def _from_vllm(value: Any) -> StructuredOutputs:
    if not isinstance(value, Mapping):
        raise InvalidRequestError("'structured_outputs' must be an object", param="structured_outputs")
    unknown = [k for k, v in value.items() if k not in _VLLM_KINDS + _VLLM_IGNORED and v is not None]
    if unknown:
        raise InvalidRequestError(f"structured_outputs.{unknown[0]} is not supported "
                                  f"(supported: {', '.join(_VLLM_KINDS)})",
                                  param=f"structured_outputs.{unknown[0]}", code="unsupported_parameter")
    kinds = [k for k in _VLLM_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise InvalidRequestError(f"'structured_outputs' must set exactly one of {', '.join(_VLLM_KINDS)}",
                                  param="structured_outputs")
    return _build(kinds[0], value[kinds[0]], f"structured_outputs.{kinds[0]}")


def _build(kind: str, value: Any, param: str, strict: bool = False) -> StructuredOutputs:
    """One spec of ``kind`` from a client's ``value``; errors name ``param`` (text that is not
    valid Unicode, a lone surrogate from a JSON ``\\ud800`` escape, cannot be queued: 400).
    A JSON schema is closed first (``gateway.admission.closed_schema``; ``strict``:
    OpenAI's strict mode)."""
    spec = _build_spec(kind, value, param, strict)
    try:
        for part in (spec.text, *spec.choices):
            part.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"'{param}' holds text that is not valid Unicode", param=param) from None
    return spec


def _build_spec(kind: str, value: Any, param: str, strict: bool) -> StructuredOutputs:
    if kind == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
            return StructuredOutputs.json_schema(close_schema(schema, strict, param))
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"'{param}' must be a JSON schema (an object): {str(exc)[:200]}",
                                      param=param) from None
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(f"'{param}' must be true", param=param)
        return StructuredOutputs.any_json_object()
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"'{param}' must be a non-empty list of strings", param=param)
        return StructuredOutputs.from_choice(value)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"'{param}' must be a non-empty string", param=param)
    return StructuredOutputs.from_regex(value) if kind == "regex" else StructuredOutputs.from_grammar(value)


def _json_depth(text: str, limit: int) -> bool:
    """True when the JSON text nests objects/arrays deeper than ``limit`` (strings skipped)."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


#: What llguidance refuses, in its words (a pattern of its error text), and the same said to a
#: user: text, or a function of the match. The first that matches wins; llguidance's own
#: detail follows it in the message.
_EXPLAINED: tuple[tuple[re.Pattern[str], Any], ...] = (
    (re.compile(r"look-around"), "look-ahead and look-behind ((?=...), (?!...), (?<=...), (?<!...)) are not "
                                 "supported: the grammar engine runs regexes in linear time"),
    (re.compile(r"backreferences"), "back-references (\\1, \\k<name>) are not supported: the grammar engine "
                                    "runs regexes in linear time"),
    (re.compile(r"Unimplemented keys: \[(.*?)\]"),
     lambda m: "these JSON Schema keywords are not supported: " + ", ".join(re.findall(r'"([^"]*)"', m[1]))),
    (re.compile(r"Invalid type: (\S+)"),
     lambda m: f"'type' {m[1]!r} is not a JSON Schema type (string, number, integer, boolean, object, array, null)"),
    (re.compile(r"Unknown format: (\S+)"), lambda m: f"'format' {m[1]!r} is not supported"),
    (re.compile(r"not present in a registry|retriev", re.IGNORECASE),
     "a '$ref' to another document is not fetched: only references inside the schema ('#/$defs/...') work"),
    (re.compile(r"Expecting object schema"), "a schema must be an object ('false' allows no value at all)"),
    (re.compile(r"Rule '([^']*)' not found"), lambda m: f"the rule {m[1]!r} is used but never defined"),
    (re.compile(r"neither Lark nor GBNF"), "it is neither Lark nor GBNF grammar syntax"),
    (re.compile(r"Unsatisfiable schema: ([^\n]*)"), lambda m: f"no JSON value satisfies it ({m[1].strip()})"),
    (re.compile(r"NoExtension"), "it matches no text at all, so nothing the model writes can satisfy it"),
    (re.compile(r'unknown name: "([^"]*)"'), lambda m: f"the rule {m[1]!r} is used but never defined"),
    (re.compile(r"regex parse error"), "it is not a valid regular expression (Rust regex syntax)"),
    (re.compile(r"too big|too complex|TooComplex|lexer", re.IGNORECASE),
     "it is too large or complex for the grammar engine's limits (fewer alternatives, shorter "
     "enums or patterns)"),
    (re.compile(r"Expected token|Unexpected token|expected", re.IGNORECASE),
     "it is not valid Lark (or GBNF) syntax"),
)

#: llguidance's error lines that show its own wrapping of the spec, not the client's text: a
#: source excerpt (``   1 | start: /.../``), its caret line, ``%llguidance {}``, ``<non-verbose/>``.
_NOISE = re.compile(r"\s*(\d+ \|.*|[\s^]*|%llguidance \{\}|<non-verbose/>)")


def explain_grammar_error(kind: str, text: str, error: str) -> str:
    """llguidance's ``error`` for a spec of ``kind`` (``text``: its regex, grammar or schema)
    as one line: what is unsupported in a user's words, then ``(llguidance: ...)`` with its
    own detail on one line, at most 300 characters (its source excerpt, which shows its own
    wrapping of the spec, dropped; so is a line repeating ``text`` and, but for a grammar
    the client wrote, the ``at L(C):`` positions in that wrapping)."""
    lines = [line.strip() for line in error.splitlines()
             if not _NOISE.fullmatch(line) and line.strip() != text.strip()]
    detail = " ".join(lines)
    if kind != "grammar":
        detail = re.sub(r"(^|\s)(at )?\d+\(\d+\):\s*", r"\1", detail)
    detail = re.sub(r"\s*\(in regex\)", "", detail).strip() or error.strip()
    for pattern, words in _EXPLAINED:
        match = pattern.search(error)
        if match:
            said = words(match) if callable(words) else words
            return f"{said} (llguidance: {detail[:300]})"
    return f"llguidance: {detail[:300]}"


class GrammarChecker:
    """Compiles specs against one tokenizer, as the worker will; remembers the verdicts.

    Args:
        tokenizer: the gateway's tokenizer; its ``hf`` (a ``tokenizers.Tokenizer``),
            ``vocab_size`` and ``eos_token_ids`` build llguidance's tokenizer (about 0.4 s,
            once). Without ``hf`` (test fakes) grammars are checked without a vocabulary.
        limits: see :class:`GrammarLimits`.
    """

    def __init__(self, tokenizer: Any, limits: GrammarLimits):
        self.limits = limits
        self._tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar-check")
        self.verdict = functools.lru_cache(maxsize=512)(self._verdict)

    def ll_tokenizer(self) -> llguidance.LLTokenizer | None:
        """llguidance's view of the tokenizer (built on first use), or None for a fake."""
        with self._lock:
            hf = getattr(self._tokenizer, "hf", None)
            if self._ll is None and hf is not None:
                self._ll = llguidance.LLTokenizer(hf.to_str(), n_vocab=self._tokenizer.vocab_size,
                                                  eos_token=sorted(self._tokenizer.eos_token_ids))
            return self._ll

    def _verdict(self, spec: StructuredOutputs) -> str:
        """"" when ``spec`` compiles and yields a first mask within the limits, else why not."""
        if spec.size > self.limits.max_spec_chars:
            return f"is too large: {spec.size} characters, at most {self.limits.max_spec_chars}"
        if spec.kind == "json" and _json_depth(spec.text, self.limits.max_json_depth):
            return f"nests deeper than {self.limits.max_json_depth} levels"
        # llguidance's view of the vocabulary is built once (1.7 s on a busy 2-core machine),
        # outside the budget, which is the grammar's own: else the first request pays for it
        self.ll_tokenizer()
        future = self._pool.submit(self._compile, spec)
        try:
            return future.result(timeout=self.limits.compile_budget_s)
        except concurrent.futures.TimeoutError:
            return f"did not compile within the {self.limits.compile_budget_s:g} s budget"

    def _compile(self, spec: StructuredOutputs) -> str:
        try:
            grammar = spec.grammar()
        except ValueError as exc:
            return f"is invalid: {explain_grammar_error(spec.kind, spec.text, str(exc))}"
        tokenizer, limits = self.ll_tokenizer(), self.limits.parser_limits()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
        if error or tokenizer is None:
            return f"cannot be enforced: {explain_grammar_error(spec.kind, spec.text, error)}" if error else ""
        matcher = llguidance.LLMatcher(tokenizer, grammar, limits=limits, log_level=0)
        mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error():
            return f"cannot be enforced: {explain_grammar_error(spec.kind, spec.text, matcher.get_error())}"
        return ""


_CHECKERS: dict[int, GrammarChecker] = {}
_CHECKERS_LOCK = threading.Lock()


def checker_for(tokenizer: Any, limits: GrammarLimits) -> GrammarChecker:
    """The :class:`GrammarChecker` of ``tokenizer`` and ``limits`` (one per pair, kept)."""
    with _CHECKERS_LOCK:
        key = hash((id(tokenizer), limits))
        if key not in _CHECKERS:
            _CHECKERS[key] = GrammarChecker(tokenizer, limits)
        return _CHECKERS[key]


def check_structured_outputs(spec: StructuredOutputs, param: str, tokenizer: Any,
                             limits: GrammarLimits) -> None:
    """Raise unless ``spec`` compiles for ``tokenizer`` within ``limits`` (verdicts are cached
    by spec, so a schema sent again costs a dictionary lookup).

    Args:
        spec: the constraint.
        param: the request field it came from (named by the error).
        tokenizer: the gateway's tokenizer (see :class:`GrammarChecker`).
        limits: see :class:`GrammarLimits`.

    Raises:
        InvalidRequestError: too large, too deep, invalid, unsupported by the grammar
            engine, or slower than ``limits.compile_budget_s`` to compile (HTTP 400 /
            INVALID_ARGUMENT, ``code`` "invalid_structured_output").
    """
    problem = checker_for(tokenizer, limits).verdict(spec)
    if problem:
        what = {"json": "the JSON schema", "json_object": "the JSON object constraint",
                "regex": "the regex", "choice": "the choice list", "grammar": "the grammar"}[spec.kind]
        raise InvalidRequestError(f"'{param}': {what} {problem}", param=param, code="invalid_structured_output")


def check_min_tokens_under(spec: StructuredOutputs, param: str, min_tokens: int) -> None:
    """Raise when ``min_tokens`` can never be met under ``spec``. Under a constraint the
    worker masks EOS until ``min_tokens`` only while the grammar allows another token; once
    the output is complete (nothing but EOS may follow) the request ends with ``stop``, as
    vLLM's terminal grammars do. A ``choice`` is complete after its longest string: at most
    one token per byte, so a ``min_tokens`` above that many bytes is refused rather than
    silently not met (other kinds may allow longer outputs: not refused).

    Raises:
        InvalidRequestError: ``param`` ``min_tokens``, its message naming both fields.
    """
    if spec.kind != "choice" or not min_tokens:
        return
    longest = max(len(choice.encode("utf-8")) for choice in spec.choices)
    if min_tokens > longest:
        raise InvalidRequestError(
            f"'min_tokens' ({min_tokens}) cannot be met under '{param}': its longest choice is {longest} bytes, "
            f"at most {longest} tokens, and the output ends once a choice is complete; ask for at most "
            f"{longest} or leave min_tokens out", param="min_tokens")
