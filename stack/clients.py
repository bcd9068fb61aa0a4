"""Small streaming clients for the demo and the benchmark: REST (SSE, OpenAI
chat-completions format) with httpx and gRPC ``inflight.v1.Inference/Generate``.

Both measure TTFT (seconds from sending to the first non-empty text) and the
end-to-end latency, and report completion tokens from the final ``usage``.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field

import grpc
import httpx

from protos import common_pb2, inference_pb2, inference_pb2_grpc

STREAM_TIMEOUT_S = 600.0  # default limit on one streamed request, seconds


@dataclass
class StreamResult:
    """One streamed answer. Times in seconds; ``token_times`` are arrival times of deltas."""

    transport: str
    prompt: str
    text: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Decode rate after the first token: (completion tokens − 1) / (e2e − TTFT)."""
        if self.ttft_s is None or self.completion_tokens < 2 or self.e2e_s <= self.ttft_s:
            return 0.0
        return (self.completion_tokens - 1) / (self.e2e_s - self.ttft_s)


async def rest_chat_stream(base_url: str, api_key: str, prompt: str, max_tokens: int = 128,
                           temperature: float = 0.0, extra: dict | None = None,
                           timeout_s: float = STREAM_TIMEOUT_S, result: StreamResult | None = None,
                           client: httpx.AsyncClient | None = None) -> StreamResult:
    """Stream ``POST {base_url}/v1/chat/completions``; errors are returned in ``.error``
    (``HTTP <status>: <body>`` before the stream, ``stream error <code>: …`` during it).
    Pass ``result`` to watch the answer grow while it streams, ``client`` to reuse its
    connections (else one client per call)."""
    body = {"model": "", "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": temperature,
            "stream_options": {"include_usage": True}, **(extra or {})}
    result = result or StreamResult("rest", prompt)
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {api_key}"}
    async with contextlib.AsyncExitStack() as owned:
        if client is None:
            client = await owned.enter_async_context(httpx.AsyncClient(timeout=timeout_s))
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                                 headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                _apply_sse_chunk(result, json.loads(line[6:]), time.perf_counter() - start)
    result.e2e_s = time.perf_counter() - start
    return result


def _apply_sse_chunk(result: StreamResult, chunk: dict, now_s: float) -> None:
    """Fold one SSE ``data:`` object into ``result``. A mid-stream failure arrives as
    ``{"error": {...}}`` (OpenAI shape) and is recorded in ``result.error``."""
    error = chunk.get("error")
    if isinstance(error, dict):
        result.error = f"stream error {error.get('code') or error.get('type')}: {error.get('message', '')}"
        return
    for choice in chunk.get("choices", []):
        text = (choice.get("delta") or {}).get("content") or ""
        if text:
            if result.ttft_s is None:
                result.ttft_s = now_s
            result.text += text
            result.token_times.append(now_s)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if usage:
        result.completion_tokens = usage.get("completion_tokens", 0)
        result.prompt_tokens = usage.get("prompt_tokens", 0)


async def grpc_chat_stream(address: str, api_key: str, prompt: str, max_tokens: int = 128,
                           temperature: float = 0.0, timeout_s: float = STREAM_TIMEOUT_S,
                           ignore_eos: bool = False, result: StreamResult | None = None,
                           channel: grpc.aio.Channel | None = None) -> StreamResult:
    """Stream ``inflight.v1.Inference/Generate`` at ``address`` (host:port, plaintext HTTP/2);
    ``ignore_eos`` makes it generate exactly ``max_tokens`` (benchmarks). Pass ``result``
    to watch the answer grow while it streams, ``channel`` to multiplex the call on an
    open channel (else one channel per call)."""
    result = result or StreamResult("grpc", prompt)
    request = inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content=prompt)]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                           ignore_eos=ignore_eos))
    start = time.perf_counter()
    async with contextlib.AsyncExitStack() as owned:
        if channel is None:
            channel = await owned.enter_async_context(grpc.aio.insecure_channel(address))
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            async for message in stub.Generate(request, timeout=timeout_s,
                                               metadata=(("authorization", f"Bearer {api_key}"),)):
                now = time.perf_counter() - start
                if message.text:
                    if result.ttft_s is None:
                        result.ttft_s = now
                    result.text += message.text
                    result.token_times.append(now)
                if message.finish_reason:
                    result.finish_reason = common_pb2.FinishReason.Name(message.finish_reason).removeprefix("FINISH_REASON_").lower()
                    result.completion_tokens = message.usage.completion_tokens
                    result.prompt_tokens = message.usage.prompt_tokens
        except grpc.aio.AioRpcError as exc:
            result.error = f"{exc.code().name}: {exc.details()}"
    result.e2e_s = time.perf_counter() - start
    return result
