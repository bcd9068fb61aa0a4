"""``inflight status``: the fleet view (common/fleet.py) as one table in the terminal, as
``ollama ps`` shows what runs; ``--watch`` redraws it every few seconds, ``--json`` prints
the same data for scripts (the shape of the gateway's ``GET /fleet``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

from common.fleet import FleetView, collect_fleet


def _duration(seconds: float) -> str:
    """``"3h 12m"``, ``"4m 05s"``, ``"12s"``."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(view: FleetView):
    """The fleet as one ``rich.table.Table``: a row per worker, the queues, the fleet's
    tokens per second and the 429s of the last minute in its caption."""
    from rich.table import Table

    table = Table(title=f"inflight fleet · {len(view.workers)} worker(s) · "
                        f"{time.strftime('%H:%M:%S', time.localtime(view.taken_unix_s))}",
                  title_justify="left", caption_justify="left")
    for name, justify in (("worker", "left"), ("model", "left"), ("batching", "left"), ("up", "right"),
                          ("running", "right"), ("waiting", "right"), ("KV cache", "right"),
                          ("prompt tok/s", "right"), ("gen tok/s", "right")):
        table.add_column(name, justify=justify, no_wrap=name not in ("worker", "model"), min_width=len(name))
    for w in view.workers:
        table.add_row(w.worker_id, w.model, w.batching, _duration(w.up_s), str(w.running), str(w.waiting),
                      f"{100 * w.kv_usage:.1f}%", _rate(w.prompt_tps), _rate(w.generation_tps))
    if not view.workers:
        table.add_row("(no worker has a heartbeat)", *[""] * 8)
    queues = " · ".join(f"p{p} {n}" for p, n in sorted(view.queue_depth.items()))
    rejected = ", ".join(f"{reason} {n}" for reason, n in sorted(view.rejections.items())) or "none"
    table.caption = (f"queued: {queues}\ntok/s over the last minute: prompt {view.prompt_tps:.1f}, "
                     f"generation {view.generation_tps:.1f}\n429s in the last minute: {rejected}")
    return table


async def _collect(redis_url: str, password: str | None) -> FleetView:
    import httpx

    from common.redis_connect import async_client

    client = async_client(redis_url, password, socket_timeout=5, socket_connect_timeout=5)
    try:
        async with httpx.AsyncClient() as http:
            return await collect_fleet(client, http)
    finally:
        await client.aclose()


def run_status(redis_url: str, password: str | None, as_json: bool, watch_s: float | None) -> int:
    """Print the fleet once (or every ``watch_s`` seconds until Ctrl-C); returns the exit code.

    Raises:
        redis.RedisError, OSError: Redis unreachable or refused the admin user (the caller
            prints one line).
    """
    if as_json and watch_s is None:
        print(json.dumps(asyncio.run(_collect(redis_url, password)).to_json(), indent=2))
        return 0
    if as_json:  # one JSON object per line, for a script that follows it
        while True:
            print(json.dumps(asyncio.run(_collect(redis_url, password)).to_json()), flush=True)
            time.sleep(watch_s)
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if not console.is_terminal:  # piped or in a log: rich's default 80 columns would cut the table
        console = Console(width=160)
    if watch_s is None:
        console.print(render(asyncio.run(_collect(redis_url, password))))
        return 0
    if not console.is_terminal:  # rich's Live draws nothing to a pipe or file until it stops
        while True:
            console.print(render(asyncio.run(_collect(redis_url, password))))
            console.file.flush()
            time.sleep(watch_s)
    with Live(render(asyncio.run(_collect(redis_url, password))), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(watch_s)
            live.update(render(asyncio.run(_collect(redis_url, password))), refresh=True)


def cmd_status(args) -> int:
    """``inflight status`` (see the module docstring)."""
    import redis

    from common.cli_args import admin_redis_url, redis_password_from, unreachable_redis_hint

    args.redis_url = admin_redis_url(args.redis_url, os.environ, "inflight status")
    if args.watch is not None:
        # "until Ctrl-C" must hold even when started from a background job of a non-interactive
        # shell, which starts it with SIGINT ignored (and Python then leaves it ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        password = redis_password_from(args.redis_password_file)
        return run_status(args.redis_url, password, args.json, args.watch)
    except ValueError as exc:
        print(f"inflight status: {exc}", file=sys.stderr)
        return 2
    except (redis.RedisError, OSError) as exc:
        print(f"inflight status: Redis at {args.redis_url} failed: {exc}; {unreachable_redis_hint()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
