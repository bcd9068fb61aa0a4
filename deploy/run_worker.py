"""Container entry point of the worker: ``inflight worker`` with /health, /ready
and /metrics bound to every interface.

``WorkerSettings.health_host`` defaults to 127.0.0.1 and the ``inflight worker``
command has no flag for it, so Prometheus (another container) and the kubelet
(the pod IP) could not reach port 9100. This script parses exactly the
``inflight worker`` arguments and changes only that field
(``INFLIGHT_WORKER_HEALTH_HOST``, default 0.0.0.0). Drop it once the CLI grows
``--health-host``.

    python /app/deploy/run_worker.py --redis-url redis://redis:6379/0 --dtype auto
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace


def main(argv: list[str] | None = None) -> int:
    from inflight.cli import _worker_settings, build_parser
    from worker.main import run_worker

    args = build_parser().parse_args(["--log-level", os.environ.get("INFLIGHT_LOG_LEVEL", "INFO"),
                                      "worker", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = replace(_worker_settings(args),
                       health_host=os.environ.get("INFLIGHT_WORKER_HEALTH_HOST", "0.0.0.0"))
    return run_worker(settings) or 0


if __name__ == "__main__":
    sys.exit(main())
