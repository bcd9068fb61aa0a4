"""``--peer llama-server PATH``: llama.cpp's HTTP server with ``--parallel N``
slots (its own continuous batching), ``-t`` threads, the same GGUF file.

Driven through its OpenAI-compatible ``/v1/chat/completions`` (SSE) with
``max_tokens``/``n_predict`` and ``ignore_eos`` so it generates exactly the
workload's token counts. Weights stay in the GGUF's own quantization (Q4_1
for the default model): llama.cpp computes on the quantized blocks.
How to build the binary: bench/README.md.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.driver import drive
from bench.metrics import RunResult, occupancy_from_records
from bench.workloads import BenchRequest
from stack.clients import rest_chat_stream


@dataclass(frozen=True)
class LlamaServerSettings:
    """binary, gguf: paths; parallel: slots; threads: CPU threads; ctx_per_slot: tokens;
    port: TCP port on 127.0.0.1 (None: a free one); log: the server's stdout+stderr (appended);
    cache_prompt: llama-server's per-request prompt cache (its default, on), off when the engine
    it is compared with runs without its prefix cache, so both prefill every prompt whole."""

    binary: Path
    gguf: Path
    parallel: int = 32
    threads: int = 2
    ctx_per_slot: int = 1024
    port: int | None = None
    log: Path = Path("llama-server.log")
    cache_prompt: bool = True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve(s: LlamaServerSettings, ready_timeout_s: float = 300.0):
    """Start llama-server, wait for ``/health`` 200, yield its base URL, stop it.

    Raises:
        RuntimeError: the server exited, or was not healthy within ``ready_timeout_s`` seconds.
    """
    port = s.port or _free_port()
    cmd = [str(s.binary), "-m", str(s.gguf), "--parallel", str(s.parallel), "-t", str(s.threads),
           "-c", str(s.ctx_per_slot * s.parallel), "--host", "127.0.0.1", "--port", str(port)]
    s.log.parent.mkdir(parents=True, exist_ok=True)
    with open(s.log, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        _wait_healthy(proc, url, ready_timeout_s, s.log)
        load_s = time.monotonic() - started
        yield url
        from bench.memory import describe, resident_mib

        print(describe("llama-server", load_s, resident_mib(proc.pid), s.gguf) + " (after its run)", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
            raise RuntimeError(f"llama-server exited with {proc.returncode}; end of {log}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server not healthy after {timeout_s} s")


def run(s: LlamaServerSettings, requests: list[BenchRequest]) -> RunResult:
    """Serve ``requests`` with llama-server; occupancy counted client-side."""
    with serve(s) as url:
        async def send(req: BenchRequest):
            return await rest_chat_stream(url, "none", req.prompt, max_tokens=req.output_tokens,
                                          extra={"ignore_eos": True, "n_predict": req.output_tokens,
                                                 "cache_prompt": s.cache_prompt, **_messages(req)})
        records = asyncio.run(drive(send, requests))
    return RunResult("llama-server", "continuous", records, occupancy_from_records(records), s.parallel,
                     "gguf-native", f"{s.parallel} slots, -t {s.threads}; running counted client-side")


def _messages(req: BenchRequest) -> dict:
    """The request's chat turns where it has a system message (``--shared-prefix-tokens``), so
    llama-server prefills what the engine does; {} keeps the client's single user turn."""
    if not req.system:
        return {}
    return {"messages": [{"role": "system", "content": req.system}, {"role": "user", "content": req.prompt}]}
