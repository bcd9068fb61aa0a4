"""A client's JSON schema as the grammar enforces it: objects closed, and under
``strict: true`` every property required (OpenAI's Structured Outputs "strict" mode).

llguidance compiles a schema as JSON Schema reads it: an object that does not say
``additionalProperties`` accepts any other key, any number of times, so a small model
writes keys of its own until ``max_tokens`` and the output does not parse (issue 45:
``[{"x":1,"ok":true,"name":"Mali","description":…`` cut at ``length``). Its named
properties come out in the schema's order, each at most once, so closing an object
also means no key is ever written twice. :func:`close_schema` therefore:

* closes every object schema that names ``properties`` and says nothing of
  ``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties``
  (``additionalProperties: false``), and every tuple (``prefixItems``) that says nothing
  of ``items`` (``items: false``): the default of vLLM's xgrammar backend
  (``strict_mode``); a schema that writes ``additionalProperties: true`` stays open;
* under ``strict`` (``response_format.json_schema.strict``, a function's ``strict``), as
  OpenAI: every object schema, named properties or not, is closed, and every property is
  required; a schema that opens an object or tuple explicitly is refused (400 naming
  the place), as OpenAI refuses it.

Objects that are parts of an ``allOf`` (or that carry one, or a ``$defs`` entry an ``allOf``
refers to) are left as they are: closing each part would make their combination
unsatisfiable. An object that names no
properties and is not strict (``{"type": "object"}``, ``json_object``) stays open: a
context-free grammar cannot remember which free keys it already wrote, so there a key
may repeat.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequestError

_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
#: Keywords whose value is one subschema.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "additionalItems", "unevaluatedItems", "unevaluatedProperties")
#: Keywords whose value is a list of subschemas.
_LIST = ("anyOf", "oneOf", "prefixItems")
#: Keywords whose value maps names to subschemas.
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def close_schema(schema: Any, strict: bool, param: str) -> Any:
    """A copy of ``schema`` closed as the module docstring says (the input is not changed;
    anything that is not a dict, such as ``true``, comes back as it is).

    Args:
        schema: the client's JSON schema (parsed).
        strict: OpenAI's strict mode.
        param: the request field it came from, named by the errors.

    Raises:
        InvalidRequestError: under ``strict``, an object with ``additionalProperties`` or
            ``unevaluatedProperties`` other than false or with ``patternProperties``, or a
            tuple with ``items`` other than false.
    """
    return _walk(schema, strict, param, in_all_of=False, combined=_all_of_refs(schema))


def _all_of_refs(node: Any, found: set[str] | None = None) -> set[str]:
    """The ``$ref`` targets that are members of some ``allOf`` (``#/$defs/Base`` of the
    inheritance pattern ``allOf: [{"$ref": Base}, {"properties": ...}]``): left open too."""
    found = set() if found is None else found
    if isinstance(node, dict):
        for member in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
            if isinstance(member, dict) and isinstance(member.get("$ref"), str):
                found.add(member["$ref"])
        for value in node.values():
            _all_of_refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _all_of_refs(value, found)
    return found


def _walk(node: Any, strict: bool, where: str, in_all_of: bool, combined: set[str]) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _walk(out[key], strict, f"{where}.{key}", False, combined)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_walk(s, strict, f"{where}.{key}[{i}]", False, combined)
                        for i, s in enumerate(out[key])]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_walk(s, strict, f"{where}.allOf[{i}]", True, combined)
                        for i, s in enumerate(out["allOf"])]
    if isinstance(out.get("items"), list):  # draft 4-7 tuples
        out["items"] = [_walk(s, strict, f"{where}.items[{i}]", False, combined)
                        for i, s in enumerate(out["items"])]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _walk(s, strict, f"{where}.{key}.{name}",
                                    key in ("$defs", "definitions") and f"#/{key}/{name}" in combined,
                                    combined)
                        for name, s in out[key].items()}
    if in_all_of or "allOf" in out:
        return out
    if _is_object(out):
        _close_object(out, strict, where)
    if isinstance(out.get("prefixItems"), list):
        _close_tuple(out, strict, where, "items")
    elif isinstance(out.get("items"), list):
        _close_tuple(out, strict, where, "additionalItems")
    return out


def _is_object(node: dict) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        kind is None and isinstance(node.get("properties"), dict))


def _close_object(node: dict, strict: bool, where: str) -> None:
    named = isinstance(node.get("properties"), dict)
    said = [k for k in _OPENERS if k in node]
    if strict:
        opened = [k for k in said if k == "patternProperties" or node[k] is not False]
        if opened:
            raise InvalidRequestError(
                f"'{where}': with strict true an object may not allow other properties "
                f"({opened[0]} must be false or absent), as OpenAI's strict mode",
                param=where, code="invalid_structured_output")
        node["additionalProperties"] = False
        if named:
            node["required"] = list(node["properties"])
    elif named and not said:
        node["additionalProperties"] = False


def _close_tuple(node: dict, strict: bool, where: str, rest: str) -> None:
    if rest not in node:
        node[rest] = False
    elif strict and node[rest] is not False:
        raise InvalidRequestError(
            f"'{where}': with strict true a tuple may not allow other items ({rest} must be "
            "false or absent), as OpenAI's strict mode", param=where,
            code="invalid_structured_output")
