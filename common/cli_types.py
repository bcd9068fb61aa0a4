"""argparse types shared by every command line (``inflight``, ``inflight bench``, the
benchmark scripts): no torch import, so the gateway and ``keys`` parse the same CLI."""

from __future__ import annotations

import argparse
import re

def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def auto_or_non_negative_int(text: str) -> int | None:
    """argparse type: ``auto`` (None: the program chooses) or an integer >= 0."""
    return None if text == "auto" else non_negative_int(text)


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
