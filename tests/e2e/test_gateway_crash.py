"""A gateway SIGKILLed mid-stream costs its client nothing (issue 49 items 2 and 4): behind
real nginx with two gateways, the ``openai`` client's stream is broken by the kill, the
worker aborts the request and frees its KV (its link is gone), and the client's SSE
reconnect with ``Last-Event-ID`` through nginx lands on the other gateway, which continues
the request from the stream's journal in Redis: the joined text is an unbroken greedy run's."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request

import httpx
import openai
import pytest

from common.promtext import sample_sum
from stack.edge import EdgeSettings, nginx_binary, start_nginx, write_config
from tests.e2e.procs import create_key, kill_all
from tests.e2e.test_readiness import spawn, status, wait_until
from tests.helpers.redis_server import free_port, start_redis
from tests.helpers.sse import sse_events

pytestmark = pytest.mark.e2e
MAX_TOKENS = 40
BODY = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def _metric(url: str, name: str) -> float:
    return sample_sum(urllib.request.urlopen(url, timeout=5).read().decode(), name)


def _edge(tmp_path, rest_ports: list[int], grpc_port: int):
    """nginx in front of every gateway in ``rest_ports`` (one upstream, round robin)."""
    settings = EdgeSettings(run_dir=str(tmp_path / "edge"), rest_port_edge=free_port(), grpc_port_edge=free_port(),
                            rest_port=rest_ports[0], grpc_port=grpc_port, ip_rate=1000, ip_burst=1000,
                            key_rate=1000, key_burst=1000)
    conf = write_config(settings)
    text = conf.read_text()
    one = f"server 127.0.0.1:{rest_ports[0]};"
    assert one in text
    conf.write_text(text.replace(one, " ".join(f"server 127.0.0.1:{p};" for p in rest_ports), 1))
    original = write_config
    import stack.edge as edge  # start_nginx rewrites the config: keep ours

    edge.write_config = lambda s: conf
    try:
        return settings, start_nginx(settings)
    finally:
        edge.write_config = original


def test_gateway_sigkill_mid_stream_frees_kv_and_the_client_resumes_through_the_other(tmp_path):
    if nginx_binary() is None:
        pytest.fail("nginx is required for the end-to-end tests (.ci/run installs it)")
    server = start_redis()
    health = free_port()
    rest_ports = [free_port(), free_port()]
    procs = [spawn(["worker", "--redis-url", server.url, "--health-port", str(health), "--grpc-health-port",
                    str(free_port()), "--dtype", "float32", "--kv-cache-mib", "64", "--warmup-tokens", "16"],
                   tmp_path / "worker.log")]
    gateways = [spawn(["gateway", "--redis-url", server.url, "--rest-port", str(port), "--grpc-port",
                       str(free_port()), "--link-port", str(free_port())], tmp_path / f"gateway-{i}.log")
                for i, port in enumerate(rest_ports)]
    procs += gateways
    nginx = None
    try:
        for port in rest_ports:
            wait_until(lambda: status(f"http://127.0.0.1:{port}/ready") == 200, 120, "the gateways")
        edge, nginx = _edge(tmp_path, rest_ports, free_port())
        key = create_key(server.url)
        base = f"http://127.0.0.1:{edge.rest_port_edge}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        args = {k: v for k, v in BODY.items() if k != "stream"}

        reference = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            stream=True, extra_body={"ignore_eos": True}, **args) if c.choices)

        raw = client.chat.completions.with_raw_response.create(stream=True, extra_body={"ignore_eos": True}, **args)
        request_id = raw.headers["x-request-id"]
        got, offset = [], 0
        stream = raw.parse()
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
            offset = chunk.usage.completion_tokens  # the offset in the chunk's SSE id
            if len(got) == 8:
                break
        owner = [i for i, port in enumerate(rest_ports)
                 if _metric(f"http://127.0.0.1:{port}/metrics", "inflight_gateway_waiting_clients") == 1]
        assert len(owner) == 1, owner
        worker_metrics = f"http://127.0.0.1:{health}/metrics"
        assert _metric(worker_metrics, "inflight_requests_running") == 1
        aborted = _metric(worker_metrics, "inflight_requests_aborted_total")
        gateways[owner[0]].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: _metric(worker_metrics, "inflight_requests_running") == 0, 5, "the worker to free the KV")
        freed_s = time.monotonic() - killed
        stream.close()
        # Freed because its link went, not because the request ran to its end: it counts as
        # aborted (a count; a 1 s bound raced the request's own end on a loaded machine).
        assert _metric(worker_metrics, "inflight_requests_aborted_total") == aborted + 1, freed_s

        r = httpx.post(f"{base}/v1/chat/completions", json={**BODY, "ignore_eos": True}, timeout=60,
                       headers={"Authorization": f"Bearer {key}", "Last-Event-ID": f"{request_id}/{offset}"})
        assert r.status_code == 200, r.text
        events = sse_events(r.text)
        assert events[-1]["data"] == "[DONE]"
        chunks = [json.loads(e["data"]) for e in events[:-1]]
        rest = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert "".join(got) + rest == reference  # nothing repeated, nothing lost
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        survivor = (tmp_path / f"gateway-{1 - owner[0]}.log").read_text()
        assert re.search(r"took over", survivor), survivor[-2000:]  # relayed, then continued past the lease
        print(f"KV freed {freed_s:.2f} s after the gateway's SIGKILL; resumed at token {offset}")
    finally:
        if nginx is not None:  # SIGTERM: the master stops its worker (a SIGKILL would orphan it)
            nginx.terminate()
            nginx.wait(10)
        kill_all(procs)
        server.stop()


def _journal(redis_url: str, request_id: str) -> tuple[str, dict]:
    """The text a stream's journal holds (gateway/stream_journal.py) and its record."""
    import redis

    from gateway.stream_journal import RECORD_PREFIX
    from protos import link_pb2

    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(f"{RECORD_PREFIX}{request_id}:events")
        record = client.hgetall(f"{RECORD_PREFIX}{request_id}")
    finally:
        client.close()
    return "".join(link_pb2.Delta.FromString(f[b"d"]).text for _, f in entries if b"d" in f), record


def test_a_stopped_gateway_is_relayed_then_taken_over_and_fenced_out_when_it_wakes(tmp_path):
    """The stream's gateway is SIGSTOPped with its client connection still open (nobody told it
    the client left): a resume on the other gateway relays what it journaled, takes the stream
    over once its owner lease lapsed (2 s here) and continues it; the stopped gateway, woken,
    may not append (its lease is gone): the journal holds each token once and its own client
    gets ``stream_taken_over``. The joined text is an unbroken greedy run's."""
    if nginx_binary() is None:
        pytest.fail("nginx is required for the end-to-end tests (.ci/run installs it)")
    max_tokens = 96  # long enough to be still running when its gateway is stopped
    body = {**BODY, "max_tokens": max_tokens}
    server = start_redis()
    rest_ports = [free_port(), free_port()]
    procs = [spawn(["worker", "--redis-url", server.url, "--health-port", str(free_port()), "--grpc-health-port",
                    str(free_port()), "--dtype", "float32", "--kv-cache-mib", "64", "--warmup-tokens", "16"],
                   tmp_path / "worker.log")]
    gateways = [spawn(["gateway", "--redis-url", server.url, "--rest-port", str(port), "--grpc-port",
                       str(free_port()), "--link-port", str(free_port()), "--stream-owner-lease", "2"],
                      tmp_path / f"gateway-{i}.log")
                for i, port in enumerate(rest_ports)]
    procs += gateways
    nginx = stopped = None
    try:
        for port in rest_ports:
            wait_until(lambda: status(f"http://127.0.0.1:{port}/ready") == 200, 120, "the gateways")
        edge, nginx = _edge(tmp_path, rest_ports, free_port())
        key = create_key(server.url)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{edge.rest_port_edge}/v1", api_key=key, max_retries=0)
        args = {k: v for k, v in body.items() if k != "stream"}
        reference = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            stream=True, extra_body={"ignore_eos": True}, **args) if c.choices)

        raw = client.chat.completions.with_raw_response.create(stream=True, extra_body={"ignore_eos": True}, **args)
        request_id = raw.headers["x-request-id"]
        got, offset = [], 0
        stream = raw.parse()
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
            offset = chunk.usage.completion_tokens
            if len(got) == 8:
                break  # the connection stays open: its gateway still streams to it
        owner = [i for i, port in enumerate(rest_ports)
                 if _metric(f"http://127.0.0.1:{port}/metrics", "inflight_gateway_waiting_clients") == 1]
        assert len(owner) == 1, owner
        stopped = gateways[owner[0]]
        stopped.send_signal(signal.SIGSTOP)
        journaled, record = _journal(server.url, request_id)
        assert not any(k.startswith(b"finish:") for k in record), "finished before its gateway stopped"

        other = rest_ports[1 - owner[0]]
        started = time.monotonic()
        r = httpx.post(f"http://127.0.0.1:{other}/v1/chat/completions", json={**body, "ignore_eos": True},
                       timeout=120, headers={"Authorization": f"Bearer {key}",
                                             "Last-Event-ID": f"{request_id}/{offset}"})
        resumed_s = time.monotonic() - started
        assert r.status_code == 200, r.text
        events = sse_events(r.text)
        assert events[-1]["data"] == "[DONE]"
        chunks = [json.loads(e["data"]) for e in events[:-1]]
        rest = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert "".join(got) + rest == reference  # nothing repeated, nothing lost
        assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
        assert _journal(server.url, request_id)[1][b"resumes"] == b"1"  # taken over once

        stopped.send_signal(signal.SIGCONT)  # it wakes with its run's output still coming in
        log = tmp_path / f"gateway-{owner[0]}.log"
        wait_until(lambda: "taken over" in log.read_text() or "stream_taken_over" in log.read_text()
                   or stopped.poll() is not None, 30, "the woken gateway to notice its lost lease")
        time.sleep(1.0)  # anything it would wrongly append lands well within this
        assert _journal(server.url, request_id)[0] == reference  # each token journaled once
        stream.close()
        print(f"stopped gateway taken over: the resume took {resumed_s:.2f} s (lease 2 s); "
              f"{len(journaled)} characters journaled before the stop")
    finally:
        if stopped is not None and stopped.poll() is None:
            stopped.send_signal(signal.SIGCONT)
        if nginx is not None:
            nginx.terminate()
            nginx.wait(10)
        kill_all(procs)
        server.stop()
