"""Build the CPU kernels ahead of the first worker start: ``python -m kernels.cpu.build``
(run by ``make install`` and the worker image). Exit status 1 when they are not
available on this machine (the worker would fall back to the torch paths)."""

from __future__ import annotations

import logging
import sys

from kernels.cpu import ops as cpu_ops


def main() -> int:
    """Build (or find) the extension, run its smoke check, print where it lives."""
    logging.basicConfig(level=logging.INFO)
    ok = cpu_ops.available()
    print(f"CPU kernels {'built' if ok else 'NOT available'} in {cpu_ops.build_dir()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
