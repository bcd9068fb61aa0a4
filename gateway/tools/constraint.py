"""The grammar that enforces ``tool_choice`` ``required`` or a named function.

The output must be Hermes-format calls (docs/TOOLS.md) and nothing else:
``<tool_call>\\n{"name":"<name>","arguments":<arguments>}\\n</tool_call>``, one call for a
named function or with ``parallel_tool_calls: false``, else one or more separated by a
newline. It is a Lark grammar in llguidance's dialect
(``common.structured_outputs.StructuredOutputs.from_grammar``; syntax:
https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md) in which each
function's ``parameters`` is its own inline ``%json`` schema, so ``$ref``/``$defs`` inside
it resolve as in the client's schema, and the arguments always validate against it. JSON
inside a call is written without whitespace (llguidance's ``whitespace_flexible: false``,
as ``common.structured_outputs.JSON_OPTIONS``), unless the schema sets ``x-guidance`` itself.
"""

from __future__ import annotations

import json

from common.structured_outputs import StructuredOutputs
from gateway.admission.closed_schema import close_schema
from gateway.tools.spec import ToolFunction, ToolSpec

_NO_WHITESPACE = {"whitespace_flexible": False}
_AFTER_NAME = '","arguments":'  # what follows the name inside the call object


def tool_call_constraint(spec: ToolSpec, parallel: bool = True) -> StructuredOutputs | None:
    """The constraint for ``spec``, or None when its choice (``auto``, ``none``) leaves
    the output free.

    Args:
        spec: the request's tools and choice.
        parallel: more than one call allowed (OpenAI's ``parallel_tool_calls``); a named
            function always gets exactly one.
    """
    if not spec.must_call:
        return None
    functions = spec.callable()
    # each rule: the rest of the name, the arguments' key, and the function's own schema
    rules = [f"f{i}: {_json_string(f.name + _AFTER_NAME)} %json {arguments_schema_text(f)}"
             for i, f in enumerate(functions)]
    one_of = " | ".join(f"f{i}" for i in range(len(functions)))
    start = "start: call" if spec.forced is not None or not parallel else 'start: call ("\\n" call)*'
    call = f'call: "<tool_call>\\n{{\\"name\\":\\"" ({one_of}) "}}\\n</tool_call>"'
    return StructuredOutputs.from_grammar("\n".join([start, call, *rules]) + "\n")


def arguments_schema_text(function: ToolFunction) -> str:
    """The arguments' schema as enforced: closed, every property required under ``strict``
    (``gateway.admission.closed_schema``), compact JSON without whitespace."""
    schema = close_schema(dict(function.parameters), function.strict, function.name)
    schema.setdefault("x-guidance", _NO_WHITESPACE)
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _json_string(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escaping is Lark's)."""
    return json.dumps(text, ensure_ascii=False)
