"""One ConfigMap of text files for deploy/k8s, rendered and checked the same way by
``render_k8s_rules.py`` (Prometheus rules) and ``render_k8s_redis_acl.py`` (the Redis
ACL): each file a literal block under ``data``, its text unchanged, and a ``--check``
mode that tests/deploy and CI use to catch a stale committed copy."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path


def render_configmap(header: str, name: str, component: str, files: Iterable[Path]) -> str:
    """The ConfigMap text: ``header``, then metadata (``name``, the inflight labels with
    ``component``) and one key per file.

    Raises:
        ValueError: a file without a final newline, with a tab or a trailing space (the
            YAML literal block would not give back the same text).
    """
    out = [header, "apiVersion: v1\nkind: ConfigMap\nmetadata:\n", f"  name: {name}\n",
           f"  labels: {{app.kubernetes.io/name: inflight, app.kubernetes.io/component: {component}}}\n",
           "data:\n"]
    for path in files:
        text = path.read_text()
        if not text.endswith("\n") or "\t" in text or any(ln != ln.rstrip() for ln in text.splitlines()):
            raise ValueError(f"{path}: needs a final newline, no tabs and no trailing spaces")
        out.append(f"  {path.name}: |\n")
        out += [f"    {line}\n" if line else "\n" for line in text.splitlines()]
    return "".join(out)


def write_or_check(text: str, output: Path, script: str, description: str, argv: list[str] | None) -> int:
    """The command line of a render script: write ``text`` to ``output``, or with
    ``--check`` exit 1 when ``output`` differs from it. Returns the exit code."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file is stale")
    args = parser.parse_args(argv)
    if args.check:
        if not output.exists() or output.read_text() != text:
            print(f"{output} is stale: run python {script}", file=sys.stderr)
            return 1
        return 0
    output.write_text(text)
    print(f"wrote {output}")
    return 0
