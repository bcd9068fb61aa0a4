"""Parse a source file for the import-rule tests, around a CPython 3.11 bug.

CPython before 3.11.8 can raise ``SystemError: AST constructor recursion depth
mismatch`` from ``ast.parse`` when other threads run Python meanwhile (gh-106905,
fixed in 3.11.8 and 3.12): the converter kept its recursion depth in state other
threads also touch. The suite's session fixtures keep gateway and worker threads
running, and a CI run on 3.11.7 hit it once in tests/gateway/test_import_boundary.py.
The parse is pure, so a retry gives the real answer.
"""

from __future__ import annotations

import ast
from pathlib import Path

ATTEMPTS = 5


def parse_file(path: Path) -> ast.Module:
    """``ast.parse`` of ``path``'s text, retried on the interpreter's spurious SystemError.

    Raises:
        SyntaxError: the file does not parse; SystemError: it failed ``ATTEMPTS`` times.
    """
    text = path.read_text(encoding="utf-8")
    for attempt in range(ATTEMPTS):
        try:
            return ast.parse(text, str(path))
        except SystemError:
            if attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
