"""Tool (function) calling: the request's ``tools``/``tool_choice`` checked into a
:class:`~gateway.tools.spec.ToolSpec` (``spec.py``), the Hermes-style tool prompt format
for models whose chat template has none (``prompt.py``, docs/TOOLS.md), and the parser
that turns the model's ``<tool_call>`` blocks into OpenAI ``tool_calls`` (``parser.py``)."""
