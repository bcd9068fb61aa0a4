"""argparse types shared by every command line (``inflight``, ``inflight bench``, the
benchmark scripts): no torch import, so the gateway and ``keys`` parse the same CLI."""

from __future__ import annotations

import argparse
import re

def _integer(text: str, expected: str) -> int:
    """``text`` as an int; argparse's own message for a ValueError would name this module's
    function (``invalid non_negative_int value``), so say what was expected instead.

    Raises:
        argparse.ArgumentTypeError: not an integer."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _integer(text, "an integer >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _integer(text, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def auto_or_non_negative_int(text: str) -> int | None:
    """argparse type: ``auto`` (None: the program chooses) or an integer >= 0."""
    if text == "auto":
        return None
    value = _integer(text, "auto or an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be auto or >= 0, got {value}")
    return value


_SPEC = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def device_spec(text: str) -> str:
    """argparse ``type`` of ``--device``: checks the spelling only (``auto``,
    ``cpu``, ``cuda``, ``cuda:N``) and lower-cases it, without touching CUDA.

    Raises:
        argparse.ArgumentTypeError: any other text.
    """
    spec = text.strip().lower()
    if not _SPEC.fullmatch(spec):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of auto, cpu, cuda, cuda:N")
    return spec
