"""The served OpenAPI document (``GET /openapi.json``) says what the gateway really answers."""

import httpx
import pytest

GENERATION = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def served(gateway):
    r = httpx.get(gateway.rest_url + "/openapi.json", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.headers["x-request-id"]
    return r.json()


def test_status_codes_and_error_bodies(served):
    error_ref = "#/components/schemas/ErrorResponse"
    for path in GENERATION:
        responses = served["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "500", "503", "504"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        for code, response in responses.items():
            if code != "200":
                assert response["content"]["application/json"]["schema"]["$ref"] == error_ref, code
    assert set(served["paths"]["/v1/models"]["get"]["responses"]) == {"200", "401", "503"}
    assert all("422" not in op["responses"] for ops in served["paths"].values() for op in ops.values())
    error = served["components"]["schemas"]["ErrorDetail"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in served["components"]["schemas"]


def test_messages_are_a_union_by_role(served):
    schemas = served["components"]["schemas"]
    items = schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]
    mapping = items["discriminator"]["mapping"]
    assert items["discriminator"]["propertyName"] == "role"
    assert set(mapping) == {"system", "developer", "user", "assistant", "tool"}
    assistant = schemas["AssistantMessageParam"]
    assert "content" not in assistant.get("required", [])  # null or absent is fine
    assert "content" in schemas["UserMessageParam"]["required"]


def test_sampling_controls_are_documented(served):
    props = served["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p",
                 "min_tokens", "logit_bias", "top_logprobs"):
        assert name in props, name
    bias = next(s for s in props["logit_bias"]["anyOf"] if s["type"] == "object")
    assert bias["maxProperties"] == 300 and bias["additionalProperties"]["maximum"] == 100
