"""Options every benchmark shares, declared once: where a run's files go.

Every ``inflight bench`` subcommand that writes a stamped CSV (and PNG) takes ``--out``
from here, so the default is the one folder of committed runs, ``bench/results`` beside
this file, wherever the command is started (it was ``./bench/results`` of the current
directory in eight of them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: The folder of committed benchmark runs (bench/RESULTS.md links them; kept out of the
#: wheel and the images, see pyproject.toml and .dockerignore).
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_out_option(parser: argparse.ArgumentParser, what: str = "the stamped CSV (and PNG)") -> None:
    """``--out DIR``: the folder of ``what`` (default :data:`RESULTS_DIR`)."""
    parser.add_argument("--out", type=Path, default=RESULTS_DIR,
                        help=f"folder of {what} (default: bench/results)")
