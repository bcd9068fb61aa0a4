"""The spelling of ``--device`` (no torch import: the gateway and ``keys`` parse the same CLI)."""

from __future__ import annotations

import argparse
import re

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
