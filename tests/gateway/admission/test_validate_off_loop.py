"""Validation (tokenizing the prompt) runs in a worker thread, so one huge prompt does
not stall the event loop that carries every other request's stream."""

from __future__ import annotations

import asyncio
import threading
from unittest import mock

import pytest

import gateway.admission.pipeline as pipeline_module
from gateway.admission.params import RequestParams
from gateway.errors import InvalidRequestError
from gateway.keys import KeyRecord
from gateway.service import GatewayService
from gateway.settings import GatewaySettings
from tests.gateway.fake_tokenizer import CharTokenizer


def test_validate_runs_off_the_event_loop_thread(monkeypatch):
    seen = {}
    real = pipeline_module.validate_request

    def recording(*args, **kwargs):
        seen["thread"] = threading.get_ident()
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_module, "validate_request", recording)

    async def scenario():
        service = GatewayService(GatewaySettings(), mock.MagicMock(), CharTokenizer())
        key = KeyRecord(key_id="k", tenant="t")
        request = await service.admission.validate(key, RequestParams(prompt="hello there", max_tokens=4))
        with pytest.raises(InvalidRequestError):
            await service.admission.validate(key, RequestParams(prompt="", max_tokens=4))
        return request, threading.get_ident()

    request, loop_thread = asyncio.run(scenario())
    assert request.prompt_tokens > 0 and request.max_tokens == 4
    assert seen["thread"] != loop_thread
