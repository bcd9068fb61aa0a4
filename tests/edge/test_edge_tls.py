"""TLS at the edge and its security headers, through real nginx: a REST client (httpx)
and a gRPC client (HTTP/2, ``ssl_channel_credentials``) that trust the self-signed
certificate ``inflight up --tls`` makes; clients that do not trust it, or speak plain
text to a TLS port, are refused."""

from __future__ import annotations

import ssl
import tempfile

import grpc
import httpx
import pytest

from protos import common_pb2, inference_pb2, inference_pb2_grpc
from stack.edge import nginx_binary, self_signed_pair

pytestmark = pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed")

SECURITY_HEADERS = {"x-content-type-options": "nosniff", "x-frame-options": "DENY",
                    "content-security-policy": "frame-ancestors 'none'", "referrer-policy": "no-referrer"}


@pytest.fixture(scope="module")
def pair():
    return self_signed_pair(tempfile.mkdtemp(prefix="edge-tls-"))


@pytest.fixture()
def tls_edge(edge, pair):
    cert, key = pair
    return edge(tls_cert=cert, tls_key=key)


def test_rest_over_tls_with_the_ca_and_the_security_headers(tls_edge, pair, api_key):
    context = ssl.create_default_context(cafile=pair[0])
    with httpx.Client(verify=context, timeout=10) as client:
        r = client.post(f"https://localhost:{tls_edge.rest_port_edge}/v1/completions",
                        headers={"Authorization": f"Bearer {api_key}"},
                        json={"model": "test-model", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert r.headers["server"] == "nginx"  # server_tokens off: no version
        for name, value in SECURITY_HEADERS.items():
            assert r.headers[name] == value
        assert r.headers["strict-transport-security"].startswith("max-age=")
        limited = client.get(f"https://localhost:{tls_edge.rest_port_edge}/metrics")
        assert limited.status_code == 404 and limited.headers["x-frame-options"] == "DENY"


def test_an_untrusting_client_and_plain_http_are_refused(tls_edge):
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"https://localhost:{tls_edge.rest_port_edge}/health", timeout=5)  # system CAs only
    r = httpx.get(f"http://127.0.0.1:{tls_edge.rest_port_edge}/health", timeout=5)
    assert r.status_code == 400  # nginx's 497: "The plain HTTP request was sent to HTTPS port"
    assert r.json()["error"]["code"] == "tls_required" and "https://" in r.json()["error"]["message"]


def test_grpc_over_tls_http2(tls_edge, pair, api_key):
    with open(pair[0], "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    req = inference_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=2))
    with grpc.secure_channel(f"localhost:{tls_edge.grpc_port_edge}", credentials) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        replies = list(stub.Generate(req, metadata=(("authorization", f"Bearer {api_key}"),), timeout=10))
    assert replies[-1].usage.completion_tokens == 2
    with grpc.insecure_channel(f"127.0.0.1:{tls_edge.grpc_port_edge}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            inference_pb2_grpc.InferenceStub(channel).ListModels(inference_pb2.ListModelsRequest(), timeout=5)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


def test_plain_edge_has_the_headers_but_no_hsts(edge, api_key):
    settings = edge()
    r = httpx.get(f"http://127.0.0.1:{settings.rest_port_edge}/v1/models",
                  headers={"Authorization": f"Bearer {api_key}"}, timeout=5)
    assert r.headers["server"] == "nginx"
    for name, value in SECURITY_HEADERS.items():
        assert r.headers[name] == value
    assert "strict-transport-security" not in r.headers


def test_the_web_page_and_the_fleet_view_over_tls(tls_edge, pair, api_key):
    """The gateway's page (static files) and GET /fleet reach the gateway through the TLS edge:
    the page with the right content types (nosniff is on) and the security headers, /fleet
    refusing a key that is not an admin's."""
    context = ssl.create_default_context(cafile=pair[0])
    base = f"https://localhost:{tls_edge.rest_port_edge}"
    with httpx.Client(verify=context, timeout=10) as client:
        root = client.get(f"{base}/")
        assert root.status_code in (302, 307) and root.headers["location"] == "/ui/"
        page = client.get(f"{base}/ui/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="app.js">' in page.text and "https://" not in page.text  # no CDN
        assert page.headers["x-frame-options"] == "DENY"
        script = client.get(f"{base}/ui/app.js")
        assert script.status_code == 200 and "javascript" in script.headers["content-type"]
        assert "sessionStorage" in script.text and "localStorage.setItem" not in script.text
        fleet = client.get(f"{base}/fleet", headers={"Authorization": f"Bearer {api_key}"})
        assert fleet.status_code == 403 and fleet.json()["error"]["code"] == "admin_key_required"
