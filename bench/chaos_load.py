"""The clients of the chaos soak (``bench/chaos.py``): one coroutine per request kind, each
ending in exactly one :class:`ChaosRecord` outcome, and resuming a broken stream the way a
real client would.

Kinds (``KINDS``; weights in ``MIX``):

* ``stream``: the ``openai`` client's chat stream, greedy, ``ignore_eos``, usage on every
  chunk (``continuous_usage_stats``: the chunk's ``usage.completion_tokens`` is the offset of
  its SSE ``id``); when the stream breaks (its gateway was killed) it is resumed through
  nginx with ``Last-Event-ID: <x-request-id>/<offset>`` (docs/API.md "Resuming a stream"),
  up to ``MAX_RESUMES`` times; the joined text is checked against the reference.
* ``complete``: the ``openai`` client, non-streaming, greedy, checked against the reference.
* ``n2``: the ``openai`` client, ``n`` = 2, sampled (seeded), both choices' token counts checked.
* ``structured``: the ``openai`` client with a JSON-schema ``response_format``; the answer
  must parse and have the schema's key.
* ``grpc``: ``inflight.v1.Inference/Generate`` through nginx, greedy; on a broken stream
  ``Resume(request_id, offset)`` through nginx; checked against the reference.
* ``cancel``: an ``openai`` stream the client closes after a random delay (outcome
  ``cancelled``).
* ``deadline``: a gRPC call with a deadline shorter than its output takes (outcome
  ``completed`` or ``failed`` with ``grpc DEADLINE_EXCEEDED``).

Fault clients (``bench/chaos_faults.py`` starts them): ``slow`` reads one SSE chunk a second;
``stalled`` stops reading without closing; ``squeeze`` sends a long prompt.

Outcomes: ``completed``; ``cancelled`` (by the client, on purpose); ``failed`` with a clear
error (an HTTP status with an OpenAI error body, an SSE error event, a gRPC status);
``ended`` (a stalled stream the gateway ended, as designed); ``lost``: anything else (a
broken connection that could not be resumed, a stream ended without a finish, hung past
``deadline_s``). Token checks: a greedy answer is compared, token by token (the model's
tokenizer), with an unbroken greedy run of the same prompt: ``extra_tokens`` (tokens that are
not the reference's: a token delivered twice shows here) and ``missing_tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import json
import socket
import time
from dataclasses import dataclass, field

import grpc
import httpx
import openai

from protos import common_pb2, inference_pb2, inference_pb2_grpc

KINDS = ("stream", "complete", "n2", "structured", "grpc", "cancel", "deadline")
MIX = {"stream": 0.30, "complete": 0.15, "n2": 0.08, "structured": 0.10, "grpc": 0.22, "cancel": 0.08,
       "deadline": 0.07}
MAX_RESUMES = 3
STALLED_RCVBUF = 8192  # bytes: the stalled reader's socket receive buffer (SO_RCVBUF)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
          "required": ["city"], "additionalProperties": False}


@dataclass
class ChaosRecord:
    """One request of the soak. Times in seconds from the start of the run."""

    rid: str
    kind: str
    sent_s: float
    max_tokens: int
    prompt_index: int = -1
    outcome: str = "lost"
    code: str = ""
    end_s: float = 0.0
    completion_tokens: int = 0
    resumes: int = 0
    server_id: str = ""
    checked: bool = False      # compared with the greedy reference
    extra_tokens: int = 0
    missing_tokens: int = 0
    note: str = ""


@dataclass
class Endpoints:
    """Where and how the clients send: nginx's REST base URL and gRPC address, the API key,
    the model name, the reference texts by (transport, prompt index), a tokenizer
    (``encode(text) -> list[int]``) for the token checks."""

    rest: str
    grpc: str
    key: str
    model: str
    prompts: list[str]
    max_tokens: int
    references: dict = field(default_factory=dict)
    encode: object = None
    deadline_s: float = 240.0


def openai_client(ends: Endpoints, timeout_s: float | None = None) -> openai.AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` on nginx's REST port (no retries: every failure is counted)."""
    return openai.AsyncOpenAI(base_url=f"{ends.rest}/v1", api_key=ends.key, max_retries=0,
                              timeout=timeout_s or ends.deadline_s)


def check_tokens(record: ChaosRecord, ends: Endpoints, transport: str, text: str) -> None:
    """Compare a greedy answer with the reference (same prompt, same transport, unbroken run)."""
    reference = ends.references.get((transport, record.prompt_index))
    if reference is None or ends.encode is None:
        return
    record.checked = True
    if text == reference:
        return
    got, want = ends.encode(text), ends.encode(reference)
    matcher = difflib.SequenceMatcher(a=want, b=got, autojunk=False)
    same = sum(block.size for block in matcher.get_matching_blocks())
    record.extra_tokens, record.missing_tokens = len(got) - same, len(want) - same
    record.note = (f"text differs from the reference at char "
                   f"{next((i for i, (a, b) in enumerate(zip(text, reference)) if a != b), min(len(text), len(reference)))}")


def fail(record: ChaosRecord, code: str, note: str = "") -> None:
    """Mark ``record`` failed with a clear error ``code``."""
    record.outcome, record.code, record.note = "failed", code, note[:200]


def classify_exception(record: ChaosRecord, exc: BaseException) -> None:
    """An exception that ended a request: a clear error (HTTP status with an error body, an SSE
    error event, a gRPC status) or a lost request (a connection that broke without one)."""
    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        err = body.get("error", body) if isinstance(body, dict) else {}
        code = (err.get("code") or err.get("type")) if isinstance(err, dict) else None
        fail(record, f"http {exc.status_code} {code or ''}".strip(), str(exc))
    elif isinstance(exc, openai.APIError) and not isinstance(exc, openai.APIConnectionError):
        body = exc.body if isinstance(exc.body, dict) else {}
        fail(record, f"stream error {body.get('code') or body.get('type') or ''}".strip(), str(exc))
    elif isinstance(exc, grpc.aio.AioRpcError):
        fail(record, f"grpc {exc.code().name}", exc.details() or "")
    elif isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        record.outcome, record.code = "lost", "hung past its deadline"
    else:
        record.outcome, record.code, record.note = "lost", f"transport {type(exc).__name__}", str(exc)[:200]


def _chat_body(ends: Endpoints, record: ChaosRecord, **extra) -> dict:
    return dict(model=ends.model, messages=[{"role": "user", "content": ends.prompts[record.prompt_index]}],
                max_tokens=record.max_tokens, temperature=0, **extra)


async def run_cancelled(ends: Endpoints, client: openai.AsyncOpenAI, record: ChaosRecord,
                        cancel_after_s: float) -> None:
    """``cancel``: a ``stream`` the client abandons (closes) ``cancel_after_s`` after sending,
    queued or running; ``completed`` when it ended before."""
    try:
        await asyncio.wait_for(run_stream(ends, client, record), cancel_after_s)
    except asyncio.TimeoutError:
        record.outcome, record.code = "cancelled", ""


async def run_stream(ends: Endpoints, client: openai.AsyncOpenAI, record: ChaosRecord) -> None:
    """``stream``: see the module docstring."""
    body = _chat_body(ends, record, stream=True, stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True},
                      extra_body={"ignore_eos": True})
    text, offset, finish, headers = [], 0, None, {}
    while True:
        try:
            raw = await client.chat.completions.with_raw_response.create(**body, extra_headers=headers)
            record.server_id = record.server_id or raw.headers.get("x-request-id", "")
            stream = raw.parse()
            try:
                async for chunk in stream:
                    for choice in chunk.choices:
                        text.append(choice.delta.content or "")
                        finish = choice.finish_reason or finish
                    if chunk.usage is not None:
                        offset = chunk.usage.completion_tokens
            finally:
                await stream.close()
            break
        except (openai.APIConnectionError, httpx.TransportError) as exc:
            # the connection broke mid-stream (its gateway died): resume through nginx
            if not record.server_id or record.resumes >= MAX_RESUMES:
                classify_exception(record, exc)
                return
            record.resumes += 1
            headers = {"Last-Event-ID": f"{record.server_id}/{offset}"}
            await asyncio.sleep(0.2 * record.resumes)
        except Exception as exc:  # noqa: BLE001 - a clear error or a lost request: counted
            classify_exception(record, exc)
            return
    record.completion_tokens = offset
    if finish is None:
        record.outcome, record.code = "lost", "stream ended without finish_reason or error"
        return
    record.outcome = "completed"
    check_tokens(record, ends, "rest", "".join(text))


async def run_complete(ends: Endpoints, client: openai.AsyncOpenAI, record: ChaosRecord) -> None:
    """``complete``: non-streaming greedy, checked against the reference."""
    try:
        raw = await client.chat.completions.with_raw_response.create(**_chat_body(ends, record),
                                                                      extra_body={"ignore_eos": True})
        record.server_id = raw.headers.get("x-request-id", "")
        answer = raw.parse()
    except Exception as exc:  # noqa: BLE001
        classify_exception(record, exc)
        return
    record.completion_tokens = answer.usage.completion_tokens
    record.outcome = "completed"
    check_tokens(record, ends, "rest", answer.choices[0].message.content or "")


async def run_n2(ends: Endpoints, client: openai.AsyncOpenAI, record: ChaosRecord, seed: int) -> None:
    """``n2``: two sampled choices in one request; each must have ``max_tokens`` tokens."""
    body = _chat_body(ends, record, n=2, seed=seed)
    body["temperature"] = 0.8
    answer = await _completed(client, record, body)
    if answer is None:
        return
    if len(answer.choices) != 2 or record.completion_tokens != 2 * record.max_tokens:
        record.note = f"{len(answer.choices)} choices, {record.completion_tokens} tokens"
        _count_against(record, 2 * record.max_tokens)


async def _completed(client: openai.AsyncOpenAI, record: ChaosRecord, body: dict):
    """One non-streaming chat request (``ignore_eos``): the answer, with ``record`` completed
    and its tokens counted; None when it failed (``record`` classified)."""
    try:
        answer = await client.chat.completions.create(**body, extra_body={"ignore_eos": True})
    except Exception as exc:  # noqa: BLE001
        classify_exception(record, exc)
        return None
    record.completion_tokens = answer.usage.completion_tokens
    record.outcome = "completed"
    return answer


def _count_against(record: ChaosRecord, expected: int) -> None:
    """The tokens ``record`` is short of ``expected``, or has beyond it."""
    record.missing_tokens = max(0, expected - record.completion_tokens)
    record.extra_tokens = max(0, record.completion_tokens - expected)


async def run_structured(ends: Endpoints, client: openai.AsyncOpenAI, record: ChaosRecord) -> None:
    """``structured``: a JSON-schema answer that must parse with its required key."""
    body = _chat_body(ends, record)
    body["messages"] = [{"role": "user", "content": "Name a city in France as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    try:
        answer = await client.chat.completions.create(**body, response_format=fmt)
    except Exception as exc:  # noqa: BLE001
        classify_exception(record, exc)
        return
    record.completion_tokens = answer.usage.completion_tokens
    try:
        ok = "city" in json.loads(answer.choices[0].message.content or "")
    except ValueError:
        ok = False
    if answer.choices[0].finish_reason == "length":
        ok = True  # a length cut is the client's max_tokens, not a fault
    record.outcome = "completed" if ok else "lost"
    record.code = "" if ok else "structured answer does not match its schema"


def _grpc_request(ends: Endpoints, record: ChaosRecord) -> inference_pb2.GenerateRequest:
    """The record's Generate request, with its own ``request_id`` (so a stream broken before its
    first message can be resumed too)."""
    return inference_pb2.GenerateRequest(
        request_id=f"chaos-{record.rid}",
        chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(
            role="user", content=ends.prompts[record.prompt_index])]),
        sampling=common_pb2.SamplingParams(max_tokens=record.max_tokens, temperature=0.0, ignore_eos=True))


async def run_grpc(ends: Endpoints, channel: grpc.aio.Channel, record: ChaosRecord,
                   timeout_s: float | None = None) -> None:
    """``grpc`` (and ``deadline`` with ``timeout_s``): Generate, resumed with Resume when broken."""
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = _grpc_request(ends, record)
    metadata = (("authorization", f"Bearer {ends.key}"),)
    text, offset, finish = [], 0, None
    record.server_id = request.request_id
    call_timeout = timeout_s or ends.deadline_s
    started = time.monotonic()
    while True:
        try:
            if offset == 0 and record.resumes == 0:
                call = stub.Generate(request, timeout=call_timeout, metadata=metadata)
            else:
                call = stub.Resume(inference_pb2.ResumeRequest(request_id=record.server_id, offset=offset,
                                                               request=request),
                                   timeout=max(0.1, call_timeout - (time.monotonic() - started)), metadata=metadata)
            async for message in call:
                text.append(message.text)
                offset += len(message.token_ids)
                if message.finish_reason:
                    finish = message.finish_reason
                    record.completion_tokens = message.usage.completion_tokens
            break
        except grpc.aio.AioRpcError as exc:
            broken = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
            # a broken stream (not an answer of the gateway's): resume through nginx
            if broken and record.server_id and record.resumes < MAX_RESUMES and _from_transport(exc):
                record.resumes += 1
                await asyncio.sleep(0.2 * record.resumes)
                continue
            classify_exception(record, exc)
            return
        except Exception as exc:  # noqa: BLE001
            classify_exception(record, exc)
            return
    if finish is None:
        record.outcome, record.code = "lost", "stream ended without finish_reason or error"
        return
    record.outcome = "completed"
    if timeout_s is None:
        check_tokens(record, ends, "grpc", "".join(text))


def _from_transport(exc: grpc.aio.AioRpcError) -> bool:
    """True when a gRPC error is a broken connection or nginx's "gateway unavailable", not a
    status the gateway chose (which carries its own message)."""
    details = (exc.details() or "").lower()
    return any(s in details for s in ("socket closed", "connection reset", "rst_stream", "unavailable",
                                      "stream removed", "broken pipe", "eof", "connection", "received http2"))


async def run_slow_reader(ends: Endpoints, record: ChaosRecord, chunk_every_s: float = 1.0) -> None:
    """``slow``: a raw SSE stream read one chunk (one ``data:`` event) a second."""
    body = {**_chat_body(ends, record, stream=True), "ignore_eos": True}
    text, finish = [], None
    try:
        async with httpx.AsyncClient(timeout=ends.deadline_s) as client:
            async with client.stream("POST", f"{ends.rest}/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {ends.key}"}) as resp:
                record.server_id = resp.headers.get("x-request-id", "")
                if resp.status_code != 200:
                    fail(record, f"http {resp.status_code}", (await resp.aread()).decode()[:200])
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        fail(record, f"stream error {chunk['error'].get('code')}", str(chunk["error"]))
                        return
                    for choice in chunk.get("choices", []):
                        text.append((choice.get("delta") or {}).get("content") or "")
                        finish = choice.get("finish_reason") or finish
                        record.completion_tokens += 1 if (choice.get("delta") or {}).get("content") else 0
                    await asyncio.sleep(chunk_every_s)
    except Exception as exc:  # noqa: BLE001
        classify_exception(record, exc)
        return
    if finish is None:
        record.outcome, record.code = "lost", "stream ended without finish_reason or error"
        return
    record.outcome = "completed"
    check_tokens(record, ends, "rest", "".join(text))


async def run_stalled_reader(ends: Endpoints, record: ChaosRecord, cancelled, give_up_s: float) -> float | None:
    """``stalled``: read the first chunk, then stop reading without closing until ``cancelled()``
    (a coroutine function: True once a gateway logged this stream's idle cancel) or
    ``give_up_s``. Each chunk carries 20 top logprobs (a few KB), so the socket buffers
    (hundreds of KB on loopback, through nginx) fill within tens of tokens and the gateway's
    sends block. Then it reads what is left: outcome ``ended`` when the gateway cancelled the
    stream (as designed: no ``[DONE]``); ``completed`` (noted) when the whole stream fit in the
    buffers and ended normally; ``lost`` otherwise. Returns the seconds from the last read to
    the cancel (None: not seen)."""
    body = {**_chat_body(ends, record, stream=True), "ignore_eos": True, "logprobs": True, "top_logprobs": 20}
    # A small fixed receive buffer, as a phone on a bad link has: loopback's autotuned one grows to
    # tcp_rmem's maximum (32 MB here) and would hold the whole stream.
    small = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, STALLED_RCVBUF)])
    try:
        async with httpx.AsyncClient(timeout=ends.deadline_s, transport=small) as client:
            async with client.stream("POST", f"{ends.rest}/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {ends.key}"}) as resp:
                record.server_id = resp.headers.get("x-request-id", "")
                if resp.status_code != 200:
                    fail(record, f"http {resp.status_code}", (await resp.aread()).decode()[:200])
                    return None
                lines = resp.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                stopped, seen = time.monotonic(), None
                while time.monotonic() - stopped < give_up_s:
                    if await cancelled(record.server_id):
                        seen = time.monotonic() - stopped
                        break
                    await asyncio.sleep(0.5)
                done, error, finish, buffered, drained_at = False, "", None, 0, time.monotonic()
                with contextlib.suppress(httpx.HTTPError, asyncio.TimeoutError, ValueError):
                    async with asyncio.timeout(30):
                        async for line in lines:
                            if time.monotonic() - drained_at < 1.0:  # what sat unread in the buffers
                                buffered += len(line) + 1
                            if line == "data: [DONE]":
                                done = True
                            elif line.startswith("data: "):
                                chunk = json.loads(line[6:])
                                error = error or str((chunk.get("error") or {}).get("code") or "")
                                for choice in chunk.get("choices", []):
                                    finish = choice.get("finish_reason") or finish
                if error:  # the gateway ended it with an error event (slow_consumer: its buffer bound)
                    record.outcome, record.code = "ended", f"stream error {error}"
                elif seen is not None and not done:
                    record.outcome, record.code = "ended", "cancelled unread (gateway idle timeout or edge send_timeout)"
                elif done and finish:
                    record.outcome, record.note = "completed", "the whole stream fit in the socket buffers"
                else:  # still generating: the client gives up and closes (the gateway then cancels)
                    record.outcome, record.code = "cancelled", f"stalled reader gave up after {give_up_s:.0f} s"
                    record.note = (f"the gateway had not cancelled it: {buffered / 1024:.0f} KB sat unread in the "
                                   "buffers (its sends block only once they are full)")
                return seen
    except Exception as exc:  # noqa: BLE001
        classify_exception(record, exc)
        return None


async def run_squeeze(ends: Endpoints, client: openai.AsyncOpenAI, record: ChaosRecord, prompt: str) -> None:
    """``squeeze``: a long prompt (KV-cache pressure), non-streaming, greedy."""
    body = {"model": ends.model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": record.max_tokens, "temperature": 0}
    if await _completed(client, record, body) is not None:
        _count_against(record, record.max_tokens)


@contextlib.asynccontextmanager
async def clients(ends: Endpoints):
    """One ``openai.AsyncOpenAI`` and one gRPC channel (through nginx) for every request."""
    client = openai_client(ends)
    channel = grpc.aio.insecure_channel(ends.grpc)
    try:
        yield client, channel
    finally:
        await channel.close()
        await client.close()
