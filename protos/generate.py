"""Regenerate the Python stubs from ``protos/*.proto`` with grpcio-tools.

Usage: ``python -m protos.generate [OUT_DIR]`` (default: the repository root, so
the stubs land beside their ``.proto`` files as ``protos/*_pb2*.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) on every proto file, writing ``*_pb2.py``,
    ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_dir/protos``.

    Raises:
        RuntimeError: when protoc reports an error.
    """
    from grpc_tools import protoc  # dev dependency, imported only here

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
