"""A corpus of JSON schemas for the structured-outputs benchmark and tests: nested objects,
bounded arrays, enums, ranged numbers, optional and required fields, ``$defs``/``$ref``,
``anyOf``, ``const``, formats and patterns.

Every string is bounded (``maxLength``, an enum, a pattern or a format), every array
has ``maxItems`` and every number a ``multipleOf`` (a power of two, exact in binary; else greedy decoding of a random-weight
model writes ``8.1111…`` until ``max_tokens``), so each schema's language is finite and any
sampler, a random-weight model's included, closes the JSON within a few hundred tokens. 24 are written by hand,
the rest are built from the same parts by a seeded generator (the same list each run).
"""

from __future__ import annotations

import random
from typing import Any


def s(n: int = 12) -> dict:
    return {"type": "string", "maxLength": n}


def i(lo: int = 0, hi: int = 100) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def num(lo: float = 0, hi: float = 1, step: float = 0.25) -> dict:
    return {"type": "number", "minimum": lo, "maximum": hi, "multipleOf": step}


def arr(items: dict, lo: int = 0, hi: int = 3) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def enum(*values: Any) -> dict:
    return {"enum": list(values)}


HANDWRITTEN: list[dict] = [
    obj({"name": s(), "age": i(0, 120)}),
    obj({"city": s(), "population": i(0, 10**7), "capital": {"type": "boolean"}}),
    obj({"answer": enum("yes", "no", "maybe")}),
    obj({"score": num(0, 10), "label": enum("low", "mid", "high")}),
    obj({"tags": arr(s(8), 1, 3)}),
    obj({"id": {"type": "string", "format": "uuid"}, "created": {"type": "string", "format": "date"}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "state": {"type": "string", "pattern": "^[A-Z]{2}$"}}),
    obj({"user": obj({"first": s(), "last": s()}), "active": {"type": "boolean"}}),
    obj({"point": obj({"x": i(-50, 50), "y": i(-50, 50)}), "color": enum("red", "green", "blue")}),
    obj({"items": arr(obj({"sku": s(6), "qty": i(1, 9)}), 1, 2), "total": num(0, 1000)}),
    obj({"title": s(20), "subtitle": s(20)}, required=["title"]),
    obj({"a": i(), "b": i(), "c": i()}, required=["b"]),
    obj({"note": {"anyOf": [s(), {"type": "null"}]}, "count": i(0, 5)}),
    obj({"kind": {"const": "event"}, "when": {"type": "string", "format": "date"}}),
    obj({"matrix": arr(arr(i(0, 9), 2, 2), 2, 2)}),
    {"$defs": {"person": obj({"name": s(), "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}})},
     **obj({"author": {"$ref": "#/$defs/person"}, "editor": {"$ref": "#/$defs/person"}}, required=["author"])},
    {"$defs": {"money": obj({"amount": num(0, 100), "currency": enum("USD", "EUR", "JPY")})},
     **obj({"price": {"$ref": "#/$defs/money"}, "discount": {"$ref": "#/$defs/money"}})},
    {"$defs": {"node": obj({"value": i(0, 9), "children": arr({"$ref": "#/$defs/node"}, 0, 2)}, required=["value"])},
     "$ref": "#/$defs/node"},
    arr(obj({"k": s(4), "v": i(0, 9)}), 1, 3),
    enum("alpha", "beta", "gamma", "delta"),
    obj({"flag": {"type": "boolean"}, "level": {"type": "integer", "enum": [1, 2, 3]}}),
    obj({"temperature": {"type": "number", "exclusiveMinimum": -10, "exclusiveMaximum": 40, "multipleOf": 0.5}}),
    obj({"meta": obj({"version": i(1, 3), "stable": {"type": "boolean"}}, required=[]), "name": s()}),
    obj({"pair": {"type": "array", "prefixItems": [s(5), i(0, 9)], "items": False, "minItems": 2}}),
]

_LEAVES = [lambda r: s(r.randint(3, 16)), lambda r: i(-r.randint(0, 100), r.randint(1, 1000)),
           lambda r: num(0, r.choice([1, 10, 100])), lambda r: {"type": "boolean"},
           lambda r: enum(*r.sample(["north", "south", "east", "west", "up", "down"], r.randint(2, 4))),
           lambda r: {"type": "string", "format": r.choice(["date", "uuid", "time"])},
           lambda r: {"anyOf": [i(0, 9), {"type": "null"}]}]
_NAMES = ["id", "name", "kind", "size", "price", "owner", "tags", "items", "when", "note", "rank", "code"]


def _value(r: random.Random, depth: int) -> dict:
    pick = r.random()
    if depth < 2 and pick < 0.25:
        return _object(r, depth + 1)
    if depth < 2 and pick < 0.4:
        return arr(_value(r, depth + 1), r.randint(0, 1), r.randint(1, 3))
    return r.choice(_LEAVES)(r)


def _object(r: random.Random, depth: int) -> dict:
    names = r.sample(_NAMES, r.randint(1, 4))
    props = {n: _value(r, depth) for n in names}
    return obj(props, required=[n for n in names if r.random() < 0.7])


def generated(count: int, seed: int = 26) -> list[dict]:
    """``count`` schemas built from the parts above; some share a ``$defs`` entry by ``$ref``."""
    r = random.Random(seed)
    out = []
    for k in range(count):
        schema = _object(r, 0)
        if k % 4 == 0:
            schema = {"$defs": {"part": _object(r, 1)}, **schema}
            schema["properties"]["part"] = {"$ref": "#/$defs/part"}
        out.append(schema)
    return out


def corpus() -> list[dict]:
    """The 60 schemas: the handwritten ones, then generated ones."""
    return HANDWRITTEN + generated(60 - len(HANDWRITTEN))
