"""GatewaySettings.from_env: INFLIGHT_GATEWAY_<FIELD> variables by the field's type."""

import pytest

from gateway.settings import GatewaySettings


def test_env_values_take_their_fields_types():
    s = GatewaySettings.from_env({"INFLIGHT_GATEWAY_REST_PORT": "9000", "INFLIGHT_GATEWAY_REDIS_TIMEOUT_S": "0.5",
                                  "INFLIGHT_GATEWAY_REQUIRE_WORKER": "0", "INFLIGHT_GATEWAY_MAX_QUEUE_DEPTH": "8,4,2"},
                                 grpc_port=1)
    assert (s.rest_port, s.redis_timeout_s, s.require_worker, s.max_queue_depth, s.grpc_port) == \
        (9000, 0.5, False, "8,4,2", 1)
    assert GatewaySettings.from_env({"INFLIGHT_GATEWAY_REQUIRE_WORKER": "True"}).require_worker is True
    with pytest.raises(ValueError, match="REQUIRE_WORKER='maybe'"):
        GatewaySettings.from_env({"INFLIGHT_GATEWAY_REQUIRE_WORKER": "maybe"})
