"""JSON logs carry the request id as a field."""

from __future__ import annotations

import json
import logging

import pytest

from common.logs import JsonFormatter, configure_logging


def test_json_record_has_request_id_and_message():
    record = logging.makeLogRecord({"name": "worker.serve.service", "levelname": "INFO", "msg": "accepted %s",
                                    "args": ("now",), "request_id": "req-1", "queue_time_s": 0.25})
    entry = json.loads(JsonFormatter().format(record))
    assert entry["msg"] == "accepted now" and entry["request_id"] == "req-1"
    assert entry["queue_time_s"] == 0.25 and entry["level"] == "INFO" and entry["logger"] == "worker.serve.service"


def test_unknown_format_is_rejected():
    with pytest.raises(ValueError):
        configure_logging("INFO", "xml")
