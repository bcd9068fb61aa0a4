"""Structured outputs: what a constrained request's output must match, shared by both sides.

A :class:`StructuredOutputs` is built at the gateway (``gateway.admission.structured``
parses OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older
``guided_*`` fields into one), travels in ``SamplingParams.structured_outputs``
(``protos/common.proto``) and is compiled by the worker. :meth:`StructuredOutputs.grammar`
is the one place that turns a spec into the grammar text the engine compiles (llguidance's
format, https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md), so the
gateway's check and the worker's compile see the same grammar. No torch here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from protos import common_pb2

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")

#: llguidance's JSON compile options for every schema: no whitespace between tokens
#: (``{"a":1}``), so a small model cannot loop on blank lines inside an object; a schema
#: may override it with llguidance's own ``"x-guidance": {"whitespace_flexible": true}``.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on one request's output.

    Attributes:
        kind: ``json`` (a JSON Schema), ``json_object`` (any JSON object), ``regex`` (the
            whole output matches it), ``choice`` (exactly one of the strings) or ``grammar``
            (Lark in llguidance's dialect, or llama.cpp's GBNF).
        text: the schema as JSON text (key order kept: it is the order of the output's
            properties), the regex or the grammar; "" for ``json_object`` and ``choice``.
        choices: the strings of ``choice`` (empty for the other kinds).

    Build with the class methods (:meth:`json_schema`, :meth:`any_json_object`,
    :meth:`from_regex`, :meth:`from_choice`, :meth:`from_grammar`).
    """

    kind: Kind
    text: str = ""
    choices: tuple[str, ...] = ()

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> "StructuredOutputs":
        """A JSON Schema (a dict, ``True``, or its JSON text).

        Raises:
            ValueError: text that is not JSON, or a value that cannot be a schema.
        """
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object (or true)")
        return cls("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def any_json_object(cls) -> "StructuredOutputs":
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def from_regex(cls, regex: str) -> "StructuredOutputs":
        """The whole output matches ``regex`` (Rust ``regex`` syntax: no look-around, no
        back-references; ``\\d``, ``\\w`` and ``\\s`` are ASCII classes)."""
        return cls("regex", regex)

    @classmethod
    def from_choice(cls, choices: list[str] | tuple[str, ...]) -> "StructuredOutputs":
        """The output is exactly one of ``choices``."""
        return cls("choice", choices=tuple(choices))

    @classmethod
    def from_grammar(cls, grammar: str) -> "StructuredOutputs":
        """A context-free grammar: Lark (llguidance's dialect, which also embeds JSON
        schemas: ``start: "<tool_call>" %json {...} "</tool_call>"``) or GBNF."""
        return cls("grammar", grammar)

    def key(self) -> str:
        """The cache key of the compiled grammar: SHA-256 (hex) of the kind, the text and
        the choices (the worker's grammar cache is keyed by it)."""
        digest = hashlib.sha256(self.kind.encode())
        for part in (self.text, *self.choices):
            digest.update(b"\x00" + part.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()

    @property
    def size(self) -> int:
        """Characters of the spec (text plus choices), what the size limit counts."""
        return len(self.text) + sum(len(c) + 1 for c in self.choices)

    def grammar(self) -> str:
        """The llguidance grammar text the engine compiles (JSON with one or more grammars).

        Raises:
            ValueError: a schema that is not JSON, a GBNF grammar that does not convert to Lark.
        """
        if self.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":  # \d, \w and \s mean ASCII, as in Python's patterns on str
            return llguidance.LLMatcher.grammar_from_lark("start: /" + llguidance.regex_to_lark(self.text, "dws") + "/")
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choices))
        try:
            lark = any_to_lark(self.text)
        except Exception as exc:  # the converter raises plain Exceptions on bad GBNF
            raise ValueError(f"the grammar is neither Lark nor GBNF: {exc}") from exc
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def to_proto(self) -> common_pb2.StructuredOutputs:
        """The ``inflight.v1.StructuredOutputs`` message."""
        if self.kind == "json_object":
            return common_pb2.StructuredOutputs(json_object=True)
        if self.kind == "choice":
            return common_pb2.StructuredOutputs(choice=common_pb2.ChoiceList(choices=list(self.choices)))
        return common_pb2.StructuredOutputs(**{self.kind: self.text})

    @classmethod
    def from_proto(cls, message: common_pb2.StructuredOutputs) -> "StructuredOutputs | None":
        """The spec in ``message``; None when no kind is set (or ``json_object`` is false)."""
        kind = message.WhichOneof("kind")
        if kind is None or (kind == "json_object" and not message.json_object):
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind == "choice":
            return cls("choice", choices=tuple(message.choice.choices))
        return cls(kind, getattr(message, kind))
