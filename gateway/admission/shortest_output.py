"""The shortest output a structured-outputs constraint allows, in tokens, where it can be
computed: a constrained request whose ``max_tokens`` cannot hold it would end at
``length`` with output that does not parse, so validation refuses it at once (400 naming
``max_tokens``) instead of spending the generation.

The shortest text is built from the constraint (:func:`shortest_text`):

* a JSON schema (closed first, ``gateway.admission.closed_schema``): its required
  properties in the schema's order (the order the grammar writes them), each with its
  shortest value: ``""`` for a string, ``0`` for a number, ``true``, ``null``, ``[]`` (or
  ``minItems`` of the shortest item), the shortest ``const``/``enum`` value or
  ``anyOf``/``oneOf`` branch, local ``$ref`` followed; written without whitespace, as
  the grammar writes JSON (``common.structured_outputs.JSON_OPTIONS``);
* ``json_object``: ``{}``; ``choice``: the shortest choice;
* an enforced tool call (``tool_choice`` ``required`` or a named function): the Hermes
  call block of ``gateway.tools.constraint`` for the function whose call is shortest;
* anything else (a regex, a grammar, ``allOf``, ``not``, a remote ``$ref``, a
  ``minLength`` or ``pattern``): not computed, nothing refused.

Its token count (:func:`fewest_tokens`) is the fewest vocabulary tokens whose bytes
spell it (a shortest-path over the text's byte positions), not the tokenizer's own
split, so no request that could fit is refused. The text under-counts a string with a
``minLength``; never over-counts what the grammar requires.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any

from common.structured_outputs import StructuredOutputs
from gateway.admission.closed_schema import close_schema
from gateway.tools.spec import ToolSpec

_MAX_DEPTH = 32  # $ref chains and nesting followed before giving up (not computed)
_SEPARATORS = (",", ":")


class NotComputed(Exception):
    """The constraint's shortest output is not computed (see the module docstring)."""


def shortest_text(spec: StructuredOutputs, tools: ToolSpec | None = None,
                  param: str = "") -> str | None:
    """The shortest output ``spec`` allows, or None when it is not computed.

    Args:
        spec: the request's constraint.
        tools: the request's tools, when ``spec`` is their call grammar (``param`` ==
            ``"tool_choice"``).
        param: the request field the constraint came from.
    """
    try:
        if param == "tool_choice" and tools is not None:
            return min((_call_text(f.name, f.parameters, f.strict) for f in tools.callable()), key=len)
        if spec.kind == "json":
            schema = json.loads(spec.text)
            return _dump(_shortest(schema, schema, 0))
        if spec.kind == "json_object":
            return "{}"
        if spec.kind == "choice":
            return min(spec.choices, key=len)
    except (NotComputed, RecursionError, ValueError):
        return None
    return None


def _call_text(name: str, parameters: Any, strict: bool) -> str:
    schema = close_schema(dict(parameters), strict, name)
    arguments = _dump(_shortest(schema, schema, 0))
    return "<tool_call>\n" + _dump({"name": name}).rstrip("}") + ',"arguments":' + arguments + "}\n</tool_call>"


def _dump(value: Any) -> str:
    return json.dumps(value, separators=_SEPARATORS, ensure_ascii=False)


def _shortest(schema: Any, root: Any, depth: int) -> Any:
    """The shortest JSON value ``schema`` accepts (raises NotComputed)."""
    if depth > _MAX_DEPTH:
        raise NotComputed
    if schema is True or schema == {}:
        return 0
    if not isinstance(schema, dict) or any(k in schema for k in ("allOf", "not", "if", "pattern",
                                                                    "minLength", "format")):
        raise NotComputed
    if "$ref" in schema:
        return _shortest(_resolve(schema["$ref"], root), root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min(schema["enum"], key=_dump_len)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return min((_shortest(s, root, depth + 1) for s in schema[key]), key=_dump_len)
    kinds = schema.get("type")
    if kinds is None:
        kinds = "object" if "properties" in schema else None
    if isinstance(kinds, list):
        return min((_shortest({**schema, "type": k}, root, depth + 1) for k in kinds), key=_dump_len)
    if kinds == "object":
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise NotComputed
        if any(name not in properties for name in required) or schema.get("minProperties", 0):
            raise NotComputed
        return {name: _shortest(sub, root, depth + 1) for name, sub in properties.items()
                if name in required}
    if kinds == "array":
        count = schema.get("minItems", 0)
        prefix = schema.get("prefixItems", [])
        if not isinstance(count, int) or not isinstance(prefix, list) or count > 64:
            raise NotComputed
        items = [_shortest(s, root, depth + 1) for s in prefix[:count]]
        if len(items) < count:
            items += [_shortest(schema.get("items", True), root, depth + 1)] * (count - len(items))
        return items
    if kinds == "string":
        return ""
    if kinds in ("integer", "number"):
        return 0
    if kinds == "boolean":
        return True
    if kinds == "null":
        return None
    raise NotComputed


def _dump_len(value: Any) -> int:
    return len(_dump(value))


def _resolve(ref: Any, root: Any) -> Any:
    """A local ``#/...`` reference inside ``root`` (raises NotComputed otherwise)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise NotComputed
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise NotComputed
        node = node[part]
    return node


class _Vocabulary:
    """The vocabulary's token bytes by length, for :func:`fewest_tokens`."""

    def __init__(self, tokenizer: Any) -> None:
        token_bytes = tokenizer.token_bytes
        pieces: set[bytes] = set()  # special tokens too: a template's tag may be one
        for token_id in range(tokenizer.vocab_size):
            try:
                pieces.add(token_bytes(token_id))
            except ValueError:
                continue
        pieces.discard(b"")
        self.pieces = frozenset(pieces)
        self.longest = max((len(p) for p in pieces), default=1)


_VOCABULARIES: dict[int, _Vocabulary] = {}
_LOCK = threading.Lock()


def _vocabulary(tokenizer: Any) -> _Vocabulary:
    with _LOCK:
        if id(tokenizer) not in _VOCABULARIES:
            _VOCABULARIES[id(tokenizer)] = _Vocabulary(tokenizer)
        return _VOCABULARIES[id(tokenizer)]


@functools.lru_cache(maxsize=1024)
def _fewest(pieces: frozenset[bytes], longest: int, data: bytes) -> int | None:
    best = [0] + [None] * len(data)
    for start in range(len(data)):
        if best[start] is None:
            continue
        for end in range(start + 1, min(len(data), start + longest) + 1):
            if data[start:end] in pieces and (best[end] is None or best[start] + 1 < best[end]):
                best[end] = best[start] + 1
    return best[-1]


def fewest_tokens(tokenizer: Any, text: str) -> int:
    """The fewest tokens whose bytes spell ``text`` (tokens); a tokenizer without
    ``token_bytes`` (a test double) counts its own encoding. Text no tokens spell
    counts as its encoding too."""
    if not hasattr(tokenizer, "token_bytes"):
        return len(tokenizer.encode(text))
    vocabulary = _vocabulary(tokenizer)
    found = _fewest(vocabulary.pieces, vocabulary.longest, text.encode("utf-8"))
    return found if found is not None else len(tokenizer.encode(text))
